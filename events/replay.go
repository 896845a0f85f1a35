package events

import (
	"bytes"
	"encoding/binary"
	"sync"

	"github.com/go-zeromq/zmq4"
)

// replayRing keeps the last max batches for the replay socket.
type replayRing struct {
	mu    sync.Mutex
	max   int
	seqs  []uint64
	msgs  [][]byte
	start int // index of the oldest
}

func (r *replayRing) add(seq uint64, payload []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.msgs) < r.max {
		r.seqs = append(r.seqs, seq)
		r.msgs = append(r.msgs, payload)
		return
	}
	r.seqs[r.start], r.msgs[r.start] = seq, payload
	r.start = (r.start + 1) % r.max
}

// from returns the kept batches with seq ≥ start, oldest first.
func (r *replayRing) from(start uint64) (seqs []uint64, msgs [][]byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := range r.msgs {
		j := (r.start + i) % len(r.msgs)
		if r.seqs[j] >= start {
			seqs = append(seqs, r.seqs[j])
			msgs = append(msgs, r.msgs[j])
		}
	}
	return seqs, msgs
}

// replayEnd is the seq frame of the answer that ends a replay.
var replayEnd = bytes.Repeat([]byte{0xFF}, 8)

// serveReplay answers replay requests until Close. A malformed request
// is ignored (the socket stays up for other clients).
func (p *Publisher) serveReplay() {
	defer p.wg.Done()
	for {
		msg, err := p.replay.Recv()
		if err != nil {
			if p.ctx.Err() != nil {
				return
			}
			continue
		}
		f := msg.Frames
		if len(f) != 3 || len(f[1]) != 0 || len(f[2]) != 8 {
			continue
		}
		id := f[0]
		start := binary.BigEndian.Uint64(f[2])
		seqs, msgs := p.ring.from(start)
		for i := range msgs {
			var sb [8]byte
			binary.BigEndian.PutUint64(sb[:], seqs[i])
			if p.replay.Send(zmq4.NewMsgFrom(id, nil, p.topic, sb[:], msgs[i])) != nil {
				break
			}
		}
		_ = p.replay.Send(zmq4.NewMsgFrom(id, nil, nil, replayEnd, nil))
	}
}

package events

import (
	"bufio"
	"encoding/binary"
	"errors"
	"log/slog"
	"net"
	"sort"
	"sync"
	"time"

	"go.uber.org/atomic"
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

// from appends to seqs and msgs at most limit kept batches with
// seq ≥ start, oldest first. Seqs are kept in increasing order (the
// publisher numbers batches one by one), so the first match is found by
// binary search: a request costs O(log max + limit) under the lock the
// publisher's send loop also takes, however far past the ring it asks.
func (r *replayRing) from(start uint64, limit int, seqs []uint64, msgs [][]byte) ([]uint64, [][]byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := len(r.msgs)
	at := func(i int) int { return (r.start + i) % n }
	first := sort.Search(n, func(i int) bool { return r.seqs[at(i)] >= start })
	for i := first; i < n && len(msgs) < limit; i++ {
		seqs = append(seqs, r.seqs[at(i)])
		msgs = append(msgs, r.msgs[at(i)])
	}
	return seqs, msgs
}

// replayEndSeq is the seq of the answer that ends a replay (0xFF×8 on
// the wire, replayEnd), with an empty topic and payload.
const replayEndSeq = ^uint64(0)

var replayEnd = binary.BigEndian.AppendUint64(nil, replayEndSeq)

// replaySocket is the replay service: a ZeroMQ ROUTER socket as DEALER
// and REQ clients see it (ZMTP 3.x, NULL mechanism). Each client has its
// own goroutine, which reads one request, writes its answer and only
// then reads the next: a client that stops reading stalls only itself
// (its writes time out after sendTimeout and it is dropped), and one
// that sends no request for lim.idle is dropped too. An answer holds at
// most perRequest batches, however far back the request starts. The
// same limits as the PUB socket bound handshakes and clients, in total
// and by remote address (peerTable).
type replaySocket struct {
	topic      []byte
	ring       *replayRing
	perRequest int
	lim        limits
	log        *slog.Logger
	ln         net.Listener

	sockLife
	conns   peerTable[net.Conn] // established clients
	shaking peerTable[net.Conn] // connections in their handshake

	refused, malformed, idleDrops atomic.Uint64
}

func newReplaySocket(topic string, ring *replayRing, perRequest int, lim limits, log *slog.Logger) *replaySocket {
	return &replaySocket{topic: []byte(topic), ring: ring, perRequest: perRequest, lim: lim, log: log, sockLife: newSockLife(),
		conns: newPeerTable[net.Conn](lim.perAddr, lim.maxConns), shaking: newPeerTable[net.Conn](lim.perAddr, lim.maxPending)}
}

func (s *replaySocket) listen(ep endpoint) error {
	ln, err := listenAndAccept(ep, &s.wg, s.done, s.log, "replay ROUTER", s.accept)
	s.ln = ln
	return err
}

// accept takes a handshake slot for conn and serves it on a goroutine
// of its own: the handshake, then (with a client slot) its requests.
// A connection refused by either table is closed at once; one displaced
// from either (by an address that holds fewer) is closed, and its own
// goroutine counts it.
func (s *replaySocket) accept(conn net.Conn) {
	addr := peerAddr(conn)
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		s.refused.Inc()
		_ = conn.Close()
		return
	}
	victim, displaced, ok := s.shaking.admit(addr, conn)
	if ok {
		s.wg.Add(1)
	}
	s.mu.Unlock()
	if displaced {
		_ = victim.Close()
	}
	if !ok {
		s.refused.Inc()
		_ = conn.Close()
		return
	}
	go func() {
		defer s.wg.Done()
		defer conn.Close()
		_, r, err := handshake(conn, "ROUTER", true, []string{"DEALER", "REQ", "ROUTER"}, s.lim)
		s.mu.Lock()
		held := s.shaking.remove(addr, conn)
		victim, displaced, ok := conn, false, false
		if err == nil && held && !s.closed {
			victim, displaced, ok = s.conns.admit(addr, conn)
		}
		s.mu.Unlock()
		if displaced {
			_ = victim.Close()
		}
		if !ok {
			s.refused.Inc()
			return
		}
		defer func() {
			s.mu.Lock()
			if !s.conns.remove(addr, conn) {
				s.refused.Inc() // displaced while served
			}
			s.mu.Unlock()
		}()
		s.serve(conn, r)
	}()
}

// serve answers one client's requests: [empty, start_seq (8 bytes
// big-endian)] is answered [empty, topic, seq, payload] per kept batch
// with seq ≥ start_seq (at most perRequest of them), then [empty, empty,
// 0xFF×8, empty]. A request of any other shape is ignored and counted; a
// protocol violation ends the connection, and so does lim.idle without
// a request (a PING or an ignored request does not count as one), from
// the handshake or the last answer.
func (s *replaySocket) serve(conn net.Conn, r *bufio.Reader) {
	pr := peerReader{r: r, limit: s.lim.maxMessage}
	w := bufio.NewWriterSize(deadlineWriter{conn, s.lim.sendTimeout}, 64<<10)
	var seqs []uint64
	var msgs [][]byte
	var hdr []byte
	idle := func() bool { // arms the idle deadline; false if the connection is gone
		if s.lim.idle <= 0 {
			return true
		}
		return conn.SetReadDeadline(time.Now().Add(s.lim.idle)) == nil
	}
	if !idle() {
		return
	}
	for {
		cmd, data, frames, err := pr.next()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				s.idleDrops.Inc()
				s.log.Info("events: replay client dropped: idle", "remote", conn.RemoteAddr(), "after", s.lim.idle)
			}
			return
		}
		switch {
		case cmd == "PING":
			pong, err := pingReply(hdr[:0], data)
			if err != nil {
				return
			}
			hdr = pong
			if _, err := w.Write(pong); err != nil || w.Flush() != nil {
				return
			}
			continue
		case cmd == "ERROR":
			return
		case cmd != "":
			continue
		}
		start, ok := parseReplayRequest(frames)
		if !ok {
			s.malformed.Inc()
			continue
		}
		seqs, msgs = s.ring.from(start, s.perRequest, seqs[:0], msgs[:0])
		for i := range msgs {
			hdr = appendFrameHeader(hdr[:0], flagMore, 0) // the empty delimiter
			hdr = appendBatchHead(hdr, s.topic, seqs[i], len(msgs[i]))
			_, _ = w.Write(hdr)
			if _, err := w.Write(msgs[i]); err != nil {
				return
			}
		}
		clear(msgs)
		hdr = appendFrameHeader(hdr[:0], flagMore, 0)
		hdr = appendBatchHead(hdr, nil, replayEndSeq, 0)
		_, _ = w.Write(hdr)
		if err := w.Flush(); err != nil || !idle() {
			return
		}
	}
}

// parseReplayRequest reads a replay request's frames: an empty delimiter
// and an 8-byte big-endian start seq. ok is false for any other shape.
func parseReplayRequest(frames [][]byte) (start uint64, ok bool) {
	if len(frames) != 2 || len(frames[0]) != 0 || len(frames[1]) != 8 {
		return 0, false
	}
	return binary.BigEndian.Uint64(frames[1]), true
}

func (s *replaySocket) addr() net.Addr { return s.ln.Addr() }

// clients returns how many connections the socket holds (handshaking or
// served).
func (s *replaySocket) clients() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.conns.len() + s.shaking.len()
}

func (s *replaySocket) close() error {
	if !s.shut(func() {
		s.conns.each(func(c net.Conn) { _ = c.Close() })
		s.shaking.each(func(c net.Conn) { _ = c.Close() })
	}) {
		return nil
	}
	err := s.ln.Close()
	s.wg.Wait()
	return err
}

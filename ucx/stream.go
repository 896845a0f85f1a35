package ucx

import (
	"fmt"
	"math"
	"sync"
	"time"
	"unsafe"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// Streaming (push model). A streaming handoff (handoff.Streaming) sends
// its blocks while the prefill is still writing them: SendStream returns
// the Start bytes at once, and the source's worker sends each part as
// the progress marks it written (handoff.Ready). Part (block i, layer j)
// is the j-th of Layers equal slices of block i in its contiguous form (a
// layered region's pieces of layer j, in kv order).
//
// Plan. The Start bytes carry pushStreamVersion and the layer count; the
// blocks are cut into messages as without streaming (runs, Config.MaxGet),
// and each message into one tagged message per layer: layer l of every
// block of message i, gathered (source) or scattered (destination) with
// an iov datatype of each side's own pieces, tagged with the message's
// first block × layers + l (below 2^28: never the table's tag). The
// destination posts a receive for every (message, layer) at once, so the
// source may send them in whatever order the prefill marks them; the
// source posts (message i, layer l) only once the progress says layer l
// of every block of message i is written, at most Window outstanding. A
// block's integrity sum (over the whole block, as without streaming) is
// computed when its message's last layer is posted, after every part is
// marked, and the table follows the last part; the destination checks
// every block before its Write resolves.
//
// Waiting. While parts are missing the worker's poller finds nothing
// ready; a goroutine of the handoff waits on the progress (Ready.Wait)
// and wakes the worker when a mark moves. It returns once the progress
// is complete or the job ends (Finish, a cancel's revocation, Close): a
// cancel stops a waiting sender as it stops a sending one.

// maxStreamParts bounds the parts (messages × layers) of one streaming
// handoff: the destination posts a receive for each at once.
const maxStreamParts = 1 << 18

// part is one (message, layer) of a streaming handoff.
type part struct {
	tag          uint32 // the low half of its tag: first × layers + layer
	first, count int    // its message's blocks
	layer        int
	n            int     // bytes: count × the layer's share of a block
	addr         uintptr // contig: its one buffer
	iov, niov    int     // else: its iov entries
	contig       bool
}

// planParts cuts msgs (of g's blocks) into their layers: message i's
// layer l is parts[l*len(msgs)+i], and spans are the iov entries every part
// points into (its slices of each block's pieces, adjacent ones merged).
// Errors wrap kvlease.ErrInvalidArgument (layers that do not split the
// block) or kvlease.ErrExceedsCapacity (more than maxStreamParts parts).
func planParts(g *geometry, msgs []message, layers int) ([]part, []Span, error) {
	if layers < 1 || layers > handoff.MaxLayers || g.bb%layers != 0 {
		return nil, nil, fmt.Errorf("ucx: a stream of %d layers over blocks of %d bytes (1 to %d layers that split the block): %w",
			layers, g.bb, handoff.MaxLayers, kvlease.ErrInvalidArgument)
	}
	if len(msgs)*layers > maxStreamParts {
		return nil, nil, fmt.Errorf("ucx: a stream of %d messages × %d layers (at most %d parts): %w",
			len(msgs), layers, maxStreamParts, kvlease.ErrExceedsCapacity)
	}
	np, pb := len(g.sizes), g.bb/layers
	parts := make([]part, 0, len(msgs)*layers)
	var spans []Span
	for _, m := range msgs {
		for l := range layers {
			k := len(spans)
			for b := m.first; b < m.first+m.count; b++ {
				spans = sliceSpans(spans, k, g.spans[b*np:(b+1)*np], l*pb, pb)
			}
			pt := part{tag: uint32(m.first*layers + l), first: m.first, count: m.count, layer: l, n: m.count * pb, iov: k, niov: len(spans) - k}
			if pt.niov == 1 {
				pt.contig, pt.addr = true, spans[k].Addr
			}
			parts = append(parts, pt)
		}
	}
	// Layer-major (the order a layer-by-layer prefill marks them in):
	// message i's layer l is out[l*len(msgs)+i].
	out := make([]part, 0, len(parts))
	for l := range layers {
		for i := range msgs {
			out = append(out, parts[i*layers+l])
		}
	}
	return out, spans, nil
}

// sliceSpans appends the spans of bytes [off, off+n) of pieces (a
// block's, in order) to dst, merging one that continues the last entry
// at or past floor (a merged entry is for the iov only: hostBytes reads
// one Go object per span).
func sliceSpans(dst []Span, floor int, pieces []Span, off, n int) []Span {
	for _, sp := range pieces {
		if n == 0 {
			break
		}
		if off >= sp.Len {
			off -= sp.Len
			continue
		}
		t := min(n, sp.Len-off)
		s := Span{Addr: sp.Addr + uintptr(off), Len: t, Memory: sp.Memory}
		if sp.pin != nil {
			s.pin = unsafe.Add(sp.pin, off)
		}
		if last := len(dst) - 1; last >= floor && dst[last].Memory == s.Memory && dst[last].Addr+uintptr(dst[last].Len) == s.Addr {
			dst[last].Len += t
		} else {
			dst = append(dst, s)
		}
		n, off = n-t, 0
	}
	return dst
}

// streamSend is a streaming source job's state: the progress, the parts,
// and which are posted. Worker thread only, but for stop.
type streamSend struct {
	ready  handoff.Ready
	layers int
	parts  []part
	lay    []int  // message i's next layer to post
	scan   int    // the first message not posted whole
	tags   []byte // keyed: each (block, layer)'s GMAC (unitTags), or nil
	stop   chan struct{}
	once   sync.Once
}

// end stops the progress waiter.
func (s *streamSend) end() { s.once.Do(func() { close(s.stop) }) }

var _ handoff.StreamSendPlane[[]byte] = (*Sender[[]byte])(nil)

// SendStream implements handoff.StreamSendPlane: Send for regions the
// prefill is still writing (push model; see Streaming in the package
// doc). It connects, attaches and returns the Start bytes at once; the
// handoff's worker then sends each (message, layer) once ready marks it
// written, and never reads a part before. The connection is the
// handoff's until it ends, as with Send. A layer count that does not
// split the blocks is refused (kvlease.ErrInvalidArgument), as are more
// than 2^18 (message, layer) parts (kvlease.ErrExceedsCapacity), before
// anything is sent.
//
// The pull model does not stream: its destination reads the regions as
// soon as it has the Start bytes, so SendStream waits until ready is
// complete (or the Sender is closed) before it registers anything, and
// returns the Start bytes then — the handoff starts after the prefill.
// A ready that is complete, or not streaming, is Send.
func (s *Sender[R]) SendStream(id handoff.PlaneID, regions []R, ready handoff.Ready, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	if !ready.Streaming() || ready.Complete() {
		return s.Send(id, regions, accept, attach)
	}
	if s.cfg.Pull {
		for l, b := -1, -1; !ready.Complete(); {
			var ok bool
			if l, b, ok = ready.Wait(l, b, s.closing); !ok {
				return nil, fmt.Errorf("ucx: send: waiting for the prefill (the pull model does not stream): %w", ErrClosed)
			}
		}
		return s.sendPull(id, regions, accept, attach)
	}
	return s.sendPush(id, regions, accept, attach, &ready)
}

// startStream plans a streaming job's parts (after its messages), and
// replaces its iov entries by the parts'.
func (p *pushSend) startStream(ready handoff.Ready) error {
	parts, spans, err := planParts(p.g, p.msgs, ready.Layers())
	if err != nil {
		return err
	}
	p.iov.free()
	p.iov = newIovs(spans)
	p.stream = &streamSend{ready: ready, layers: ready.Layers(), parts: parts, lay: make([]int, len(p.msgs)), stop: make(chan struct{}),
		tags: unitTags(p.summer.mode, p.g.blocks(), ready.Layers())}
	return nil
}

// waitProgress wakes the job's worker each time the progress moves,
// until it is complete or the job ends.
func (j *sendJob[R]) waitProgress(st *streamSend, w *worker) {
	l, b := 0, 0
	for {
		var ok bool
		if l, b, ok = st.ready.Wait(l, b, st.stop); !ok {
			return
		}
		if !w.do(func() {}) || st.ready.Complete() {
			return
		}
	}
}

// postParts posts the parts the progress marks written and the job has
// not posted, at most Window outstanding, and returns how many it
// posted. Worker thread only.
func (j *sendJob[R]) postParts() int {
	p := j.push
	st := p.stream
	L, np, sl := st.layers, len(p.g.sizes), p.summer.mode.sumLen()
	lw, bw := st.ready.Written()
	completed := p.inline + p.b.completed()
	posted := 0
scan:
	for i := st.scan; i < len(p.msgs); i++ {
		m := p.msgs[i]
		upTo := min(lw, L)
		if m.first+m.count <= bw {
			upTo = L
		}
		for st.lay[i] < upTo {
			if p.next-completed >= j.s.cfg.Window {
				break scan
			}
			l := st.lay[i]
			for b := m.first; b < m.first+m.count; b++ {
				if hook := j.s.cfg.BeforeSend; hook != nil {
					hook(j.id, b)
				}
				pieces := p.g.spans[b*np : (b+1)*np]
				if st.tags != nil {
					// Layer l of the block is written: its unit's GMAC.
					k := (b*L + l) * macLen
					p.summer.unit(st.tags[k:k], b, l, pieces, l*p.g.bb/L, p.g.bb/L)
				}
				if l == L-1 && sl > 0 {
					// Every layer of the block is written: its sum.
					if dst := p.sums.bytes()[b*sl : (b+1)*sl]; st.tags != nil {
						p.summer.fold(dst, st.tags[b*L*macLen:(b+1)*L*macLen], b)
					} else {
						p.summer.sum(dst, b, pieces)
					}
				}
			}
			if j.halt.Load() {
				break scan // revoked: nothing more is posted
			}
			pt := st.parts[l*len(p.msgs)+i]
			tag := tagOf(p.salt, pt.tag)
			var done bool
			var err error
			if pt.contig {
				done, err = p.ep.send(pt.addr, pt.n, false, tag, p.b)
			} else {
				done, err = p.ep.send(p.iov.at(pt.iov), pt.niov, true, tag, p.b)
			}
			if err != nil {
				p.err = err
				break scan
			}
			st.lay[i]++
			p.next++
			j.stall.progress()
			posted++
			if done {
				p.inline++
				completed++
			}
		}
		if i == st.scan && st.lay[i] == L {
			st.scan++
		}
	}
	return posted
}

// postPart posts the receive of part j.next (streaming); true when the
// job is stopping (canceled in the BeforeGet hook, or the post failed).
// Worker thread only.
func (j *recvJob[R]) postPart() bool {
	p := j.push
	pt := p.parts[j.next]
	if hook := j.r.cfg.BeforeGet; hook != nil {
		for b := pt.first; b < pt.first+pt.count; b++ {
			hook(j.id, b)
			if j.stopping() {
				return true
			}
		}
	}
	tag := tagOf(p.prep.salt, pt.tag)
	var err error
	if pt.contig {
		err = j.w.recv(p.rv, j.next, pt.addr, pt.n, false, tag)
	} else {
		err = j.w.recv(p.rv, j.next, p.iov.at(pt.iov), pt.niov, true, tag)
	}
	j.next++ // posted, or failed at once (counted as completed)
	j.stall.progress()
	if err != nil {
		j.postErr = err
		return true
	}
	return false
}

// streamStopGrace bounds a streaming destination's wait for its cancel
// once the source's endpoint failed: a source's abort revokes its worker
// at once, and the abort itself travels on the control connection, so
// the destination may see the failure first. Within the grace the
// handoff ends as the abort says (Aborted); past it as failed.
const streamStopGrace = 2 * time.Second

// stopGrace finishes a streaming job whose source endpoint failed, once
// every posted receive is done (the worker writes none of the regions
// any more: evidence either way): canceled if the job's cancel comes
// within streamStopGrace, else with failed.
func (j *recvJob[R]) stopGrace(epErr error) {
	deadline := time.Now().Add(streamStopGrace)
	for !j.canceled.Load() && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if j.canceled.Load() {
		j.finish(fmt.Errorf("ucx: stream stopped (the source's endpoint: %v): %w", epErr, kvlease.ErrCanceled), false)
		return
	}
	j.finish(fmt.Errorf("%w: %w", epErr, ErrRevoked), true)
}

// Keyed sums of a stream. A streaming handoff's block sum is the summer's
// with units the block's layers (layerUnits: both sides cut the block
// the same way, whatever their pieces): the GMAC of each layer's bytes
// with the nonce (block, layer), then the GMAC of those with the nonce
// (block, all units). Each side computes a layer's GMAC as soon as it may
// read that layer — the source when it posts the layer's message, the
// destination when that message's receive completed — and folds them at
// the end: the whole handoff is not read again after the last layer.
// Past maxUnitTags (block, layer) pairs the tags are not kept and the
// sums are computed at the end over the whole blocks (the same values).
const maxUnitTags = 1 << 20

// layerUnits returns layers units of bb/layers bytes.
func layerUnits(bb, layers int) []int {
	u := make([]int, max(layers, 1))
	for i := range u {
		u[i] = bb / max(layers, 1)
	}
	return u
}

// unitTags returns the buffer of a keyed stream's per-(block, layer)
// GMACs, or nil (not keyed, or too many).
func unitTags(mode integrityMode, blocks, layers int) []byte {
	if mode != integrityMAC || blocks*layers > maxUnitTags {
		return nil
	}
	return make([]byte, blocks*layers*macLen)
}

// unit appends the GMAC of unit u of block b, bytes [off, off+n) of its
// contiguous form over pieces, to dst (keyed only).
func (s *summer) unit(dst []byte, b, u int, pieces []Span, off, n int) []byte {
	s.spans = sliceSpans(s.spans[:0], math.MaxInt, pieces, off, n) // unmerged
	var data []byte
	if len(s.spans) == 1 {
		data = hostBytes(s.spans[0])
	} else {
		if cap(s.scratch) < n {
			s.scratch = make([]byte, n)
		}
		data = s.scratch[:0]
		for _, sp := range s.spans {
			data = append(data, hostBytes(sp)...)
		}
	}
	return s.gmac(dst, data, uint32(b), uint32(u))
}

// fold writes block b's sum, given its units' GMACs (tags), to dst: as
// sum computes it.
func (s *summer) fold(dst, tags []byte, b int) {
	if len(s.units) == 1 {
		copy(dst, tags)
		return
	}
	s.folded = s.gmac(s.folded[:0], tags, uint32(b), tableIndex)
	copy(dst, s.folded)
}

// sumArrived computes the unit GMACs of the parts whose receives
// completed, in order, up to the first still outstanding (or failed: the
// outcome then fails without them). Worker thread only.
func (j *recvJob[R]) sumArrived() {
	p := j.push
	np, L := len(p.g.sizes), p.layers
	pb := p.g.bb / L
	for p.summed < j.next {
		pt := p.parts[p.summed]
		done, n, err := p.rv.result(p.summed)
		if !done || err != nil || n != pt.n {
			return
		}
		for b := pt.first; b < pt.first+pt.count; b++ {
			k := (b*L + pt.layer) * macLen
			p.summer.unit(p.utags[k:k], b, pt.layer, p.g.spans[b*np:(b+1)*np], pt.layer*pb, pb)
		}
		p.summed++
	}
}

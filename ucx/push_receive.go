package ucx

import (
	"crypto/hmac"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// preparePush checks out an idle worker of id's session (or starts one)
// and returns the Accept bytes: "KU", pushVersion, blocks, salt, the
// most bytes of one message (Config.MaxGet), the worker's address. The
// salt is new on the worker for every handoff: a random start, then one
// more per handoff, so no two handoffs of a worker share a tag.
func (r *Receiver[R]) preparePush(id handoff.PlaneID, p *prepared) ([]byte, error) {
	c := r.pool.take(keyOf(id), nil)
	if c != nil {
		r.stats.add(func(st *Stats) { st.Reuses++ })
	} else {
		w, err := r.ctx.newWorker()
		if err != nil {
			return nil, err
		}
		c = &conn{w: w, dest: true}
		if cerr := w.call(func() { c.own, err = w.address() }); cerr != nil {
			err = cerr
		}
		if err != nil {
			c.destroy()
			return nil, err
		}
		var salt [4]byte
		if _, err := rand.Read(salt[:]); err != nil {
			c.destroy()
			return nil, fmt.Errorf("ucx: prepare: %w", err)
		}
		c.salt = binary.LittleEndian.Uint32(salt[:])
		r.stats.add(func(st *Stats) { st.Workers++ })
	}
	p.c, p.w = c, c.w
	p.salt = c.salt
	c.salt++
	b := appendPushAccept(nil, p.blocks, p.salt, r.cfg.MaxGet, c.own)
	if len(b) > handoff.MaxPlane {
		p.release()
		return nil, fmt.Errorf("ucx: accept bytes %d exceed %d: %w", len(b), handoff.MaxPlane, kvlease.ErrExceedsCapacity)
	}
	return b, nil
}

// pushRecv is a destination job's push state.
type pushRecv struct {
	prep   *prepared
	g      *geometry
	msgs   []message
	iov    iovs
	rv     recvs // one per message, then the integrity table's
	sums   cbuf
	mode   integrityMode
	summer *summer
	tabled bool   // the table's receive is posted
	layers int    // streaming: the layers of each block (0: not streaming)
	parts  []part // streaming: message i's layer l is parts[i*layers+l]
	cancel bool   // outstanding receives were asked to cancel
	epErr  error  // streaming: the source's endpoint failed (stopGrace)
	utags  []byte // streaming, keyed: each (block, layer)'s GMAC (unitTags), or nil
	summed int    // streaming: parts [0, summed) have their unit tags
	stray  bool   // at the end, a message no receive asked for waited in the worker
}

func (p *pushRecv) free() {
	p.iov.free()
	p.iov = iovs{}
	p.rv.free()
	p.rv = recvs{}
	if p.sums.p != nil {
		p.sums.free()
		p.sums = cbuf{}
	}
}

// receivePush is Receive in the push model: it checks the Start bytes
// against the regions, connects to the source's worker (to hear of its
// failure), attaches the transfer and posts the receives from the
// handoff worker's thread.
func (r *Receiver[R]) receivePush(id handoff.PlaneID, prep *prepared, regions []R, startBytes []byte, attach func(*kvlease.Transfer) error) error {
	j := &recvJob[R]{r: r, id: id, w: prep.w, push: &pushRecv{prep: prep}}
	p := j.push
	fail := func(err error) error {
		j.teardown()
		p.free()
		return err
	}
	st, err := parsePushStart(startBytes)
	if err != nil {
		return fail(err)
	}
	if err := blockCounts(st.blocks, prep.blocks, len(regions)); err != nil {
		return fail(err)
	}
	if p.g, err = locate(r.pieces, regions, &j.pin); err != nil {
		return fail(err)
	}
	if err := matchPieces(st.sizes, p.g.sizes); err != nil {
		return fail(err)
	}
	if _, err := registrations(p.g.spans); err != nil {
		return fail(err)
	}
	if limit := max(1, r.cfg.MaxGet/p.g.bb); st.per > limit {
		return fail(fmt.Errorf("ucx: receive: the source sends up to %d blocks per message, this destination takes %d: %w", st.per, limit, ErrCorrupt))
	}
	key, err := r.keys.derive(id, keyContext(id.Handoff, st.nonce, prep.salt))
	if err != nil {
		return fail(fmt.Errorf("ucx: receive: block key: %w", err))
	}
	if err := checkIntegrity(key, st.mode, p.g.spans); err != nil {
		return fail(fmt.Errorf("ucx: receive: %w", err))
	}
	p.mode = st.mode
	if st.mode != integrityNone && !allHost(p.g.spans) {
		p.mode = integrityNone // device memory, insecure: the CPU cannot check it
	}
	units := st.sizes
	if st.layers > 0 {
		units = layerUnits(p.g.bb, st.layers)
	}
	if p.summer, err = newSummer(p.mode, key, units); err != nil {
		return fail(err)
	}
	// The endpoint only carries the source's failure to us (peer error
	// handling): nothing waits for its handshake, so a source that
	// stalls does not stall the destination's Receive. (If the
	// handshake never completes, teardown's bounded flush abandons the
	// worker rather than destroy it; see Limits in DESIGN.md.)
	c := prep.c
	var connected, broken bool
	if c.ep != nil && c.peer == string(st.addr) && c.healthy() {
		j.ep = c.ep // the source's worker of the last handoff: reused
	} else if cerr := j.w.call(func() {
		broken = c.ep != nil && c.peer == string(st.addr)
		if c.ep != nil {
			_ = j.w.closeEP(c.ep, true)
			c.ep, c.peer = nil, ""
		}
		if j.ep, err = j.w.connect(st.addr); err == nil {
			c.ep, c.peer, connected = j.ep, string(st.addr), true
		}
	}); cerr != nil {
		err = cerr
	}
	if connected || broken {
		r.stats.add(func(s *Stats) {
			if connected {
				s.Connects++
			}
			if broken {
				s.Broken++
			}
		})
	}
	if err != nil {
		return fail(err)
	}
	p.msgs = messagesOf(p.g, st.runs, st.per)
	if st.layers > 0 {
		// Streaming: a receive per (message, layer), all posted at once
		// (the source sends the parts in the order the prefill marks
		// them).
		p.layers = st.layers
		var spans []Span
		if p.parts, spans, err = planParts(p.g, p.msgs, st.layers); err != nil {
			return fail(fmt.Errorf("%w: %w", err, ErrCorrupt))
		}
		p.iov = newIovs(spans)
		p.utags = unitTags(p.mode, st.blocks, st.layers)
	} else if needIov(p.msgs) {
		p.iov = newIovs(p.g.spans)
	}
	p.rv = newRecvs(p.units() + 1)
	if n := st.mode.sumLen(); n > 0 {
		p.sums = newCbuf(n * st.blocks)
	}
	return j.launch(attach, p.mode == integrityMAC, j.stepPush)
}

// units is how many receives the job's blocks take: its messages, or
// streaming its parts.
func (p *pushRecv) units() int {
	if p.layers > 0 {
		return len(p.parts)
	}
	return len(p.msgs)
}

// stepPush advances a push job on its worker's thread: it posts the
// integrity table's receive, then the messages' receives (at most Window
// outstanding; streaming, every part's at once), and once every posted receive has completed (its
// message landed, or it was canceled before one matched) it checks the
// blocks and resolves. True when it is done.
func (j *recvJob[R]) stepPush() bool {
	if j.dead {
		return true
	}
	p := j.push
	if err := j.ep.failed(); err != nil && p.layers == 0 {
		go j.finish(fmt.Errorf("%w: %w", err, ErrRevoked), true)
		return true
	} else if err != nil && p.epErr == nil {
		// Streaming: the source's worker is gone (its abort revoked it,
		// or it died). Stop as on a cancel; once every receive is done,
		// give the abort, which travels on the control connection and
		// may come second, a grace (streamStopGrace) to arrive.
		p.epErr = err
	}
	msgs := p.units()
	np := len(p.g.sizes)
	window := j.r.cfg.Window
	if p.layers > 0 {
		window = msgs
	}
	if !p.tabled && p.sums.p != nil {
		p.tabled = true
		j.stall.progress()
		if err := j.w.recv(p.rv, msgs, p.sums.addr(), p.sums.n, false, tagOf(p.prep.salt, tableIndex)); err != nil {
			j.postErr = err
		}
	}
	table := 0
	if p.tabled {
		table = 1
	}
	completed := p.rv.b.completed()
	if completed != j.seen {
		j.seen = completed
		j.stall.progress()
	}
	stopping := j.stopping() || j.postErr != nil || p.rv.b.failedN() > 0 || p.epErr != nil
	for !stopping && j.next < msgs && j.next+table-completed < window+table {
		if p.layers > 0 {
			stopping = j.postPart()
			completed = p.rv.b.completed()
			continue
		}
		m := p.msgs[j.next]
		if hook := j.r.cfg.BeforeGet; hook != nil {
			for b := m.first; b < m.first+m.count && !stopping; b++ {
				hook(j.id, b)
				stopping = j.stopping()
			}
			if stopping {
				break
			}
		}
		var err error
		tag := tagOf(p.prep.salt, uint32(m.first))
		if m.contig {
			err = j.w.recv(p.rv, j.next, m.addr, m.count*p.g.bb, false, tag)
		} else {
			err = j.w.recv(p.rv, j.next, p.iov.at(m.first*np), m.count*np, true, tag)
		}
		j.next++ // posted, or failed at once (counted as completed)
		j.stall.progress()
		if err != nil {
			j.postErr = err
			stopping = true
		}
		completed = p.rv.b.completed()
	}
	if stopping && !p.cancel {
		p.cancel = true
		for i := range j.next {
			j.w.cancel(p.rv, i)
		}
		if p.tabled {
			j.w.cancel(p.rv, msgs)
		}
	}
	if p.utags != nil && !stopping {
		j.sumArrived()
	}
	if p.rv.b.completed() < j.next+table {
		return false // wait for the posted receives
	}
	if !stopping && j.next < msgs {
		return false
	}
	// Every posted receive completed: UCX writes none of the regions
	// any more. Evidence; the outcome says whether every block arrived
	// intact. A worker holding a message nobody asked for (of an earlier
	// handoff, or from anyone who reached it) is not kept.
	p.stray = j.w.stray()
	if p.epErr != nil && !j.canceled.Load() {
		go j.stopGrace(p.epErr)
		return true
	}
	go j.finish(j.pushOutcome(), false)
	return true
}

// pushOutcome checks what the completed receives delivered. Worker
// thread only, once every posted receive completed.
func (j *recvJob[R]) pushOutcome() error {
	p := j.push
	blocks := p.g.blocks()
	var canceled bool
	check := func(i, want int, what string) error {
		_, n, err := p.rv.result(i)
		switch {
		case errors.Is(err, kvlease.ErrCanceled):
			canceled = true
			return nil
		case err != nil:
			return fmt.Errorf("ucx: %s: %w: %w", what, err, ErrCorrupt)
		case n != want:
			return fmt.Errorf("ucx: %s: %d bytes, want %d: %w", what, n, want, ErrCorrupt)
		}
		return nil
	}
	for i, pt := range p.parts[:min(j.next, len(p.parts))] {
		what := fmt.Sprintf("layer %d of block %d of %d", pt.layer, pt.first, blocks)
		if pt.count > 1 {
			what = fmt.Sprintf("layer %d of blocks %d to %d of %d", pt.layer, pt.first, pt.first+pt.count-1, blocks)
		}
		if err := check(i, pt.n, what); err != nil {
			return err
		}
	}
	for i, m := range p.msgs[:min(j.next, len(p.msgs))] {
		if p.layers > 0 {
			break
		}
		what := fmt.Sprintf("block %d of %d", m.first, blocks)
		if m.count > 1 {
			what = fmt.Sprintf("blocks %d to %d of %d", m.first, m.first+m.count-1, blocks)
		}
		if err := check(i, m.count*p.g.bb, what); err != nil {
			return err
		}
	}
	if p.tabled {
		if err := check(p.units(), p.sums.n, "integrity table"); err != nil {
			return err
		}
	}
	if j.postErr != nil {
		return j.postErr
	}
	if (canceled || j.next < p.units()) && j.stalled.Load() {
		return fmt.Errorf("ucx: stopped after %d of %d messages: no progress for %v: %w", j.next, p.units(), j.r.cfg.StallTimeout, ErrStalled)
	}
	if canceled || j.next < p.units() {
		return fmt.Errorf("ucx: stopped after %d of %d messages: %w", j.next, p.units(), kvlease.ErrCanceled)
	}
	if n := p.mode.sumLen(); n > 0 {
		got := make([]byte, n)
		want := p.sums.bytes()
		np := len(p.g.sizes)
		folded := p.utags != nil && p.summed == len(p.parts)
		for b := range blocks {
			if folded {
				L := p.layers
				p.summer.fold(got, p.utags[b*L*macLen:(b+1)*L*macLen], b)
			} else {
				p.summer.sum(got, b, p.g.spans[b*np:(b+1)*np])
			}
			if !hmac.Equal(got, want[b*n:(b+1)*n]) {
				return fmt.Errorf("ucx: block %d of %d fails its %v check: %w", b, blocks, p.mode, ErrCorrupt)
			}
		}
	}
	j.bytes = int64(blocks) * int64(p.g.bb)
	return nil
}

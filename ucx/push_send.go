package ucx

import (
	"crypto/rand"
	"fmt"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// The push model (the default). The destination exposes nothing and
// names no address of the source: its Prepare takes a worker for the
// handoff alone (an idle one of the session, or a new one; see pool.go)
// and puts that worker's address and a tag salt new on it in the Accept
// bytes; the source connects to it and sends each block as
// one tagged message (ucp_tag_send_nbx; a block of several pieces is
// gathered from its pieces with an iov datatype), then a table of the
// blocks' integrity sums. The destination receives each block into its
// own pieces (ucp_tag_recv_nbx with the block's exact tag, scattered
// with an iov datatype), so a message lands only where the destination
// put it, and only into a block of this handoff. Both contexts are
// created without UCP_FEATURE_RMA: no worker of this model serves a
// software-emulated get or put (UCX registers those handlers only for
// that feature).
//
// Runs: consecutive blocks that lie one after the other in the source's
// memory (all their pieces, block by block) form a run, and a run moves
// as one message (tagged with its first block), cut at the smaller of
// the two sides' Config.MaxGet (the destination's travels in the Accept
// bytes); the Start bytes list the runs of two blocks or more, and every
// other block is a message of its own, as before. The destination
// receives a run's message into its own blocks: one buffer where they
// are adjacent in its memory too, scattered with an iov datatype where
// they are not. The sums stay per block.

// pushSend is a source job's push state. Everything is owned by the
// job's worker thread once it is polled.
type pushSend struct {
	ep     *endpoint
	salt   uint32
	g      *geometry
	msgs   []message
	iov    iovs // the pieces of every block, when a message is not one buffer
	sums   cbuf // the integrity table, sent after the last block
	summer *summer
	b      batch
	next   int // messages posted
	inline int // sends that completed at once
	tabled bool
	seen   int         // completed sends the stall clock has seen
	err    error       // a send that could not be posted
	stream *streamSend // a streaming handoff's state (stream.go), or nil
}

// units is how many sends the job's blocks take: its messages, or
// streaming its parts.
func (p *pushSend) units() int {
	if p.stream != nil {
		return len(p.stream.parts)
	}
	return len(p.msgs)
}

func (p *pushSend) free() {
	if p.stream != nil {
		p.stream.end()
	}
	p.iov.free()
	p.iov = iovs{}
	if p.sums.p != nil {
		p.sums.free()
		p.sums = cbuf{}
	}
	if p.b.b != nil {
		p.b.free()
		p.b = batch{}
	}
}

// sendPush is Send in the push model: it connects to the destination's
// worker, attaches the transfer and sends the blocks (a message per run
// of blocks adjacent in memory, one per other block) from the worker's
// thread. The transfer resolves as in the pull model: on Finish or a
// cancel, after the revocation (the handoff's endpoint closed, its
// worker destroyed: nothing of UCX reads the regions any more).
//
// Streaming (SendStream: ready not nil), the Start bytes say so and the
// worker sends each (message, layer) once ready marks it (stream.go).
func (s *Sender[R]) sendPush(id handoff.PlaneID, regions []R, accept []byte, attach func(*kvlease.Transfer) error, ready *handoff.Ready) ([]byte, error) {
	acc, err := parsePushAccept(accept)
	if err != nil {
		return nil, err
	}
	blocks := acc.blocks
	if blocks != len(regions) {
		return nil, fmt.Errorf("ucx: send: accept for %d blocks, %d regions: %w", blocks, len(regions), ErrCorrupt)
	}
	j, err := s.enroll(id, &pushSend{salt: acc.salt})
	if err != nil {
		return nil, err
	}
	p := j.push
	if p.g, err = locate(s.pieces, regions, &j.pin); err != nil {
		return j.fail(err)
	}
	if _, err := registrations(p.g.spans); err != nil {
		return j.fail(err) // overlapping pieces
	}
	var nonce [nonceLen]byte
	if _, err := rand.Read(nonce[:]); err != nil {
		return j.fail(fmt.Errorf("ucx: send: %w", err))
	}
	key, err := s.keys.derive(id, keyContext(id.Handoff, nonce[:], acc.salt))
	if err != nil {
		return j.fail(fmt.Errorf("ucx: send: block key: %w", err))
	}
	mode := integrityFor(key, p.g.spans)
	if err := checkIntegrity(key, mode, p.g.spans); err != nil {
		return j.fail(fmt.Errorf("ucx: send: %w", err))
	}
	units := p.g.sizes
	if ready != nil {
		units = layerUnits(p.g.bb, ready.Layers())
	}
	if p.summer, err = newSummer(mode, key, units); err != nil {
		return j.fail(err)
	}
	if j.c, err = s.connection(id, acc.addr); err != nil {
		return j.fail(err)
	}
	j.w, p.ep = j.c.w, j.c.ep
	st := &pushStart{sizes: p.g.sizes, blocks: blocks, mode: mode, nonce: nonce[:], addr: j.c.own,
		per: max(1, min(s.cfg.MaxGet, acc.maxMsg)/p.g.bb)}
	if ready != nil {
		st.layers = ready.Layers()
	}
	start := appendPushStart(nil, st)
	if len(start) > handoff.MaxPlane {
		return j.fail(fmt.Errorf("ucx: start bytes %d exceed %d: %w", len(start), handoff.MaxPlane, kvlease.ErrExceedsCapacity))
	}
	if st.per > 1 {
		// The runs the Start bytes hold (the longest, if not all fit).
		st.runs = fitRuns(blockRuns(p.g), handoff.MaxPlane-len(start))
		start = appendPushStart(start[:0], st)
	}
	p.msgs = messagesOf(p.g, st.runs, st.per)
	if ready != nil {
		if err := p.startStream(*ready); err != nil {
			return j.fail(err)
		}
	} else if needIov(p.msgs) {
		p.iov = newIovs(p.g.spans)
	}
	if n := mode.sumLen(); n > 0 {
		p.sums = newCbuf(n * blocks)
	}
	p.b = newBatch()
	if err := s.attachJob(j, id, attach, mode == integrityMAC); err != nil {
		return nil, err
	}
	if !j.w.do(func() { j.w.pollers = append(j.w.pollers, j.pushStep) }) {
		go j.revoke(fmt.Errorf("ucx: send: %w: %w", errWorkerGone, ErrRevoked))
	} else if p.stream != nil {
		go j.waitProgress(p.stream, j.w)
	}
	return start, nil
}

// connection checks out an idle connection of id's session to the
// destination worker at addr, or makes one: an endpoint to addr and a
// flush of it (the handshake completes before anything is attached),
// from an idle worker of the session whose endpoint goes elsewhere (its
// old endpoint closed), else from a worker of its own. An idle
// connection whose endpoint failed is destroyed (Stats.Broken) and
// replaced.
func (s *Sender[R]) connection(id handoff.PlaneID, addr []byte) (*conn, error) {
	k := keyOf(id)
	for range 2 * max(s.cfg.MaxIdle, 1) { // bounded: at most the idle ones
		c := s.pool.take(k, func(c *conn) bool { return c.peer == string(addr) })
		if c == nil {
			break
		}
		if c.healthy() {
			s.stats.add(func(st *Stats) { st.Reuses++ })
			return c, nil
		}
		c.destroy()
		s.stats.add(func(st *Stats) { st.Broken++ })
	}
	// The destinations's workers and ours are evicted independently: a
	// worker of ours may be idle with an endpoint to one the destination
	// no longer names. Connect it to this one instead.
	if c := s.pool.take(k, nil); c != nil {
		var err error
		if cerr := c.w.call(func() {
			if c.ep != nil {
				_ = c.w.closeEP(c.ep, true)
				c.ep, c.peer = nil, ""
			}
			if c.ep, err = c.w.connect(addr); err != nil {
				return
			}
			c.peer = string(addr)
			err = c.w.flushWait(c.ep, s.cfg.ConnectSpins)
		}); cerr != nil {
			err = cerr
		}
		if err == nil {
			s.stats.add(func(st *Stats) { st.Connects++ })
			return c, nil
		}
		c.destroy()
	}
	w, err := s.ctx.newWorker()
	if err != nil {
		return nil, err
	}
	c := &conn{w: w, peer: string(addr)}
	s.stats.add(func(st *Stats) { st.Workers++ })
	if cerr := w.call(func() {
		if c.own, err = w.address(); err != nil {
			return
		}
		if c.ep, err = w.connect(addr); err != nil {
			return
		}
		err = w.flushWait(c.ep, s.cfg.ConnectSpins)
	}); cerr != nil {
		err = cerr
	}
	if err != nil {
		c.destroy()
		return nil, err
	}
	s.stats.add(func(st *Stats) { st.Connects++ })
	return c, nil
}

// release ends a handoff whose destination reported done without error:
// once every send the job posted has completed (UCX is done with the
// regions: that is the evidence), its connection goes back to the idle
// pool and the transfer resolves nil. Sends that do not complete within
// settleTimeout, or a connection that failed meanwhile, make it a
// revocation instead (the connection is destroyed, then the transfer
// resolves nil: the destination's done stands).
func (j *sendJob[R]) release() {
	j.once.Do(func() {
		j.stall.stop()
		if j.sent.Load() || j.quiesced() {
			j.push.free()
			j.pin.Unpin()
			j.s.pool.put(keyOf(j.id), j.c)
		} else {
			j.teardown()
		}
		j.s.mu.Lock()
		delete(j.s.jobs, j.id)
		j.s.mu.Unlock()
		j.s.stats.add(func(st *Stats) { st.Completed++ })
		j.t.Resolve(nil)
		j.s.wg.Done()
	})
}

// quiesced waits, on the worker's thread, until every message and the
// sums table are posted and every posted send completed; false if the
// endpoint failed, a send could not be posted, or settleTimeout passed.
func (j *sendJob[R]) quiesced() bool {
	done := make(chan bool, 1)
	deadline := time.Now().Add(settleTimeout)
	p := j.push
	check := func() bool {
		switch {
		case p.ep.failed() != nil || p.err != nil:
			done <- false
		case p.next == p.units() && (p.sums.p == nil || p.tabled) && p.inline+p.b.completed() == p.posted():
			done <- true
		case time.Now().After(deadline):
			done <- false
		default:
			return false
		}
		return true
	}
	if !j.w.do(func() {
		if !check() {
			j.w.pollers = append(j.w.pollers, check)
		}
	}) {
		return false
	}
	return <-done
}

// posted is how many sends the job posted: its messages and the table.
func (p *pushSend) posted() int {
	if p.tabled {
		return p.next + 1
	}
	return p.next
}

// pushStep posts the job's messages, at most Window outstanding, then
// the integrity table; true once everything is posted (or posting
// failed). The source's evidence does not come from the sends'
// completions but from Finish or a cancel (the revocation), as in the
// pull model. Worker thread only.
func (j *sendJob[R]) pushStep() bool {
	p := j.push
	if p.ep == nil || p.ep.failed() != nil {
		return true
	}
	var posted int
	if p.stream != nil {
		posted = j.postParts()
	} else {
		posted = j.postMessages()
	}
	if posted > 0 {
		j.s.stats.add(func(st *Stats) { st.Messages += posted })
	}
	if c := p.inline + p.b.completed(); c != p.seen {
		p.seen = c
		j.stall.progress()
	} else if p.stream != nil && p.next < p.units() && c == p.next {
		// Nothing outstanding, the next part not written yet: the wait
		// is for our own prefill, not the destination.
		j.stall.progress()
	}
	if p.err != nil || j.halt.Load() {
		return true
	}
	if p.next < p.units() {
		return false
	}
	if p.sums.p != nil && !p.tabled {
		p.tabled = true
		j.stall.progress()
		if done, err := p.ep.send(p.sums.addr(), p.sums.n, false, tagOf(p.salt, tableIndex), p.b); err != nil {
			p.err = err
			return true
		} else if done {
			p.inline++
		}
	}
	if c := p.inline + p.b.completed(); c < p.posted() {
		return false // until every send completed: release then needs no wait
	} else if c != p.seen {
		p.seen = c // the table's send (the clock runs on to the done)
		j.stall.progress()
	}
	j.sent.Store(true)
	return true
}

// postMessages posts the job's messages, at most Window outstanding, and
// returns how many it posted. Worker thread only.
func (j *sendJob[R]) postMessages() int {
	p := j.push
	np := len(p.g.sizes)
	completed := p.inline + p.b.completed()
	posted := 0
	for p.next < len(p.msgs) && p.next-completed < j.s.cfg.Window {
		m := p.msgs[p.next]
		for b := m.first; b < m.first+m.count; b++ {
			if hook := j.s.cfg.BeforeSend; hook != nil {
				hook(j.id, b)
			}
			if n := p.summer.mode.sumLen(); n > 0 {
				p.summer.sum(p.sums.bytes()[b*n:(b+1)*n], b, p.g.spans[b*np:(b+1)*np])
			}
		}
		if j.halt.Load() {
			break // revoked: nothing more is posted
		}
		var done bool
		var err error
		tag := tagOf(p.salt, uint32(m.first))
		if m.contig {
			done, err = p.ep.send(m.addr, m.count*p.g.bb, false, tag, p.b)
		} else {
			done, err = p.ep.send(p.iov.at(m.first*np), m.count*np, true, tag, p.b)
		}
		if err != nil {
			p.err = err
			break
		}
		p.next++
		posted++
		j.stall.progress()
		if done {
			p.inline++
			completed++
		}
	}
	return posted
}

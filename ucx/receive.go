package ucx

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"

	"go.uber.org/atomic"
)

// Receiver is the destination side's plane: each handoff has a UCX
// worker to itself (pushed: an idle one of its session, or a new one;
// see Connections in DESIGN.md; pulled: a new one). Pushed (the
// default), it posts a tagged receive per message (a run of blocks, or a
// block) into the blocks' own pieces and checks every block against its
// sum; pulled (Config.Pull), it connects to the source's handoff
// worker, unpacks the remote keys and reads the blocks with ucp_get_nbx
// into its own registered regions, then flushes the endpoint. It is safe
// for concurrent use.
type Receiver[R any] struct {
	side[R] // its pool holds idle workers (push)

	mu       sync.Mutex
	prepared map[handoff.PlaneID]*prepared
	jobs     map[*recvJob[R]]struct{}
	closed   bool
	wg       sync.WaitGroup
}

var _ handoff.RecvPlane[[]byte] = (*Receiver[[]byte])(nil)

// NewReceiver initialises UCX and returns a receiver plane for regions
// of type R, whose memory pieces lists as NewSender's does.
func NewReceiver[R any](cfg Config, pieces func(r R, dst []Span) []Span) (*Receiver[R], error) {
	r := &Receiver[R]{prepared: make(map[handoff.PlaneID]*prepared), jobs: make(map[*recvJob[R]]struct{})}
	if err := r.init(cfg, pieces, defaultReceiverIdle); err != nil {
		return nil, err
	}
	return r, nil
}

// Prepare implements handoff.RecvPlane. Pushed, it takes an idle worker
// of the session (or starts one) for the handoff, and the Accept bytes
// carry the block count, a tag salt new on that worker, the most bytes
// of one message and the worker's address (the source connects to it,
// or reuses its endpoint to it). Pulled, they
// carry the block count (the source's worker address travels in Start:
// the source owns the registration, the destination connects to it);
// pull refuses an authenticated session (kvlease.ErrInvalidArgument).
func (r *Receiver[R]) Prepare(id handoff.PlaneID, blocks int) ([]byte, error) {
	if blocks <= 0 || blocks > handoff.MaxBlocks {
		return nil, fmt.Errorf("ucx: prepare %d blocks: %w", blocks, kvlease.ErrInvalidArgument)
	}
	p := &prepared{blocks: blocks}
	var accept []byte
	if r.cfg.Pull && r.keys.secure(id) {
		return nil, errPullSecure
	}
	if r.cfg.Pull {
		accept = appendAccept(nil, blocks)
	} else {
		var err error
		if accept, err = r.preparePush(id, p); err != nil {
			return nil, err
		}
	}
	r.mu.Lock()
	_, dup := r.prepared[id]
	closed := r.closed
	if !dup && !closed {
		r.prepared[id] = p
	}
	r.mu.Unlock()
	if dup || closed {
		p.release()
		if closed {
			return nil, fmt.Errorf("ucx: prepare: %w", ErrClosed)
		}
		return nil, fmt.Errorf("ucx: prepare: %v already prepared: %w", id, kvlease.ErrInvalidArgument)
	}
	return accept, nil
}

// prepared is a handoff between Prepare and Receive: its block count
// and, in the push model, the worker its messages arrive at and the salt
// of their tags.
type prepared struct {
	blocks int
	w      *worker
	c      *conn // w's connection (the push model)
	salt   uint32
}

// release destroys a prepared worker that will never receive (not
// returned to the pool: the source may have sent to it already).
func (p *prepared) release() {
	if p.c != nil {
		p.c.destroy()
		p.c, p.w = nil, nil
	}
}

// Forget implements handoff.RecvPlane: in the push model it destroys the
// handoff's worker (nothing was received into a region: no transfer; it
// is not kept, since the source may have sent to it).
func (r *Receiver[R]) Forget(id handoff.PlaneID) {
	r.mu.Lock()
	p := r.prepared[id]
	delete(r.prepared, id)
	r.mu.Unlock()
	if p != nil {
		p.release()
	}
}

// recvJob is one handoff being read. Everything but the atomic flags is
// owned by its worker's thread once the job is polled.
type recvJob[R any] struct {
	r       *Receiver[R]
	id      handoff.PlaneID
	w       *worker
	ep      *endpoint
	keys    []*rkey
	memhs   []*memh
	pin     runtime.Pinner
	t       *kvlease.Transfer
	plan    []getOp
	lregs   []run // the destination's registrations (memhs)
	next    int   // gets posted
	inline  int   // gets that completed at once
	b       batch
	fl      op
	flushed bool // the flush is posted
	postErr error
	bytes   int64
	dead    bool      // torn down: step must not touch UCX
	push    *pushRecv // the push model's state, or nil

	canceled atomic.Bool
	once     sync.Once
	// stall is the transfer's progress timeout (stall.go); stalled is set
	// when it passed before any cancel, and stops the job as a cancel
	// does; seen is the completions the clock has seen (worker thread).
	stall   *stallClock
	stalled atomic.Bool
	seen    int
}

// getOp is one get: n bytes from raddr into local.
type getOp struct {
	block int // of its first byte
	local uintptr
	n     int
	m     int // index into memhs
	raddr uint64
	key   int // index into keys
}

// Receive implements handoff.RecvPlane: it checks the Start bytes against
// the regions (ErrCorrupt, kvlease.ErrInvalidArgument: nothing attached),
// connects to the source's handoff worker, attaches the transfer and
// receives (or, pulled, registers the regions and reads) on the handoff
// worker's thread. The transfer resolves as the package doc says.
func (r *Receiver[R]) Receive(id handoff.PlaneID, regions []R, startBytes []byte, attach func(*kvlease.Transfer) error) error {
	r.mu.Lock()
	p, ok := r.prepared[id]
	delete(r.prepared, id)
	closed := r.closed
	r.mu.Unlock()
	if !ok {
		return fmt.Errorf("ucx: receive: %v not prepared: %w", id, kvlease.ErrInvalidArgument)
	}
	if closed {
		p.release()
		return fmt.Errorf("ucx: receive: %w", ErrClosed)
	}
	if !r.cfg.Pull {
		return r.receivePush(id, p, regions, startBytes, attach)
	}
	blocks := p.blocks
	st, err := parseStart(startBytes)
	if err != nil {
		return err
	}
	j := &recvJob[R]{r: r, id: id}
	g, err := locate(r.pieces, regions, &j.pin)
	if err != nil {
		j.pin.Unpin()
		return err
	}
	if err := blockCounts(st.blocks, blocks, len(regions)); err != nil {
		j.pin.Unpin()
		return err
	}
	if err := matchPieces(st.sizes, g.sizes); err != nil {
		j.pin.Unpin()
		return err
	}
	if st.table != nil {
		if st.regs, st.pieces, err = parseTable(st.table, st.blocks, st.sizes); err != nil {
			j.pin.Unpin()
			return err
		}
	}
	if j.lregs, err = registrations(g.spans); err != nil {
		j.pin.Unpin()
		return err
	}
	if j.w, err = r.ctx.newWorker(); err != nil {
		j.pin.Unpin()
		return err
	}
	for _, lr := range j.lregs {
		m, err := r.ctx.memMap(lr.addr, lr.n, lr.mem == CUDA)
		if err != nil {
			j.teardown()
			return err
		}
		r.stats.add(func(st *Stats) { st.Registrations++; st.RegisteredBytes += int64(lr.n) })
		j.memhs = append(j.memhs, m)
	}
	if cerr := j.w.call(func() {
		if j.ep, err = j.w.connect(st.addr); err != nil {
			return
		}
		// Finish the handshake before anything is attached: a flush of
		// the fresh endpoint completes once it is wired up.
		if err = j.w.flushWait(j.ep, r.cfg.ConnectSpins); err != nil {
			return
		}
		if st.remote != nil {
			if st.regs, st.pieces, err = j.readTable(st); err != nil {
				return
			}
		}
		for _, rr := range st.regs {
			k, kerr := j.ep.unpack(rr.key)
			if kerr != nil {
				err = kerr
				return
			}
			j.keys = append(j.keys, k)
		}
	}); cerr != nil {
		err = cerr
	}
	if err != nil {
		j.teardown()
		return err
	}
	j.plan = planGets(st.sizes, st.pieces, g, j.lregs, r.cfg.MaxGet)
	return j.launch(attach, false, j.step)
}

// launch gives the job its transfer, attaches it, enrolls the job and
// hands it to its worker's thread (poll), in both models. A failed attach
// or a Receiver closed meanwhile tears the job down (nothing was read or
// received: evidence) and frees the push model's state; keyed counts the
// handoff in Stats.Keyed.
func (j *recvJob[R]) launch(attach func(*kvlease.Transfer) error, keyed bool, poll func() bool) error {
	r := j.r
	drop := func() {
		j.teardown()
		if j.push != nil {
			j.push.free()
		}
	}
	j.stall = newStallClock(r.cfg.StallTimeout)
	j.t = kvlease.NewTransfer(func() {
		j.canceled.Store(true)
		j.w.do(func() {}) // wake the worker
	})
	if err := attach(j.t); err != nil {
		drop()
		j.t.Resolve(err)
		return err
	}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		drop()
		j.t.Resolve(fmt.Errorf("ucx: receive: %w", ErrClosed))
		return nil
	}
	r.jobs[j] = struct{}{}
	r.wg.Add(1)
	r.mu.Unlock()
	go j.stall.watch(func(time.Duration) {
		if !j.canceled.Load() {
			j.stalled.Store(true)
			j.w.do(func() {}) // wake the worker: it stops as on a cancel
		}
	})
	r.stats.add(func(s *Stats) {
		s.Started++
		if keyed {
			s.Keyed++
		}
	})
	if j.push == nil {
		j.b, j.fl = newBatch(), newOp() // the pull model's gets and flush
	}
	if !j.w.do(func() { j.w.pollers = append(j.w.pollers, poll) }) {
		go j.finish(fmt.Errorf("ucx: receive: %w", errWorkerGone), true)
	}
	return nil
}

// readTable reads the source's run table (before anything is attached:
// into C memory of ours, not into a region). Worker thread only.
func (j *recvJob[R]) readTable(st *start) ([]remoteRun, []remotePiece, error) {
	k, err := j.ep.unpack(st.remote.key)
	if err != nil {
		return nil, nil, err
	}
	buf := newCbuf(int(st.remote.n))
	done, err := j.w.getWait(j.ep, buf, st.remote.addr, k, j.r.cfg.ConnectSpins)
	if !done {
		return nil, nil, err // the get may still use buf and the key: both stay allocated
	}
	k.destroy()
	defer buf.free()
	if err != nil {
		return nil, nil, err
	}
	return parseTable(buf.bytes(), st.blocks, st.sizes)
}

// step advances the job on its worker's thread; true when it is done.
func (j *recvJob[R]) step() bool {
	if j.dead {
		return true
	}
	if err := j.ep.failed(); err != nil {
		// The peer is gone: UCX completes what was outstanding without
		// the peer's word. Not evidence: revoke.
		go j.finish(fmt.Errorf("%w: %w", err, ErrRevoked), true)
		return true
	}
	completed := j.inline + j.b.completed()
	if completed != j.seen {
		j.seen = completed
		j.stall.progress()
	}
	stopping := j.stopping() || j.postErr != nil || j.b.failedN() > 0
	for !stopping && j.next < len(j.plan) && j.next-completed < j.r.cfg.Window {
		g := j.plan[j.next]
		if hook := j.r.cfg.BeforeGet; hook != nil {
			hook(j.id, g.block)
			if j.stopping() {
				stopping = true
				break
			}
		}
		done, err := j.ep.get(g.local, g.n, j.memhs[g.m], g.raddr, j.keys[g.key], j.b)
		if err != nil {
			j.postErr = err
			stopping = true
			break
		}
		j.next++
		j.stall.progress()
		if done {
			j.inline++
			completed++
		}
	}
	if completed < j.next {
		return false // wait for the posted gets
	}
	if !j.flushed && (stopping || j.next == len(j.plan)) {
		j.flushed = true
		if _, err := j.ep.flush(j.fl); err != nil {
			go j.finish(fmt.Errorf("%w: %w", err, ErrRevoked), true)
			return true
		}
	}
	if !j.flushed || !j.fl.done() {
		return false
	}
	if err := j.fl.err(); err != nil {
		// A flush that failed proves nothing: revoke.
		go j.finish(fmt.Errorf("ucx: flush: %w: %w", err, ErrRevoked), true)
		return true
	}
	// Every posted get completed and a flush after them completed:
	// evidence. The outcome says whether every block arrived.
	var out error
	switch {
	case j.b.failedN() > 0:
		out = fmt.Errorf("ucx: %d of %d gets failed: %w", j.b.failedN(), j.next, j.b.firstErr())
	case j.postErr != nil:
		out = j.postErr
	case j.next < len(j.plan) && j.stalled.Load():
		out = fmt.Errorf("ucx: stopped after %d of %d gets: no progress for %v: %w", j.next, len(j.plan), j.r.cfg.StallTimeout, ErrStalled)
	case j.next < len(j.plan):
		out = fmt.Errorf("ucx: stopped after %d of %d gets: %w", j.next, len(j.plan), kvlease.ErrCanceled)
	default:
		for _, g := range j.plan {
			j.bytes += int64(g.n)
		}
	}
	go j.finish(out, false)
	return true
}

// stopping reports whether the job was canceled or stalled: it posts
// nothing more and withdraws what it can.
func (j *recvJob[R]) stopping() bool { return j.canceled.Load() || j.stalled.Load() }

// teardown releases the job's UCX resources: remote keys and the
// endpoint (forced close: only after the flush's evidence or as part of
// a revocation), the worker, the destination's registrations.
func (j *recvJob[R]) teardown() {
	if j.push != nil && j.push.prep.c != nil {
		c := j.push.prep.c
		c.w.destroy(func() {
			j.dead = true
			if c.ep != nil {
				_ = c.w.closeEP(c.ep, true)
				c.ep, j.ep = nil, nil
			}
			c.w.settle() // the source connected to this worker
		})
	} else if j.w != nil {
		j.w.destroy(func() {
			j.dead = true
			for _, k := range j.keys {
				k.destroy()
			}
			j.keys = nil
			if j.ep != nil {
				_ = j.w.closeEP(j.ep, true)
				j.ep = nil
			}
			if j.push != nil {
				j.w.settle() // the source connected to this worker
			}
		})
	}
	for _, m := range j.memhs {
		_ = j.r.ctx.unmap(m)
	}
	j.memhs = nil
	j.pin.Unpin()
}

// finish tears the job down and resolves its transfer, once. revoked
// says the evidence is the teardown itself.
func (j *recvJob[R]) finish(out error, revoked bool) {
	j.once.Do(func() {
		j.stall.stop()
		if j.push != nil && j.push.stray {
			j.r.stats.add(func(s *Stats) { s.Strays++ })
		}
		if out == nil && !revoked && j.push != nil && j.push.prep.c != nil && !j.push.stray {
			// Every receive completed and every block passed its check:
			// the worker and its endpoint serve the session's next
			// handoff (a new salt, so none of this one's tags).
			j.pin.Unpin()
			j.r.pool.put(keyOf(j.id), j.push.prep.c)
		} else {
			j.teardown()
		}
		j.b.free()
		j.fl.free()
		j.r.mu.Lock()
		delete(j.r.jobs, j)
		j.r.mu.Unlock()
		if j.push != nil {
			j.push.free()
		}
		j.r.stats.add(func(s *Stats) {
			if j.push != nil {
				s.Messages += j.next
			} else {
				s.Gets += j.next
			}
			switch {
			case revoked:
				s.Revoked++
			case out == nil:
				s.Completed++
				s.Bytes += j.bytes
			case errors.Is(out, kvlease.ErrCanceled):
				s.Canceled++
			}
			if errors.Is(out, ErrStalled) {
				s.Stalled++
			}
		})
		j.t.Resolve(out)
		j.r.wg.Done()
	})
}

// Stats returns what the receiver did.
func (r *Receiver[R]) Stats() Stats { return r.snapshot() }

// Close revokes every handoff still reading (the operator's way out of a
// silent source: each job's endpoint is closed, its worker destroyed and
// its registrations unmapped, and that is its evidence), destroys the
// idle workers and releases UCX. Closing again does nothing.
func (r *Receiver[R]) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil // closed already (UCX is released once)
	}
	r.closed = true
	all := make([]*recvJob[R], 0, len(r.jobs))
	for j := range r.jobs {
		all = append(all, j)
	}
	preps := make([]*prepared, 0, len(r.prepared))
	for id, p := range r.prepared {
		preps = append(preps, p)
		delete(r.prepared, id)
	}
	r.mu.Unlock()
	for _, p := range preps {
		p.release()
	}
	for _, j := range all {
		j.finish(fmt.Errorf("%w: %w", ErrClosed, ErrRevoked), true)
	}
	r.wg.Wait()
	r.release()
	return nil
}

// blockCounts checks that the Start bytes describe as many blocks as
// were prepared and as the destination's regions (ErrCorrupt).
func blockCounts(start, prepared, regions int) error {
	if regions != prepared || start != prepared {
		return fmt.Errorf("ucx: receive: start describes %d blocks; %d prepared, %d regions: %w",
			start, prepared, regions, ErrCorrupt)
	}
	return nil
}

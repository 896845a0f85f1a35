package audit

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

var (
	errClientGone = errors.New("audit: client went away")
	errBusy       = errors.New("audit: destination busy")
	errRevoked    = errors.New("audit: destination revoked its acceptance")
	errDeadline   = fmt.Errorf("audit: transfer passed its deadline: %w", kvlease.ErrQuarantined)
)

// world is one run's deployment and the audit's model of it. Only the
// driver's goroutine changes it; copy goroutines read the refs of their
// own job and report violations through addAsync.
type world struct {
	cfg   *Config
	env   handoff.Envelope
	pools []*poolState
	reqs  map[int32]*request
	live  []*request // not gone, not in limbo; the generator picks from these
	limbo []*request // quarantined, ack lost, nobody waiting for it
	jobs  []*job     // copies whose goroutine has not exited
	rep   *Report

	op       int  // index of the operation being executed; -1 while draining
	stopped  bool // a stall: goroutines are stuck, the run cannot go on
	fullEach bool // run the full check after every operation (short replays)
	quit     chan struct{}

	mu     sync.Mutex // guards async and closed
	async  []Violation
	closed bool
}

// poolState is one worker: its pool and the model the audit keeps of
// it, per slot: how many open-lease positions hold it, how many pending
// and quarantined transfer attachments gate it, the generation it was
// last handed out at, and what it was sealed with.
type poolState struct {
	idx  int
	name string
	p    *kvlease.Pool[[]byte]
	mem  *kvlease.HostMemory
	held []int32
	pend []int32
	quar []int32
	gen  []uint32
	seal []sealRec
	fifo []*request // queued AcquireWait callers, in arrival order
}

type sealRec struct {
	gen  uint32
	hash kvlease.BlockHash
	want Marker
	ok   bool
}

// leaseRec is the audit's record of one lease: its refs as handed out and
// the content each block must hold (known[i] false while a transfer
// writes it).
type leaseRec struct {
	ps       *poolState
	l        *kvlease.Lease[[]byte]
	r        *request
	refs     []kvlease.BlockRef
	want     []Marker
	known    []bool
	open     bool
	sealedTo int // positions [0, sealedTo) are sealed or were never to be
}

// xferRec is the audit's record of a transfer and what it gates.
type xferRec struct {
	t     *kvlease.Transfer
	state kvlease.TransferState
	atts  []attRec
}

type attRec struct {
	lr *leaseRec
	n  int // blocks [0, n)
}

type status uint8

const (
	stGone status = iota
	stWaiting
	stIdle
	stAccepted
	stFlying
	stStuck
)

// request is one synthetic request.
type request struct {
	id     int32
	owner  string
	prompt int
	maxNew int
	tokens []int32
	hashes []kvlease.BlockHash
	growth int // blocks it may still grow by

	at   *poolState
	cur  *leaseRec
	wait *waitRec
	h    *handRec
	jobs []*job
	gone bool

	live  int // index in world.live, -1 if not there
	limbo bool

	// The generator's intentions for the transfer in flight.
	abortAt, deadlineAt int
	aborted, expired    bool
}

type waitRec struct {
	ps     *poolState
	n      int
	cancel context.CancelFunc
	ch     chan waitResult
}

type waitResult struct {
	l   *kvlease.Lease[[]byte]
	err error
}

// handRec is a handoff in progress.
type handRec struct {
	h   *handoff.Handoff[[]byte, []byte]
	to  *poolState
	src *leaseRec
	dst *leaseRec
	x   *xferRec
	job *job
	n   int
}

func newWorld(cfg *Config) (*world, error) {
	w := &world{
		cfg:  cfg,
		env:  cfg.envelope(),
		reqs: make(map[int32]*request),
		rep:  &Report{Seed: cfg.Seed},
		quit: make(chan struct{}),
	}
	obs := kvlease.ObserverFunc(func(e kvlease.Event) {
		if e.Kind == kvlease.EventLeaked {
			w.addAsync(Violation{Kind: Leak, Detail: fmt.Sprintf("lease %d (%s) became unreachable while open: %v", e.Lease, e.Owner, e.Err)})
		}
	})
	for i := range cfg.Workers {
		n := cfg.poolBlocks(i)
		mem, err := kvlease.NewHostMemory(n, cfg.BlockBytes)
		if err != nil {
			return nil, err
		}
		opts := []kvlease.Option{kvlease.WithBlockTokens(cfg.BlockTokens), kvlease.WithObserver(obs), kvlease.WithLeakCheck(true)}
		if cfg.PoolOptions != nil {
			opts = append(opts, cfg.PoolOptions(i)...)
		}
		p, err := kvlease.NewPool[[]byte](mem, opts...)
		if err != nil {
			return nil, fmt.Errorf("audit: worker %d: %w", i, err)
		}
		w.pools = append(w.pools, &poolState{
			idx: i, name: fmt.Sprintf("w%d", i), p: p, mem: mem,
			held: make([]int32, n), pend: make([]int32, n), quar: make([]int32, n),
			gen: make([]uint32, n), seal: make([]sealRec, n),
		})
	}
	return w, nil
}

// violate records a violation found by the driver's goroutine.
func (w *world) violate(k ViolationKind, format string, args ...any) {
	w.rep.violate(Violation{Kind: k, Op: w.op, Detail: fmt.Sprintf(format, args...)})
}

// addAsync records a violation found on another goroutine (a copy's
// write check, a leak cleanup); the driver files it after the operation.
func (w *world) addAsync(v Violation) {
	w.mu.Lock()
	if !w.closed {
		w.async = append(w.async, v)
	}
	w.mu.Unlock()
}

func (w *world) collectAsync() {
	w.mu.Lock()
	vs := w.async
	w.async = nil
	w.mu.Unlock()
	for _, v := range vs {
		v.Op = w.op
		w.rep.violate(v)
	}
}

// stall records that something did not progress, and stops the run.
func (w *world) stall(what string) {
	w.violate(Stall, "no progress within %v: %s", w.cfg.StallTimeout, what)
	w.stopped = true
}

// await waits for ch, or reports a stall.
func (w *world) await(ch <-chan struct{}, what string) bool {
	select {
	case <-ch:
		return true
	default:
	}
	t := time.NewTimer(w.cfg.StallTimeout)
	defer t.Stop()
	select {
	case <-ch:
		return true
	case <-t.C:
		w.stall(what)
		return false
	}
}

// spin waits for cond, which another goroutine is about to make true,
// or reports a stall.
func (w *world) spin(cond func() bool, what string) bool {
	var deadline time.Time
	for i := 0; !cond(); i++ {
		if i < 64 {
			runtime.Gosched()
			continue
		}
		if deadline.IsZero() {
			deadline = time.Now().Add(w.cfg.StallTimeout)
		} else if time.Now().After(deadline) {
			w.stall(what)
			return false
		}
		time.Sleep(20 * time.Microsecond)
	}
	return true
}

// status says where r is, as the generator sees it.
func (w *world) status(r *request) status {
	switch {
	case r == nil || r.gone:
		return stGone
	case r.wait != nil:
		return stWaiting
	case r.h != nil:
		if r.h.x == nil {
			return stAccepted
		}
		if r.h.job != nil && !r.h.job.ended {
			return stFlying
		}
		return stStuck
	case r.cur != nil:
		return stIdle
	}
	return stGone
}

// rogue returns a copy of r's that runs outside any handoff and has not
// ended (only broken variants start those), or nil.
func (r *request) rogue() *job {
	for _, j := range r.jobs {
		if j.hr == nil && !j.ended {
			return j
		}
	}
	return nil
}

func (w *world) addLive(r *request) {
	r.live = len(w.live)
	w.live = append(w.live, r)
}

func (w *world) removeLive(r *request) {
	if r.live < 0 {
		return
	}
	last := w.live[len(w.live)-1]
	w.live[r.live] = last
	last.live = r.live
	w.live = w.live[:len(w.live)-1]
	r.live = -1
}

// toLimbo moves a request whose quarantined transfer nobody waits for
// out of the live set.
func (w *world) toLimbo(r *request) {
	w.removeLive(r)
	r.limbo = true
	w.limbo = append(w.limbo, r)
}

func (w *world) gone(r *request) {
	r.gone = true
	w.removeLive(r)
	if r.limbo {
		r.limbo = false
		w.limbo = slices.DeleteFunc(w.limbo, func(x *request) bool { return x == r })
	}
	w.forget(r)
}

// forget drops a gone request whose copies have all stopped: nothing
// names it any more (a later operation on it is skipped).
func (w *world) forget(r *request) {
	if !r.gone {
		return
	}
	for _, j := range r.jobs {
		if !j.ended {
			return
		}
	}
	delete(w.reqs, r.id)
}

// ---- the model ----

// opened records a lease just handed out: its first hits blocks are
// prefix hits (checked against what was sealed), the rest fresh
// (checked against every holder the model knows of).
func (w *world) opened(ps *poolState, l *kvlease.Lease[[]byte], hits int, r *request) *leaseRec {
	n := l.Len()
	lr := &leaseRec{ps: ps, l: l, r: r, refs: make([]kvlease.BlockRef, 0, n), want: make([]Marker, 0, n), known: make([]bool, 0, n), open: true}
	for i := range n {
		w.addBlock(lr, l.Ref(i), i < hits)
	}
	return lr
}

// addBlock appends block ref to lr's record, checking it.
func (w *world) addBlock(lr *leaseRec, ref kvlease.BlockRef, hit bool) {
	ps := lr.ps
	i := len(lr.refs)
	lr.refs = append(lr.refs, ref)
	lr.want = append(lr.want, Marker{})
	lr.known = append(lr.known, false)
	id := int(ref.ID)
	if id < 0 || id >= len(ps.held) {
		w.violate(Unexpected, "%s: lease %d block %d: slot %v outside the pool", ps.name, lr.l.ID(), i, ref)
		return
	}
	if hit {
		rec := ps.seal[id]
		var h kvlease.BlockHash
		if lr.r != nil && i < len(lr.r.hashes) {
			h = lr.r.hashes[i]
		}
		switch {
		case !rec.ok || rec.gen != ref.Gen:
			w.violate(BadHit, "%s: request %d block %d hit slot %v, which the audit never sealed at that generation", ps.name, lr.r.id, i, ref)
		case rec.hash != h:
			w.violate(BadHit, "%s: request %d block %d hit slot %v sealed with hash %016x, want %016x", ps.name, lr.r.id, i, ref, uint64(rec.hash), uint64(h))
		default:
			lr.want[i], lr.known[i] = rec.want, true
			w.checkBlock(lr, i)
		}
	} else {
		if w.cfg.Concurrent && (ps.held[id] > 0 || ps.pend[id] > 0 || ps.quar[id] > 0) {
			// The model may lag what copies and handoffs did meanwhile.
			w.resync()
		}
		if ps.held[id] > 0 || ps.pend[id] > 0 || ps.quar[id] > 0 {
			w.violate(DoubleLease, "%s: slot %v handed out fresh to %s while %d open leases, %d pending and %d quarantined transfers hold it",
				ps.name, ref, lr.l.Owner(), ps.held[id], ps.pend[id], ps.quar[id])
		}
		if ref.Gen == ps.gen[id] {
			w.violate(DoubleLease, "%s: slot %v handed out fresh to %s without a new generation", ps.name, ref, lr.l.Owner())
		}
		ps.gen[id] = ref.Gen
	}
	ps.held[id]++
}

// closeRec records that lr closed.
func (w *world) closeRec(lr *leaseRec) {
	if lr == nil || !lr.open {
		return
	}
	lr.open = false
	for _, ref := range lr.refs {
		if id := int(ref.ID); id >= 0 && id < len(lr.ps.held) {
			lr.ps.held[id]--
		}
	}
}

// syncLease notices that the library closed lr (a handoff does that).
func (w *world) syncLease(lr *leaseRec) {
	if lr != nil && lr.open && leaseClosed(lr.l) {
		w.closeRec(lr)
	}
}

func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

func leaseClosed(l *kvlease.Lease[[]byte]) bool { return l.Closed() }

func (w *world) attachRec(x *xferRec) {
	for _, a := range x.atts {
		for _, ref := range a.lr.refs[:a.n] {
			a.lr.ps.pend[ref.ID]++
		}
	}
}

// syncXfer brings the model's view of x to the transfer's state.
func (w *world) syncXfer(x *xferRec) {
	if x == nil {
		return
	}
	st := x.t.State()
	if st == x.state || x.state == kvlease.TransferResolved {
		return
	}
	if x.state == kvlease.TransferQuarantined && st == kvlease.TransferPending {
		w.violate(Unexpected, "transfer %d went from quarantined back to pending", x.t.ID())
		return
	}
	for _, a := range x.atts {
		ps := a.lr.ps
		for _, ref := range a.lr.refs[:a.n] {
			if x.state == kvlease.TransferPending {
				ps.pend[ref.ID]--
			} else {
				ps.quar[ref.ID]--
			}
			if st == kvlease.TransferQuarantined {
				ps.quar[ref.ID]++
			}
		}
	}
	x.state = st
}

// resync brings the model's lease and transfer records up to date with
// the library, for every request that holds anything (concurrent runs,
// where copies resolve and handoffs release on their own).
func (w *world) resync() {
	for _, r := range w.reqs {
		if hr := r.h; hr != nil {
			w.syncXfer(hr.x)
			w.syncLease(hr.src)
			w.syncLease(hr.dst)
		}
		for _, j := range r.jobs {
			w.syncXfer(j.x)
		}
		if r.cur != nil {
			w.syncLease(r.cur)
		}
	}
}

// stamp writes the request's own marker into block i of lr.
func (w *world) stamp(lr *leaseRec, i int) {
	b, err := lr.l.Region(i)
	if err != nil {
		w.violate(Unexpected, "%s: open lease %d refuses block %d: %v", lr.ps.name, lr.l.ID(), i, err)
		return
	}
	m := Marker{Request: uint64(lr.r.id), Block: uint32(i), Gen: lr.refs[i].Gen}
	Stamp(b, m)
	lr.want[i], lr.known[i] = m, true
}

// checkBlock checks block i of the open lease lr against what it must
// hold.
func (w *world) checkBlock(lr *leaseRec, i int) {
	if !lr.known[i] {
		return
	}
	b, err := lr.l.ReadRegion(i)
	if err != nil {
		w.violate(Unexpected, "%s: open lease %d refuses block %d: %v", lr.ps.name, lr.l.ID(), i, err)
		return
	}
	if err := Check(b, lr.want[i]); err != nil {
		me := err.(*MismatchError)
		me.Where = fmt.Sprintf("%s: request %d's lease %d block %d (slot %v)", lr.ps.name, lr.r.id, lr.l.ID(), i, lr.refs[i])
		w.violate(MarkerMix, "%v", me)
	}
}

func (w *world) checkLease(lr *leaseRec) {
	if lr == nil || !lr.open {
		return
	}
	for i := range lr.refs {
		w.checkBlock(lr, i)
	}
}

// sealFrom seals lr's unsealed full prompt blocks, from lr.sealedTo on.
func (w *world) sealFrom(lr *leaseRec) {
	r := lr.r
	bt := w.cfg.BlockTokens
	end := min(len(r.hashes), len(lr.refs))
	for i := lr.sealedTo; i < end; i++ {
		if !lr.known[i] {
			break
		}
		parent := namespace
		if i > 0 {
			parent = r.hashes[i-1]
		}
		h, err := lr.l.SealTokens(i, parent, r.tokens[i*bt:(i+1)*bt])
		if err != nil {
			w.violate(Unexpected, "%s: seal block %d of request %d: %v", lr.ps.name, i, r.id, err)
			return
		}
		if h != r.hashes[i] {
			w.violate(Unexpected, "%s: SealTokens hashed block %d of request %d to %016x, ChainHashes says %016x", lr.ps.name, i, r.id, uint64(h), uint64(r.hashes[i]))
		}
		ref := lr.refs[i]
		lr.ps.seal[ref.ID] = sealRec{gen: ref.Gen, hash: h, want: lr.want[i], ok: true}
		lr.sealedTo = i + 1
		w.rep.Seals++
	}
}

// prefill computes a new lease's KV: stamps its fresh blocks and seals its
// full prompt blocks.
func (w *world) prefill(r *request, lr *leaseRec, hits int) {
	for i := hits; i < len(lr.refs); i++ {
		w.stamp(lr, i)
	}
	lr.sealedTo = min(hits, len(r.hashes))
	w.sealFrom(lr)
	r.cur, r.at = lr, lr.ps
	w.rep.Admitted++
}

// ---- settling ----

// settle brings the model up to date with what the last operation did to
// r: transfer evidence, leases a handoff closed, the handoff's outcome.
func (w *world) settle(r *request) {
	if r == nil {
		return
	}
	concurrent := w.cfg.Concurrent
	if concurrent {
		for _, j := range r.jobs {
			w.poll(j)
		}
	}
	if hr := r.h; hr != nil && !r.gone && concurrent {
		// Copies resolve and handoffs record it on their own. Done is
		// closed once a handoff's final state and its effects (a
		// released destination) are in place, and no final state comes
		// before the transfer's evidence: so look at Done first, then
		// bring the model up to date, then act on the final state.
		done := closed(hr.h.Done())
		if !done && hr.x != nil && hr.x.t.State() == kvlease.TransferResolved {
			// The watcher is about to record the evidence.
			if !w.await(hr.h.Done(), fmt.Sprintf("request %d: handoff to record its transfer's evidence", r.id)) {
				return
			}
			done = true
		}
		if done && hr.job != nil {
			w.finishJob(hr.job)
		}
		w.syncXfer(hr.x)
		w.syncLease(hr.src)
		w.syncLease(hr.dst)
		if done {
			w.settleHandoff(r, hr)
		}
	} else if hr != nil && !r.gone {
		if hr.x != nil && hr.x.t.State() == kvlease.TransferResolved {
			if hr.job != nil && !hr.job.ended && !hr.job.flagged {
				hr.job.flagged = true
				w.violate(EarlyResolve, "request %d: transfer %d resolved (%v) while its copy was still running (%d of %d blocks written)",
					r.id, hr.x.t.ID(), hr.x.t.Err(), hr.job.writes, hr.n)
			}
			// The handoff's watcher records the evidence; wait for it.
			if !w.await(hr.h.Done(), fmt.Sprintf("request %d: handoff to record its transfer's evidence", r.id)) {
				return
			}
		}
		w.syncXfer(hr.x)
		w.syncLease(hr.src)
		w.syncLease(hr.dst)
		w.settleHandoff(r, hr)
	}
	for _, j := range r.jobs {
		w.syncXfer(j.x)
	}
	if r.cur != nil {
		w.syncLease(r.cur)
	}
}

// refresh settles r between operations (concurrent runs): what its copy
// did meanwhile, and the waiters that freed blocks served.
func (w *world) refresh(r *request) {
	w.settle(r)
	for _, ps := range w.pools {
		w.serveWaiters(ps)
	}
	w.collectAsync()
}

// settleHandoff acts on a handoff's state after an operation.
func (w *world) settleHandoff(r *request, hr *handRec) {
	h := hr.h
	switch st := h.State(); st {
	case handoff.Rejected:
		if h.Transfer() != nil {
			w.violate(HandoffBroken, "request %d: rejected handoff has transfer %d", r.id, h.Transfer().ID())
		}
		if hr.dst != nil && hr.dst.open {
			w.violate(HandoffBroken, "request %d: rejected handoff left its destination lease open", r.id)
		}
		r.h = nil
	case handoff.Delivered:
		if w.cfg.Concurrent && hr.job != nil {
			w.finishJob(hr.job)
		}
		if hr.job == nil || !hr.job.ended || hr.x == nil || hr.x.state != kvlease.TransferResolved {
			w.violate(HandoffBroken, "request %d: handoff delivered before its copy ended", r.id)
		}
		dst := hr.dst
		if !dst.open {
			w.violate(HandoffBroken, "request %d: delivered destination lease is closed", r.id)
			r.h = nil
			return
		}
		for i := range dst.refs {
			dst.want[i], dst.known[i] = hr.src.want[i], hr.src.known[i]
		}
		w.rep.Delivered++
		w.checkLease(dst)
		// The source worker is done with the request.
		w.checkLease(hr.src)
		hr.src.l.Release()
		w.closeRec(hr.src)
		r.cur, r.at, r.h = dst, dst.ps, nil
		if w.cfg.hooks.delivered != nil {
			w.cfg.hooks.delivered(w, r)
		}
	case handoff.Failed:
		if hr.dst != nil && hr.dst.open {
			w.violate(HandoffBroken, "request %d: failed handoff left its destination lease open", r.id)
		}
		if hr.x != nil {
			w.rep.Failed++
		}
		r.h = nil
	case handoff.Aborted:
		if hr.src.open || (hr.dst != nil && hr.dst.open) {
			w.violate(HandoffBroken, "request %d: aborted handoff left a lease open", r.id)
		}
		if hr.x != nil && hr.x.state != kvlease.TransferResolved {
			w.violate(HandoffBroken, "request %d: handoff aborted while its transfer is %v", r.id, hr.x.state)
		}
		r.h = nil
		w.gone(r)
	case handoff.Accepted, handoff.Transferring, handoff.Aborting, handoff.Quarantined:
	default:
		w.violate(HandoffBroken, "request %d: handoff left in state %v", r.id, st)
	}
}

// serveWaiters hands the leases of waiters the pool served to their
// requests. The pool serves in arrival order, so they are the head of the
// queue.
func (w *world) serveWaiters(ps *poolState) {
	if len(ps.fifo) == 0 {
		return
	}
	if w.cfg.Concurrent {
		// Copies free blocks at any time: take the results that came.
		for _, r := range slices.Clone(ps.fifo) {
			select {
			case res := <-r.wait.ch:
				ps.fifo = removeReq(ps.fifo, r)
				r.wait = nil
				if res.err != nil {
					w.violate(Unexpected, "%s: served waiter %d got %v", ps.name, r.id, res.err)
					w.gone(r)
					continue
				}
				w.waited(r, ps, res.l)
			default:
			}
		}
		return
	}
	q := ps.p.Stats().Waiters
	if len(ps.fifo) > 0 && len(ps.fifo[0].wait.ch) > 0 {
		q = min(q, len(ps.fifo)-1) // served before the audit saw it queue
	}
	if q > len(ps.fifo) {
		w.violate(Unexpected, "%s: pool reports %d waiters, the audit queued %d", ps.name, q, len(ps.fifo))
		return
	}
	for len(ps.fifo) > q && !w.stopped {
		r := ps.fifo[0]
		ps.fifo = ps.fifo[1:]
		res, ok := w.result(r.wait)
		r.wait = nil
		if !ok {
			return
		}
		if res.err != nil {
			w.violate(Unexpected, "%s: served waiter %d got %v", ps.name, r.id, res.err)
			w.gone(r)
			continue
		}
		w.waited(r, ps, res.l)
	}
}

func (w *world) result(wr *waitRec) (waitResult, bool) {
	select {
	case res := <-wr.ch:
		return res, true
	default:
	}
	t := time.NewTimer(w.cfg.StallTimeout)
	defer t.Stop()
	select {
	case res := <-wr.ch:
		return res, true
	case <-t.C:
		w.stall("a served or cancelled waiter did not return")
		return waitResult{}, false
	}
}

func (w *world) waited(r *request, ps *poolState, l *kvlease.Lease[[]byte]) {
	lr := w.opened(ps, l, 0, r)
	w.rep.Waited++
	w.prefill(r, lr, 0)
}

// ---- checks ----

// cheapCheck runs after every operation: the state counts sum to
// capacity.
func (w *world) cheapCheck() {
	for _, ps := range w.pools {
		s := ps.p.Stats()
		if sum := s.Free + s.Cached + s.Leased + s.Draining + s.Quarantined; sum != s.Capacity {
			w.violate(CountMismatch, "%s: state counts %+v sum to %d, capacity %d", ps.name, s, sum, s.Capacity)
		}
	}
}

// fullCheck checks every live lease's markers, every pool's internal
// consistency, and the state counts against the model.
func (w *world) fullCheck() {
	for _, ps := range w.pools {
		if err := ps.p.Check(); err != nil {
			w.violate(PoolCheck, "%s: %v", ps.name, err)
		}
		if w.cfg.Concurrent && w.op >= 0 {
			continue // the model is exact only at rest
		}
		s := ps.p.Stats()
		var q, l, d, fc int
		for id := range ps.held {
			switch {
			case ps.quar[id] > 0:
				q++
			case ps.held[id] > 0:
				l++
			case ps.pend[id] > 0:
				d++
			default:
				fc++
			}
		}
		if s.Quarantined != q || s.Leased != l || s.Draining != d || s.Free+s.Cached != fc {
			w.violate(CountMismatch, "%s: pool counts quarantined %d, leased %d, draining %d, free+cached %d; the audit's leases and transfers say %d, %d, %d, %d",
				ps.name, s.Quarantined, s.Leased, s.Draining, s.Free+s.Cached, q, l, d, fc)
		}
	}
	for _, r := range w.live {
		w.checkLease(r.cur)
	}
}

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

// Package replay replays a request trace (package trace) through a block
// allocator as a serving engine's scheduler would, and measures it.
//
// The engine runs in steps. Each step it
//
//  1. queues the requests whose arrival step has come;
//  2. admits waiting requests in order while fewer than MaxRunning run:
//     it hashes the prompt's full blocks (kvlease.ChainHashes under
//     Config.Seed), acquires a lease with AcquirePrefix, and seals the
//     prompt blocks that missed (prefill filled them). Admission stops at
//     the first request that does not fit (first come, first served);
//  3. decodes one token for every running request, oldest first: a
//     request whose last block is full first grows its lease by one block
//     (Extend); when that is refused for lack of blocks the youngest
//     running request is preempted (its lease released, its progress kept,
//     and it is requeued at the front, to be recomputed from the prefix
//     cache on readmission), until the growth fits or the request preempted
//     itself. A block that fills is sealed with HashBlock chained on its
//     parent, so later requests hit it. A request aborts at its abort step
//     (Lease.Abort) and releases its lease after max_new tokens.
//
// With a decode pool (Config.DecodeBlocks > 0) admission is a
// disaggregated handoff: the decode pool reserves the request's blocks
// first (with its own prefix hits), then prefill acquires and seals on the
// first pool, the blocks the decode pool missed are copied under one
// kvlease.Transfer attached to both leases (Read on the source range,
// Write on the destination range) and resolved once the copy is done, the
// prefill lease is released, the copied blocks are sealed on the decode
// pool and decoding proceeds there. Baselines copy the same blocks without
// a transfer.
//
// A request that could never fit (its prompt plus max_new tokens needs
// more blocks than a pool has) is rejected when it reaches the head of the
// queue. Everything else is deterministic: the same trace and Config give
// the same schedule and the same counts; only the timings vary.
package replay

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/bench/trace"
)

// Config describes the engine and its pools.
type Config struct {
	BlockTokens  int               // tokens per block (default 16)
	Blocks       int               // capacity of the pool (the prefill pool with a decode pool)
	DecodeBlocks int               // > 0: handoff to a decode pool of this many blocks
	BlockBytes   int               // bytes per block of host memory (default 64)
	MaxRunning   int               // most requests decoding at once (default 256)
	Seed         kvlease.BlockHash // namespace seed of the chain hashes
	// TimeCalls times every allocator call (two clock reads each) to
	// report CallTime; acquires are always timed for their latency.
	TimeCalls bool
}

func (c Config) withDefaults() Config {
	if c.BlockTokens <= 0 {
		c.BlockTokens = 16
	}
	if c.BlockBytes <= 0 {
		c.BlockBytes = 64
	}
	if c.MaxRunning <= 0 {
		c.MaxRunning = 256
	}
	return c
}

// PoolResult is what one pool saw during a replay.
type PoolResult struct {
	Role     string // "pool", or "prefill" / "decode" with a handoff
	Acquires int64  // leases this pool handed out
	Queried  int64  // full prompt blocks looked up in its prefix cache
	Hits     int64  // of those, served from the cache
	// Peak holds the largest value of each Stats field, sampled after
	// every step and in every handoff while the copy is in flight; Final
	// is the Stats after the replay.
	Peak, Final kvlease.Stats
}

// HitRate returns Hits/Queried (0 when nothing was queried).
func (p *PoolResult) HitRate() float64 {
	if p.Queried == 0 {
		return 0
	}
	return float64(p.Hits) / float64(p.Queried)
}

// Result is one replay's counts and timings.
type Result struct {
	Allocator string
	Config    Config

	Requests, Finished, Aborted, Rejected int
	Preemptions                           int   // running requests preempted to make room
	Exhausted                             int64 // acquires and extends refused for lack of blocks
	Steps                                 int   // engine steps simulated
	Tokens                                int64 // tokens generated

	// A block operation is one block handed out (by an acquire, hit or
	// fresh, or an extend) or given back (by a release or an abort).
	// BlocksOut counts the first kind, BlocksIn the second; after a
	// complete replay they are equal.
	BlocksOut, BlocksIn int64
	Seals               int64 // Seal calls
	Handoffs            int   // prefill → decode handoffs
	CopiedBlocks        int64 // blocks copied by handoffs

	Pools []PoolResult // one, or prefill and decode

	Wall       time.Duration // the whole replay
	CPU        time.Duration // process CPU time (user+system, GC included) during the replay; 0 where unknown
	CallTime   time.Duration // time inside allocator calls (Config.TimeCalls)
	AcquireP50 time.Duration // admission acquire latency
	AcquireP99 time.Duration
}

// PoolOps counts block operations as bench/README.md does: every block handed
// out (acquired fresh or hit), sealed, given back (released or aborted) or
// evicted counts one.
func (r *Result) PoolOps() int64 {
	return r.BlockOps() + r.Seals + r.Evictions()
}

// Evictions returns the cached blocks evicted in every pool.
func (r *Result) Evictions() int64 {
	ev := int64(0)
	for _, p := range r.Pools {
		ev += int64(p.Final.Evictions)
	}
	return ev
}

// BlockOps returns BlocksOut + BlocksIn.
func (r *Result) BlockOps() int64 { return r.BlocksOut + r.BlocksIn }

// OpsPerSec returns block operations per second of wall time (the whole
// engine: token generation, hashing, scheduling and allocation).
func (r *Result) OpsPerSec() float64 {
	if r.Wall <= 0 {
		return 0
	}
	return float64(r.BlockOps()) / r.Wall.Seconds()
}

// OpsPerCPUSec returns block operations per second of process CPU time:
// steadier than OpsPerSec on a shared machine, where other work steals
// the replay's cores (the replay itself runs on one goroutine; the GC's
// CPU counts too). 0 where CPU time is unknown.
func (r *Result) OpsPerCPUSec() float64 {
	if r.CPU <= 0 {
		return 0
	}
	return float64(r.BlockOps()) / r.CPU.Seconds()
}

// NsPerOp returns wall nanoseconds per block operation.
func (r *Result) NsPerOp() float64 {
	if r.BlockOps() == 0 {
		return 0
	}
	return float64(r.Wall.Nanoseconds()) / float64(r.BlockOps())
}

// HitRate returns the hit rate of the first pool's prefix cache.
func (r *Result) HitRate() float64 { return r.Pools[0].HitRate() }

// errClientGone is the cause of a trace abort.
var errClientGone = errors.New("replay: client went away (trace abort event)")

// request is one trace request as the engine tracks it.
type request struct {
	tr        *trace.Request
	owner     string
	tokens    []int32             // prompt, then generated tokens
	hashes    []kvlease.BlockHash // chain hashes of the full blocks of tokens
	generated int
	abortAt   int
	lease     Lease
	held      int // blocks in lease
	need      int // blocks at the end: prompt + max_new tokens
}

// deque is the waiting queue: a FIFO of arrivals with a stack in front
// for preempted requests (the most recently pushed front comes out first).
type deque struct {
	front []*request
	fifo  []*request
	head  int
}

func (d *deque) len() int { return len(d.front) + len(d.fifo) - d.head }

func (d *deque) peek() *request {
	if n := len(d.front); n > 0 {
		return d.front[n-1]
	}
	return d.fifo[d.head]
}

func (d *deque) pop() {
	if n := len(d.front); n > 0 {
		d.front[n-1] = nil
		d.front = d.front[:n-1]
		return
	}
	d.fifo[d.head] = nil
	d.head++
	if d.head == len(d.fifo) {
		d.fifo, d.head = d.fifo[:0], 0
	}
}

func (d *deque) pushFront(r *request) { d.front = append(d.front, r) }
func (d *deque) pushBack(r *request)  { d.fifo = append(d.fifo, r) }

type engine struct {
	cfg      Config
	pools    []Allocator // [0] admits; [1] decodes when handing off
	res      *Result
	waiting  deque
	running  []*request
	lat      []int64
	err      error
	copyTr   bool // both pools are kvlease: handoffs attach a transfer
	srcIDs   []kvlease.BlockID
	dstIDs   []kvlease.BlockID
	progress bool // something happened this step
}

// Run replays t through pools: one allocator, or a prefill and a decode
// allocator when cfg.DecodeBlocks > 0 (the caller makes them with those
// capacities). It fails on an allocator error other than ErrExhausted, or
// when the schedule cannot make progress.
func Run(t *trace.Trace, cfg Config, pools ...Allocator) (*Result, error) {
	cfg = cfg.withDefaults()
	want := 1
	if cfg.DecodeBlocks > 0 {
		want = 2
	}
	if len(pools) != want {
		return nil, fmt.Errorf("replay: %d allocators for DecodeBlocks=%d, want %d: %w",
			len(pools), cfg.DecodeBlocks, want, kvlease.ErrInvalidArgument)
	}
	e := &engine{cfg: cfg, pools: pools, res: &Result{Allocator: pools[0].Name(), Config: cfg}}
	if want == 2 {
		e.res.Pools = []PoolResult{{Role: "prefill"}, {Role: "decode"}}
		_, a := pools[0].(*KVLease)
		_, b := pools[1].(*KVLease)
		e.copyTr = a && b
	} else {
		e.res.Pools = []PoolResult{{Role: "pool"}}
	}
	reqs := make([]request, len(t.Requests))
	for i := range reqs {
		tr := &t.Requests[i]
		reqs[i] = request{tr: tr, owner: "req-" + strconv.Itoa(tr.ID), abortAt: tr.AbortAt(),
			need: ceilDiv(tr.Prompt.Len()+tr.MaxNew, cfg.BlockTokens)}
	}
	e.res.Requests = len(reqs)

	cpu0, start := processCPU(), time.Now()
	next := 0
	for step := 0; ; step++ {
		if e.waiting.len() == 0 && len(e.running) == 0 {
			if next == len(reqs) {
				break
			}
			step = max(step, reqs[next].tr.Arrival) // idle: skip ahead
		}
		for next < len(reqs) && reqs[next].tr.Arrival <= step {
			e.waiting.pushBack(&reqs[next])
			next++
		}
		e.progress = false
		e.admit()
		e.decode()
		e.sample()
		e.res.Steps++
		if e.err != nil {
			return nil, e.err
		}
		if !e.progress && next == len(reqs) {
			return nil, fmt.Errorf("replay: step %d: no progress with %d waiting and %d running", step, e.waiting.len(), len(e.running))
		}
	}
	e.res.Wall = time.Since(start)
	if cpu := processCPU(); cpu0 > 0 {
		e.res.CPU = cpu - cpu0
	}

	for i, p := range pools {
		e.res.Pools[i].Final = p.Stats()
		if err := p.Check(); err != nil {
			return nil, fmt.Errorf("replay: %s after the replay: %w", p.Name(), err)
		}
	}
	slices.Sort(e.lat)
	if n := len(e.lat); n > 0 {
		e.res.AcquireP50 = time.Duration(e.lat[n/2])
		e.res.AcquireP99 = time.Duration(e.lat[min(n-1, n*99/100)])
	}
	return e.res, nil
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

// admit admits waiting requests in order until one does not fit.
func (e *engine) admit() {
	for len(e.running) < e.cfg.MaxRunning && e.waiting.len() > 0 && e.err == nil {
		r := e.waiting.peek()
		if e.tooBig(r) {
			e.waiting.pop()
			e.res.Rejected++
			e.progress = true
			continue
		}
		if !e.start(r) {
			return
		}
		e.waiting.pop()
		e.progress = true
		if r.generated == r.abortAt {
			e.close(r, true)
			continue
		}
		e.running = append(e.running, r)
	}
}

func (e *engine) tooBig(r *request) bool {
	// A preempted request is readmitted with up to prompt+max_new-1
	// tokens, so both pools must hold r.need blocks.
	if e.cfg.DecodeBlocks > 0 && r.need > e.cfg.DecodeBlocks {
		return true
	}
	return r.need > e.cfg.Blocks
}

// start gives r a lease for its tokens so far (prompt, plus what it had
// generated before a preemption), reporting false when it does not fit.
func (e *engine) start(r *request) bool {
	B := e.cfg.BlockTokens
	if r.tokens == nil {
		r.tokens = r.tr.Prompt.AppendTokens(make([]int32, 0, r.tr.Prompt.Len()+r.tr.MaxNew))
		r.hashes = kvlease.ChainHashes(e.cfg.Seed, r.tokens, B)
		r.hashes = slices.Grow(r.hashes, r.need-len(r.hashes))
	}
	n := ceilDiv(len(r.tokens), B)
	if len(e.pools) == 1 {
		l, hits, ok := e.acquire(0, r, n)
		if !ok {
			return false
		}
		e.seal(l, hits, len(r.hashes), r.hashes)
		r.lease, r.held = l, n
		return true
	}
	// Handoff: reserve on the decode pool first, as a decode worker that
	// pulls from prefill does, so a full decode pool wastes no prefill.
	dst, dhits, ok := e.acquire(1, r, n)
	if !ok {
		return false
	}
	src, phits, ok := e.acquire(0, r, n)
	if !ok {
		e.release(dst, n, false)
		return false
	}
	e.seal(src, phits, len(r.hashes), r.hashes) // prefill computed them
	e.handoff(src, dst, dhits, n)
	e.release(src, n, false)
	e.seal(dst, dhits, len(r.hashes), r.hashes)
	r.lease, r.held = dst, n
	return true
}

// acquire acquires n blocks for r from pool i, timing it.
func (e *engine) acquire(i int, r *request, n int) (Lease, int, bool) {
	t0 := time.Now()
	l, hits, err := e.pools[i].AcquirePrefix(r.owner, r.hashes, n)
	d := time.Since(t0)
	e.lat = append(e.lat, int64(d))
	if e.cfg.TimeCalls {
		e.res.CallTime += d
	}
	if !e.ok(err) {
		return nil, 0, false
	}
	pr := &e.res.Pools[i]
	pr.Acquires++
	pr.Queried += int64(len(r.hashes))
	pr.Hits += int64(hits)
	e.res.BlocksOut += int64(n)
	return l, hits, true
}

// handoff copies blocks from..n-1 of src (prefill) to dst (decode). With
// kvlease on both sides one transfer gates both ranges while the copy is
// in flight: a Read on the source, a Write on the destination.
func (e *engine) handoff(src, dst Lease, from, n int) {
	e.res.Handoffs++
	if from == n {
		return
	}
	var t *kvlease.Transfer
	if e.copyTr {
		t = kvlease.NewTransfer(nil)
		s, d := src.(*kvlease.Lease[[]byte]), dst.(*kvlease.Lease[[]byte])
		if err := s.AttachRange(t, from, n, kvlease.Read); err != nil {
			e.fail(err)
		}
		if err := d.AttachRange(t, from, n, kvlease.Write); err != nil {
			e.fail(err)
		}
	}
	e.sample() // the handoff's peak: both leases held, the copy in flight
	e.srcIDs = src.AppendBlockIDs(e.srcIDs[:0], from)
	e.dstIDs = dst.AppendBlockIDs(e.dstIDs[:0], from)
	for k, id := range e.srcIDs {
		copy(e.pools[1].Region(e.dstIDs[k]), e.pools[0].Region(id))
	}
	if t != nil {
		t.Resolve(nil) // the copy is done: the only evidence
	}
	e.res.CopiedBlocks += int64(n - from)
}

// decode generates one token for each running request, oldest first.
func (e *engine) decode() {
	w := 0
	for i := 0; i < len(e.running) && e.err == nil; i++ {
		r := e.running[i]
		if e.step(r) {
			e.running[w] = r
			w++
		}
	}
	clear(e.running[w:])
	e.running = e.running[:w]
}

// step decodes one token of r and reports whether r still runs. It may
// preempt the youngest running requests (the tail of e.running, which the
// decode loop has not reached yet) and r itself.
func (e *engine) step(r *request) bool {
	B := e.cfg.BlockTokens
	if len(r.tokens) == r.held*B {
		for {
			t0 := e.now()
			err := r.lease.Extend(1)
			e.since(t0)
			if e.ok(err) {
				r.held++
				e.res.BlocksOut++
				break
			}
			if e.err != nil {
				return false
			}
			last := len(e.running) - 1
			y := e.running[last]
			e.running[last] = nil
			e.running = e.running[:last]
			e.release(y.lease, y.held, false)
			y.lease, y.held = nil, 0
			e.res.Preemptions++
			e.waiting.pushFront(y)
			if y == r {
				return false
			}
		}
	}
	r.tokens = append(r.tokens, r.tr.OutputToken(r.generated))
	r.generated++
	e.res.Tokens++
	e.progress = true
	if len(r.tokens)%B == 0 {
		k := len(r.tokens)/B - 1
		parent := e.cfg.Seed
		if k > 0 {
			parent = r.hashes[k-1]
		}
		r.hashes = append(r.hashes, kvlease.HashBlock(parent, r.tokens[k*B:]))
		e.seal(r.lease, k, k+1, r.hashes)
	}
	switch r.generated {
	case r.abortAt:
		e.close(r, true)
		return false
	case r.tr.MaxNew:
		e.close(r, false)
		return false
	}
	return true
}

// close ends r: aborted (a trace event) or finished.
func (e *engine) close(r *request, abort bool) {
	e.release(r.lease, r.held, abort)
	r.lease, r.held = nil, 0
	r.tokens, r.hashes = nil, nil
	if abort {
		e.res.Aborted++
	} else {
		e.res.Finished++
	}
}

func (e *engine) release(l Lease, held int, abort bool) {
	t0 := e.now()
	if abort {
		l.Abort(errClientGone)
	} else {
		l.Release()
	}
	e.since(t0)
	e.res.BlocksIn += int64(held)
}

// seal seals blocks from..to-1 of l with hashes[from:to].
func (e *engine) seal(l Lease, from, to int, hashes []kvlease.BlockHash) {
	for i := from; i < to; i++ {
		t0 := e.now()
		err := l.Seal(i, hashes[i])
		e.since(t0)
		if err != nil {
			e.fail(err)
			return
		}
		e.res.Seals++
	}
}

// ok sorts an allocator error: nil is ok, ErrExhausted is counted and
// not ok, anything else fails the replay.
func (e *engine) ok(err error) bool {
	switch {
	case err == nil:
		return true
	case errors.Is(err, kvlease.ErrExhausted):
		e.res.Exhausted++
	default:
		e.fail(err)
	}
	return false
}

func (e *engine) fail(err error) {
	if e.err == nil {
		e.err = err
	}
}

// sample folds each pool's Stats into its peaks.
func (e *engine) sample() {
	for i, p := range e.pools {
		s := p.Stats()
		pk := &e.res.Pools[i].Peak
		pk.Capacity = s.Capacity
		pk.Free = max(pk.Free, s.Free)
		pk.Cached = max(pk.Cached, s.Cached)
		pk.Leased = max(pk.Leased, s.Leased)
		pk.Draining = max(pk.Draining, s.Draining)
		pk.Quarantined = max(pk.Quarantined, s.Quarantined)
		pk.Waiters = max(pk.Waiters, s.Waiters)
		pk.OpenLeases = max(pk.OpenLeases, s.OpenLeases)
	}
}

var zeroTime time.Time

func (e *engine) now() time.Time {
	if !e.cfg.TimeCalls {
		return zeroTime
	}
	return time.Now()
}

func (e *engine) since(t0 time.Time) {
	if e.cfg.TimeCalls {
		e.res.CallTime += time.Since(t0)
	}
}

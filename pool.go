package kvlease

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"go.uber.org/atomic"

	"github.com/kvlease/kvlease/internal/invariants"
)

// Stats is a snapshot of a pool. The five state counts are block counts,
// each block counted once in its one state, and always sum to Capacity. A
// block that qualifies for several states counts in the first that
// applies: Quarantined, Leased, Draining, Cached, Free.
type Stats struct {
	Capacity    int
	Free        int // unreferenced, no content worth keeping
	Cached      int // unreferenced, holds a findable sealed prefix block (evictable)
	Leased      int // held by at least one open lease
	Draining    int // held only by pending transfers of closed leases
	Quarantined int // gated by a transfer that ended without proof

	// QuarantinedLeased counts the Quarantined blocks an open lease still
	// holds: a running request uses them though they count as
	// Quarantined, so Leased+QuarantinedLeased is the blocks in use.
	QuarantinedLeased int
	// Usable is Capacity minus Quarantined: the most blocks that could
	// ever be free while the current quarantine lasts. A request for more
	// (an acquire of more than Usable) fails with ErrQuarantineBound; an
	// admission check (an envelope's pool size) should be asked against
	// Usable, not Capacity. Pool.Usable returns it alone.
	Usable int

	Waiters    int    // AcquireWait callers queued now
	OpenLeases int    // leases acquired and not yet closed
	Acquires   uint64 // leases handed out
	Rejections uint64 // acquires that failed (any reason)

	// Prefix cache. PrefixQueries and PrefixHits count the lookups of
	// admitted prefix acquires only, together, so PrefixHits/PrefixQueries
	// is the hit rate; lookups of acquires refused for want of blocks are
	// counted in PrefixRefused instead (a request refused three times then
	// admitted counts once in PrefixQueries).
	PrefixQueries    uint64 // blocks looked up by admitted prefix acquires
	PrefixHits       uint64 // of those, blocks served from the cache
	PrefixRefused    uint64 // blocks looked up by prefix acquires then refused (ErrExhausted)
	Evictions        uint64 // cached blocks evicted to make room
	DuplicateSeals   uint64 // seals whose hash was already findable elsewhere
	VerifyMismatches uint64 // verified-mode lookups whose hash matched but content did not

	// Rejections by reason; they sum to Rejections.
	RejectedExhausted       uint64 // ErrExhausted (not ErrQuarantineBound): no room now
	RejectedQuarantineBound uint64 // ErrQuarantineBound: more than quarantine leaves usable
	RejectedCanceled        uint64 // the caller's context ended while queued (AcquireWait)
	RejectedClosed          uint64 // ErrPoolClosed
	RejectedInvalid         uint64 // any other error: ErrInvalidArgument, ErrExceedsCapacity

	// Transfers, counted once per lease a transfer gates, when the
	// transfer first ends: resolved without error, resolved with an error
	// (the memory is quiescent all the same), or quarantined (no proof).
	TransfersResolved    uint64
	TransfersFailed      uint64
	TransfersQuarantined uint64
	Quarantines          uint64 // leases that entered LeaseQuarantined
	QuarantineLifts      uint64 // leases late evidence brought out of LeaseQuarantined
	// LeakedLeases counts leases found unreachable while open. The
	// detection is armed only with WithObserver; without one it stays 0.
	LeakedLeases uint64
}

// Pool owns a Memory's blocks and hands them out as typed leases. All
// methods are safe for concurrent use.
//
// A pool is one mutex over a table of slots indexed by BlockID, a stack of
// free ids, an intrusive LRU of cached blocks and a FIFO of waiters. Lock
// order, where two are held: a Transfer's mutex, then a pool's mutex. No
// internal lock is held while an observer or a cancel hook runs.
type Pool[R any] struct {
	core
	mem   Memory[R]
	slabs leaseSlabs[R] // guarded by mu
}

// core is the non-generic part of a pool: everything but the memory.
// Transfers and leases of every region type talk to it.
type core struct {
	mu    sync.Mutex
	slots []slot
	pre   []prefixSlot // parallel to slots
	free  []BlockID    // stack of free slots; top at the end

	lruHead, lruTail BlockID // least recently unreferenced first
	lruLen           int

	counts [numClasses]int
	index  prefixIndex // BlockHash → the slot findable by it; its table made by the first Seal

	waiters []*waiter // FIFO; waiters[head:] are queued
	whead   int

	quarLeased    int  // quarantined slots with refs > 0 (Stats.QuarantinedLeased)
	alertLimit    int  // alert when quarantined blocks exceed this (MaxInt: never)
	alerted       bool // the quarantine alert is raised
	scannedUsable int  // usable() when the waiter queue was last scanned for ErrQuarantineBound

	closed     atomic.Bool
	rejections atomic.Uint64 // counted without the lock: rejections come in storms
	rejectedBy [numRejectReasons]atomic.Uint64
	leaked     atomic.Uint64
	nextLease  uint64
	openLeases int
	stats      counters

	cfg config
	obs Observer
	// watchOpens: a leak check, an observer or a checked build wants to
	// hear of every lease opened (fixed when the pool is made; one field
	// test instead of three keeps opened inlinable).
	watchOpens bool
	kv         *kvEventLog // nil unless WithKVEvents
	meta       []sealMeta  // verified mode: per-slot parent
	tokens     []int32     // verified mode: per-slot tokens, blockTokens each
	stamp      uint32      // bumped per prefix probe
	hook       offerer     // eviction hook (evict.go); nil without one
}

type counters struct {
	acquires, rejections                                 uint64
	prefixQueries, prefixHits, evictions, duplicateSeals uint64
	prefixRefused                                        uint64
	verifyMismatches                                     uint64
	transfersResolved, transfersFailed, transfersQuar    uint64
	quarantines, quarantineLifts                         uint64
}

// The reasons Stats splits Rejections into.
const (
	rejectExhausted = iota
	rejectQuarantineBound
	rejectCanceled
	rejectClosed
	rejectInvalid
	numRejectReasons
)

func rejectReason(err error) int {
	switch {
	case errors.Is(err, ErrQuarantineBound):
		return rejectQuarantineBound
	case errors.Is(err, ErrExhausted):
		return rejectExhausted
	case errors.Is(err, ErrPoolClosed):
		return rejectClosed
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return rejectCanceled
	}
	return rejectInvalid
}

// NewPool makes a pool over mem: every block starts free. mem must be
// non-nil with a positive block count that fits a BlockID and a positive
// block size.
func NewPool[R any](mem Memory[R], opts ...Option) (*Pool[R], error) {
	n, bb, ok := memSizes(mem)
	if !ok {
		return nil, fmt.Errorf("kvlease: NewPool with a nil memory: %w", ErrInvalidArgument)
	}
	if n <= 0 || n > math.MaxInt32 || bb <= 0 {
		return nil, fmt.Errorf("kvlease: NewPool over %d blocks of %d bytes: need 1..%d blocks and a positive block size: %w",
			n, bb, math.MaxInt32, ErrInvalidArgument)
	}
	cfg, err := applyOptions(opts)
	if err != nil {
		return nil, err
	}
	p := &Pool[R]{mem: mem}
	c := &p.core
	c.cfg, c.obs = cfg, cfg.obs
	c.watchOpens = cfg.leakCheck || cfg.obs != nil || invariants.Enabled
	c.slots = make([]slot, n)
	c.pre = make([]prefixSlot, n)
	c.index = newPrefixIndex(c.pre)
	c.free = make([]BlockID, n)
	for i := range c.free {
		// Lowest ids on top: the first acquire gets block 0.
		c.free[i] = BlockID(n - 1 - i)
		c.pre[i].prev, c.pre[i].next = nilID, nilID
	}
	c.lruHead, c.lruTail = nilID, nilID
	c.counts[classFree] = n
	c.alertLimit = cfg.alertLimit(n)
	c.scannedUsable = n
	if cfg.kvEvents > 0 {
		c.kv = newKVEventLog(cfg.kvEvents)
	}
	if cfg.verify {
		if cfg.blockTokens > math.MaxInt/4/n {
			return nil, fmt.Errorf("kvlease: verified mode for %d blocks of %d tokens overflows: %w", n, cfg.blockTokens, ErrInvalidArgument)
		}
		c.meta = make([]sealMeta, n)
		c.tokens = make([]int32, n*cfg.blockTokens)
	}
	return p, nil
}

// memSizes asks mem for its sizes; ok is false for a nil memory (a nil
// interface, or a typed nil whose methods panic).
func memSizes[R any](mem Memory[R]) (n, bb int, ok bool) {
	if mem == nil {
		return 0, 0, false
	}
	defer func() {
		if recover() != nil {
			n, bb, ok = 0, 0, false
		}
	}()
	return mem.Blocks(), mem.BlockBytes(), true
}

// Memory returns the memory the pool hands out.
func (p *Pool[R]) Memory() Memory[R] { return p.mem }

// Capacity returns the number of blocks the pool owns.
func (p *Pool[R]) Capacity() int { return len(p.slots) }

// BlockBytes returns the size of one block in bytes.
func (p *Pool[R]) BlockBytes() int { return p.mem.BlockBytes() }

// Acquire hands out a lease on n fresh blocks, or nothing at all. Fresh
// blocks come from the free list first, then by evicting the least recently
// used cached blocks. Errors wrap ErrInvalidArgument (n ≤ 0, empty owner),
// ErrPoolClosed, ErrExceedsCapacity (n > capacity: it can never succeed) or
// ErrExhausted (not enough free or evictable blocks now, or AcquireWait
// callers are queued: a plain acquire never overtakes them).
func (p *Pool[R]) Acquire(owner string, n int) (*Lease[R], error) {
	l, _, err := p.acquire(owner, nil, nil, n)
	return l, err
}

// acquire is Acquire and AcquirePrefix.
func (p *Pool[R]) acquire(owner string, hashes []BlockHash, v *verifier, n int) (*Lease[R], int, error) {
	c := &p.core
	// precheck's argument tests, inline (the call cost 38 instructions a
	// cycle); a closed pool is refused under the lock below, after them,
	// and precheckErr keeps precheck's order of errors.
	if owner == "" || n <= 0 || n > len(c.slots) {
		return nil, 0, c.reject(owner, n, c.precheckErr(owner, n))
	}
	c.mu.Lock()
	if c.closed.Load() {
		c.mu.Unlock()
		return nil, 0, c.reject(owner, n, closedErr(owner, n))
	}
	if q := c.queued(); q > 0 {
		var err error
		if len(hashes) == 0 {
			// (With hashes, hits on quarantined blocks could still make
			// room: only the lookup can tell.)
			err = c.boundErr(owner, n, 0)
		}
		if err == nil {
			err = &exhaustedError{op: "acquire", owner: owner, n: n, queued: q}
		}
		c.mu.Unlock()
		return nil, 0, c.reject(owner, n, err)
	}
	var ev events
	var l *Lease[R]
	hits := 0
	if len(hashes) > 0 {
		var err error
		l = p.newLease(owner, n)
		if hits, err = c.fillPrefix(&l.ls, hashes, n, v, &ev); err != nil {
			c.mu.Unlock()
			ev.flush()
			return nil, 0, c.reject(owner, n, err)
		}
	} else {
		if avail := c.available(); avail < n {
			err := c.boundErr(owner, n, 0)
			if err == nil {
				err = &exhaustedError{op: "acquire", owner: owner, n: n, avail: avail}
			}
			c.mu.Unlock()
			return nil, 0, c.reject(owner, n, err)
		}
		l = p.newLease(owner, n)
		c.fill(l.ls.blocks, &ev)
	}
	c.opened(&l.ls, hits, &ev)
	c.mu.Unlock()
	ev.flush()
	return l, hits, nil
}

// AcquireWait is Acquire that waits for blocks instead of failing with
// ErrExhausted. Waiters are served strictly in arrival order: a later
// waiter is never served while an earlier one still waits, so a large
// request is never starved by small ones. Argument errors come first, then
// ErrPoolClosed, then ErrExceedsCapacity (at once: waiting could never
// help). When ctx ends first, AcquireWait returns ctx's error and holds
// nothing; Close wakes every waiter with ErrPoolClosed.
//
// A request for more blocks than Stats.Usable (capacity minus
// quarantined blocks) could never be served while the quarantine lasts:
// it fails at once with ErrQuarantineBound (which wraps ErrExhausted), and
// a waiter already queued is failed with it as soon as quarantine shrinks
// the usable blocks below its request, so that it never blocks the
// waiters behind it forever.
func (p *Pool[R]) AcquireWait(ctx context.Context, owner string, n int) (*Lease[R], error) {
	c := &p.core
	if err := c.precheck(owner, n); err != nil {
		return nil, c.reject(owner, n, err)
	}
	if err := ctx.Err(); err != nil {
		return nil, c.reject(owner, n, err)
	}
	var ev events
	c.mu.Lock()
	if c.closed.Load() {
		c.mu.Unlock()
		return nil, c.reject(owner, n, closedErr(owner, n))
	}
	l := p.newLease(owner, n)
	if c.queued() == 0 && c.available() >= n {
		c.fill(l.ls.blocks, &ev)
		c.opened(&l.ls, 0, &ev)
		c.mu.Unlock()
		ev.flush()
		return l, nil
	}
	if err := c.boundErr(owner, n, 0); err != nil {
		// Waiting could not help while the quarantine lasts, and it would
		// block everyone queued behind it.
		c.mu.Unlock()
		return nil, c.reject(owner, n, err)
	}
	w := &waiter{l: &l.ls, n: n, ready: make(chan struct{})}
	c.waiters = append(c.waiters, w)
	c.mu.Unlock()

	select {
	case <-w.ready:
	case <-ctx.Done():
		c.mu.Lock()
		if !w.served && w.err == nil {
			c.dequeue(w)
			// The head may have changed: whoever is next may fit now.
			c.serve(&ev)
			c.mu.Unlock()
			ev.flush()
			return nil, c.reject(owner, n, ctx.Err())
		}
		c.mu.Unlock()
	}
	// Served or woken by Close. The lease (if served) was filled and its
	// events emitted by whoever served it.
	if w.err != nil {
		return nil, c.reject(owner, n, w.err)
	}
	return l, nil
}

// waiter is one queued AcquireWait. Its lease is allocated before it
// queues, so serving it under the pool's lock only fills in blocks.
type waiter struct {
	l      *lease
	n      int
	ready  chan struct{} // closed when served or failed
	served bool
	err    error
}

func (c *core) queued() int { return len(c.waiters) - c.whead }

func (c *core) dequeue(w *waiter) {
	for i := c.whead; i < len(c.waiters); i++ {
		if c.waiters[i] == w {
			copy(c.waiters[i:], c.waiters[i+1:])
			c.waiters[len(c.waiters)-1] = nil
			c.waiters = c.waiters[:len(c.waiters)-1]
			break
		}
	}
	c.compactWaiters()
}

func (c *core) compactWaiters() {
	if c.whead == len(c.waiters) {
		clear(c.waiters)
		c.waiters, c.whead = c.waiters[:0], 0
	} else if c.whead > 64 && c.whead*2 > len(c.waiters) {
		n := copy(c.waiters, c.waiters[c.whead:])
		clear(c.waiters[n:])
		c.waiters, c.whead = c.waiters[:n], 0
	}
}

// serve hands blocks to queued waiters in arrival order, stopping at the
// first that does not fit, and raises or clears the quarantine alert.
// Called with c.mu held after anything that may have returned blocks or
// changed the quarantine.
//
// serve itself is the test, small enough to inline into every release
// (a call cost 17 instructions a cycle, callgrind); serveAll does the work.
func (c *core) serve(ev *events) {
	if c.whead != len(c.waiters) || (c.counts[classQuarantined] > c.alertLimit) != c.alerted {
		c.serveAll(ev)
	}
}

func (c *core) serveAll(ev *events) {
	if (c.counts[classQuarantined] > c.alertLimit) != c.alerted {
		c.quarantineAlert(ev)
	}
	if c.whead == len(c.waiters) {
		return
	}
	c.serveSlow(ev)
}

// usable is capacity minus quarantined blocks: the most that could ever
// be free while the current quarantine lasts.
func (c *core) usable() int { return len(c.slots) - c.counts[classQuarantined] }

// boundErr returns an error wrapping ErrQuarantineBound when n fresh
// blocks could never be free while the current quarantine lasts, given
// that held usable blocks are already the requester's own (an extending
// lease's unquarantined blocks, or prefix hits); nil otherwise.
func (c *core) boundErr(owner string, n, held int) error {
	if n <= c.usable()-held {
		return nil
	}
	return fmt.Errorf("kvlease: %d fresh blocks for %q: %d of %d blocks are quarantined, %d usable, %d of them held already: %w",
		n, owner, c.counts[classQuarantined], len(c.slots), c.usable(), held, ErrQuarantineBound)
}

// quarantineAlert raises or clears the quarantine alert. Called with c.mu
// held.
func (c *core) quarantineAlert(ev *events) {
	c.alerted = !c.alerted
	if c.obs == nil {
		return
	}
	q := c.counts[classQuarantined]
	kind, verb := EventQuarantineAlert, "above"
	if !c.alerted {
		kind, verb = EventQuarantineRecovered, "back to or below"
	}
	ev.add(c.obs, Event{Kind: kind, Blocks: q,
		Err: fmt.Errorf("kvlease: %d of %d blocks quarantined (%d usable), %s the alert limit of %d",
			q, len(c.slots), len(c.slots)-q, verb, c.alertLimit)})
}

// failBound fails a queued waiter that quarantine left unservable.
func failBound(w *waiter, err error) {
	w.err = err
	close(w.ready)
}

func (c *core) serveSlow(ev *events) {
	if u := c.usable(); u < c.scannedUsable {
		// Quarantine grew since the last scan: fail every queued waiter
		// that asks for more than could ever be free now.
		kept := c.waiters[:c.whead]
		for _, w := range c.waiters[c.whead:] {
			if err := c.boundErr(w.l.owner, w.n, 0); err != nil {
				failBound(w, err)
				continue
			}
			kept = append(kept, w)
		}
		clear(c.waiters[len(kept):])
		c.waiters = kept
	}
	c.scannedUsable = c.usable()
	for c.whead < len(c.waiters) {
		w := c.waiters[c.whead]
		if c.available() < w.n {
			break
		}
		c.fill(w.l.blocks, ev)
		c.opened(w.l, 0, ev)
		w.served = true
		close(w.ready)
		c.waiters[c.whead] = nil
		c.whead++
	}
	c.compactWaiters()
}

// precheck validates what needs no lock: arguments, capacity, closure.
// The test that passes is small enough to inline; the errors are built
// out of line.
func (c *core) precheck(owner string, n int) error {
	if owner != "" && n > 0 && n <= len(c.slots) && !c.closed.Load() {
		return nil
	}
	return c.precheckErr(owner, n)
}

func (c *core) precheckErr(owner string, n int) error {
	switch {
	case owner == "":
		return fmt.Errorf("kvlease: acquire %d blocks: empty owner: %w", n, ErrInvalidArgument)
	case n <= 0:
		return fmt.Errorf("kvlease: acquire %d blocks for %q: n must be positive: %w", n, owner, ErrInvalidArgument)
	case c.closed.Load():
		return closedErr(owner, n)
	case n > len(c.slots):
		return fmt.Errorf("kvlease: acquire %d blocks for %q: pool capacity is %d: %w", n, owner, len(c.slots), ErrExceedsCapacity)
	}
	return nil
}

// closedErr is the error of an acquire refused by a closed pool.
func closedErr(owner string, n int) error {
	return fmt.Errorf("kvlease: acquire %d blocks for %q: %w", n, owner, ErrPoolClosed)
}

// reject counts and reports a failed acquire and returns err.
func (c *core) reject(owner string, n int, err error) error {
	c.rejections.Inc()
	c.rejectedBy[rejectReason(err)].Inc()
	if c.obs != nil {
		c.obs.Observe(Event{Kind: EventRejected, Owner: owner, Blocks: n, Err: err})
	}
	return err
}

func (c *core) available() int { return len(c.free) + c.lruLen }

// fill fills dst with fresh blocks. The caller checked available() ≥
// len(dst).
func (c *core) fill(dst []BlockRef, ev *events) {
	n := len(dst)
	if len(c.free) < n {
		for i := range dst {
			dst[i] = c.takeFresh(ev, n-i)
		}
		return
	}
	// Fast path: pop n ids off the free stack. A free slot is unheld,
	// unsealed and unindexed: only its generation and head change.
	top := len(c.free) - n
	ids := c.free[top:][:len(dst)]
	slots := c.slots
	for i, id := range ids {
		s := &slots[id]
		gen := s.gen + 1
		if gen == 0 {
			gen = 1 // generation 0 is never handed out
		}
		s.gen = gen
		s.setHead(headLeased)
		dst[i] = BlockRef{ID: id, Gen: gen}
	}
	c.free = c.free[:top]
	c.counts[classFree] -= n
	c.counts[classLeased] += n
}

// takeFresh hands out one block fresh: the top of the free stack, else the
// least recently used cached block (evicted: its content is forfeit and it
// leaves the prefix index, or is first offered to the eviction hook when
// the cache can spare it: see SetEvictHook). need counts this block and
// the ones the caller still has to take. The caller checked available() ≥
// need.
func (c *core) takeFresh(ev *events, need int) BlockRef {
	var id BlockID
	if n := len(c.free); n > 0 {
		id = c.free[n-1]
		c.free = c.free[:n-1]
		c.counts[classFree]--
	} else {
		if c.hook != nil {
			c.offerVictim(need, ev)
		}
		id = c.lruPopHead()
		c.counts[classCached]--
		c.evict(id)
	}
	s := &c.slots[id]
	s.gen++
	if s.gen == 0 {
		s.gen = 1
	}
	s.refs, s.class = 1, classLeased
	c.counts[classLeased]++
	return BlockRef{ID: id, Gen: s.gen}
}

// opened finishes handing out l: id, counters, leak check, event.
func (c *core) opened(l *lease, hits int, ev *events) {
	c.nextLease++
	l.id = c.nextLease
	l.state = LeaseActive
	c.openLeases++
	c.stats.acquires++
	if c.watchOpens {
		c.watchOpened(l, hits, ev)
	}
}

// watchOpened is what opened does for a leak check, an observer or a
// checked build.
func (c *core) watchOpened(l *lease, hits int, ev *events) {
	if c.cfg.leakCheck {
		l.watchLeak()
	}
	if c.obs != nil {
		ev.add(c.obs, Event{Kind: EventAcquired, Owner: l.owner, Lease: l.id, Blocks: len(l.blocks), Hits: hits})
	}
	if invariants.Enabled {
		c.checkCounts()
	}
}

// settleSlot re-derives slot id's state after its holds changed. A slot
// nobody holds any more goes to the LRU when it holds findable sealed
// content, else to the free stack (its content is forfeit). Called with
// c.mu held.
func (c *core) settleSlot(id BlockID) {
	s := &c.slots[id]
	if invariants.Enabled && (s.refs < 0 || s.pins < 0 || s.quar < 0 || s.wpins < 0) {
		panic(fmt.Sprintf("kvlease: slot %d: negative hold counts refs=%d pins=%d quar=%d wpins=%d",
			id, s.refs, s.pins, s.quar, s.wpins))
	}
	old, next := s.class, s.class
	switch {
	case s.refs|s.pins|s.quar != 0:
		next = s.classify()
	case s.index:
		// Findable sealed content nobody holds: cached, most recent.
		c.lruPush(id)
		next = classCached
	default:
		// Nothing worth keeping: its content is forfeit.
		if s.sealed {
			c.unseal(id)
		}
		c.free = append(c.free, id)
		next = classFree
	}
	if next != old {
		s.class = next
		c.counts[old]--
		c.counts[next]++
	}
}

// drop releases one reference to each block, tail first, so that a
// chain's last block becomes the least recently used. Blocks nobody else
// holds go back at once. Called with c.mu held.
//
// The common cases, a private unsealed block that no transfer gates (it
// goes straight onto the free stack) or that pending transfers gate (it
// drains), run in a loop of their own that tests and writes each slot's
// head as one word: this runs for every block of every lease, and the
// general loop cost twice the instructions (callgrind). The first block
// that is neither hands the rest to dropSlow.
func (c *core) drop(blocks []BlockRef) {
	if i := c.dropFast(blocks); i > 0 {
		c.dropSlow(blocks[:i])
	}
}

// dropFast is drop's loop over the common cases, tail first: a block this
// lease alone holds, unsealed, goes onto the free stack when no transfer
// gates it and drains when only pending ones do. It stops at the first
// block that is neither and returns how many blocks are left for
// dropSlow. It calls nothing, so that its loop keeps everything in
// registers (with dropSlow's call in the same function, the loop reloaded
// its slices from the stack: callgrind).
func (c *core) dropFast(blocks []BlockRef) int {
	slots := c.slots
	// The free stack never holds more than capacity ids, so its spare
	// capacity has room for every block: no append.
	room := c.free[:cap(c.free)]
	k0 := len(c.free)
	k, drained := k0, 0
	leased, free, draining := headLeased, headFree, headDraining
	i := len(blocks)
	for ; i > 0 && k < len(room); i-- {
		id := blocks[i-1].ID
		s := &slots[id]
		if s.head() != leased {
			break // shared, sealed or quarantined
		}
		// Leased by this lease alone, unsealed.
		if s.gates() == 0 {
			s.setHead(free)
			room[k] = id
			k++
		} else if s.quar == 0 {
			s.setHead(draining) // pending transfers still gate it
			drained++
		} else {
			break
		}
	}
	freed := k - k0
	c.free = c.free[:k] // (not room[:k]: its write barrier spilled the loop)
	c.counts[classLeased] -= freed + drained
	c.counts[classFree] += freed
	c.counts[classDraining] += drained
	return i
}

// dropSlow is drop for blocks that may be shared, sealed or gated. The
// common outcomes are settleSlot's, spelled out inline with the counts
// batched; anything else goes through settleSlot. Locals keep the slice
// headers in registers: the compiler cannot prove the slot stores leave
// c.free alone.
func (c *core) dropSlow(blocks []BlockRef) {
	blocks = blocks[:c.cacheFast(blocks)]
	slots, free := c.slots, c.free
	freed, drained, cached := 0, 0, 0
	indexedLeased, indexedCached := headIndexedLeased, headIndexedCached
	for i := len(blocks) - 1; i >= 0; i-- {
		id := blocks[i].ID
		s := &slots[id]
		if s.head() == indexedLeased && s.gates() == 0 {
			// The common case of a prefix hit or a sealed block: findable
			// content this lease alone held. Cached, most recent.
			s.setHead(indexedCached)
			c.lruPush(id)
			cached++
			continue
		}
		s.refs--
		switch {
		case s.refs|s.pins|s.quar == 0 && !s.sealed: // (indexed implies sealed)
			// Private and unsealed: it was counted as leased.
			free = append(free, id)
			s.class = classFree
			freed++
		case s.refs|s.pins|s.quar == 0 && s.index:
			// Findable sealed content nobody holds: cached, most recent.
			c.lruPush(id)
			s.class = classCached
			cached++
		case s.refs > 0 && s.class == classLeased:
			// Another open lease still holds it.
		case s.refs|s.quar == 0 && s.pins > 0 && s.class == classLeased:
			// Gated by a pending transfer: it drains.
			s.class = classDraining
			drained++
		default:
			if s.quar > 0 && s.refs == 0 {
				c.quarLeased-- // it held the last reference
			}
			c.free = free
			c.settleSlot(id)
			free = c.free
		}
	}
	c.free = free
	c.counts[classLeased] -= freed + drained + cached
	c.counts[classFree] += freed
	c.counts[classCached] += cached
	c.counts[classDraining] += drained
}

// cacheFast is dropSlow's loop over its most common case, tail first: a
// sealed, indexed block its lease alone held, no transfer gating it, is
// cached (pushed at the LRU's most recent end). It stops at the first
// block with any other outcome and returns how many blocks are left. One
// loop with the LRU's tail in a register. Called with c.mu held.
func (c *core) cacheFast(blocks []BlockRef) int {
	slots, pre := c.slots, c.pre
	head, tail := c.lruHead, c.lruTail
	leased, cached := headIndexedLeased, headIndexedCached
	i := len(blocks)
	for ; i > 0; i-- {
		id := blocks[i-1].ID
		s := &slots[id]
		if s.head() != leased || s.gates() != 0 {
			break
		}
		s.setHead(cached)
		p := &pre[id]
		p.prev, p.next = tail, nilID
		if tail == nilID {
			head = id
		} else {
			pre[tail].next = id
		}
		tail = id
	}
	n := len(blocks) - i
	c.lruHead, c.lruTail = head, tail
	c.lruLen += n
	c.counts[classLeased] -= n
	c.counts[classCached] += n
	return i
}

// lruPush appends id at the most recently used end.
func (c *core) lruPush(id BlockID) {
	p := &c.pre[id]
	p.prev, p.next = c.lruTail, nilID
	if c.lruTail == nilID {
		c.lruHead = id
	} else {
		c.pre[c.lruTail].next = id
	}
	c.lruTail = id
	c.lruLen++
}

// lruPopHead takes the least recently used block off the LRU (which is
// not empty) and returns it: lruRemove of the head, whose prev is known.
func (c *core) lruPopHead() BlockID {
	id := c.lruHead
	p := &c.pre[id]
	next := p.next
	c.lruHead = next
	if next == nilID {
		c.lruTail = nilID
	} else {
		c.pre[next].prev = nilID
	}
	p.next = nilID // (p.prev is nilID already)
	c.lruLen--
	return id
}

func (c *core) lruRemove(id BlockID) {
	p := &c.pre[id]
	if p.prev == nilID {
		c.lruHead = p.next
	} else {
		c.pre[p.prev].next = p.next
	}
	if p.next == nilID {
		c.lruTail = p.prev
	} else {
		c.pre[p.next].prev = p.prev
	}
	p.prev, p.next = nilID, nilID
	c.lruLen--
}

// Available returns how many blocks a fresh acquire could get now: free
// plus evictable cached blocks (queued waiters come first, though). It is
// a hint for schedulers; the answer may change before the next call.
func (p *Pool[R]) Available() int {
	c := &p.core
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.available()
}

// Usable returns capacity minus quarantined blocks: the most blocks that
// could ever be free while the current quarantine lasts (Stats.Usable).
// Ask admission questions (does a maximum-context request fit this
// pool?) against it rather than Capacity.
func (p *Pool[R]) Usable() int {
	c := &p.core
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.usable()
}

// Stats returns a snapshot of the pool's counts.
func (p *Pool[R]) Stats() Stats {
	c := &p.core
	c.mu.Lock()
	defer c.mu.Unlock()
	return Stats{
		Capacity:          len(c.slots),
		Free:              c.counts[classFree],
		Cached:            c.counts[classCached],
		Leased:            c.counts[classLeased],
		Draining:          c.counts[classDraining],
		Quarantined:       c.counts[classQuarantined],
		QuarantinedLeased: c.quarLeased,
		Usable:            c.usable(),
		Waiters:           c.queued(),
		OpenLeases:        c.openLeases,
		Acquires:          c.stats.acquires,
		Rejections:        c.rejections.Load(),
		PrefixQueries:     c.stats.prefixQueries,
		PrefixHits:        c.stats.prefixHits,
		PrefixRefused:     c.stats.prefixRefused,
		Evictions:         c.stats.evictions,
		DuplicateSeals:    c.stats.duplicateSeals,
		VerifyMismatches:  c.stats.verifyMismatches,

		RejectedExhausted:       c.rejectedBy[rejectExhausted].Load(),
		RejectedQuarantineBound: c.rejectedBy[rejectQuarantineBound].Load(),
		RejectedCanceled:        c.rejectedBy[rejectCanceled].Load(),
		RejectedClosed:          c.rejectedBy[rejectClosed].Load(),
		RejectedInvalid:         c.rejectedBy[rejectInvalid].Load(),
		TransfersResolved:       c.stats.transfersResolved,
		TransfersFailed:         c.stats.transfersFailed,
		TransfersQuarantined:    c.stats.transfersQuar,
		Quarantines:             c.stats.quarantines,
		QuarantineLifts:         c.stats.quarantineLifts,
		LeakedLeases:            c.leaked.Load(),
	}
}

// Region returns the region of ref while its slot is at that generation
// and not free: leased, draining (a transport still needs it), cached or
// quarantined. Once the slot is free or has moved to another generation the
// error wraps ErrStaleRef; an id outside the pool wraps both
// ErrInvalidArgument and ErrStaleRef.
func (p *Pool[R]) Region(ref BlockRef) (R, error) {
	var zero R
	c := &p.core
	if ref.ID < 0 || int(ref.ID) >= len(c.slots) {
		return zero, fmt.Errorf("kvlease: block %v outside pool of %d blocks: %w: %w",
			ref, len(c.slots), ErrInvalidArgument, ErrStaleRef)
	}
	c.mu.Lock()
	s := &c.slots[ref.ID]
	gen, class := s.gen, s.class
	c.mu.Unlock()
	if gen != ref.Gen || class == classFree {
		return zero, fmt.Errorf("kvlease: block %v (slot now at generation %d, %v): %w", ref, gen, class, ErrStaleRef)
	}
	return p.mem.Region(ref.ID), nil
}

// Close refuses new acquires from now on and wakes every queued waiter
// with ErrPoolClosed. Open leases keep working (they may be released,
// aborted, sealed and attached; Extend fails with ErrPoolClosed) and
// transfers still resolve. Close is idempotent and returns nil.
func (p *Pool[R]) Close() error {
	c := &p.core
	c.mu.Lock()
	c.closed.Store(true)
	for _, w := range c.waiters[c.whead:] {
		w.err = closedErr(w.l.owner, w.n)
		close(w.ready)
	}
	clear(c.waiters)
	c.waiters, c.whead = c.waiters[:0], 0
	c.mu.Unlock()
	return nil
}

// Check walks the whole slot table and returns every inconsistency it
// finds (nil when there is none), like bbolt's Tx.Check: each slot's state
// matches its holds, the state counts match the slots and sum to capacity,
// the free stack and the LRU hold exactly the unheld slots, and the prefix
// index points at sealed slots. It takes the pool's lock for O(capacity)
// time; tests and audits call it, the hot path never does.
func (p *Pool[R]) Check() error {
	c := &p.core
	c.mu.Lock()
	defer c.mu.Unlock()
	var errs []error
	bad := func(format string, args ...any) {
		if len(errs) < 32 {
			errs = append(errs, fmt.Errorf(format, args...))
		}
	}
	var counts [numClasses]int
	onFreeN, onLRUN := 0, 0
	for i := range c.slots {
		s := &c.slots[i]
		if s.refs < 0 || s.pins < 0 || s.quar < 0 || s.wpins < 0 {
			bad("slot %d: negative holds refs=%d pins=%d quar=%d wpins=%d", i, s.refs, s.pins, s.quar, s.wpins)
		}
		if s.wpins > s.pins+s.quar {
			bad("slot %d: %d write pins but only %d pending+quarantined", i, s.wpins, s.pins+s.quar)
		}
		if got := s.classify(); got != s.class {
			bad("slot %d: recorded %v, holds say %v", i, s.class, got)
		}
		counts[s.class]++
		switch s.class {
		case classFree:
			onFreeN++
			if s.held() || s.index || s.sealed {
				bad("slot %d: free but held=%v indexed=%v sealed=%v", i, s.held(), s.index, s.sealed)
			}
		case classCached:
			onLRUN++
			if s.held() || !s.index {
				bad("slot %d: cached but held=%v indexed=%v", i, s.held(), s.index)
			}
		}
		if s.index {
			h := c.pre[i].hash
			if got, ok := c.index.find(h); !s.sealed || !ok || got != BlockID(i) {
				bad("slot %d: marked indexed but index[%x]=%d (found %v) sealed=%v", i, h, got, ok, s.sealed)
			}
		}
	}
	ql := 0
	for i := range c.slots {
		if s := &c.slots[i]; s.quar > 0 && s.refs > 0 {
			ql++
		}
	}
	if ql != c.quarLeased {
		bad("%d quarantined slots are leased, counted %d", ql, c.quarLeased)
	}
	if counts != c.counts {
		bad("state counts %v, slots say %v", c.counts, counts)
	}
	sum := 0
	for _, n := range c.counts {
		sum += n
	}
	if sum != len(c.slots) {
		bad("state counts sum to %d, capacity %d", sum, len(c.slots))
	}
	if onFreeN != len(c.free) {
		bad("free stack has %d ids, %d slots are free", len(c.free), onFreeN)
	}
	seen := make([]bool, len(c.slots))
	for _, id := range c.free {
		if seen[id] || c.slots[id].class != classFree {
			bad("free stack: slot %d listed twice or %v", id, c.slots[id].class)
		}
		seen[id] = true
	}
	n := 0
	for id := c.lruHead; id != nilID && n <= len(c.slots); id = c.pre[id].next {
		if c.slots[id].class != classCached {
			bad("LRU: slot %d is %v", id, c.slots[id].class)
		}
		n++
	}
	if n != c.lruLen || onLRUN != c.lruLen {
		bad("LRU: %d linked, %d counted, %d slots cached", n, c.lruLen, onLRUN)
	}
	if err := c.index.check(); err != nil {
		bad("%v", err)
	}
	for h, id := range c.index.all() {
		if s := &c.slots[id]; !s.index || c.pre[id].hash != h {
			bad("index[%x] = slot %d, which is indexed=%v with hash %x", h, id, s.index, c.pre[id].hash)
		}
	}
	return errors.Join(errs...)
}

// checkCounts is the O(1) check run after every operation in checked
// builds: the five state counts sum to capacity.
func (c *core) checkCounts() {
	sum := 0
	for _, n := range c.counts {
		if n < 0 {
			panic(fmt.Sprintf("kvlease: negative state count %v", c.counts))
		}
		sum += n
	}
	if sum != len(c.slots) {
		panic(fmt.Sprintf("kvlease: state counts %v sum to %d, capacity %d", c.counts, sum, len(c.slots)))
	}
}

// closedChan is returned by Settled and Done once the event has happened,
// so that asking late allocates nothing.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// startDeadline arms the drain deadline for a lease that closed unsettled.
func (c *core) startDeadline(l *lease) {
	if c.cfg.deadline <= 0 {
		return
	}
	l.ext().timer = time.AfterFunc(c.cfg.deadline, func() { c.deadlinePassed(l) })
}

// deadlinePassed quarantines the still-pending transfers of a lease that
// did not settle in time, and reports it. Nothing is freed.
func (c *core) deadlinePassed(l *lease) {
	var ev events
	var ts []*Transfer
	c.mu.Lock()
	if l.state == LeaseSettled {
		c.mu.Unlock()
		return
	}
	for i := range l.natts {
		if a := l.att(i); a.applied == TransferPending {
			ts = append(ts, a.t)
		}
	}
	if c.obs != nil {
		ev.add(c.obs, Event{Kind: EventDeadline, Owner: l.owner, Lease: l.id, Blocks: len(l.blocks),
			Err: ErrDrainDeadline})
	}
	c.mu.Unlock()
	ev.flush()
	for _, t := range ts {
		t.Quarantine(fmt.Errorf("kvlease: lease %d (%s) not settled after %v: %w", l.id, l.owner, c.cfg.deadline, ErrDrainDeadline))
	}
}

package kvlease

import (
	"fmt"
	"math"
	"sync"

	"github.com/kvlease/kvlease/internal/invariants"
	"github.com/kvlease/kvlease/internal/slots"
	"go.uber.org/atomic"
)

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
	slabs leaseSlabs[R]  // guarded by mu
	tn    tenantState[R] // registered tenants (quota.go)
}

// core is the non-generic part of a pool: everything but the memory.
// Transfers and leases of every region type talk to it. Its parts are
// named by what they serve; their fields are promoted, so code reads
// c.waiters as before. Everything is guarded by mu except the atomics
// of lifecycle.
type core struct {
	mu  sync.Mutex
	tab slots.Table // every block's state: its only writer (internal/slots)

	// serve's trigger, read on every release: the FIFO of AcquireWait
	// waiters (waiters[whead:] are queued; waiters.go) and alertAt (serve
	// looks further when quarantined blocks exceed it: alertLimit while
	// the alert is clear, -1 while it is raised, then serveAll tells
	// whether to clear it). They live in core itself, not in a part: a
	// promoted field costs the inliner a node, and one compare of each
	// keeps serve inlinable.
	waiters []*waiter
	whead   int
	alertAt int

	prefixState // the prefix cache: per-slot hashes, the index, seal records
	alertState  // the quarantine alert and bound, beside alertAt
	lifecycle   // open, closed, counted

	cfg config
	obs Observer

	enginePolicy // retention, tenants, adapters

	holds holdings // who holds what, for CheckQuiescent (quiescent.go)
}

// prefixState is the prefix cache's part of the core: per-slot state
// kept apart from the slot table (so that the table the hot path walks
// stays small), the index, and how each block was sealed.
type prefixState struct {
	pre   []prefixSlot // parallel to the table
	index prefixIndex  // BlockHash → the slot findable by it; its table made by the first Seal
	stamp uint32       // bumped per prefix probe

	verified bool         // verified mode (WithVerifiedPrefix)
	records  bool         // seals write their record: verified mode, KV events or WithSealRecords
	seals    []sealRecord // per slot: how it was sealed (seal.go)
	sealTok  []int32      // per slot: its sealed tokens, blockTokens each; made by the first SealTokens
	kv       *kvEventLog  // nil unless WithKVEvents
	hook     offerer      // eviction hook (evict.go); nil without one
}

// alertState is the quarantine alert's (WithQuarantineAlert) and the
// quarantine bound's (waiters.go); core.alertAt is serve's trigger.
type alertState struct {
	alertLimit int  // alert when quarantined blocks exceed this (MaxInt: never)
	alerted    bool // the quarantine alert is raised
	// scannedUsable: usable() when the wait queue was last scanned for
	// ErrQuarantineBound.
	scannedUsable int
}

// lifecycle is the pool's open and closed state and its counters.
type lifecycle struct {
	closed     atomic.Bool
	rejections atomic.Uint64 // counted without the lock: rejections come in storms
	rejectedBy [numRejectReasons]atomic.Uint64
	leaked     atomic.Uint64
	nextLease  uint64
	openLeases int
	stats      counters
	// watchOpens: a leak check, an observer or a checked build wants to
	// hear of every lease opened (fixed when the pool is made; one field
	// test instead of three keeps opened inlinable).
	watchOpens bool
}

// enginePolicy is what an engine's policy adds to the core: retention
// classes, tenants and the adapters seal records name.
type enginePolicy struct {
	// ret: retention by adapter (retention.go), made at the first
	// SetAdapterRetention or seal by a tagged lease.
	ret *retentionState
	// tenants: registered tenants' names and counters (quota.go), by
	// their index in the slot table; [0] is no tenant. nil until the
	// first Pool.Tenant.
	tenants []tenantRecord
	// adapters interns the adapters seal records name (adapter.go):
	// adapters[0] is none.
	adapters  []Adapter
	adapterIx map[Adapter]int32
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
	c.tab.Init(n) // every block free, the first acquire gets block 0
	c.seals = make([]sealRecord, n)
	c.pre = make([]prefixSlot, n)
	c.index = newPrefixIndex(c.pre)
	c.alertLimit = cfg.alertLimit(n)
	c.alertAt = c.alertLimit
	c.scannedUsable = n
	if cfg.kvEvents > 0 {
		c.kv = newKVEventLog(cfg.kvEvents)
	}
	c.records = cfg.sealRecords || cfg.verify || cfg.kvEvents > 0
	if cfg.verify {
		if cfg.blockTokens > math.MaxInt/4/n {
			return nil, fmt.Errorf("kvlease: verified mode for %d blocks of %d tokens overflows: %w", n, cfg.blockTokens, ErrInvalidArgument)
		}
		c.verified = true
		c.sealTok = make([]int32, n*cfg.blockTokens)
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

// Acquire hands out a lease on n fresh blocks, or nothing at all. Fresh
// blocks come from the free list first, then by evicting the least recently
// used cached blocks. Errors wrap ErrInvalidArgument (n ≤ 0, empty owner),
// ErrPoolClosed, ErrExceedsCapacity (n > capacity: it can never succeed) or
// ErrExhausted (not enough free or evictable blocks now, or AcquireWait
// callers are queued: a plain acquire never overtakes them).
func (p *Pool[R]) Acquire(owner string, n int) (*Lease[R], error) {
	l, _, err := p.acquire(owner, 0, nil, nil, n)
	return l, err
}

// acquire is Acquire and AcquirePrefix, for tenant tn (0: none).
func (p *Pool[R]) acquire(owner string, tn uint16, hashes []BlockHash, v *verifier, n int) (*Lease[R], int, error) {
	c := &p.core
	// precheck's argument tests, inline (its call would be one more per
	// cycle: BenchmarkLeaseCycle); a closed pool is refused under the lock
	// below, after them, and precheckErr keeps precheck's order of errors.
	if owner == "" || n <= 0 || n > c.tab.Len() {
		return nil, 0, c.reject(owner, n, c.precheckErr(owner, n))
	}
	c.mu.Lock()
	if c.closed.Load() {
		c.unlock()
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
		c.unlock()
		return nil, 0, c.reject(owner, n, err)
	}
	var ev outbox
	var l *Lease[R]
	hits := 0
	if len(hashes) > 0 {
		var err error
		l = p.newLease(owner, n)
		l.ls.tenant = tn
		if hits, err = c.fillPrefix(&l.ls, hashes, n, v, &ev); err != nil {
			c.unlock()
			ev.flush()
			return nil, 0, c.reject(owner, n, err)
		}
	} else if tn != 0 {
		var err error
		if l, err = p.freshTenant(owner, tn, n, &ev); err != nil {
			c.unlock()
			return nil, 0, c.reject(owner, n, err)
		}
	} else {
		if avail := c.available(); avail < n {
			err := c.freshErr("acquire", owner, 0, n)
			c.unlock()
			return nil, 0, c.reject(owner, n, err)
		}
		l = p.newLease(owner, n)
		// A fill, in line (see fillEvict): a call would be one more per cycle.
		if !c.tab.Fill(refs(l.ls.blocks)) {
			c.fillEvict(l.ls.blocks, 0, &ev)
		}
	}
	c.opened(&l.ls, hits, &ev)
	c.unlock()
	ev.flush()
	return l, hits, nil
}

// precheck validates what needs no lock: arguments, capacity, closure.
// The test that passes is small enough to inline; the errors are built
// out of line.
func (c *core) precheck(owner string, n int) error {
	if owner != "" && n > 0 && n <= c.tab.Len() && !c.closed.Load() {
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
	case n > c.tab.Len():
		return fmt.Errorf("kvlease: acquire %d blocks for %q: pool capacity is %d: %w", n, owner, c.tab.Len(), ErrExceedsCapacity)
	}
	return nil
}

// closedErr is the error of an acquire refused by a closed pool.
func closedErr(owner string, n int) error {
	return fmt.Errorf("kvlease: acquire %d blocks for %q: %w", n, owner, ErrPoolClosed)
}

// opened finishes handing out l: id, counters, leak check, event.
func (c *core) opened(l *lease, hits int, ev *outbox) {
	c.nextLease++
	l.id = c.nextLease
	// (born Active: the zero state is Active, see lease.current)
	c.openLeases++
	c.stats.acquires++
	if c.watchOpens {
		c.watchOpened(l, hits, ev)
	}
}

// watchOpened is what opened does for a leak check, an observer or a
// checked build.
func (c *core) watchOpened(l *lease, hits int, ev *outbox) {
	c.hold(l)
	if c.cfg.leakCheck {
		l.watchLeak()
	}
	if c.obs != nil {
		ev.add(c.obs, Event{Kind: EventAcquired, Owner: l.owner, Lease: l.id, Blocks: len(l.blocks), Hits: hits})
	}
}

// Available returns how many blocks a fresh acquire could get now: free
// plus evictable cached blocks (queued waiters come first, though). It is
// a hint for schedulers; the answer may change before the next call.
func (p *Pool[R]) Available() int {
	c := &p.core
	c.mu.Lock()
	defer c.unlock()
	return c.available()
}

// Region returns the region of ref while its slot is at that generation
// and not free: leased, draining (a transport still needs it), cached or
// quarantined. Once the slot is free or has moved to another generation the
// error wraps ErrStaleRef; an id outside the pool wraps both
// ErrInvalidArgument and ErrStaleRef.
func (p *Pool[R]) Region(ref BlockRef) (R, error) {
	var zero R
	c := &p.core
	if ref.ID < 0 || int(ref.ID) >= c.tab.Len() {
		return zero, fmt.Errorf("kvlease: block %v outside pool of %d blocks: %w: %w",
			ref, c.tab.Len(), ErrInvalidArgument, ErrStaleRef)
	}
	c.mu.Lock()
	gen, class := c.tab.Gen(int32(ref.ID)), c.tab.ClassOf(int32(ref.ID))
	c.unlock()
	if gen != ref.Gen || class == slots.Free {
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
	c.unlock()
	return nil
}

// closedChan is returned by Settled and Done once the event has happened,
// so that asking late allocates nothing.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

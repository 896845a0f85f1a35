package kvlease

import (
	"context"
	"fmt"
	"math"

	"github.com/kvlease/kvlease/internal/slots"
	"go.uber.org/atomic"
)

// Tenants and quotas.
//
// Tenant isolation (tenant.go) keeps one tenant from hitting or timing
// another's blocks; quotas keep one tenant from taking the others' cache.
// A tenant that sends unique prompts at ten times another's rate would
// otherwise evict the other's whole cache: every one of its fresh blocks
// takes the least recently used cached block, whoever sealed it.
//
// A registered tenant (Pool.Tenant) is charged for every block one of
// its leases takes fresh (Tenant.Acquire, AcquirePrefix, AcquireWait, a
// sequence admitted with SequenceSpec.Tenant, and their Extends), from
// then until the block is free again: leased, draining, quarantined or
// cached, it counts in the tenant's held blocks. A prefix hit or a Share
// does not move a charge (the block stays its sealer's); an eviction
// moves it to the evicting lease's tenant; a block offered to the
// eviction hook is charged to no one from then on (it leaves for a lower
// tier). Leases of no tenant (Pool.Acquire and the other pool methods)
// take blocks exactly as before.
//
// Its quota (Tenant.SetQuota) has two parts:
//
//   - Cap: the most blocks it holds at once. A tenant at its cap takes
//     every further fresh block from its own cached blocks, least
//     recently cached first, even when others are free: its flood evicts
//     itself. An acquire needing more fresh blocks than its cap leaves
//     (cap − held + its cached blocks) is refused with an error wrapping
//     ErrQuota (and so ErrExhausted) that names the cap; nothing is held
//     or evicted then. Extend and a sequence's Append obey it too.
//   - Reserve: its most recently cached min(Reserve, cached) blocks are
//     reserved: no fill of another tenant, or of no tenant, evicts them
//     (nor does the eviction hook take them), and they do not count in
//     what others may acquire (Pool.Available). Its own fills may.
//
// Waiters. AcquireWait keeps strict arrival order for everyone. A tenant
// whose cap leaves no room for its request now is refused at once with
// ErrQuota rather than queued: only its own releases could make that
// room, and a queued request at the head would hold up every tenant
// behind it. Should its room shrink while it waits (its running requests
// grew), it is failed with ErrQuota when it reaches the head of the queue,
// rather than block the queue. Otherwise the head waiter is served when
// the blocks available to it (its own reservation included) suffice.
//
// Everything is O(1) per block: a tenant's cached blocks are also on a
// list of its own, its reservation is that list's newest end, and an
// eviction that meets another tenant's reserved block at the head of the
// pool's order sets it aside (at most once each time it is cached). Stats
// per tenant (TenantStats) are bounded by the tenants the engine
// registers, plus one line for everything else.

// ErrQuota is wrapped by the error of an acquire (or extend, or a
// waiter) refused because its tenant's cap leaves no room for it (see
// Quota). It wraps ErrExhausted: a caller that retries or preempts on
// ErrExhausted still does; one that tests for ErrQuota knows only that
// tenant's own releases can make room.
var ErrQuota = fmt.Errorf("kvlease: tenant over its quota: %w", ErrExhausted)

// Quota is what one tenant may hold of a pool (see Tenant.SetQuota).
type Quota struct {
	// Cap is the most blocks charged to the tenant at once (leased,
	// draining, quarantined or cached); 0 means no cap.
	Cap int
	// Reserve is how many of the tenant's cached blocks, its most
	// recently cached, no other tenant's demand may evict; 0 means none.
	Reserve int
}

// Tenant is one registered tenant of a pool: the leases it acquires are
// charged to it, under its quota. Get it from Pool.Tenant (one per name,
// for the pool's life) and keep it: its methods do no lookup. Its
// methods are safe for concurrent use.
type Tenant[R any] struct {
	p    *Pool[R]
	ix   uint16
	name string
	ns   string // its public namespace identifier (tenant.go), "" for none
}

// tenantRecord is what the pool keeps of a registered tenant besides its
// charges (in the slot table): its name and counters. Guarded by c.mu.
// A tenant's other per-tenant state belongs here too.
type tenantRecord struct {
	name          string
	ns            *extraKeys // its namespace, shared by the records of its blocks without extra keys; nil: none
	queries, hits uint64     // admitted prefix lookups, as Stats counts them
	rejected      uint64     // refused by its cap
}

// tenantState is the pool's registry of tenants.
type tenantState[R any] struct {
	handles []*Tenant[R]                      // by index - 1; guarded by c.mu
	byName  atomic.Pointer[map[string]uint16] // copied on write: read without the lock
}

// Tenant returns the tenant called name, registering it (with no quota)
// the first time: later calls return the same *Tenant. A registered
// tenant costs a small record for the pool's life and is a line of
// TenantStats: register the tenants the engine authenticates (its API
// keys), never names a request supplies. An empty name, or more than
// 65,535 tenants, wraps ErrInvalidArgument.
func (p *Pool[R]) Tenant(name string) (*Tenant[R], error) {
	if name == "" {
		return nil, fmt.Errorf("kvlease: tenant with an empty name: %w", ErrInvalidArgument)
	}
	c := &p.core
	c.mu.Lock()
	defer c.unlock()
	if ix := p.tenantIndex(name); ix != 0 {
		return p.tn.handles[ix-1], nil
	}
	ix, ok := c.tab.AddTenant()
	if !ok {
		return nil, fmt.Errorf("kvlease: tenant %q: the pool keeps %d tenants already: %w", name, slots.MaxTenants, ErrInvalidArgument)
	}
	if c.tenants == nil {
		c.tenants = []tenantRecord{{}}
	}
	rec := tenantRecord{name: name}
	ns := tenantNamespace(&p.cfg, name)
	if ns != "" {
		rec.ns = &extraKeys{ns: ns}
	}
	c.tenants = append(c.tenants, rec)
	t := &Tenant[R]{p: p, ix: ix, name: name, ns: ns}
	p.tn.handles = append(p.tn.handles, t)
	m := map[string]uint16{name: ix}
	if old := p.tn.byName.Load(); old != nil {
		for k, v := range *old {
			m[k] = v
		}
	}
	p.tn.byName.Store(&m)
	return t, nil
}

// LookupTenant returns the tenant called name if it is registered
// (Pool.Tenant), without registering it: for a name that came with a
// request (SequenceSpec.Tenant), which must never register a tenant.
func (p *Pool[R]) LookupTenant(name string) (*Tenant[R], bool) {
	ix := p.tenantIndex(name)
	if ix == 0 {
		return nil, false
	}
	c := &p.core
	c.mu.Lock()
	defer c.unlock()
	return p.tn.handles[ix-1], true
}

// tenantIndex is the index of the tenant called name, 0 when it is not
// registered. It takes no lock.
func (p *Pool[R]) tenantIndex(name string) uint16 {
	m := p.tn.byName.Load()
	if m == nil || name == "" {
		return 0
	}
	return (*m)[name]
}

// Name returns the tenant's name (its line in TenantStats, the name
// TenantSeed derives its seeds from).
func (t *Tenant[R]) Name() string { return t.name }

// SetQuota sets the tenant's quota (see Quota), at once: a reservation
// takes (or gives back) cached blocks now, in O(the change); a cap lower
// than what the tenant holds refuses its acquires until it is back under
// it, and makes its fresh blocks come from its own cache meanwhile.
// Errors wrap ErrInvalidArgument: a negative Cap or Reserve, a Reserve
// above a nonzero Cap, or reservations that would add up to more than the
// pool's capacity.
func (t *Tenant[R]) SetQuota(q Quota) error {
	c := &t.p.core
	if q.Cap < 0 || q.Reserve < 0 || (q.Cap > 0 && q.Reserve > q.Cap) {
		return fmt.Errorf("kvlease: tenant %q: quota cap %d, reserve %d: neither negative, reserve at most a nonzero cap: %w",
			t.name, q.Cap, q.Reserve, ErrInvalidArgument)
	}
	c.mu.Lock()
	defer c.unlock()
	others := 0
	for ix := 1; ix <= c.tab.Tenants(); ix++ {
		if uint16(ix) != t.ix {
			_, r := c.tab.Quota(uint16(ix))
			others += r
		}
	}
	if q.Reserve > c.tab.Len()-others {
		return fmt.Errorf("kvlease: tenant %q: reserve %d blocks: other tenants reserve %d of the pool's %d: %w",
			t.name, q.Reserve, others, c.tab.Len(), ErrInvalidArgument)
	}
	c.tab.SetQuota(t.ix, q.Cap, q.Reserve)
	return nil
}

// Acquire is Pool.Acquire for the tenant: the fresh blocks are charged to
// it, under its cap (see Quota). Errors as Pool.Acquire's, and ErrQuota
// (wrapping ErrExhausted) when its cap leaves no room for n blocks.
func (t *Tenant[R]) Acquire(owner string, n int) (*Lease[R], error) {
	l, _, err := t.p.acquire(owner, t.ix, nil, nil, n)
	return l, err
}

// AcquirePrefix is Pool.AcquirePrefix for the tenant: hits are shared as
// ever (and stay charged to whoever sealed them), the fresh blocks are
// charged to it under its cap. Errors as Acquire's.
func (t *Tenant[R]) AcquirePrefix(owner string, hashes []BlockHash, n int) (*Lease[R], int, error) {
	return t.p.acquire(owner, t.ix, hashes, nil, n)
}

// AcquireWait is Pool.AcquireWait for the tenant, in the same queue as
// everyone (see the package's Tenants section for how its cap and the
// queue meet): ErrQuota at once when its cap leaves no room for n now,
// or once it reaches the head of the queue without that room.
func (t *Tenant[R]) AcquireWait(ctx context.Context, owner string, n int) (*Lease[R], error) {
	return t.p.acquireWait(ctx, owner, t.ix, n)
}

// Stats returns the tenant's line of TenantStats, in O(1).
func (t *Tenant[R]) Stats() TenantStats {
	c := &t.p.core
	c.mu.Lock()
	defer c.unlock()
	return c.tenantStats(t.ix)
}

// TenantStats is one tenant's share of a pool.
type TenantStats struct {
	// Tenant is the tenant's name; "" on the line for every block charged
	// to no registered tenant (Pool.TenantStats' last line).
	Tenant string
	Quota  Quota
	// Held counts the blocks charged to the tenant: leased, draining,
	// quarantined or cached. Cached and Reserved count those cached, and
	// of them those within its reservation.
	Held, Cached, Reserved int
	// PrefixQueries and PrefixHits are its share of Stats' (the lookups
	// of its admitted prefix acquires): PrefixHits/PrefixQueries is its
	// hit rate.
	PrefixQueries, PrefixHits uint64
	// Rejected counts its acquires refused by its cap (ErrQuota).
	Rejected uint64
	// Evicted counts its cached blocks evicted for another tenant's fill
	// (or one of no tenant); EvictedOwn those evicted for its own.
	Evicted, EvictedOwn uint64
}

// TenantStats appends to dst a line per registered tenant, in the order
// they were registered, then the line of everything charged to no
// registered tenant (Tenant ""): its Held and Cached are the pool's
// non-free and cached blocks less the tenants', its prefix counts the
// pool's less theirs. O(tenants).
func (p *Pool[R]) TenantStats(dst []TenantStats) []TenantStats {
	c := &p.core
	c.mu.Lock()
	defer c.unlock()
	other := TenantStats{
		Held:          c.tab.Len() - c.tab.Count(slots.Free),
		Cached:        c.tab.Count(slots.Cached),
		PrefixQueries: c.stats.prefixQueries,
		PrefixHits:    c.stats.prefixHits,
	}
	for ix := 1; ix <= c.tab.Tenants(); ix++ {
		s := c.tenantStats(uint16(ix))
		other.Held -= s.Held
		other.Cached -= s.Cached
		other.PrefixQueries -= s.PrefixQueries
		other.PrefixHits -= s.PrefixHits
		dst = append(dst, s)
	}
	return append(dst, other)
}

// tenantStats is tenant ix's line. Called with c.mu held.
func (c *core) tenantStats(ix uint16) TenantStats {
	held, cached, reserved := c.tab.TenantCounts(ix)
	cp, rs := c.tab.Quota(ix)
	r := &c.tenants[ix]
	ev, own := c.tab.TenantEvictions(ix)
	return TenantStats{Tenant: r.name, Quota: Quota{Cap: cp, Reserve: rs},
		Held: held, Cached: cached, Reserved: reserved,
		PrefixQueries: r.queries, PrefixHits: r.hits, Rejected: r.rejected,
		Evicted: ev, EvictedOwn: own}
}

// freshTenant is acquire's lease of n fresh blocks for tenant tn (not
// 0), out of the plain acquire's way. Called with c.mu held.
func (p *Pool[R]) freshTenant(owner string, tn uint16, n int, ev *outbox) (*Lease[R], error) {
	c := &p.core
	if !c.tab.Fits(tn, n) && !c.tab.Admits(tn, n) { // (Fits, the common case, implies Admits)
		return nil, c.freshErr("acquire", owner, tn, n)
	}
	l := p.newLease(owner, n)
	l.ls.tenant = tn
	if !c.tab.FillTenant(refs(l.ls.blocks), tn) {
		c.fillEvict(l.ls.blocks, tn, ev)
	}
	return l, nil
}

// availableFor is how many fresh blocks a fill for tenant tn (0: none)
// could get now, its cap aside. Called with c.mu held.
func (c *core) availableFor(tn uint16) int {
	if tn == 0 {
		return c.tab.Available()
	}
	return c.tab.AvailableFor(tn)
}

// freshErr is the error of a fill of n fresh blocks for tenant tn (0:
// none) that its cap or the pool cannot serve now (slots.Table.Admits
// said no). Called with c.mu held, out of the acquire's way.
func (c *core) freshErr(op, owner string, tn uint16, n int) error {
	if tn != 0 {
		if err := c.quotaErr(op, owner, tn, n, 0); err != nil {
			return err
		}
	}
	avail := c.availableFor(tn)
	if err := c.boundErr(owner, n, 0); err != nil {
		return err
	}
	return &exhaustedError{op: op, owner: owner, n: n, avail: avail}
}

// quotaErr returns the error of a fill of fresh blocks for tenant tn (not
// 0) beyond what its cap leaves, own being its cached blocks the same
// acquire hits (they stop being its to evict); nil when the cap leaves
// room. It counts the refusal. Called with c.mu held.
func (c *core) quotaErr(op, owner string, tn uint16, fresh, own int) error {
	room := c.tab.Room(tn)
	if room == math.MaxInt || fresh <= room-own {
		return nil
	}
	c.tenants[tn].rejected++
	held, cached, _ := c.tab.TenantCounts(tn)
	cp, _ := c.tab.Quota(tn)
	return &quotaError{op: op, owner: owner, tenant: c.tenants[tn].name, n: fresh, cap: cp, held: held, cached: cached - own}
}

// quotaError is the error of a fill refused by its tenant's cap. Like
// exhaustedError it is formatted only if someone reads it.
type quotaError struct {
	op, owner, tenant string
	n                 int // fresh blocks asked for
	cap, held, cached int // the tenant's cap, held blocks, cached blocks it may evict
}

func (e *quotaError) Error() string {
	return fmt.Sprintf("kvlease: %s %d fresh blocks for %q of tenant %q: its cap of %d blocks leaves room for %d (it holds %d, %d of them cached): %v",
		e.op, e.n, e.owner, e.tenant, e.cap, max(e.cap-e.held+e.cached, 0), e.held, e.cached, ErrQuota)
}

func (e *quotaError) Unwrap() error { return ErrQuota }

// fillFor fills dst with fresh blocks for tenant tn (0: none). The caller
// checked availableFor(tn) and the cap.
func (c *core) fillFor(dst []BlockRef, tn uint16, ev *outbox) {
	if !c.tab.FillFor(refs(dst), tn) {
		c.fillEvict(dst, tn, ev)
	}
}

// hitsCost is slots.Table.HitsCost for an acquire's hits: ids holds the
// slots the probe recorded, and hashes[:hits] find the rest. Called with
// c.mu held, once tenants exist.
func (c *core) hitsCost(tn uint16, ids []int32, hashes []BlockHash, hits int) (lost, own int) {
	if hits > len(ids) {
		all := make([]int32, 0, hits)
		all = append(all, ids...)
		for k := len(ids); k < hits; k++ {
			id, _ := c.index.find(hashes[k])
			all = append(all, int32(id))
		}
		ids = all
	}
	return c.tab.HitsCost(tn, ids[:hits])
}

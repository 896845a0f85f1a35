package kvlease

import (
	"fmt"
	"github.com/kvlease/kvlease/internal/slots"
	"runtime"
	"time"
)

// Lease is the typed ownership handle of a set of blocks. While it is open
// (Active, or Quarantined and not yet closed), its owner may read and write
// the regions, extend it, seal blocks and attach transfers. Release and
// Abort close it at once: no new work can be attached and Region fails with
// ErrLeaseClosed. Each block returns to the pool only when every transfer
// gating it has resolved; Settled tells when that is done for all of them.
//
// Region hands out a block for writing only while it is not sealed and no
// other lease shares it (ErrReadOnly otherwise): one request can never
// overwrite KV another reads. ReadRegion serves every held block for
// reading.
//
// A lease must be closed exactly as a file must: one that becomes
// unreachable while open is reported to the observer as leaked (when the
// leak check is on) and its blocks stay leased forever. All methods are
// safe for concurrent use.
//
// Leases are carved from per-pool slabs of about 16 KiB (see slab.go), so
// acquiring one allocates nothing on average; the price is that a lease
// kept reachable keeps its slab's memory. Drop closed leases you no longer
// need.
type Lease[R any] struct {
	ls lease // first: transfers point at it, and it starts the allocation
	p  *Pool[R]
}

// lease is the non-generic part of a lease. Everything but owner, id and
// c is guarded by c.mu.
type lease struct {
	c      *core
	id     uint64
	owner  string
	blocks []BlockRef

	state       LeaseState
	closed      bool
	tenant      uint16 // charged for its fresh blocks (quota.go); 0: none
	pending     int32  // attachments whose transfer is pending
	quarantined int32  // attachments whose transfer is quarantined
	natts       int32  // live attachments (pending or quarantined): att0, then extra.more

	att0  attachment  // the first attachment inline: none allocated for one transfer
	extra *leaseExtra // only when something rarer is needed (see leaseExtra)
}

// newLease returns a fresh lease whose table has n zero entries (the
// caller fills them before anyone sees the lease), carved from the pool's
// slabs (see slab.go). Called with c.mu held.
func (p *Pool[R]) newLease(owner string, n int) *Lease[R] {
	l, blocks := p.slabs.carve(n, p.cfg.leakCheck)
	l.p = p
	l.ls.c = &p.core
	l.ls.owner = owner
	l.ls.blocks = blocks[:n] // filled by the caller before anyone sees it
	return l
}

// leaseExtra holds what only some leases need, off the hot path: a
// lease is carved for every request, and every byte of it is garbage to
// collect.
type leaseExtra struct {
	more    []attachment  // attachments after the first
	settled chan struct{} // made on demand by Settled
	timer   *time.Timer   // drain deadline
	leak    runtime.Cleanup
	watched bool      // leak is registered
	trimmed int       // blocks before this index were given back by TrimTo (trim.go)
	hold    int32     // index+1 in the pool's table of holders (quiescent.go); 0: not in it
	tagIx   int32     // SetAdapter's adapter, interned (adapter.go); 0: the base model
	ret     Retention // SetRetention (retention.go); 0 with hasRet false: the default
	hasRet  bool
}

func (l *lease) ext() *leaseExtra {
	if l.extra == nil {
		l.extra = new(leaseExtra)
	}
	return l.extra
}

// settledChan returns the Settled channel if anyone asked for it, else nil.
func (l *lease) settledChan() chan struct{} {
	if l.extra == nil {
		return nil
	}
	return l.extra.settled
}

type leakInfo struct {
	c     *core
	obs   Observer
	owner string
	id    uint64
	hold  int32
}

// watchLeak registers the cleanup that reports this lease if it becomes
// unreachable while open. Called with c.mu held when the lease opens.
func (l *lease) watchLeak() {
	if l.c.obs == nil {
		return
	}
	x := l.ext()
	x.leak = runtime.AddCleanup(l, func(i leakInfo) {
		i.c.leaked.Inc()
		i.c.markLeaked(i.hold, i.id)
		i.obs.Observe(Event{Kind: EventLeaked, Owner: i.owner, Lease: i.id,
			Err: fmt.Errorf("kvlease: lease %d (%s) became unreachable while open; its blocks stay leased", i.id, i.owner)})
	}, leakInfo{l.c, l.c.obs, l.owner, l.id, x.hold})
	x.watched = true
}

// ID returns the lease's id, unique within its pool; observer events carry
// it. Ids increase in the order leases are handed out (for waiters: the
// order they are served).
func (l *Lease[R]) ID() uint64 { return l.ls.id }

// Owner returns the owner named at acquire.
func (l *Lease[R]) Owner() string { return l.ls.owner }

// Pool returns the pool the lease came from.
func (l *Lease[R]) Pool() *Pool[R] { return l.p }

// snapshot returns the block table as it is now. Entries are never
// rewritten once set (Extend only appends), so the caller may index the
// returned slice without the lock.
func (l *lease) snapshot() []BlockRef {
	l.c.mu.Lock()
	b := l.blocks
	l.c.unlock()
	return b
}

// Len returns the number of blocks in the lease (it still answers after the
// lease closes).
func (l *Lease[R]) Len() int { return len(l.ls.snapshot()) }

// Ref returns the reference of block i: its slot and the generation it had
// when this lease got it. It still answers after the lease closes, so a
// caller can keep refs and later check them for staleness with
// Pool.Region. An i outside [0, Len()) panics like a slice index.
func (l *Lease[R]) Ref(i int) BlockRef { return l.ls.snapshot()[i] }

// AppendBlockIDs appends the ids of blocks from..Len()-1 to dst and returns
// it: the block table an attention kernel indexes. An engine sends only the
// new tail each decode step. It allocates nothing when dst has room; a
// from outside [0, Len()] panics like a slice expression.
func (l *Lease[R]) AppendBlockIDs(dst []BlockID, from int) []BlockID {
	for _, r := range l.ls.liveFrom(from) {
		dst = append(dst, r.ID)
	}
	return dst
}

// Region returns block i's region for writing. It fails with
// ErrLeaseClosed once the lease is released or aborted (the region may be
// someone else's soon), with ErrInvalidArgument for an i outside [0,
// Len()), and with ErrReadOnly when block i is sealed or shared with
// another lease (a prefix hit, a Share): its content is immutable and
// others read it, so no lease may write it. Read such a block with
// ReadRegion.
func (l *Lease[R]) Region(i int) (R, error) {
	return l.region(i, true)
}

// ReadRegion returns block i's region for reading: any block the open
// lease holds, sealed or shared included. A transport that sends or
// offloads a lease's content reads it here (or through Pool.Region).
// Writing through it is a contract violation the library cannot catch.
// Errors as Region, except ErrReadOnly.
func (l *Lease[R]) ReadRegion(i int) (R, error) {
	return l.region(i, false)
}

func (l *Lease[R]) region(i int, write bool) (R, error) {
	var zero R
	c := l.ls.c
	c.mu.Lock()
	if l.ls.closed {
		c.unlock()
		return zero, fmt.Errorf("kvlease: region %d of lease %d (%s): %w", i, l.ls.id, l.ls.owner, ErrLeaseClosed)
	}
	if i < l.ls.first() || i >= len(l.ls.blocks) {
		n := len(l.ls.blocks)
		c.unlock()
		return zero, fmt.Errorf("kvlease: region %d of lease %d (%s) with %d blocks: %w", i, l.ls.id, l.ls.owner, n, ErrInvalidArgument)
	}
	id := l.ls.blocks[i].ID
	if write {
		if sealed, refs := c.tab.Sealed(int32(id)), c.tab.Refs(int32(id)); sealed || refs > 1 {
			c.unlock()
			return zero, readOnlyErr(&l.ls, i, sealed, refs)
		}
	}
	c.unlock()
	return l.p.mem.Region(id), nil
}

// readOnlyErr is the error of a write access to a sealed or shared block.
func readOnlyErr(l *lease, i int, sealed bool, refs int32) error {
	why := "sealed"
	if !sealed {
		why = fmt.Sprintf("shared by %d leases", refs)
	}
	return fmt.Errorf("kvlease: writable region %d of lease %d (%s): the block is %s: %w", i, l.id, l.owner, why, ErrReadOnly)
}

// AppendRegions appends the writable regions of blocks from..to-1 to dst
// and returns it, under one lock acquisition: what a copy or a kernel
// launch that writes wants, rather than a Region call (and a lock) per
// block. Errors as Region (ErrReadOnly if any of those blocks is sealed or
// shared: nothing is appended then); a range outside [Trimmed(), Len()]
// (or to < from) wraps ErrInvalidArgument. AppendReadRegions serves every
// block for reading.
func (l *Lease[R]) AppendRegions(dst []R, from, to int) ([]R, error) {
	return l.appendRegions(dst, from, to, true)
}

// AppendReadRegions is AppendRegions for reading: it serves sealed and
// shared blocks too (what a send or an offload wants).
func (l *Lease[R]) AppendReadRegions(dst []R, from, to int) ([]R, error) {
	return l.appendRegions(dst, from, to, false)
}

func (l *Lease[R]) appendRegions(dst []R, from, to int, write bool) ([]R, error) {
	c := l.ls.c
	c.mu.Lock()
	if l.ls.closed {
		c.unlock()
		return dst, fmt.Errorf("kvlease: regions of lease %d (%s): %w", l.ls.id, l.ls.owner, ErrLeaseClosed)
	}
	blocks, first := l.ls.blocks, l.ls.first()
	if from < first || to < from || to > len(blocks) {
		c.unlock()
		return dst, fmt.Errorf("kvlease: regions %d..%d of lease %d (%s) with %d blocks: %w",
			from, to, l.ls.id, l.ls.owner, len(blocks), ErrInvalidArgument)
	}
	if write {
		for i := from; i < to; i++ {
			if id := int32(blocks[i].ID); c.tab.Sealed(id) || c.tab.Refs(id) > 1 {
				sealed, refs := c.tab.Sealed(id), c.tab.Refs(id)
				c.unlock()
				return dst, readOnlyErr(&l.ls, i, sealed, refs)
			}
		}
	}
	c.unlock()
	for _, r := range blocks[from:to] {
		dst = append(dst, l.p.mem.Region(r.ID))
	}
	return dst, nil
}

// Closed reports whether the lease has been released or aborted. (State
// alone cannot tell: LeaseQuarantined means open or closed.)
func (l *Lease[R]) Closed() bool {
	c := l.ls.c
	c.mu.Lock()
	defer c.unlock()
	return l.ls.closed
}

// State returns the lease's lifecycle state.
func (l *Lease[R]) State() LeaseState {
	c := l.ls.c
	c.mu.Lock()
	defer c.unlock()
	return l.ls.current()
}

// Settled returns a channel that is closed once the lease is closed and
// holds none of its blocks any more: every transfer gating it has resolved
// and its references are dropped. (The blocks may still be leased by
// others, or be cached or free.) The channel is made on first call.
func (l *Lease[R]) Settled() <-chan struct{} {
	c := l.ls.c
	c.mu.Lock()
	defer c.unlock()
	if l.ls.current() == LeaseSettled {
		return closedChan
	}
	x := l.ls.ext()
	if x.settled == nil {
		x.settled = make(chan struct{})
	}
	return x.settled
}

// Release closes the lease: from now on nothing can be attached and Region
// fails. Blocks no pending transfer gates return to the pool at once (a
// chain's tail first, so the cache evicts it from its end); the others as
// their transfers resolve. Release is idempotent, and a no-op after Abort.
func (l *Lease[R]) Release() { l.ls.close(false, nil) }

// Abort closes the lease like Release and then calls Cancel on every
// attached transfer that has not resolved (pending or quarantined).
// Cancelling is a request to the transport; the blocks still return only
// when the transfers resolve. cause is reported to the observer (nil means
// ErrAborted). Abort is idempotent, and a no-op after Release.
func (l *Lease[R]) Abort(cause error) {
	if cause == nil {
		cause = ErrAborted
	}
	l.ls.close(true, cause)
}

func (l *lease) close(abort bool, cause error) {
	c := l.c
	var ev outbox
	var toCancel []*Transfer
	c.mu.Lock()
	if l.closed {
		c.unlock()
		return
	}
	l.closed = true
	c.openLeases--
	// x is loaded once: nothing below, under the lock, sets l.extra.
	x := l.extra
	if x != nil && x.watched {
		x.leak.Stop()
		x.watched = false
	}
	if c.obs != nil {
		if abort {
			ev.add(c.obs, Event{Kind: EventAborted, Owner: l.owner, Lease: l.id, Blocks: len(l.blocks), Err: cause})
		} else {
			ev.add(c.obs, Event{Kind: EventReleased, Owner: l.owner, Lease: l.id, Blocks: len(l.blocks)})
		}
	}
	from := 0 // l.first()
	if x != nil {
		from = x.trimmed
	}
	if l.natts == 0 {
		// c.drop, by hand: its call would be one more per cycle.
		var i int
		if l.tenant == 0 {
			i = c.tab.Drop(refs(l.blocks[from:]))
		} else {
			i = c.tab.DropTenant(refs(l.blocks[from:]), l.tenant)
		}
		if i > 0 {
			c.tab.DropRest(refs(l.blocks[from : from+i]))
		}
	} else {
		c.dropGated(l, from)
	}
	if abort {
		var cancel [4]*Transfer // zeroed only on this path
		toCancel = cancel[:0]
		for i := range l.natts {
			if a := l.att(i); a.applied != TransferResolved {
				toCancel = append(toCancel, a.t)
			}
		}
	}
	if !c.settlesQuietly(l) {
		c.transition(l, &ev)
		if l.current() != LeaseSettled {
			c.startDeadline(l)
			if x != nil && x.hold != 0 {
				c.holds.recs[x.hold-1].closed = l // CheckQuiescent reads its state until it settles
			}
		}
	}
	c.serve(&ev)
	c.unlock()
	ev.flush()
	for _, t := range toCancel {
		t.Cancel()
	}
}

// Extend appends n fresh blocks to the open lease, all or nothing: a
// request's KV grows by a block every block-size tokens while it decodes.
// Growth of running work is not queued behind AcquireWait waiters (their
// order governs admission of new work only), but it does evict cached
// blocks when nothing is free. Transfers attached with Attach gate the new
// blocks too (as writes: they are unsealed); AttachRange ranges are fixed.
// Errors wrap ErrInvalidArgument (n ≤ 0), ErrLeaseClosed, ErrPoolClosed,
// ErrExceedsCapacity (the lease would outgrow the pool) or ErrExhausted
// (ErrQuota for a tenant's lease its cap leaves no room: see Quota).
func (l *Lease[R]) Extend(n int) error {
	ls := &l.ls
	c := ls.c
	if n <= 0 {
		return fmt.Errorf("kvlease: extend lease %d (%s) by %d blocks: n must be positive: %w", ls.id, ls.owner, n, ErrInvalidArgument)
	}
	var ev outbox
	c.mu.Lock()
	var err error
	switch have := len(ls.blocks) - ls.first(); {
	case ls.closed:
		err = fmt.Errorf("kvlease: extend lease %d (%s): %w", ls.id, ls.owner, ErrLeaseClosed)
	case c.closed.Load():
		err = fmt.Errorf("kvlease: extend lease %d (%s): %w", ls.id, ls.owner, ErrPoolClosed)
	case n > c.tab.Len()-have: // not have+n: that overflows for a huge n
		err = fmt.Errorf("kvlease: extend lease %d (%s) from %d by %d blocks: pool capacity is %d: %w",
			ls.id, ls.owner, have, n, c.tab.Len(), ErrExceedsCapacity)
	case ls.tenant != 0 && c.tab.Room(ls.tenant) < n:
		err = c.quotaErr("extend", ls.owner, ls.tenant, n, 0)
	case c.availableFor(ls.tenant) < n:
		held := 0 // usable blocks this lease holds already (trimmed ones it gave back)
		for _, r := range ls.blocks[ls.first():] {
			if !c.tab.Quarantined(int32(r.ID)) {
				held++
			}
		}
		if err = c.boundErr(ls.owner, n, held); err == nil {
			err = &exhaustedError{op: "extend", owner: ls.owner, lease: ls.id, n: n, avail: c.availableFor(ls.tenant)}
		}
	}
	if err != nil {
		c.unlock()
		return err
	}
	from := len(ls.blocks)
	if cap(ls.blocks)-from < n {
		// Grow by doubling, outside the inline array.
		nb := make([]BlockRef, from, max(2*cap(ls.blocks), from+n))
		copy(nb, ls.blocks)
		ls.blocks = nb
	}
	ls.blocks = ls.blocks[:from+n]
	c.fillFor(ls.blocks[from:], ls.tenant, &ev)
	for i := range ls.natts {
		a := ls.att(i)
		if a.whole && a.applied != TransferResolved {
			for _, r := range ls.blocks[from:] {
				// Fresh, so unsealed: a write pin.
				c.tab.Repin(int32(r.ID), slots.PinNone, pinOf(a.applied), true)
			}
		}
	}
	if c.obs != nil {
		ev.add(c.obs, Event{Kind: EventExtended, Owner: ls.owner, Lease: ls.id, Blocks: n})
	}
	c.serve(&ev) // a quarantined Attach may have quarantined the new blocks
	c.unlock()
	ev.flush()
	return nil
}

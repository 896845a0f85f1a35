package kvlease

import (
	"slices"
	"unsafe"

	"github.com/kvlease/kvlease/internal/slots"
)

// The slot table lives in internal/slots, the one writer of block state
// (holds, classes, the free stack, the LRU, the counts). This file is the
// core's side of it: handing blocks out fresh (with eviction, which the
// prefix index and the eviction hook take part in) and dropping them.

// prefixSlot is the per-block state only the prefix cache uses, kept apart
// from the slot table so that the table the hot path walks stays small.
// Guarded by the pool's mutex; indexed by BlockID.
type prefixSlot struct {
	hash BlockHash // valid while the slot is sealed
	mark uint32    // probe stamp: catches a block named twice in one lookup
}

// refs views a block table as the slot table's refs: the same layout (see
// the checks below), so no copy.
func refs(b []BlockRef) []slots.Ref {
	// The header reinterpreted, not unsafe.Slice: that checks its
	// arguments on every call, and this runs on every acquire and release.
	return *(*[]slots.Ref)(unsafe.Pointer(&b))
}

// BlockRef and slots.Ref have the same size and field offsets: a
// compile-time check of what refs relies on.
const (
	_ = uint(unsafe.Sizeof(BlockRef{}) - unsafe.Sizeof(slots.Ref{}))
	_ = uint(unsafe.Sizeof(slots.Ref{}) - unsafe.Sizeof(BlockRef{}))
	_ = uint(unsafe.Offsetof(BlockRef{}.Gen) - unsafe.Offsetof(slots.Ref{}.Gen))
	_ = uint(unsafe.Offsetof(slots.Ref{}.Gen) - unsafe.Offsetof(BlockRef{}.Gen))
)

// ref converts a slot table ref.
func ref(r slots.Ref) BlockRef { return BlockRef{ID: BlockID(r.ID), Gen: r.Gen} }

func (c *core) available() int { return c.tab.Available() }

// fillEvict is fill when the free stack is short, for tenant tn (0:
// none; see quota.go): block by block, evicting.
// Kept out of line: inlined into acquire, it cost every cycle spills.
//
// The free blocks come first, in dst's first places; the victims fill
// the rest from the end backwards. Eviction takes a chain's blocks tail
// first (its last block is the least recently used), so a chain's
// victims come with descending ids: laid backwards they ascend, one run
// (see AppendRuns). The places of a lease's fresh blocks are
// interchangeable.
//
//go:noinline
func (c *core) fillEvict(dst []BlockRef, tn uint16, ev *outbox) {
	if c.tenants != nil {
		c.fillEvictTenant(dst, tn, ev)
		return
	}
	n := len(dst)
	k := min(c.tab.FreeLen(), n)
	for i := range k {
		dst[i] = c.takeFresh(ev, n-i)
	}
	for i := n - 1; i >= k; i-- {
		dst[i] = c.takeFresh(ev, i-k+1)
	}
}

// fillEvictTenant is fillEvict in a pool with tenants, for tenant tn (0:
// none; see quota.go): the evictions in one loop (slots.Table.EvictRun)
// when nothing is free or tn is at its cap, then block by block as
// fillEvict does (an eviction hook is offered victims block by block).
//
//go:noinline
func (c *core) fillEvictTenant(dst []BlockRef, tn uint16, ev *outbox) {
	if c.hook == nil {
		m := c.tab.EvictRun(refs(dst), tn)
		for _, r := range dst[len(dst)-m:] {
			c.evicted(r.ID)
		}
		dst = dst[:len(dst)-m]
	}
	n := len(dst)
	k := min(c.tab.FreeLen(), n)
	for i := range k {
		dst[i] = c.takeTenant(ev, n-i, tn)
	}
	for i := n - 1; i >= k; i-- {
		dst[i] = c.takeTenant(ev, i-k+1, tn)
	}
}

// ascend reverses every stretch of dst whose ids descend one by one, so
// that it ascends: one run (see AppendRuns); also, when not nil, is
// parallel to dst and reversed with it. The eviction hook's offered
// leases use it: their victims come least recently used first, a chain
// tail first, and their places are interchangeable.
func ascend(dst []BlockRef, also []BlockHash) {
	for i := 0; i < len(dst)-1; {
		j := i
		for j+1 < len(dst) && dst[j+1].ID == dst[j].ID-1 {
			j++
		}
		if j > i {
			slices.Reverse(dst[i : j+1])
			if also != nil {
				slices.Reverse(also[i : j+1])
			}
		}
		i = j + 1
	}
}

// takeFresh hands out one block fresh: the top of the free stack, else the
// least recently used cached block (evicted: its content is forfeit and it
// leaves the prefix index, or is first offered to the eviction hook when
// the cache can spare it: see SetEvictHook). need counts this block and
// the ones the caller still has to take. The caller checked available()
// ≥ need. A pool with tenants takes with takeTenant.
func (c *core) takeFresh(ev *outbox, need int) BlockRef {
	if c.hook != nil && c.tab.FreeLen() == 0 {
		c.offerVictim(need, ev)
	}
	r, evicted := c.tab.Take()
	if evicted {
		c.evicted(BlockID(r.ID))
	}
	return ref(r)
}

// takeTenant is takeFresh in a pool with tenants, for tenant tn (0:
// none; see quota.go): the block is charged to tn. The caller checked
// availableFor(tn) ≥ need, and tn's cap.
func (c *core) takeTenant(ev *outbox, need int, tn uint16) BlockRef {
	if c.hook != nil && c.tab.FreeLen() == 0 {
		c.offerVictim(need, ev)
	}
	r, evicted := c.tab.TakeTenant(tn)
	if evicted {
		c.evicted(BlockID(r.ID))
	}
	return ref(r)
}

// drop releases one reference to each block, tail first, so that a
// chain's last block becomes the least recently used. Blocks nobody else
// holds go back at once. Called with c.mu held.
func (c *core) drop(blocks []BlockRef) {
	if i := c.tab.Drop(refs(blocks)); i > 0 {
		c.tab.DropRest(refs(blocks[:i]))
	}
}

package kvlease

import (
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

// fill fills dst with fresh blocks. The caller checked available() ≥
// len(dst).
// (Acquire spells it out: see there.)
func (c *core) fill(dst []BlockRef, ev *outbox) {
	if !c.tab.Fill(refs(dst)) {
		c.fillEvict(dst, ev)
	}
}

// fillEvict is fill when the free stack is short: block by block, evicting.
// Kept out of line: inlined into acquire, it cost every cycle spills.
//
//go:noinline
func (c *core) fillEvict(dst []BlockRef, ev *outbox) {
	n := len(dst)
	for i := range dst {
		dst[i] = c.takeFresh(ev, n-i)
	}
}

// takeFresh hands out one block fresh: the top of the free stack, else the
// least recently used cached block (evicted: its content is forfeit and it
// leaves the prefix index, or is first offered to the eviction hook when
// the cache can spare it: see SetEvictHook). need counts this block and
// the ones the caller still has to take. The caller checked available() ≥
// need.
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

// drop releases one reference to each block, tail first, so that a
// chain's last block becomes the least recently used. Blocks nobody else
// holds go back at once. Called with c.mu held.
func (c *core) drop(blocks []BlockRef) {
	if i := c.tab.Drop(refs(blocks)); i > 0 {
		c.tab.DropRest(refs(blocks[:i]))
	}
}

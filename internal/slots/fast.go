package slots

import (
	"math/bits"

	"github.com/kvlease/kvlease/internal/invariants"
)

// The fast paths. Each loop runs for every block of every lease, so each
// is hand-written for its commonest case and says which case of change it
// mirrors; a block outside that case ends the loop and the rest take the
// general path. Most are leaves (they call nothing), so that the loop
// keeps the table, its counter and its bounds in registers: a call later
// in the same function made the compiler spill and reload them every
// block. The root package's BenchmarkLeaseCycle, BenchmarkLeaseCycleTransfer,
// BenchmarkAcquirePrefix and BenchmarkEvictionChurn guard them, measured
// in instructions with bench/instr (numbers in bench/README.md). In
// checked builds each sometimes takes the general path for everything.

// generalPercent is how often a checked build takes the general path.
const generalPercent = 25

// takeFast is Take's commonest case written out, for an eviction runs it
// for every block when the pool is full of cached blocks (the root
// package's BenchmarkEvictionChurn and BenchmarkProductionReplay).
//
// Mirrors takeGeneral: change(+1 ref) on the free stack's top, Free →
// Leased, or on the LRU's head, its content forfeit, Cached → Leased.
func (t *Table) takeFast() (r Ref, evicted bool) {
	var id int32
	old := Free
	if n := len(t.free); n > 0 {
		id = t.free[n-1]
		t.free = t.free[:n-1]
	} else {
		// The lowest retention class with a cached slot, its LRU's head
		// (the default class's while no other was ever used).
		r := DefaultRetention
		if t.retUsed {
			r = bits.TrailingZeros8(t.lruMask)
		}
		e := &t.lru[r&(NumRetention-1)]
		id = e.head
		e.head, e.tail = unlink(t.links, e.head, e.tail, id)
		if e.head == Nil {
			t.lruMask &^= 1 << r
		}
		t.lruLen--
		old, evicted = Cached, true
	}
	s := &t.s[id]
	gen := s.bumpGen()
	s.setHead(headLeased) // one reference, unsealed, unindexed
	t.counts[old]--
	t.counts[Leased]++
	return Ref{ID: id, Gen: gen}, evicted
}

// Fill hands out len(dst) slots fresh into dst, when the free stack holds
// them all; it returns false, changing nothing, when it does not (the
// caller then takes them one by one with Take, which evicts).
//
// Mirrors Take on a free slot: a generation bump and change(+1 ref), Free
// → Leased. A free slot is unheld, unsealed and unindexed, so only its
// generation and head change.
func (t *Table) Fill(dst []Ref) bool {
	n := len(dst)
	if len(t.free) < n {
		return false
	}
	if invariants.Enabled { // (a constant: production builds pay nothing, not even in inlining budget)
		if invariants.Sometimes(generalPercent) {
			t.fillGeneral(dst)
			return true
		}
	}
	t.fillFast(dst)
	return true
}

// fillGeneral is Fill by Take: the same ids in the same places.
func (t *Table) fillGeneral(dst []Ref) {
	for i := range dst {
		dst[i], _ = t.takeGeneral()
	}
}

// fillFast is Fill's loop. It reads the stack from the top down, so that
// dst[0] is the top: a run that Drop pushed tail first (its lowest id on
// top) comes back in ascending order, one contiguous run (see the
// package doc).
func (t *Table) fillFast(dst []Ref) {
	n := len(dst)
	top := len(t.free) - n
	ids := t.free[top:][:len(dst)]
	slots := t.s
	for j := len(ids) - 1; j >= 0; j-- { // (this form proves both indexes in bounds)
		id := ids[j]
		s := &slots[id]
		gen := s.gen + 1
		if gen == 0 {
			gen = 1 // generation 0 is never handed out
		}
		s.gen = gen
		s.setHead(headLeased)
		dst[len(ids)-1-j] = Ref{ID: id, Gen: gen}
	}
	t.free = t.free[:top]
	t.counts[Free] -= n
	t.counts[Leased] += n
}

// Drop drops one open lease's hold on each slot of blocks, tail first, so
// that a chain's last block becomes the least recently used: Unref of
// each, the slots nobody else holds going back at once. It takes the
// commonest cases and returns how many blocks it left, from the first
// block outside them: the caller hands those to DropRest. (Two calls
// rather than one that calls both: the release of every lease would pay
// a call more, and the loop is fastest as a leaf.)
func (t *Table) Drop(blocks []Ref) (rest int) {
	if invariants.Enabled { // (a constant: production builds pay nothing, not even in inlining budget)
		if invariants.Sometimes(generalPercent) {
			t.dropGeneral(blocks)
			return 0
		}
	}
	rest, _ = t.dropFast(blocks, headLeased, headDraining)
	return rest
}

// DropPinned is Drop for blocks that one pending read transfer gates
// without having pinned them yet (the pool pins a read only when its
// lease gives the blocks back): it pins and drops in one pass, tail
// first, and returns how many blocks it left, from the first block
// outside its case: the caller pins those (PinPending) and drops them
// (Drop).
//
// Mirrors Repin(PinNone → PinPending, read) then Unref, on a slot this
// lease alone holds and nothing pins yet, unsealed or sealed and indexed:
// Leased → Draining. A leaf.
func (t *Table) DropPinned(blocks []Ref) (rest int) {
	if invariants.Enabled { // (a constant: production builds pay nothing, not even in inlining budget)
		if invariants.Sometimes(generalPercent) {
			t.pinGeneral(blocks, false)
			t.dropGeneral(blocks)
			return 0
		}
	}
	return t.dropPinnedFast(blocks)
}

// dropPinnedFast is DropPinned's loop.
func (t *Table) dropPinnedFast(blocks []Ref) int {
	slots := t.s
	leased, indexedLeased := headLeased, headIndexedLeased
	draining, indexedDraining := headDraining, headIndexedDraining
	i := len(blocks)
	for ; i > 0; i-- {
		s := &slots[blocks[i-1].ID]
		if s.gates() != 0 {
			break
		}
		if h := s.head(); h == leased {
			s.setHead(draining)
		} else if h == indexedLeased {
			s.setHead(indexedDraining)
		} else {
			break
		}
		s.pins = 1
	}
	n := len(blocks) - i
	t.counts[Leased] -= n
	t.counts[Draining] += n
	return i
}

// DropRest is Drop for the blocks it left.
func (t *Table) DropRest(blocks []Ref) { t.dropSlow(blocks) }

// dropGeneral is Drop by Unref.
func (t *Table) dropGeneral(blocks []Ref) {
	for i := len(blocks) - 1; i >= 0; i-- {
		t.Unref(blocks[i].ID)
	}
}

// dropFast is Drop's loop over its commonest cases, tail first, and
// returns how many blocks it left (from the first it could not take) and
// how many it freed.
// leased and draining are the heads it takes (headLeased and
// headDraining; DropTenant's tracked ones): a freed slot's head is
// headFree either way, charged to no one.
//
// Mirrors change(-1 ref) on a slot this lease alone holds, unsealed:
// Leased → Free when no transfer pins it (onto the free stack), Leased →
// Draining when only pending pins do. A leaf: with dropSlow's call in the
// same function the loop reloaded its slices from the stack every block.
func (t *Table) dropFast(blocks []Ref, leased, draining uint64) (int, int) {
	slots := t.s
	// The free stack never holds more than capacity ids, so its spare
	// capacity has room for every block: no append.
	room := t.free[:cap(t.free)]
	k0 := len(t.free)
	k, drained := k0, 0
	free := headFree
	i := len(blocks)
	for ; i > 0 && k < len(room); i-- {
		id := blocks[i-1].ID
		s := &slots[id]
		if s.head() != leased {
			break // shared, sealed or quarantined
		}
		if s.gates() == 0 {
			s.setHead(free)
			room[k] = id
			k++
		} else if s.quar == 0 {
			s.setHead(draining) // pending transfers still pin it
			drained++
		} else {
			break
		}
	}
	freed := k - k0
	t.free = t.free[:k] // (not room[:k]: its write barrier spilled the loop)
	t.counts[Leased] -= freed + drained
	t.counts[Free] += freed
	t.counts[Draining] += drained
	return i, freed
}

// dropSlow is Drop for blocks that may be shared, sealed or pinned: the
// cached case in a loop of its own (cacheFast, then cacheTracked for
// slots charged to a tenant), then, block by block, the same cases inline
// and change for anything else.
func (t *Table) dropSlow(blocks []Ref) {
	blocks = blocks[:t.cacheFast(blocks)]
	if t.tenantsOn {
		blocks = blocks[:t.cacheTracked(blocks)]
	}
	slots := t.s
	cached := 0
	indexedLeased, indexedCached := headIndexedLeased, headIndexedCached
	for i := len(blocks) - 1; i >= 0; i-- {
		id := blocks[i].ID
		s := &slots[id]
		if s.head() == indexedLeased && s.gates() == 0 {
			// cacheFast's case.
			s.setHead(indexedCached)
			t.lruPush(id)
			cached++
			continue
		}
		if s.head() == headIndexedLeasedT && s.gates() == 0 {
			// The same for a slot charged to a tenant: onto its tenant's
			// list too (tenantPush, written out for a tenant without a
			// reservation), and its reservation.
			s.setHead(headIndexedCachedT)
			if te := &t.tenants[t.ten[id]]; te.reserve == 0 {
				t.lruPush(id)
				te.list.head, te.list.tail = link(t.tlinks, te.list.head, te.list.tail, id)
				te.cached++
			} else {
				t.tenantPush(id)
			}
			cached++
			continue
		}
		if s.refs > 1 {
			// change(-1 ref) on a slot another open lease still holds:
			// its class (leased or quarantined) stays.
			s.refs--
			continue
		}
		t.change(id, -1, 0, 0, 0)
	}
	t.counts[Leased] -= cached
	t.counts[Cached] += cached
}

// cacheFast is dropSlow's loop over its commonest case, tail first (the
// release of prefix hits and sealed blocks), and returns how many blocks
// it left.
//
// Mirrors change(-1 ref) on a sealed, indexed slot this lease alone
// holds, no transfer pinning it: Leased → Cached, pushed at the LRU's
// most recent end. One loop with the LRU's ends in registers.
func (t *Table) cacheFast(blocks []Ref) int {
	if t.retUsed {
		return t.cacheClasses(blocks)
	}
	// Every slot is in the default class: its LRU is the only one.
	slots, links := t.s, t.links
	head, tail := t.lru[DefaultRetention].head, t.lru[DefaultRetention].tail
	leased, cached := headIndexedLeased, headIndexedCached
	i := len(blocks)
	for ; i > 0; i-- {
		id := blocks[i-1].ID
		s := &slots[id]
		if s.head() != leased || s.gates() != 0 {
			break
		}
		s.setHead(cached)
		head, tail = link(links, head, tail, id)
	}
	t.cachedRun(DefaultRetention, head, tail, len(blocks)-i)
	return i
}

// cacheClasses is cacheFast once retention classes are in use: one
// class's LRU in registers, the last block's; a block of another class
// ends the loop (dropSlow pushes it on its own list).
func (t *Table) cacheClasses(blocks []Ref) int {
	if len(blocks) == 0 {
		return 0
	}
	slots, links, rets := t.s, t.links, t.ret
	r := rets[blocks[len(blocks)-1].ID] & (NumRetention - 1)
	head, tail := t.lru[r].head, t.lru[r].tail
	leased, cached := headIndexedLeased, headIndexedCached
	i := len(blocks)
	for ; i > 0; i-- {
		id := blocks[i-1].ID
		s := &slots[id]
		if s.head() != leased || s.gates() != 0 || rets[id] != r {
			break
		}
		s.setHead(cached)
		head, tail = link(links, head, tail, id)
	}
	t.cachedRun(r, head, tail, len(blocks)-i)
	return i
}

// cachedRun stores class r's LRU ends back after a cache loop pushed n
// leased slots on it (now cached) and counts them. As with revivedRun, the
// two loops stay separate on purpose (cacheFast's never loads t.ret);
// only this once-per-call bookkeeping is shared.
func (t *Table) cachedRun(r uint8, head, tail int32, n int) {
	t.lru[r] = lruEnds{head, tail}
	if n > 0 {
		t.lruMask |= 1 << r
	}
	t.lruLen += n
	t.counts[Leased] -= n
	t.counts[Cached] += n
}

// PinPending adds one pending pin (a write pin too when write) to each
// slot of blocks, which an open lease holds.
//
// Mirrors Repin(PinNone → PinPending): change(+1 pin) on a held slot,
// whose class it cannot change (a lease's hold outranks a pending pin).
func (t *Table) PinPending(blocks []Ref, write bool) {
	if invariants.Enabled { // (a constant: production builds pay nothing, not even in inlining budget)
		if invariants.Sometimes(generalPercent) {
			t.pinGeneral(blocks, write)
			return
		}
	}
	var w int32
	if write {
		w = 1
	}
	pinPending(t.s, blocks, w)
}

// pinGeneral is PinPending by Repin.
func (t *Table) pinGeneral(blocks []Ref, write bool) {
	for _, r := range blocks {
		t.Repin(r.ID, PinNone, PinPending, write)
	}
}

// pinPending is PinPending's loop: a leaf, so that it keeps everything in
// registers (inlined into its caller it spilled its counter).
//
//go:noinline
func pinPending(slots []slot, blocks []Ref, w int32) {
	for _, r := range blocks {
		s := &slots[r.ID]
		s.pins++
		s.wpins += w
	}
}

// Resolve drops one pending pin from each slot of blocks, tail first: the
// common end of a transfer. The pin is a write pin when write, or, for a
// whole-lease attachment (whole), on the unsealed slots.
func (t *Table) Resolve(blocks []Ref, write, whole bool) {
	if invariants.Enabled { // (a constant: production builds pay nothing, not even in inlining budget)
		if invariants.Sometimes(generalPercent) {
			t.resolveGeneral(blocks, write, whole)
			return
		}
	}
	var w int32
	if write {
		w = 1
	}
	k0 := len(t.free)
	i, k := unpinFast(t.s, blocks, t.free[:cap(t.free)], k0, w, whole)
	t.free = t.free[:k]
	freed := k - k0
	t.counts[Draining] -= freed
	t.counts[Free] += freed
	t.resolveGeneral(blocks[:i], write, whole)
}

// resolveGeneral is Resolve by Repin, tail first.
func (t *Table) resolveGeneral(blocks []Ref, write, whole bool) {
	for i := len(blocks) - 1; i >= 0; i-- {
		id := blocks[i].ID
		t.Repin(id, PinPending, PinNone, write || (whole && !t.s[id].sealed))
	}
}

// unpinFast is Resolve's loop over its commonest case, tail first: it
// unpins each block onto the free stack room[k:] and stops before the
// first block outside the case, returning how many blocks are left (that
// one included) and the new top of room.
//
// Mirrors change(-1 pin) on a slot draining on this one pending pin alone
// (so unsealed: its write pin, if any, is w, or 1 for a whole-lease
// attachment): Draining → Free. A leaf.
func unpinFast(slots []slot, blocks []Ref, room []int32, k int, w int32, whole bool) (i, top int) {
	if whole {
		w = 1
	}
	draining, free, one := headDraining, headFree, gatesOnePin
	for i = len(blocks); i > 0 && k < len(room); i-- {
		id := blocks[i-1].ID
		s := &slots[id]
		if s.head() != draining || s.gates() != one {
			break
		}
		s.pins = 0
		s.wpins -= w
		s.setHead(free)
		room[k] = id
		k++
	}
	return i, k
}

// Revive adds an open lease's hold on the leading ids that are cached
// (prefix hits), writing each into dst[k] with its generation, and returns
// how many it did: it stops at the first id in any other class, or
// cached and charged to a tenant (the caller continues with RefHeld, or
// with Ref).
//
// Mirrors change(+1 ref) on a cached slot: Cached → Leased, off the LRU.
// One loop with the LRU's ends in registers.
func (t *Table) Revive(dst []Ref, ids []int32) int {
	if invariants.Enabled { // (a constant: production builds pay nothing, not even in inlining budget)
		if invariants.Sometimes(generalPercent) {
			return t.reviveGeneral(dst, ids)
		}
	}
	return t.reviveFast(dst, ids)
}

// reviveGeneral is Revive by Ref.
func (t *Table) reviveGeneral(dst []Ref, ids []int32) int {
	k := 0
	for ; k < len(ids) && k < len(dst) && t.s[ids[k]].class == Cached; k++ {
		t.Ref(ids[k])
		dst[k] = Ref{ID: ids[k], Gen: t.s[ids[k]].gen}
	}
	return k
}

// reviveFast is Revive's loop.
func (t *Table) reviveFast(dst []Ref, ids []int32) int {
	if t.retUsed {
		return t.reviveClasses(dst, ids)
	}
	// Every slot is in the default class: its LRU is the only one.
	k := 0
	slots, links := t.s, t.links
	head, tail := t.lru[DefaultRetention].head, t.lru[DefaultRetention].tail
	cachedHead := headIndexedCached
	for ; k < len(ids) && k < len(dst); k++ {
		id := ids[k]
		s := &slots[id]
		if s.head() != cachedHead { // (a tenant's cached slot too: tenantRemove)
			break
		}
		s.refs++
		s.class = Leased
		head, tail = unlink(links, head, tail, id)
		dst[k] = Ref{ID: id, Gen: s.gen}
	}
	t.revivedRun(DefaultRetention, head, tail, k)
	return k
}

// reviveClasses is reviveFast once retention classes are in use: one
// class's LRU in registers, the first hit's; a hit of another class ends
// the loop (the caller takes it by Ref).
func (t *Table) reviveClasses(dst []Ref, ids []int32) int {
	if len(ids) == 0 {
		return 0
	}
	k := 0
	slots, links, rets := t.s, t.links, t.ret
	r := rets[ids[0]] & (NumRetention - 1)
	head, tail := t.lru[r].head, t.lru[r].tail
	cachedHead := headIndexedCached
	for ; k < len(ids) && k < len(dst); k++ {
		id := ids[k]
		s := &slots[id]
		if s.head() != cachedHead || rets[id] != r {
			break
		}
		s.refs++
		s.class = Leased
		head, tail = unlink(links, head, tail, id)
		dst[k] = Ref{ID: id, Gen: s.gen}
	}
	t.revivedRun(r, head, tail, k)
	return k
}

// revivedRun stores class r's LRU ends back after a revive loop took k of
// its cached slots (now leased) and counts them. The two loops above stay
// separate on purpose: reviveFast's never loads t.ret, the per-slot class
// test reviveClasses needs; only this bookkeeping, once per call, is
// shared.
func (t *Table) revivedRun(r uint8, head, tail int32, k int) {
	t.lru[r] = lruEnds{head, tail}
	if head == Nil {
		t.lruMask &^= 1 << r
	}
	t.lruLen -= k
	t.counts[Cached] -= k
	t.counts[Leased] += k
}

// RefHeld adds an open lease's hold on the leading ids that another open
// lease holds (prefix hits on blocks in use), writing each into dst[k]
// with its generation, and returns how many it did: it stops at the first
// id no open lease holds.
//
// Mirrors change(+1 ref) on a held slot: its class (leased or
// quarantined) stays. A leaf loop.
func (t *Table) RefHeld(dst []Ref, ids []int32) int {
	if invariants.Enabled { // (a constant: production builds pay nothing, not even in inlining budget)
		if invariants.Sometimes(generalPercent) {
			return t.refHeldGeneral(dst, ids)
		}
	}
	return refHeld(t.s, dst, ids)
}

// refHeldGeneral is RefHeld by Ref.
func (t *Table) refHeldGeneral(dst []Ref, ids []int32) int {
	k := 0
	for ; k < len(ids) && k < len(dst) && t.s[ids[k]].refs > 0; k++ {
		t.Ref(ids[k])
		dst[k] = Ref{ID: ids[k], Gen: t.s[ids[k]].gen}
	}
	return k
}

// refHeld is RefHeld's loop.
func refHeld(slots []slot, dst []Ref, ids []int32) int {
	k := 0
	for ; k < len(ids) && k < len(dst); k++ {
		id := ids[k]
		s := &slots[id]
		if s.refs == 0 {
			break
		}
		s.refs++
		dst[k] = Ref{ID: id, Gen: s.gen}
	}
	return k
}

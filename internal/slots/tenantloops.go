package slots

import (
	"math/bits"

	"github.com/kvlease/kvlease/internal/invariants"
)

// The tenant-aware loops: take, evict, fill, admit and drop for a lease
// of a tenant (tenants.go keeps the registry, the charges and the
// per-tenant LRUs they use). Each fast loop names the case of the
// transition function it mirrors; checked builds take the general path
// sometimes (invariants.Sometimes), as fast.go's do.

// TakeFor is Take for a lease of tenant tn (0: none): the slot is charged
// to tn. A tenant at its cap takes its own least recently cached slot,
// even when others are free; otherwise the free stack's top, else the
// victim (see victim). The caller checked AvailableFor(tn) > 0 and, for a
// tenant, Room(tn) > 0.
func (t *Table) TakeFor(tn uint16) (r Ref, evicted bool) {
	if !t.tenantsOn {
		return t.Take()
	}
	return t.TakeTenant(tn)
}

// TakeTenant is TakeFor once a tenant was added: takeFor's commonest
// cases written out (BenchmarkQuotaChurn). A tenant at its cap takes its
// own least recently cached slot, which stays charged to it; others
// take the free stack's top or the head of the lowest class's list
// (takeShared). A victim in a reservation (reserved or parked) takes
// takeFor instead, before anything changes.
//
// Mirrors takeFor's at-cap case: change(+1 ref) on the head of the
// tenant's list, Cached → Leased, unreserved (tenantRemove's unreserved
// case: off its tenant's list and its class's), its charge unchanged.
func (t *Table) TakeTenant(tn uint16) (Ref, bool) {
	if invariants.Enabled { // (a constant: production builds pay nothing, not even in inlining budget)
		if invariants.Sometimes(generalPercent) {
			return t.takeFor(tn)
		}
	}
	te := &t.tenants[tn]
	if te.cap == 0 || te.held < te.cap { // ([0], no tenant, has no cap)
		return t.takeShared(tn)
	}
	id := te.list.head
	if id == Nil || t.s[id].flags != flagTracked {
		return t.takeFor(tn) // reserved or parked
	}
	s := &t.s[id]
	tl := t.tlinks
	next := tl[id].next // the head: no prev
	te.list.head = next
	if next == Nil {
		te.list.tail = Nil
	} else {
		tl[next].prev = Nil
	}
	te.cached--
	te.ownEvict++
	r := t.ret[id] & (NumRetention - 1)
	e := &t.lru[r]
	e.head, e.tail = unlink(t.links, e.head, e.tail, id)
	if e.head == Nil {
		t.lruMask &^= 1 << r
	}
	t.lruLen--
	gen := s.bumpGen()
	s.setHead(headLeasedT) // one reference, unsealed, unindexed, still tn's
	t.counts[Cached]--
	t.counts[Leased]++
	return Ref{ID: id, Gen: gen}, true
}

// takeShared is takeFor for tenant tn (0: none) under its cap: the free
// stack's top, else the head of the lowest class's list when no
// reservation keeps it (charged to another tenant, or to none).
//
// Mirrors takeFor: change(+1 ref) on a free slot (Free → Leased) or on
// an evicted cached one (Cached → Leased: off its class's list and, if
// charged, off its tenant's: tenantRemove's unreserved case), then
// charge(tn).
func (t *Table) takeShared(tn uint16) (Ref, bool) {
	var id int32
	evicted := false
	if n := len(t.free) - 1; n >= 0 {
		id = t.free[n]
		t.free = t.free[:n]
		t.counts[Free]--
	} else {
		r := bits.TrailingZeros8(t.lruMask) & (NumRetention - 1)
		id = t.lru[r].head
		if id == Nil || t.s[id].flags&(flagReserved|flagParked) != 0 {
			return t.takeFor(tn)
		}
		e := &t.lru[r]
		e.head, e.tail = unlink(t.links, e.head, e.tail, id)
		if e.head == Nil {
			t.lruMask &^= 1 << r
		}
		t.lruLen--
		if t.s[id].flags != 0 {
			u := t.ten[id]
			ue := &t.tenants[u]
			ue.list.head, ue.list.tail = unlink(t.tlinks, ue.list.head, ue.list.tail, id)
			ue.cached--
			ue.held--
			if u == tn {
				ue.ownEvict++
			} else {
				ue.evicted++
			}
		}
		t.counts[Cached]--
		evicted = true
	}
	s := &t.s[id]
	gen := s.bumpGen()
	t.counts[Leased]++
	if tn == 0 {
		s.setHead(headLeased) // one reference, unsealed, unindexed
	} else {
		s.setHead(headLeasedT)
		t.ten[id] = tn
		t.tenants[tn].held++
	}
	return Ref{ID: id, Gen: gen}, evicted
}

// EvictRun is TakeFor's eviction in one loop, for a fill of tenant tn
// (0: none) in a table with tenants, when its next slots are all
// evictions: nothing is free, or tn is at its cap. It takes up to
// len(dst) victims, lays them into dst from its end backwards (a chain
// is evicted tail first: see the root package's fillEvict) and returns
// how many it took; it stops early (the caller takes the rest one by one
// with TakeFor) at a victim in a reservation, or when a slot is free and
// tn is under its cap. (BenchmarkQuotaChurn: the per-block calls were
// most of what tenants cost an eviction.)
//
// Mirrors TakeTenant, block by block: change(+1 ref) on the victim,
// Cached → Leased (off its class's list and, if charged, its tenant's:
// tenantRemove's unreserved case), then charge(tn).
func (t *Table) EvictRun(dst []Ref, tn uint16) int {
	if invariants.Enabled { // (a constant: production builds pay nothing, not even in inlining budget)
		if invariants.Sometimes(generalPercent) {
			return 0
		}
	}
	te := &t.tenants[tn] // [0]: no tenant, no cap
	k := len(dst)
	if te.cap == 0 || te.held < te.cap {
		if len(t.free) > 0 {
			return 0
		}
		k = t.evictShared(dst, tn)
	}
	if k > 0 && te.cap > 0 && te.held >= te.cap {
		k = t.evictOwn(dst[:k], te)
	}
	return len(dst) - k
}

// evictOwn is EvictRun at tenant te's cap: its least recently cached
// slots, which stay charged to it, until one is reserved. It returns how
// many places of dst are left.
//
// Mirrors TakeTenant's at-cap case, block by block.
func (t *Table) evictOwn(dst []Ref, te *tenant) int {
	slots := t.s
	links, tlinks, rets := t.links[:len(slots)], t.tlinks[:len(slots)], t.ret[:len(slots)]
	k := len(dst)
	id := te.list.head
	for k > 0 && id != Nil {
		s := &slots[id]
		if s.flags != flagTracked {
			break // reserved or parked
		}
		next := tlinks[id].next
		r := rets[id] & (NumRetention - 1)
		e := &t.lru[r]
		e.head, e.tail = unlink(links, e.head, e.tail, id)
		if e.head == Nil {
			t.lruMask &^= 1 << r
		}
		gen := s.gen + 1
		if gen == 0 {
			gen = 1 // generation 0 is never handed out
		}
		s.gen = gen
		s.setHead(headLeasedT) // one reference, unsealed, unindexed, still its tenant's
		k--
		dst[k] = Ref{ID: id, Gen: gen}
		id = next
	}
	// The taken slots were the head of te's list: it starts at id now.
	te.list.head = id
	if id == Nil {
		te.list.tail = Nil
	} else {
		tlinks[id].prev = Nil
	}
	m := len(dst) - k
	te.cached -= m
	te.ownEvict += uint64(m)
	t.lruLen -= m
	t.counts[Cached] -= m
	t.counts[Leased] += m
	return k
}

// evictShared is EvictRun under tenant tn's cap with nothing free: the
// head of the lowest class's list, as long as no reservation keeps it
// and tn stays under its cap. It returns how many places of dst are
// left.
//
// Mirrors TakeTenant's takeShared eviction, block by block.
func (t *Table) evictShared(dst []Ref, tn uint16) int {
	slots := t.s
	links, tlinks, ten := t.links[:len(slots)], t.tlinks[:len(slots)], t.ten[:len(slots)]
	te := &t.tenants[tn]
	head := headLeasedT
	if tn == 0 {
		head = headLeased
	}
	k := len(dst)
	for k > 0 && (te.cap == 0 || te.held < te.cap) {
		r := bits.TrailingZeros8(t.lruMask) & (NumRetention - 1)
		e := &t.lru[r]
		id := e.head
		if id == Nil {
			break
		}
		s := &slots[id]
		f := s.flags
		if f&(flagReserved|flagParked) != 0 {
			break
		}
		e.head, e.tail = unlink(links, e.head, e.tail, id)
		if e.head == Nil {
			t.lruMask &^= 1 << r
		}
		if f != 0 {
			u := ten[id]
			ue := &t.tenants[u]
			ue.list.head, ue.list.tail = unlink(tlinks, ue.list.head, ue.list.tail, id)
			ue.cached--
			ue.held--
			if u == tn {
				ue.ownEvict++
			} else {
				ue.evicted++
			}
		}
		gen := s.gen + 1
		if gen == 0 {
			gen = 1 // generation 0 is never handed out
		}
		s.gen = gen
		s.setHead(head) // one reference, unsealed, unindexed
		if tn != 0 {
			ten[id] = tn
			te.held++
		}
		k--
		dst[k] = Ref{ID: id, Gen: gen}
	}
	m := len(dst) - k
	t.lruLen -= m
	t.counts[Cached] -= m
	t.counts[Leased] += m
	return k
}

// cacheTracked is dropSlow's loop over its commonest case for slots
// charged to a tenant, tail first, and returns how many blocks it left:
// the run of blocks charged to one tenant without a reservation, all of
// one retention class, each sealed, indexed and held by this lease
// alone with no transfer pinning it.
//
// Mirrors change(-1 ref) on such a slot: Leased → Cached, onto its
// class's list and its tenant's (tenantPush without a reservation). One
// loop with both lists' ends in registers.
func (t *Table) cacheTracked(blocks []Ref) int {
	if len(blocks) == 0 {
		return 0
	}
	last := blocks[len(blocks)-1].ID
	tn := t.ten[last]
	te := &t.tenants[tn]
	if t.s[last].flags != flagTracked || te.reserve != 0 {
		return len(blocks)
	}
	r := t.ret[last] & (NumRetention - 1)
	// Every per-slot slice resliced to the table's length, so that slots'
	// bounds check covers them all.
	slots := t.s
	links, tlinks, ten := t.links[:len(slots)], t.tlinks[:len(slots)], t.ten[:len(slots)]
	head, tail := t.lru[r].head, t.lru[r].tail
	thead, ttail := te.list.head, te.list.tail
	i := len(blocks)
	if !t.retUsed { // every slot in the default class (see cacheFast)
		for ; i > 0; i-- {
			id := blocks[i-1].ID
			s := &slots[id]
			if s.head() != headIndexedLeasedT || s.gates() != 0 || ten[id] != tn {
				break
			}
			s.setHead(headIndexedCachedT)
			head, tail = link(links, head, tail, id)
			thead, ttail = link(tlinks, thead, ttail, id)
		}
	} else {
		rets := t.ret[:len(slots)]
		for ; i > 0; i-- {
			id := blocks[i-1].ID
			s := &slots[id]
			if s.head() != headIndexedLeasedT || s.gates() != 0 || ten[id] != tn || rets[id] != r {
				break
			}
			s.setHead(headIndexedCachedT)
			head, tail = link(links, head, tail, id)
			thead, ttail = link(tlinks, thead, ttail, id)
		}
	}
	n := len(blocks) - i
	te.list = lruEnds{thead, ttail}
	te.cached += n
	t.cachedRun(r, head, tail, n)
	return i
}

// FillTenant is Fill for a lease of tenant tn (not 0): it hands out
// len(dst) slots off the free stack, charged to tn, when the stack holds
// them all and tn's cap leaves room for them without evicting its own;
// otherwise it returns false, changing nothing (the caller takes them one
// by one with TakeFor).
//
// Mirrors takeFor on a free slot: a generation bump, change(+1 ref)
// (Free → Leased) and charge(tn).
func (t *Table) FillTenant(dst []Ref, tn uint16) bool {
	if invariants.Enabled { // (a constant: production builds pay nothing, not even in inlining budget)
		if invariants.Sometimes(generalPercent) {
			return t.fillTenantGeneral(dst, tn)
		}
	}
	return t.fillTracked(dst, tn)
}

// Fits reports whether the free stack holds n slots and tenant tn's cap
// leaves room for them without evicting its own: FillTenant's case (and
// then Admits holds too).
func (t *Table) Fits(tn uint16, n int) bool {
	te := &t.tenants[tn]
	return len(t.free) >= n && (te.cap == 0 || te.held+n <= te.cap)
}

// fillTenantGeneral is FillTenant by takeFor.
func (t *Table) fillTenantGeneral(dst []Ref, tn uint16) bool {
	if !t.Fits(tn, len(dst)) {
		return false
	}
	for i := range dst {
		dst[i], _ = t.takeFor(tn)
	}
	return true
}

// FillFor is Fill for tenant tn: FillTenant, or Fill for 0.
func (t *Table) FillFor(dst []Ref, tn uint16) bool {
	if tn == 0 {
		return t.Fill(dst)
	}
	return t.FillTenant(dst, tn)
}

// fillTracked is FillTenant's test and loop: fillFast's loop, with the
// tracked head and the tenant's index stored, and its charge counted.
func (t *Table) fillTracked(dst []Ref, tn uint16) bool {
	n := len(dst)
	te := &t.tenants[tn]
	if len(t.free) < n || (te.cap != 0 && te.held+n > te.cap) { // (fits, with te kept)
		return false
	}
	// The bookkeeping first, so that nothing but the loop's own values is
	// live across it (with t and n live too, it spilled six registers a
	// block: BenchmarkQuotaCycle).
	top := len(t.free) - n
	ids := t.free[top:][:len(dst)]
	t.free = t.free[:top]
	t.counts[Free] -= n
	t.counts[Leased] += n
	te.held += n
	slots, ten := t.s, t.ten[:len(t.s)]
	head := headLeasedT
	for j := len(ids) - 1; j >= 0; j-- {
		id := ids[j]
		s := &slots[id]
		gen := s.gen + 1
		if gen == 0 {
			gen = 1 // generation 0 is never handed out
		}
		s.gen = gen
		s.setHead(head)
		ten[id] = tn
		dst[len(ids)-1-j] = Ref{ID: id, Gen: gen}
	}
	return true
}

// Admits reports whether a fill of n fresh slots for tenant tn (0: none)
// fits now: n ≤ AvailableFor(tn) and, for a tenant, n ≤ Room(tn). Small
// enough to inline into every acquire.
func (t *Table) Admits(tn uint16, n int) bool {
	avail := len(t.free) + t.lruLen - t.reservedAll
	if tn == 0 {
		return avail >= n
	}
	return t.admitsTenant(tn, n, avail)
}

func (t *Table) admitsTenant(tn uint16, n, avail int) bool {
	te := &t.tenants[tn]
	return avail+te.reserved >= n && (te.cap == 0 || te.cap-te.held+te.cached >= n)
}

// DropTenant is Drop for the blocks of a lease of tenant tn (not 0),
// whose fresh blocks are charged to tn: the same loop with the tracked
// heads, each slot freed uncharged. It returns how many blocks it left,
// for DropRest.
func (t *Table) DropTenant(blocks []Ref, tn uint16) (rest int) {
	if invariants.Enabled {
		if invariants.Sometimes(generalPercent) {
			t.dropGeneral(blocks)
			return 0
		}
	}
	rest, freed := t.dropFast(blocks, headLeasedT, headDrainingT)
	t.tenants[tn].held -= freed
	return rest
}

// HitsCost says what reviving the cached slots among ids (prefix hits;
// the others change nothing) costs a fill for tenant tn (0: none):
// lost, how many fewer slots AvailableFor(tn) counts afterwards, and own,
// how many of them are tn's own cached slots (Room counts that many
// fewer). A hit on a slot another tenant reserves costs nothing unless
// that tenant has an unreserved cached slot to reserve instead. ids holds
// no slot twice. O(len(ids)).
func (t *Table) HitsCost(tn uint16, ids []int32) (lost, own int) {
	var buf [8]uint16
	touched := buf[:0]
	for _, id := range ids {
		s := &t.s[id]
		if s.class != Cached {
			continue
		}
		lost++
		if s.flags == 0 {
			continue
		}
		u := t.ten[id]
		te := &t.tenants[u]
		if te.scratch == 0 {
			touched = append(touched, u)
		}
		te.scratch++
		if u == tn {
			own++
		}
	}
	for _, u := range touched {
		te := &t.tenants[u]
		// Once revived, the tenant's reservation is min(reserve, what
		// stays cached): the slots it gives back become available.
		if u != tn {
			lost -= te.reserved - min(te.reserve, te.cached-te.scratch)
		}
		te.scratch = 0
	}
	return lost, own
}

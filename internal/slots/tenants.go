package slots

import (
	"math"
	"math/bits"
)

// Tenants and their quotas.
//
// A slot handed out fresh to a lease of a tenant is charged to that
// tenant until it is free again (flagTracked, its index in ten): leased,
// draining, quarantined or cached, it counts in the tenant's held slots;
// cached, also in its cached slots. A prefix hit or a share does not move
// the charge; an eviction moves it to the evicting lease's tenant (or to
// none), and an offer to a lower tier (Offer) ends it. Slots of no tenant
// carry no flags and take the untracked loops exactly as before.
//
// A tenant's quota is a cap and a reservation:
//
//   - Cap: a tenant that holds cap slots takes every further fresh slot
//     from its own cached slots, least recently cached first (atCap), even
//     when others are free. Room says how many fresh slots the cap lets it
//     take now (cap − held + cached: its cached slots it may evict); the
//     caller refuses a fill beyond it before changing anything.
//   - Reservation: the newest min(reserve, cached) of a tenant's cached
//     slots are reserved (flagReserved): an eviction for another tenant,
//     or for no tenant, never takes them. Every cached slot stays on its
//     class's list in the order it was cached; an eviction that finds a
//     reserved slot of someone else at the head of a list parks it
//     (flagParked: off the list, still on its tenant's list), so each
//     cached slot is passed at most once. A parked slot that leaves its
//     reservation (its tenant cached newer slots) goes back to the front
//     of its class's list: it is older than everything on it.
//
// Each tenant keeps its cached slots on a list of its own, least recently
// cached first (tlinks), with the first reserved one marked (bound): the
// reservation is the list's suffix from bound. Every operation is O(1)
// per slot; parking is amortised (a slot is parked at most once each time
// it is cached).

// The tenant flags of a slot (slot.flags).
const (
	flagTracked  uint8 = 1 << iota // charged to tenant ten[id]
	flagReserved                   // cached, one of its tenant's newest reserve cached slots
	flagParked                     // reserved, off its class's list: an eviction passed it
)

// MaxTenants is the most tenants a table keeps: an index is a uint16, and
// 0 is no tenant.
const MaxTenants = math.MaxUint16

// tenant is one tenant's charges and quota.
type tenant struct {
	held     int     // slots charged to it that are not free
	cached   int     // of them, cached
	reserved int     // of them, reserved: always min(reserve, cached)
	cap      int     // 0: no cap
	reserve  int     // 0: no reservation
	list     lruEnds // its cached slots, least recently cached first
	bound    int32   // its oldest reserved slot (where the reserved suffix starts), Nil when none
	scratch  int     // HitsCost's count of the tenant's hits; zero between calls
	evicted  uint64  // its cached slots evicted for another tenant's fill (or none's)
	ownEvict uint64  // its cached slots evicted for its own fills
}

// tenantTable is the part of a Table that tenants use; embedded in Table.
type tenantTable struct {
	ten         []uint16  // per slot: the tenant charged (meaningful while flagTracked)
	tlinks      []lruLink // per slot: its place on its tenant's list (while cached and tracked)
	tenants     []tenant  // [0] is no tenant and stays zero
	reservedAll int       // the sum of every tenant's reserved
	tenantsOn   bool      // AddTenant was called: evictions take takeFor
}

// The heads of tracked slots the tenant-aware loops compare against.
var (
	headLeasedT        = (&slot{refs: 1, class: Leased, flags: flagTracked}).head()
	headDrainingT      = (&slot{class: Draining, flags: flagTracked}).head()
	headIndexedLeasedT = (&slot{refs: 1, class: Leased, sealed: true, index: true, flags: flagTracked}).head()
	headIndexedCachedT = (&slot{class: Cached, sealed: true, index: true, flags: flagTracked}).head()
)

// AddTenant adds a tenant with no quota and returns its index (from 1),
// or false when MaxTenants are kept already.
func (t *Table) AddTenant() (uint16, bool) {
	if t.tenants == nil {
		t.tenants = make([]tenant, 1, 8)
		t.tenants[0].bound = Nil
		t.ten = make([]uint16, len(t.s))
		t.tlinks = make([]lruLink, len(t.s))
		for i := range t.tlinks {
			t.tlinks[i] = lruLink{Nil, Nil}
		}
	}
	if len(t.tenants) > MaxTenants {
		return 0, false
	}
	t.tenants = append(t.tenants, tenant{list: lruEnds{Nil, Nil}, bound: Nil})
	t.tenantsOn = true
	return uint16(len(t.tenants) - 1), true
}

// Tenants is the number of tenants added.
func (t *Table) Tenants() int { return max(len(t.tenants)-1, 0) }

// SetQuota sets tenant tn's cap and reservation (0: none; neither
// negative). The reservation takes or gives back cached slots at once:
// O(the change).
func (t *Table) SetQuota(tn uint16, cap, reserve int) {
	te := &t.tenants[tn]
	te.cap, te.reserve = cap, reserve
	for te.reserved > te.reserve {
		t.demote(te)
	}
	for te.reserved < min(te.reserve, te.cached) {
		t.promote(te)
	}
}

// Quota is tenant tn's cap and reservation.
func (t *Table) Quota(tn uint16) (cap, reserve int) {
	te := &t.tenants[tn]
	return te.cap, te.reserve
}

// TenantCounts are tenant tn's held (not free), cached and reserved slots.
func (t *Table) TenantCounts(tn uint16) (held, cached, reserved int) {
	te := &t.tenants[tn]
	return te.held, te.cached, te.reserved
}

// TenantEvictions are how many of tenant tn's cached slots were evicted
// for other fills (another tenant's, or no tenant's) and for its own.
func (t *Table) TenantEvictions(tn uint16) (others, own uint64) {
	te := &t.tenants[tn]
	return te.evicted, te.ownEvict
}

// TenantOf is the tenant slot id is charged to (0: none).
func (t *Table) TenantOf(id int32) uint16 {
	if t.s[id].flags&flagTracked == 0 {
		return 0
	}
	return t.ten[id]
}

// Reserved reports whether slot id is cached within its tenant's
// reservation.
func (t *Table) Reserved(id int32) bool { return t.s[id].flags&flagReserved != 0 }

// Room is how many fresh slots tenant tn's cap lets it take now: its cap
// less what it holds, plus its cached slots (a tenant at its cap evicts
// its own). math.MaxInt without a cap; negative when it holds more than
// its cap (a cap lowered under it) in use.
func (t *Table) Room(tn uint16) int {
	te := &t.tenants[tn]
	if te.cap == 0 {
		return math.MaxInt
	}
	return te.cap - te.held + te.cached
}

// AvailableFor is how many slots a fill for tenant tn (0: none) could
// take: free, plus cached ones no other tenant's reservation keeps.
// (Its cap is Room's business.)
func (t *Table) AvailableFor(tn uint16) int {
	return t.Available() + t.tenants[tn].reserved
}

// atCap reports whether tenant tn (not 0) holds its cap or more: its next
// fresh slot is its own least recently cached.
func (t *Table) atCap(tn uint16) bool {
	te := &t.tenants[tn]
	return te.cap > 0 && te.held >= te.cap
}

// charge moves slot id's charge to tenant tn (0: none). The slot is held
// and not cached.
func (t *Table) charge(id int32, tn uint16) {
	s := &t.s[id]
	if s.flags&flagTracked != 0 {
		t.tenants[t.ten[id]].held--
	}
	if tn == 0 {
		s.flags = 0
		return
	}
	s.flags = flagTracked
	t.ten[id] = tn
	t.tenants[tn].held++
}

// uncharge ends slot id's charge: it became free.
func (t *Table) uncharge(id int32) {
	t.tenants[t.ten[id]].held--
	t.s[id].flags = 0
}

// tenantPush is lruPush for a tracked slot that just became cached: it
// joins its class's list and, as the most recent, its tenant's list and
// reservation (whose oldest slot leaves it when it is full).
func (t *Table) tenantPush(id int32) {
	te := &t.tenants[t.ten[id]]
	te.list.head, te.list.tail = link(t.tlinks, te.list.head, te.list.tail, id)
	te.cached++
	t.lruPush(id)
	if te.reserve == 0 {
		return
	}
	t.s[id].flags |= flagReserved
	te.reserved++
	t.reservedAll++
	if te.bound == Nil {
		te.bound = id
	}
	if te.reserved > te.reserve {
		t.demote(te)
	}
}

// tenantRemove is lruRemove for a tracked cached slot leaving the cache
// (a hit, an eviction, an offer, a reset): off its class's list (unless
// parked) and its tenant's; a reserved slot's place in the reservation
// goes to the tenant's newest unreserved cached slot, if any.
func (t *Table) tenantRemove(id int32) {
	s := &t.s[id]
	te := &t.tenants[t.ten[id]]
	if s.flags&flagParked != 0 {
		t.lruLen--
	} else {
		t.lruRemove(id)
	}
	if te.bound == id {
		te.bound = t.tlinks[id].next
	}
	te.list.head, te.list.tail = unlink(t.tlinks, te.list.head, te.list.tail, id)
	te.cached--
	reserved := s.flags&flagReserved != 0
	s.flags = flagTracked
	if reserved {
		te.reserved--
		t.reservedAll--
		t.promote(te)
	}
}

// demote takes te's oldest reserved slot out of its reservation; a parked
// one goes back to the front of its class's list.
func (t *Table) demote(te *tenant) {
	b := te.bound
	te.bound = t.tlinks[b].next
	te.reserved--
	t.reservedAll--
	s := &t.s[b]
	if s.flags&flagParked != 0 {
		r := t.ret[b]
		e := &t.lru[r]
		e.head, e.tail = linkFront(t.links, e.head, e.tail, b)
		t.lruMask |= 1 << r
	}
	s.flags &^= flagReserved | flagParked
}

// promote adds te's newest unreserved cached slot, if any, to its
// reservation (it stays where it is on its class's list).
func (t *Table) promote(te *tenant) {
	p := te.list.tail
	if te.bound != Nil {
		p = t.tlinks[te.bound].prev
	}
	if p == Nil {
		return
	}
	t.s[p].flags |= flagReserved
	te.bound = p
	te.reserved++
	t.reservedAll++
}

// victim is the cached slot an eviction for tenant tn (0: none) takes
// when nothing is free and tn is under its cap: the head of the lowest
// class's list whose slot no other tenant reserves (reserved heads of
// others are parked on the way), else, when every list is empty, tn's own
// least recently cached slot (all parked then). Nil when there is none:
// the caller checked AvailableFor.
func (t *Table) victim(tn uint16) int32 {
	for t.lruMask != 0 {
		r := bits.TrailingZeros8(t.lruMask)
		id := t.lru[r].head
		if f := t.s[id].flags; f&flagReserved == 0 || (tn != 0 && t.ten[id] == tn) {
			return id
		}
		e := &t.lru[r]
		e.head, e.tail = unlink(t.links, e.head, e.tail, id)
		if e.head == Nil {
			t.lruMask &^= 1 << r
		}
		t.s[id].flags |= flagParked // (still counted in lruLen)
	}
	if tn != 0 {
		return t.tenants[tn].list.head
	}
	return Nil
}

// parkedHead is a parked slot when there is one, else Nil. O(tenants).
func (t *Table) parkedHead() int32 {
	if t.reservedAll == 0 {
		return Nil
	}
	for tn := range t.tenants {
		for id := t.tenants[tn].bound; id != Nil; id = t.tlinks[id].next {
			if t.s[id].flags&flagParked != 0 {
				return id
			}
		}
	}
	return Nil
}

// parkedIn counts the parked slots of retention class r. O(reserved).
func (t *Table) parkedIn(r uint8) int {
	n := 0
	if t.reservedAll == 0 {
		return 0
	}
	for tn := range t.tenants {
		for id := t.tenants[tn].bound; id != Nil; id = t.tlinks[id].next {
			if t.s[id].flags&flagParked != 0 && t.ret[id] == r {
				n++
			}
		}
	}
	return n
}

// linkFront puts id at the least recently used end of the LRU whose ends
// are head and tail, and returns the new ends (see link).
func linkFront(links []lruLink, head, tail, id int32) (int32, int32) {
	links[id] = lruLink{Nil, head}
	if head == Nil {
		tail = id
	} else {
		links[head].prev = id
	}
	return id, tail
}

// checkTenants is Check's part for tenants: charges, flags, lists and
// reservations agree with the slots. It returns how many slots are
// parked (they are cached but on no class's list).
func (t *Table) checkTenants(bad func(format string, args ...any)) (parked int) {
	held := make([]int, len(t.tenants))
	cached := make([]int, len(t.tenants))
	for i := range t.s {
		s := &t.s[i]
		f := s.flags
		if f == 0 {
			continue
		}
		if f&flagTracked == 0 || f&^(flagTracked|flagReserved|flagParked) != 0 {
			bad("slot %d: tenant flags %03b", i, f)
			continue
		}
		tn := int(t.ten[i])
		if tn == 0 || tn >= len(t.tenants) {
			bad("slot %d: charged to tenant %d of %d", i, tn, len(t.tenants)-1)
			continue
		}
		if s.class == Free {
			bad("slot %d: free but charged to tenant %d", i, tn)
		}
		held[tn]++
		if s.class == Cached {
			cached[tn]++
		} else if f&(flagReserved|flagParked) != 0 {
			bad("slot %d: %v but reserved or parked (flags %03b)", i, s.class, f)
		}
		if f&flagParked != 0 {
			parked++
			if f&flagReserved == 0 {
				bad("slot %d: parked but not reserved", i)
			}
		}
	}
	all := 0
	for tn := 1; tn < len(t.tenants); tn++ {
		te := &t.tenants[tn]
		if te.held != held[tn] || te.cached != cached[tn] {
			bad("tenant %d: held %d cached %d counted, slots say %d %d", tn, te.held, te.cached, held[tn], cached[tn])
		}
		if want := min(te.reserve, te.cached); te.reserved != want {
			bad("tenant %d: %d reserved, want min(reserve %d, cached %d)", tn, te.reserved, te.reserve, te.cached)
		}
		all += te.reserved
		// The list: its cached slots in order, the reserved suffix from bound.
		prev, n, inRes, res := Nil, 0, false, 0
		for id := te.list.head; id != Nil && n <= len(t.s); id = t.tlinks[id].next {
			if t.tlinks[id].prev != prev {
				bad("tenant %d: slot %d links back to %d, not %d", tn, id, t.tlinks[id].prev, prev)
			}
			if t.s[id].class != Cached || t.TenantOf(id) != uint16(tn) {
				bad("tenant %d: listed slot %d is %v of tenant %d", tn, id, t.s[id].class, t.TenantOf(id))
			}
			if id == te.bound {
				inRes = true
			}
			if r := t.s[id].flags&flagReserved != 0; r != inRes {
				bad("tenant %d: slot %d reserved=%v, the reservation starts at %d", tn, id, r, te.bound)
			} else if r {
				res++
			}
			prev = id
			n++
		}
		if prev != te.list.tail || n != te.cached || res != te.reserved {
			bad("tenant %d: list ends at %d (tail %d), %d listed, %d reserved; counted %d cached, %d reserved",
				tn, prev, te.list.tail, n, res, te.cached, te.reserved)
		}
	}
	if all != t.reservedAll {
		bad("%d slots reserved, counted %d", all, t.reservedAll)
	}
	return parked
}

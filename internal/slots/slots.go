// Package slots is a kvlease pool's slot table: the one home of block
// state. It owns, per block, the holds (open leases, pending and
// quarantined transfer pins, write pins), the sealed and indexed flags and
// the generation, and for the table the free stack, the LRU of cached
// blocks and the per-class counts. Nothing outside it writes a slot.
//
// Every change of a slot's holds goes through one transition function,
// change: it applies the deltas and settles the slot into the class its
// holds imply (free, cached, leased, draining, quarantined), moving it
// between the free stack and the LRU. The loops that run for every block
// of every lease (fill, drop, pin, resolve, revive) are hand-written
// fast paths for the commonest cases; each says which case of change it
// mirrors, and in checked builds (internal/invariants) each sometimes
// takes the general path instead, so that the tests and fuzzers of the
// root package prove the two equal.
//
// Contiguous runs: a fill hands out the free stack from the top down
// (dst[0] is the top), and Drop, Resolve and the general path push freed
// slots tail first, so a lease's blocks given back as an ascending run of
// ids sit on the stack with the lowest on top and come back to the next
// fill as the same ascending run. This keeps the free space in runs at no
// cost per block (the root package's AppendRuns reports a lease's runs).
//
// The table is not safe for concurrent use: the pool's mutex guards it.
package slots

import (
	"fmt"
	"math/bits"
	"unsafe"

	"github.com/kvlease/kvlease/internal/invariants"
)

// Ref is a slot at a generation: the layout of kvlease.BlockRef.
type Ref struct {
	ID  int32
	Gen uint32
}

// Nil is the id of no slot (an empty LRU end).
const Nil = int32(-1)

// Class is the one state of rule 7 a slot is counted in. When several
// apply, the first in this order wins: quarantined, leased, draining,
// cached, free.
type Class uint8

// The classes.
const (
	Free        Class = iota // unheld, nothing worth keeping: on the free stack
	Cached                   // unheld, findable sealed content: on the LRU
	Leased                   // an open lease holds it
	Draining                 // only pending transfer pins hold it
	Quarantined              // a quarantined transfer pins it
	NumClasses
)

var classNames = [NumClasses]string{"free", "cached", "leased", "draining", "quarantined"}

func (c Class) String() string {
	if c < NumClasses {
		return classNames[c]
	}
	return "class(?)"
}

// Pin is the state of a transfer pin on a slot: the transfer states that
// hold blocks (pending, quarantined) and None (resolved: no pin).
type Pin uint8

// The pin states.
const (
	PinNone Pin = iota
	PinPending
	PinQuarantined
)

// slot is the per-block state.
//
// The first eight bytes (refs, class, sealed, index and the tenant
// flags) are the slot's head. The fast loops read and write the head as
// one word (see head): a fresh private block of no tenant is exactly
// headLeased, a returned one exactly headFree. Keep those fields first
// and together. A slot charged to a tenant has flagTracked set, so no
// head the untracked loops compare against matches it: they leave it to
// the general path or to the tenant-aware loops (tenants.go).
type slot struct {
	refs   int32 // open leases holding the block (a lease counts once per position)
	class  Class // also says which list an unheld slot is on: free stack or LRU
	sealed bool  // content immutable from now on
	index  bool  // the prefix index maps a hash to this slot
	flags  uint8 // tenant flags (tenants.go); zero for a slot charged to no tenant

	pins  int32  // pending transfer pins
	quar  int32  // quarantined transfer pins
	gen   uint32 // bumped each time the slot is handed out fresh
	wpins int32  // pending or quarantined *write* pins (content in flux)
}

// head returns the slot's first eight bytes as one word.
func (s *slot) head() uint64 { return *(*uint64)(unsafe.Pointer(s)) }

// setHead overwrites refs, class, sealed and index at once.
func (s *slot) setHead(w uint64) { *(*uint64)(unsafe.Pointer(s)) = w }

// gates returns pins and quar as one word: zero when no transfer pins
// the slot.
func (s *slot) gates() uint64 { return *(*uint64)(unsafe.Pointer(&s.pins)) }

// The head is the eight bytes before pins, and quar follows pins: a
// compile-time check of what head and gates rely on.
const (
	_ = uint(unsafe.Offsetof(slot{}.pins) - 8)
	_ = uint(8 - unsafe.Offsetof(slot{}.pins))
	_ = uint(unsafe.Offsetof(slot{}.quar) - 12)
	_ = uint(12 - unsafe.Offsetof(slot{}.quar))
)

// The heads the fast paths compare against and store (the byte order is
// the machine's, so they are computed, not written as constants).
var (
	headLeased          = (&slot{refs: 1, class: Leased}).head()
	headFree            = (&slot{class: Free}).head()
	headDraining        = (&slot{class: Draining}).head()
	headIndexedLeased   = (&slot{refs: 1, class: Leased, sealed: true, index: true}).head()
	headIndexedCached   = (&slot{class: Cached, sealed: true, index: true}).head()
	headIndexedDraining = (&slot{class: Draining, sealed: true, index: true}).head()
	gatesOnePin         = (&slot{pins: 1}).gates()
)

func (s *slot) held() bool { return s.refs > 0 || s.pins > 0 || s.quar > 0 }

// classify is the class the slot's holds imply.
func (s *slot) classify() Class {
	switch {
	case s.quar > 0:
		return Quarantined
	case s.refs > 0:
		return Leased
	case s.pins > 0:
		return Draining
	case s.index:
		return Cached // unheld findable content lives on the LRU
	default:
		return Free
	}
}

// lruLink is a slot's place on its class's LRU (only while it is cached).
type lruLink struct{ prev, next int32 }

// Retention classes. Cached slots sit on one LRU per class; an eviction
// takes the least recently used slot of the lowest class that has one
// (a bit mask of the non-empty lists finds it in one instruction), so
// every operation stays O(1). A slot's class is set when it is sealed
// (SetRetention) and kept while its content is.
const (
	NumRetention     = 8 // classes 0 (evicted first) to 7
	DefaultRetention = 4 // the class of a slot sealed without one
)

// lruEnds are one LRU's ends.
type lruEnds struct{ head, tail int32 }

// Table is the slot table of one pool. The zero value is empty; Init
// sizes it.
type Table struct {
	s     []slot
	links []lruLink // parallel to s
	free  []int32   // stack of free slots; top at the end

	lru     [NumRetention]lruEnds // per retention class: least recently unreferenced first
	lruMask uint8                 // bit r set: lru[r] is not empty
	lruLen  int                   // cached slots: on the lists, or parked (tenants.go)
	ret     []uint8               // per slot: its retention class (parallel to s)
	// retUsed: a slot was given a class other than the default. Until
	// then every cached slot is on the default class's LRU, and the fast
	// loops run as with one LRU, reading no class.
	retUsed bool

	tenantTable // per-tenant charges and quotas (tenants.go)

	counts     [NumClasses]int
	quarLeased int // quarantined slots an open lease still holds
}

// Init makes a table of n free slots, the lowest ids on top of the free
// stack (the first fill gets slot 0).
func (t *Table) Init(n int) {
	t.s = make([]slot, n)
	t.links = make([]lruLink, n)
	t.free = make([]int32, n)
	t.ret = make([]uint8, n)
	for i := range t.free {
		t.free[i] = int32(n - 1 - i)
		t.links[i] = lruLink{Nil, Nil}
		t.ret[i] = DefaultRetention
	}
	for r := range t.lru {
		t.lru[r] = lruEnds{Nil, Nil}
	}
	t.counts = [NumClasses]int{Free: n}
}

// Len is the number of slots.
func (t *Table) Len() int { return len(t.s) }

// Available is how many slots a fill of no tenant could take: free plus
// cached, less the cached slots tenants' reservations keep (AvailableFor).
func (t *Table) Available() int { return len(t.free) + t.lruLen - t.reservedAll }

// FreeLen is the number of free slots.
func (t *Table) FreeLen() int { return len(t.free) }

// LRULen is the number of cached slots (Evictable: those no
// reservation keeps).
func (t *Table) LRULen() int { return t.lruLen }

// Evictable is the number of cached slots an eviction for no tenant may
// take: those no tenant's reservation keeps.
func (t *Table) Evictable() int { return t.lruLen - t.reservedAll }

// LRUHead is the least recently unreferenced cached slot of the lowest
// retention class that has one on its list, or, when none has, a slot a
// reservation keeps off the lists (parked), or Nil when nothing is
// cached. Without tenants it is the next slot an eviction takes.
func (t *Table) LRUHead() int32 {
	if t.lruMask == 0 {
		return t.parkedHead()
	}
	return t.lru[bits.TrailingZeros8(t.lruMask)].head
}

// SetRetention sets slot id's retention class (below NumRetention). A
// cached slot moves to the most recently used end of its new class's LRU.
// (Inlined into every seal: the change itself is out of line.)
//
// Until a slot is first given another class than the default, every slot
// is in the default class, and a seal need not set it: RetentionUsed
// tells.
func (t *Table) SetRetention(id int32, r uint8) {
	if t.ret[id] != r {
		t.setRetention(id, r)
	}
}

// SetRetentionWhere gives class r to every slot match accepts. Cached
// slots keep their recency order: they are walked oldest first in each
// other class's list and join r's list as its most recent in that order,
// so a chain released tail first still leaves from its end. Other slots
// only take the class (it applies when they are next cached). O(slots);
// match is called with the table's owner's lock held.
func (t *Table) SetRetentionWhere(r uint8, match func(id int32) bool) {
	var moved []int32
	for c := range t.lru {
		if uint8(c) == r {
			continue
		}
		for id := t.lru[c].head; id != Nil; id = t.links[id].next {
			if match(id) {
				moved = append(moved, id)
			}
		}
	}
	for _, id := range moved {
		t.setRetention(id, r)
	}
	for id := range t.ret {
		if t.ret[id] != r && (t.s[id].class != Cached || t.s[id].flags&flagParked != 0) && match(int32(id)) {
			t.setRetention(int32(id), r) // (a parked slot is on no class's list)
		}
	}
}

// RetentionUsed reports whether any slot was ever given a class other
// than the default.
func (t *Table) RetentionUsed() bool { return t.retUsed }

func (t *Table) setRetention(id int32, r uint8) {
	t.retUsed = true
	if s := &t.s[id]; s.class == Cached && s.flags&flagParked == 0 {
		t.lruRemove(id)
		t.ret[id] = r
		t.lruPush(id)
		return
	}
	t.ret[id] = r
}

// CachedIn is the number of cached slots of retention class r, parked
// ones included. O(cached).
func (t *Table) CachedIn(r uint8) int {
	n := 0
	for id := t.lru[r].head; id != Nil; id = t.links[id].next {
		n++
	}
	return n + t.parkedIn(r)
}

// Count is the number of slots in class c.
func (t *Table) Count(c Class) int { return t.counts[c] }

// QuarantinedCount is Count(Quarantined).
func (t *Table) QuarantinedCount() int { return t.counts[Quarantined] }

// QuarantinedLeased is the number of quarantined slots an open lease
// holds.
func (t *Table) QuarantinedLeased() int { return t.quarLeased }

// Gen is slot id's generation.
func (t *Table) Gen(id int32) uint32 { return t.s[id].gen }

// ClassOf is slot id's class.
func (t *Table) ClassOf(id int32) Class { return t.s[id].class }

// Sealed reports whether slot id's content is immutable.
func (t *Table) Sealed(id int32) bool { return t.s[id].sealed }

// Indexed reports whether the prefix index maps a hash to slot id.
func (t *Table) Indexed(id int32) bool { return t.s[id].index }

// Refs is the number of open leases holding slot id.
func (t *Table) Refs(id int32) int32 { return t.s[id].refs }

// Quarantined reports whether a quarantined transfer pins slot id.
func (t *Table) Quarantined(id int32) bool { return t.s[id].quar > 0 }

// Writing reports whether a pending or quarantined write pins slot id:
// its content is not known.
func (t *Table) Writing(id int32) bool { return t.s[id].wpins > 0 }

// View is a read-only view of the slots for a lookup's loop: copy it into
// a local so that the loop keeps the table in registers.
type View struct{ s []slot }

// View returns the table's view.
func (t *Table) View() View { return View{t.s} }

// Probe returns what a prefix lookup asks of slot id: its write pins
// (content in flux: no hit) and its class (a hit on a cached slot takes
// it off the LRU).
func (v View) Probe(id int32) (wpins int32, class Class) {
	s := &v.s[id]
	return s.wpins, s.class
}

// change is the table's one transition function: it adds the deltas to
// slot id's holds and settles the slot into the class they imply, moving
// it between the free stack and the LRU and keeping the counts. A slot
// that becomes free forfeits its content (it is unsealed). Every other
// writer of holds is a fast path that says which case of change it
// mirrors.
func (t *Table) change(id int32, refs, pins, quar, wpins int32) {
	s := &t.s[id]
	ql := s.quar > 0 && s.refs > 0
	s.refs += refs
	s.pins += pins
	s.quar += quar
	s.wpins += wpins
	if invariants.Enabled && (s.refs < 0 || s.pins < 0 || s.quar < 0 || s.wpins < 0) {
		panic(fmt.Sprintf("kvlease: slot %d: negative holds refs=%d pins=%d quar=%d wpins=%d",
			id, s.refs, s.pins, s.quar, s.wpins))
	}
	if q := s.quar > 0 && s.refs > 0; q != ql {
		if q {
			t.quarLeased++
		} else {
			t.quarLeased--
		}
	}
	t.settle(id)
}

// settle moves slot id into the class its holds imply (see change).
func (t *Table) settle(id int32) {
	s := &t.s[id]
	old, next := s.class, s.classify()
	if old == next {
		return
	}
	switch old {
	case Cached:
		if s.flags != 0 {
			t.tenantRemove(id) // off its tenant's list too
		} else {
			t.lruRemove(id)
		}
	case Free:
		t.freeRemove(id)
	}
	switch next {
	case Cached:
		if s.flags != 0 {
			t.tenantPush(id)
		} else {
			t.lruPush(id)
		}
	case Free:
		s.sealed = false // nothing worth keeping: its content is forfeit
		if s.flags != 0 {
			t.uncharge(id) // a free slot is charged to no one
		}
		t.free = append(t.free, id)
	}
	s.class = next
	t.counts[old]--
	t.counts[next]++
}

// freeRemove takes id off the free stack: the top when a fill takes it.
func (t *Table) freeRemove(id int32) {
	n := len(t.free) - 1
	if t.free[n] != id {
		for i, x := range t.free {
			if x == id {
				t.free[i], t.free[n] = t.free[n], x
				break
			}
		}
	}
	t.free = t.free[:n]
}

// link and unlink are the only writers of the LRU's links: every push
// and removal, general or fast, goes through them. They take the LRU's
// ends and return them, so that a loop keeps the ends in registers.

// link appends id at the most recently used end of the LRU whose ends
// are head and tail, and returns the new ends.
func link(links []lruLink, head, tail, id int32) (int32, int32) {
	links[id] = lruLink{tail, Nil}
	if tail == Nil {
		head = id
	} else {
		links[tail].next = id
	}
	return head, id
}

// unlink takes id off the LRU whose ends are head and tail, and returns
// the new ends.
func unlink(links []lruLink, head, tail, id int32) (int32, int32) {
	l := &links[id]
	prev, next := l.prev, l.next
	if prev == Nil {
		head = next
	} else {
		links[prev].next = next
	}
	if next == Nil {
		tail = prev
	} else {
		links[next].prev = prev
	}
	*l = lruLink{Nil, Nil}
	return head, tail
}

// lruPush appends id at the most recently used end of its class's LRU.
func (t *Table) lruPush(id int32) {
	r := t.ret[id]
	e := &t.lru[r]
	e.head, e.tail = link(t.links, e.head, e.tail, id)
	t.lruMask |= 1 << r
	t.lruLen++
}

// lruRemove takes id off its class's LRU.
func (t *Table) lruRemove(id int32) {
	r := t.ret[id]
	e := &t.lru[r]
	e.head, e.tail = unlink(t.links, e.head, e.tail, id)
	if e.head == Nil {
		t.lruMask &^= 1 << r
	}
	t.lruLen--
}

// bumpGen moves slot id to its next generation (0 is never handed out).
func (s *slot) bumpGen() uint32 {
	s.gen++
	if s.gen == 0 {
		s.gen = 1
	}
	return s.gen
}

// Take hands out one slot fresh to an open lease: the top of the free
// stack, else the least recently used cached slot, which is evicted (its
// content forfeit: unsealed and unindexed; the caller takes its hash out
// of the prefix index and reports evicted). The slot moves to its next
// generation. The caller checked Available() > 0. A table with tenants
// takes with TakeFor (or TakeTenant): Take knows no reservation.
func (t *Table) Take() (r Ref, evicted bool) {
	if invariants.Enabled { // (a constant: production builds pay nothing, not even in inlining budget)
		if t.tenantsOn {
			panic("kvlease: Take on a slot table with tenants: TakeFor")
		}
		if invariants.Sometimes(generalPercent) {
			return t.takeGeneral()
		}
	}
	return t.takeFast()
}

// takeGeneral is Take by change (TakeFor's general path for no tenant).
func (t *Table) takeGeneral() (r Ref, evicted bool) { return t.takeFor(0) }

// takeFor hands out one slot fresh to a lease of tenant tn (0: none) by
// change: the top of the free stack, else an eviction's victim (see
// victim), or, for a tenant at its cap, its own least recently cached
// slot whatever is free; the slot is charged to tn from now on.
func (t *Table) takeFor(tn uint16) (r Ref, evicted bool) {
	var id int32
	switch {
	case tn != 0 && t.atCap(tn):
		id = t.tenants[tn].list.head
	case len(t.free) > 0:
		id = t.free[len(t.free)-1]
	default:
		id = t.victim(tn)
	}
	s := &t.s[id]
	if s.class == Cached {
		s.index, s.sealed = false, false
		evicted = true
		if s.flags != 0 {
			if u := &t.tenants[t.ten[id]]; t.ten[id] == tn {
				u.ownEvict++
			} else {
				u.evicted++
			}
		}
	}
	gen := s.bumpGen()
	t.change(id, 1, 0, 0, 0)
	t.charge(id, tn)
	return Ref{ID: id, Gen: gen}, evicted
}

// Offer hands the cached slot an eviction for no tenant would take (see
// victim) to an open lease without evicting its content: it leaves the
// index (unindexed) but stays sealed at its generation, and is charged
// to no tenant from now on (it leaves the cache for a lower tier). The
// caller takes its hash out of the prefix index. Evictable() > 0.
func (t *Table) Offer() Ref {
	id := t.victim(0)
	s := &t.s[id]
	s.index = false
	t.change(id, 1, 0, 0, 0)
	t.charge(id, 0)
	return Ref{ID: id, Gen: s.gen}
}

// Ref adds an open lease's hold on slot id (a prefix hit, a share).
func (t *Table) Ref(id int32) { t.change(id, 1, 0, 0, 0) }

// Unref drops an open lease's hold on slot id.
func (t *Table) Unref(id int32) { t.change(id, -1, 0, 0, 0) }

// Repin moves one transfer pin on slot id from state from to state to
// (a pin added: from PinNone; resolved: to PinNone); write says whether
// it is a write pin.
func (t *Table) Repin(id int32, from, to Pin, write bool) {
	var pins, quar, w int32
	switch from {
	case PinPending:
		pins--
	case PinQuarantined:
		quar--
	}
	switch to {
	case PinPending:
		pins++
	case PinQuarantined:
		quar++
	}
	if write && (from == PinNone) != (to == PinNone) {
		w = 1
		if to == PinNone {
			w = -1
		}
	}
	t.change(id, 0, pins, quar, w)
}

// Seal marks slot id's content immutable.
func (t *Table) Seal(id int32) { t.s[id].sealed = true }

// SetIndexed records whether the prefix index maps a hash to slot id. A
// cached slot that leaves the index becomes free (its content forfeit).
func (t *Table) SetIndexed(id int32, on bool) {
	s := &t.s[id]
	s.index = on
	if s.class >= Leased {
		return // held: the index flag cannot change its class (settle's first case)
	}
	t.settle(id)
}

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
// The table is not safe for concurrent use: the pool's mutex guards it.
package slots

import (
	"fmt"
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
// The first eight bytes (refs, class, sealed, index and a zero pad) are
// the slot's head. The fast loops read and write the head as one word
// (see head): a fresh private block is exactly headLeased, a returned one
// exactly headFree. Keep those fields first and together.
type slot struct {
	refs   int32 // open leases holding the block (a lease counts once per position)
	class  Class // also says which list an unheld slot is on: free stack or LRU
	sealed bool  // content immutable from now on
	index  bool  // the prefix index maps a hash to this slot
	_      uint8 // always zero: part of the head word

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

// lruLink is a slot's place on the LRU (only while it is cached).
type lruLink struct{ prev, next int32 }

// Table is the slot table of one pool. The zero value is empty; Init
// sizes it.
type Table struct {
	s     []slot
	links []lruLink // parallel to s
	free  []int32   // stack of free slots; top at the end

	head, tail int32 // the LRU: least recently unreferenced first
	lruLen     int

	counts     [NumClasses]int
	quarLeased int // quarantined slots an open lease still holds
}

// Init makes a table of n free slots, the lowest ids on top of the free
// stack (the first fill gets slot 0).
func (t *Table) Init(n int) {
	t.s = make([]slot, n)
	t.links = make([]lruLink, n)
	t.free = make([]int32, n)
	for i := range t.free {
		t.free[i] = int32(n - 1 - i)
		t.links[i] = lruLink{Nil, Nil}
	}
	t.head, t.tail = Nil, Nil
	t.counts = [NumClasses]int{Free: n}
}

// Len is the number of slots.
func (t *Table) Len() int { return len(t.s) }

// Available is how many slots a fill could take: free plus cached.
func (t *Table) Available() int { return len(t.free) + t.lruLen }

// FreeLen is the number of free slots.
func (t *Table) FreeLen() int { return len(t.free) }

// LRULen is the number of cached slots.
func (t *Table) LRULen() int { return t.lruLen }

// LRUHead is the least recently unreferenced cached slot, or Nil.
func (t *Table) LRUHead() int32 { return t.head }

// Count is the number of slots in class c.
func (t *Table) Count(c Class) int { return t.counts[c] }

// QuarantinedCount is Count(Quarantined).
func (t *Table) QuarantinedCount() int { return t.counts[Quarantined] }

// Counts is the number of slots in each class.
func (t *Table) Counts() [NumClasses]int { return t.counts }

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
		t.lruRemove(id)
	case Free:
		t.freeRemove(id)
	}
	switch next {
	case Cached:
		t.lruPush(id)
	case Free:
		s.sealed = false // nothing worth keeping: its content is forfeit
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

// lruPush appends id at the most recently used end.
func (t *Table) lruPush(id int32) {
	t.head, t.tail = link(t.links, t.head, t.tail, id)
	t.lruLen++
}

// lruRemove takes id off the LRU.
func (t *Table) lruRemove(id int32) {
	t.head, t.tail = unlink(t.links, t.head, t.tail, id)
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
// generation. The caller checked Available() > 0.
func (t *Table) Take() (r Ref, evicted bool) {
	if invariants.Enabled { // (a constant: production builds pay nothing, not even in inlining budget)
		if invariants.Sometimes(generalPercent) {
			return t.takeGeneral()
		}
	}
	return t.takeFast()
}

// takeGeneral is Take by change.
func (t *Table) takeGeneral() (r Ref, evicted bool) {
	var id int32
	if n := len(t.free); n > 0 {
		id = t.free[n-1]
	} else {
		id = t.head
		s := &t.s[id]
		s.index, s.sealed = false, false
		evicted = true
	}
	gen := t.s[id].bumpGen()
	t.change(id, 1, 0, 0, 0)
	return Ref{ID: id, Gen: gen}, evicted
}

// Offer hands the least recently used cached slot to an open lease
// without evicting its content: it leaves the index (unindexed) but stays
// sealed at its generation. The caller takes its hash out of the prefix
// index. The LRU is not empty.
func (t *Table) Offer() Ref {
	id := t.head
	s := &t.s[id]
	s.index = false
	t.change(id, 1, 0, 0, 0)
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

// SetGen sets slot id's generation: tests use it to wrap generations.
func (t *Table) SetGen(id int32, gen uint32) { t.s[id].gen = gen }

package kvlease

import (
	"fmt"
	"unsafe"
)

// BlockID names a block slot of a pool: an index in [0, capacity).
type BlockID int32

// BlockRef names the content of a slot at one generation. A slot's
// generation changes every time it is handed out fresh (taken from the free
// list or evicted from the cache), so a BlockRef kept past that point is
// detected as stale (ErrStaleRef) instead of silently naming someone else's
// data. A prefix-cache hit shares the same content and keeps the generation.
// Generation 0 is never handed out.
type BlockRef struct {
	ID  BlockID
	Gen uint32
}

func (r BlockRef) String() string { return fmt.Sprintf("%d@%d", r.ID, r.Gen) }

// blockClass is the one state of rule 7 a slot is counted in. When several
// apply, the first in Stats' order wins: quarantined, leased, draining,
// cached, free.
type blockClass uint8

const (
	classFree blockClass = iota
	classCached
	classLeased
	classDraining
	classQuarantined
	numClasses
)

var classNames = [numClasses]string{"free", "cached", "leased", "draining", "quarantined"}

func (c blockClass) String() string { return classNames[c] }

const nilID = BlockID(-1)

// slot is the per-block state, one entry of the pool's table indexed by
// BlockID. Everything is guarded by the pool's mutex.
//
// A slot is held while refs+pins+quar > 0. An unheld slot is on exactly one
// list, which its class names: the free stack (classFree), or the LRU when
// it holds findable sealed content (classCached).
//
// The first eight bytes (refs, class, sealed, index and a zero pad) are the
// slot's head. The loops that run for every block of every lease (fill,
// drop, the resolve of a transfer) read and write the head as one word
// (see head): a fresh private block is exactly headLeased, a returned one
// exactly headFree. Keep those fields first and together.
type slot struct {
	refs   int32      // open leases holding the block (a lease counts once per position)
	class  blockClass // also says which list an unheld slot is on: free stack or LRU
	sealed bool       // content immutable from now on
	index  bool       // the prefix index maps hash to this slot
	_      uint8      // always zero: part of the head word

	pins  int32  // pending transfer attachments gating the block
	quar  int32  // quarantined transfer attachments gating the block
	gen   uint32 // bumped each time the slot is handed out fresh
	wpins int32  // pending or quarantined *write* attachments (content in flux)
}

// head returns the slot's first eight bytes as one word.
func (s *slot) head() uint64 { return *(*uint64)(unsafe.Pointer(s)) }

// setHead overwrites refs, class, sealed and index at once with a word
// made by headOf.
func (s *slot) setHead(w uint64) { *(*uint64)(unsafe.Pointer(s)) = w }

// gates returns pins and quar as one word: zero when no transfer gates
// the slot.
func (s *slot) gates() uint64 { return *(*uint64)(unsafe.Pointer(&s.pins)) }

// headOf returns the head word of a slot with these fields (the byte
// order is the machine's, so it is computed, not written as a constant).
func headOf(refs int32, class blockClass) uint64 {
	s := slot{refs: refs, class: class}
	return s.head()
}

// The head is the eight bytes before pins, and quar follows pins: a
// compile-time check of what head and gates rely on.
const (
	_ = uint(unsafe.Offsetof(slot{}.pins) - 8)
	_ = uint(8 - unsafe.Offsetof(slot{}.pins))
	_ = uint(unsafe.Offsetof(slot{}.quar) - 12)
	_ = uint(12 - unsafe.Offsetof(slot{}.quar))
)

// The heads the fast paths compare against and store: unsealed and
// unindexed, with one reference (a block a single lease holds), or none.
var (
	headLeased   = headOf(1, classLeased)
	headFree     = headOf(0, classFree)
	headDraining = headOf(0, classDraining)
	// A sealed, indexed block one lease holds, and the same cached.
	headIndexedLeased = (&slot{refs: 1, class: classLeased, sealed: true, index: true}).head()
	headIndexedCached = (&slot{class: classCached, sealed: true, index: true}).head()
	// gatesOnePin is gates() of a slot with one pending pin and no
	// quarantined one.
	gatesOnePin = (&slot{pins: 1}).gates()
)

// prefixSlot is the per-block state only the prefix cache uses, kept apart
// from slot so that the table the hot path walks stays small (24 bytes a
// block). Guarded by the pool's mutex; indexed by BlockID like slots.
type prefixSlot struct {
	hash BlockHash // valid while the slot is sealed
	mark uint32    // probe stamp: catches a block named twice in one lookup
	// LRU links (only while the slot is on the LRU).
	prev, next BlockID
}

func (s *slot) held() bool { return s.refs > 0 || s.pins > 0 || s.quar > 0 }

func (s *slot) classify() blockClass {
	switch {
	case s.quar > 0:
		return classQuarantined
	case s.refs > 0:
		return classLeased
	case s.pins > 0:
		return classDraining
	case s.index:
		return classCached // unheld findable content lives on the LRU
	default:
		return classFree
	}
}

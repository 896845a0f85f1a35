package kvlease

import (
	"fmt"
	"unsafe"

	"github.com/kvlease/kvlease/internal/invariants"
)

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

// The head is the eight bytes before pins, and quar follows pins: a
// compile-time check of what head and gates rely on.
const (
	_ = uint(unsafe.Offsetof(slot{}.pins) - 8)
	_ = uint(8 - unsafe.Offsetof(slot{}.pins))
	_ = uint(unsafe.Offsetof(slot{}.quar) - 12)
	_ = uint(12 - unsafe.Offsetof(slot{}.quar))
)

func (c *core) available() int { return len(c.free) + c.lruLen }

// fill fills dst with fresh blocks. The caller checked available() ≥
// len(dst).
func (c *core) fill(dst []BlockRef, ev *outbox) {
	n := len(dst)
	if len(c.free) < n {
		for i := range dst {
			dst[i] = c.takeFresh(ev, n-i)
		}
		return
	}
	// Fast path: pop n ids off the free stack. A free slot is unheld,
	// unsealed and unindexed: only its generation and head change.
	top := len(c.free) - n
	ids := c.free[top:][:len(dst)]
	slots := c.slots
	for i, id := range ids {
		s := &slots[id]
		gen := s.gen + 1
		if gen == 0 {
			gen = 1 // generation 0 is never handed out
		}
		s.gen = gen
		s.setHead(headLeased)
		dst[i] = BlockRef{ID: id, Gen: gen}
	}
	c.free = c.free[:top]
	c.counts[classFree] -= n
	c.counts[classLeased] += n
}

// takeFresh hands out one block fresh: the top of the free stack, else the
// least recently used cached block (evicted: its content is forfeit and it
// leaves the prefix index, or is first offered to the eviction hook when
// the cache can spare it: see SetEvictHook). need counts this block and
// the ones the caller still has to take. The caller checked available() ≥
// need.
func (c *core) takeFresh(ev *outbox, need int) BlockRef {
	var id BlockID
	if n := len(c.free); n > 0 {
		id = c.free[n-1]
		c.free = c.free[:n-1]
		c.counts[classFree]--
	} else {
		if c.hook != nil {
			c.offerVictim(need, ev)
		}
		id = c.lruPopHead()
		c.counts[classCached]--
		c.evict(id)
	}
	s := &c.slots[id]
	s.gen++
	if s.gen == 0 {
		s.gen = 1
	}
	s.refs, s.class = 1, classLeased
	c.counts[classLeased]++
	return BlockRef{ID: id, Gen: s.gen}
}

// settleSlot re-derives slot id's state after its holds changed. A slot
// nobody holds any more goes to the LRU when it holds findable sealed
// content, else to the free stack (its content is forfeit). Called with
// c.mu held.
func (c *core) settleSlot(id BlockID) {
	s := &c.slots[id]
	if invariants.Enabled && (s.refs < 0 || s.pins < 0 || s.quar < 0 || s.wpins < 0) {
		panic(fmt.Sprintf("kvlease: slot %d: negative hold counts refs=%d pins=%d quar=%d wpins=%d",
			id, s.refs, s.pins, s.quar, s.wpins))
	}
	old, next := s.class, s.class
	switch {
	case s.refs|s.pins|s.quar != 0:
		next = s.classify()
	case s.index:
		// Findable sealed content nobody holds: cached, most recent.
		c.lruPush(id)
		next = classCached
	default:
		// Nothing worth keeping: its content is forfeit.
		if s.sealed {
			c.unseal(id)
		}
		c.free = append(c.free, id)
		next = classFree
	}
	if next != old {
		s.class = next
		c.counts[old]--
		c.counts[next]++
	}
}

// drop releases one reference to each block, tail first, so that a
// chain's last block becomes the least recently used. Blocks nobody else
// holds go back at once. Called with c.mu held.
//
// The common cases, a private unsealed block that no transfer gates (it
// goes straight onto the free stack) or that pending transfers gate (it
// drains), run in a loop of their own that tests and writes each slot's
// head as one word: this runs for every block of every lease, and the
// general loop cost twice the instructions (callgrind). The first block
// that is neither hands the rest to dropSlow.
func (c *core) drop(blocks []BlockRef) {
	if i := c.dropFast(blocks); i > 0 {
		c.dropSlow(blocks[:i])
	}
}

// dropFast is drop's loop over the common cases, tail first: a block this
// lease alone holds, unsealed, goes onto the free stack when no transfer
// gates it and drains when only pending ones do. It stops at the first
// block that is neither and returns how many blocks are left for
// dropSlow. It calls nothing, so that its loop keeps everything in
// registers (with dropSlow's call in the same function, the loop reloaded
// its slices from the stack: callgrind).
func (c *core) dropFast(blocks []BlockRef) int {
	slots := c.slots
	// The free stack never holds more than capacity ids, so its spare
	// capacity has room for every block: no append.
	room := c.free[:cap(c.free)]
	k0 := len(c.free)
	k, drained := k0, 0
	leased, free, draining := headLeased, headFree, headDraining
	i := len(blocks)
	for ; i > 0 && k < len(room); i-- {
		id := blocks[i-1].ID
		s := &slots[id]
		if s.head() != leased {
			break // shared, sealed or quarantined
		}
		// Leased by this lease alone, unsealed.
		if s.gates() == 0 {
			s.setHead(free)
			room[k] = id
			k++
		} else if s.quar == 0 {
			s.setHead(draining) // pending transfers still gate it
			drained++
		} else {
			break
		}
	}
	freed := k - k0
	c.free = c.free[:k] // (not room[:k]: its write barrier spilled the loop)
	c.counts[classLeased] -= freed + drained
	c.counts[classFree] += freed
	c.counts[classDraining] += drained
	return i
}

// dropSlow is drop for blocks that may be shared, sealed or gated. The
// common outcomes are settleSlot's, spelled out inline with the counts
// batched; anything else goes through settleSlot. Locals keep the slice
// headers in registers: the compiler cannot prove the slot stores leave
// c.free alone.
func (c *core) dropSlow(blocks []BlockRef) {
	blocks = blocks[:c.cacheFast(blocks)]
	slots, free := c.slots, c.free
	freed, drained, cached := 0, 0, 0
	indexedLeased, indexedCached := headIndexedLeased, headIndexedCached
	for i := len(blocks) - 1; i >= 0; i-- {
		id := blocks[i].ID
		s := &slots[id]
		if s.head() == indexedLeased && s.gates() == 0 {
			// The common case of a prefix hit or a sealed block: findable
			// content this lease alone held. Cached, most recent.
			s.setHead(indexedCached)
			c.lruPush(id)
			cached++
			continue
		}
		s.refs--
		switch {
		case s.refs|s.pins|s.quar == 0 && !s.sealed: // (indexed implies sealed)
			// Private and unsealed: it was counted as leased.
			free = append(free, id)
			s.class = classFree
			freed++
		case s.refs|s.pins|s.quar == 0 && s.index:
			// Findable sealed content nobody holds: cached, most recent.
			c.lruPush(id)
			s.class = classCached
			cached++
		case s.refs > 0 && s.class == classLeased:
			// Another open lease still holds it.
		case s.refs|s.quar == 0 && s.pins > 0 && s.class == classLeased:
			// Gated by a pending transfer: it drains.
			s.class = classDraining
			drained++
		default:
			if s.quar > 0 && s.refs == 0 {
				c.quarLeased-- // it held the last reference
			}
			c.free = free
			c.settleSlot(id)
			free = c.free
		}
	}
	c.free = free
	c.counts[classLeased] -= freed + drained + cached
	c.counts[classFree] += freed
	c.counts[classCached] += cached
	c.counts[classDraining] += drained
}

// cacheFast is dropSlow's loop over its most common case, tail first: a
// sealed, indexed block its lease alone held, no transfer gating it, is
// cached (pushed at the LRU's most recent end). It stops at the first
// block with any other outcome and returns how many blocks are left. One
// loop with the LRU's tail in a register. Called with c.mu held.
func (c *core) cacheFast(blocks []BlockRef) int {
	slots, pre := c.slots, c.pre
	head, tail := c.lruHead, c.lruTail
	leased, cached := headIndexedLeased, headIndexedCached
	i := len(blocks)
	for ; i > 0; i-- {
		id := blocks[i-1].ID
		s := &slots[id]
		if s.head() != leased || s.gates() != 0 {
			break
		}
		s.setHead(cached)
		p := &pre[id]
		p.prev, p.next = tail, nilID
		if tail == nilID {
			head = id
		} else {
			pre[tail].next = id
		}
		tail = id
	}
	n := len(blocks) - i
	c.lruHead, c.lruTail = head, tail
	c.lruLen += n
	c.counts[classLeased] -= n
	c.counts[classCached] += n
	return i
}

// lruPush appends id at the most recently used end.
func (c *core) lruPush(id BlockID) {
	p := &c.pre[id]
	p.prev, p.next = c.lruTail, nilID
	if c.lruTail == nilID {
		c.lruHead = id
	} else {
		c.pre[c.lruTail].next = id
	}
	c.lruTail = id
	c.lruLen++
}

// lruPopHead takes the least recently used block off the LRU (which is
// not empty) and returns it: lruRemove of the head, whose prev is known.
func (c *core) lruPopHead() BlockID {
	id := c.lruHead
	p := &c.pre[id]
	next := p.next
	c.lruHead = next
	if next == nilID {
		c.lruTail = nilID
	} else {
		c.pre[next].prev = nilID
	}
	p.next = nilID // (p.prev is nilID already)
	c.lruLen--
	return id
}

func (c *core) lruRemove(id BlockID) {
	p := &c.pre[id]
	if p.prev == nilID {
		c.lruHead = p.next
	} else {
		c.pre[p.prev].next = p.next
	}
	if p.next == nilID {
		c.lruTail = p.prev
	} else {
		c.pre[p.next].prev = p.prev
	}
	p.prev, p.next = nilID, nilID
	c.lruLen--
}

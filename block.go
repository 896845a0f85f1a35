package kvlease

import "fmt"

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
type slot struct {
	gen   uint32 // bumped each time the slot is handed out fresh
	refs  int32  // open leases holding the block (a lease counts once per position)
	pins  int32  // pending transfer attachments gating the block
	quar  int32  // quarantined transfer attachments gating the block
	wpins int32  // pending or quarantined *write* attachments (content in flux)

	class  blockClass // also says which list an unheld slot is on: free stack or LRU
	sealed bool       // content immutable from now on
	index  bool       // the prefix index maps hash to this slot
}

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

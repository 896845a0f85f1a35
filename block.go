package kvlease

import (
	"fmt"
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

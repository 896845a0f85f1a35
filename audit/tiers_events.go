package audit

import (
	"slices"

	"github.com/kvlease/kvlease"
)

type blockInfo struct {
	parent kvlease.BlockHash
	first  bool
	tokens []int32
}

// tierBlockTokens is the tiers audit's block size in tokens.
const tierBlockTokens = 4

// addChain records a chain's blocks; hashes[k] is the block of tokens
// toks[4k:4k+4] under hashes[k-1] (seed for k == 0).
func (r *tiersRun[D]) addChain(seed kvlease.BlockHash, toks []int32, hashes []kvlease.BlockHash) {
	for k, h := range hashes {
		info := blockInfo{parent: seed, first: k == 0, tokens: toks[tierBlockTokens*k : tierBlockTokens*(k+1)]}
		if k > 0 {
			info.parent = hashes[k-1]
		}
		r.blocks[h] = info
	}
}

// drainEvents applies each tier's KV events to its view and checks each:
// a block of the workload, stored with its tokens and, when it names a
// parent, the right one. A ring that overflowed resynchronises the view
// from the pool's snapshot (counted, not a violation).
func (r *tiersRun[D]) drainEvents() {
	for t, src := range r.cache.EventSources() {
		evs, dropped := src.Pool.DrainKVEvents(nil)
		view := r.views[t]
		if dropped > 0 {
			r.rep.EventDrops += int(dropped)
			_, snap := src.Pool.SnapshotKVBlocks(nil)
			clear(view)
			for _, e := range snap {
				view[e.BlockHash] = true
			}
			continue
		}
		for _, e := range evs {
			r.rep.Events++
			switch e.Kind {
			case kvlease.KVAllBlocksCleared:
				clear(view)
			case kvlease.KVBlockRemoved:
				delete(view, e.BlockHash)
			case kvlease.KVBlockStored:
				view[e.BlockHash] = true
				info, ok := r.blocks[e.BlockHash]
				switch {
				case !ok:
					r.violate(&r.rep.Other, "%s stored an unknown block %016x", src.Medium, uint64(e.BlockHash))
				case e.HasParent && (info.first || e.ParentBlockHash != info.parent):
					r.violate(&r.rep.Other, "%s stored %016x under parent %016x, not its own", src.Medium, uint64(e.BlockHash), uint64(e.ParentBlockHash))
				case e.TokenIDs == nil:
					r.violate(&r.rep.Other, "%s stored %016x without its tokens", src.Medium, uint64(e.BlockHash))
				case !slices.Equal(e.TokenIDs, info.tokens) || e.HasParent == info.first:
					r.violate(&r.rep.Other, "%s stored %016x with tokens %v (parent named: %v), want %v", src.Medium, uint64(e.BlockHash), e.TokenIDs, e.HasParent, info.tokens)
				}
			}
		}
	}
}

// checkViews compares each tier's replayed events with what its pool can
// actually serve (at rest: nothing changes meanwhile).
func (r *tiersRun[D]) checkViews() {
	for t, src := range r.cache.EventSources() {
		_, snap := src.Pool.SnapshotKVBlocks(nil)
		if len(snap) != len(r.views[t]) {
			r.violate(&r.rep.Other, "%s events say %d blocks are findable, the pool has %d", src.Medium, len(r.views[t]), len(snap))
			continue
		}
		for _, e := range snap {
			if h := e.BlockHash; !r.views[t][h] {
				r.violate(&r.rep.Other, "%s pool serves %016x, its events never stored it", src.Medium, uint64(h))
				break
			}
		}
	}
}

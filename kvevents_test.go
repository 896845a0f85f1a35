package kvlease

import (
	"errors"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// The first block of a chain carries no parent whether it was sealed with
// Seal or SealTokens; later blocks name theirs.
func TestKVEventsFirstBlockHasNoParent(t *testing.T) {
	toks := prompt(1, 32)
	hs := ChainHashes(9, toks, 16)
	for _, tokens := range []bool{false, true} {
		p := newTestPool(t, 4, WithBlockTokens(16), WithKVEvents(16))
		a, err := p.Acquire("a", 2)
		require.NoError(t, err)
		if tokens {
			_, err = a.SealTokens(0, 9, toks[:16])
			require.NoError(t, err)
			_, err = a.SealTokens(1, hs[0], toks[16:])
			require.NoError(t, err)
		} else {
			require.NoError(t, a.Seal(0, hs[0]))
			require.NoError(t, a.Seal(1, hs[1]))
		}
		evs, _ := p.DrainKVEvents(nil)
		require.Len(t, evs, 2)
		require.False(t, evs[0].HasParent, "tokens=%v", tokens)
		require.Zero(t, evs[0].ParentBlockHash)
		require.True(t, evs[1].HasParent)
		require.Equal(t, hs[0], evs[1].ParentBlockHash)
		a.Release()
	}
}

// SnapshotKVBlocks re-announces every findable block with its parent and
// tokens, parents first, and leaves out what was evicted.
func TestSnapshotKVBlocks(t *testing.T) {
	p := newTestPool(t, 6, WithBlockTokens(4), WithKVEvents(64))
	seq, snap := p.SnapshotKVBlocks(nil)
	require.Zero(t, seq)
	require.Empty(t, snap)

	toks := prompt(3, 12)
	hs := ChainHashes(1, toks, 4)
	a, err := p.Acquire("a", 3)
	require.NoError(t, err)
	parent := BlockHash(1)
	for i := range 3 {
		h, err := a.SealTokens(i, parent, toks[4*i:4*i+4])
		require.NoError(t, err)
		parent = h
	}
	b, err := p.Acquire("b", 1)
	require.NoError(t, err)
	require.NoError(t, b.Seal(0, 77)) // no tokens
	seq, snap = p.SnapshotKVBlocks(nil)
	require.EqualValues(t, 4, seq)
	require.Len(t, snap, 4)
	pos := map[BlockHash]int{}
	for i, e := range snap {
		require.Equal(t, KVBlockStored, e.Kind)
		pos[e.BlockHash] = i
	}
	require.Less(t, pos[hs[0]], pos[hs[1]])
	require.Less(t, pos[hs[1]], pos[hs[2]])
	e := snap[pos[hs[2]]]
	require.Equal(t, KVEvent{Kind: KVBlockStored, BlockHash: hs[2], ParentBlockHash: hs[1], HasParent: true,
		TokenIDs: toks[8:12], BlockSize: 4}, e)
	require.False(t, snap[pos[hs[0]]].HasParent)
	require.Empty(t, snap[pos[77]].TokenIDs)

	a.Release()
	b.Release()
	x, err := p.Acquire("x", 4) // evicts the two least recent: the tail of a's chain
	require.NoError(t, err)
	_, snap = p.SnapshotKVBlocks(snap[:0])
	require.Len(t, snap, 2)
	require.ElementsMatch(t, []BlockHash{hs[0], 77}, []BlockHash{snap[0].BlockHash, snap[1].BlockHash})
	x.Release()
}

// SealAs places a block in its chain whatever its place in the lease:
// block 0 of a lease can name its parent, a later block can start a
// chain; with tokens, the checks are SealTokens'.
func TestSealAsPlacesTheBlock(t *testing.T) {
	toks := prompt(1, 48)
	hs := ChainHashes(9, toks, 16)
	p := newTestPool(t, 4, WithBlockTokens(16), WithKVEvents(16))
	l, err := p.Acquire("tier", 3)
	require.NoError(t, err)
	// A tier's lease of blocks from two places in one chain: block 2 of
	// the chain first, then its first block.
	require.NoError(t, l.SealAs(0, SealInfo{Hash: hs[2], Parent: hs[1], HasParent: true, Chained: true, Tokens: toks[32:48]}))
	require.NoError(t, l.SealAs(1, SealInfo{Hash: hs[0], Parent: 9, HasParent: true, Tokens: toks[:16]}))
	err = l.SealAs(2, SealInfo{Hash: hs[1], Parent: hs[0], HasParent: true, Chained: true, Tokens: toks[:3]})
	require.True(t, errors.Is(err, ErrInvalidArgument), "a partial block: %v", err)

	evs, _ := p.DrainKVEvents(nil)
	require.Len(t, evs, 2)
	require.Equal(t, KVEvent{Seq: 1, Kind: KVBlockStored, BlockHash: hs[2], ParentBlockHash: hs[1], HasParent: true,
		TokenIDs: toks[32:48], BlockSize: 16}, evs[0])
	require.Equal(t, KVEvent{Seq: 2, Kind: KVBlockStored, BlockHash: hs[0], TokenIDs: toks[:16], BlockSize: 16}, evs[1])
	_, snap := p.SnapshotKVBlocks(nil)
	require.Len(t, snap, 2)
	l.Release()
}

// Drains swap the ring under the pool's lock and copy outside it: with
// sealers and several drainers racing, every event is drained exactly
// once, in sequence order within each drain, none is dropped while the
// ring has room, and every stored event's tokens are the block's own.
func TestKVEventDrainsRaceSeals(t *testing.T) {
	const bt, sealers, rounds = 4, 2, 300
	p := newTestPool(t, 64, WithBlockTokens(bt), WithKVEvents(1<<14))
	var wg sync.WaitGroup
	for w := range sealers {
		wg.Go(func() {
			for r := range rounds {
				l, err := p.Acquire("s", 2)
				if err != nil {
					continue // the other sealer holds blocks: fine
				}
				seed := 1 + w*rounds + r
				toks := prompt(seed, 2*bt)
				parent := BlockHash(seed)
				for i := range 2 {
					parent, err = l.SealTokens(i, parent, toks[bt*i:bt*(i+1)])
					require.NoError(t, err)
				}
				l.Release()
			}
		})
	}
	var mu sync.Mutex
	var all []KVEvent
	stop := make(chan struct{})
	var drainers sync.WaitGroup
	drain := func() {
		ev, dropped := p.DrainKVEvents(nil)
		require.Zero(t, dropped)
		for i := 1; i < len(ev); i++ {
			require.Equal(t, ev[i-1].Seq+1, ev[i].Seq, "a drain is one consecutive run")
		}
		mu.Lock()
		all = append(all, ev...)
		mu.Unlock()
	}
	for range 2 {
		drainers.Go(func() {
			for {
				select {
				case <-stop:
					return
				case <-p.KVEventsReady():
					drain()
				}
			}
		})
	}
	wg.Wait()
	close(stop)
	drainers.Wait()
	drain()
	slices.SortFunc(all, func(a, b KVEvent) int { return int(a.Seq) - int(b.Seq) })
	stored := 0
	for i, e := range all {
		require.EqualValues(t, i+1, e.Seq, "every event once")
		if e.Kind == KVBlockStored {
			stored++
			require.Len(t, e.TokenIDs, bt)
			require.Equal(t, cap(e.TokenIDs), len(e.TokenIDs))
			if e.HasParent { // the second block of a prompt: its tokens are its own
				require.Equal(t, HashBlock(e.ParentBlockHash, e.TokenIDs), e.BlockHash)
			}
		}
	}
	require.Positive(t, stored)
	require.NoError(t, p.Check())
}

// Tokens are copied into the ring's and the slots' tables rather than
// allocated per seal: what a drain or a snapshot hands out is the caller's
// own copy, unchanged by later seals that reuse the ring entries and the
// slots; a seal the full ring drops is counted and its tokens go nowhere.
func TestKVEventTokensAreStableCopies(t *testing.T) {
	p := newTestPool(t, 2, WithBlockTokens(4), WithKVEvents(2))
	seal := func(owner string, seed int) [][]int32 {
		l, err := p.Acquire(owner, 2)
		require.NoError(t, err)
		toks := prompt(seed, 8)
		parent := BlockHash(seed)
		for i := range 2 {
			parent, err = l.SealTokens(i, parent, toks[4*i:4*i+4])
			require.NoError(t, err)
		}
		toks[0] = -1 // the caller's slice is not kept
		l.Release()
		return [][]int32{prompt(seed, 8)[:4], prompt(seed, 8)[4:]}
	}
	wantA := seal("a", 1)
	evA, dropped := p.DrainKVEvents(nil)
	require.Zero(t, dropped)
	require.Len(t, evA, 2)
	keepA := [][]int32{slices.Clone(evA[0].TokenIDs), slices.Clone(evA[1].TokenIDs)}
	require.Equal(t, wantA, keepA)

	// The same slots and ring entries, other tokens: evicting a's two
	// blocks fills the ring of 2 with removals, so b's stored events drop.
	seal("b", 2)
	evB, dropped := p.DrainKVEvents(nil)
	require.EqualValues(t, 2, dropped)
	require.Len(t, evB, 2)
	require.Equal(t, KVBlockRemoved, evB[0].Kind)
	require.Equal(t, keepA, [][]int32{evA[0].TokenIDs, evA[1].TokenIDs}, "a drained copy never changes")

	_, snap := p.SnapshotKVBlocks(nil)
	require.Len(t, snap, 2)
	wantB := [][]int32{prompt(2, 8)[:4], prompt(2, 8)[4:]}
	require.ElementsMatch(t, wantB, [][]int32{snap[0].TokenIDs, snap[1].TokenIDs})
	seal("c", 3)
	require.ElementsMatch(t, wantB, [][]int32{snap[0].TokenIDs, snap[1].TokenIDs}, "a snapshot is the caller's")
	require.Equal(t, cap(snap[0].TokenIDs), len(snap[0].TokenIDs), "appending cannot reach a neighbour")
	require.NoError(t, p.Check())
}

func TestKVEvents(t *testing.T) {
	p := newTestPool(t, 4, WithKVEvents(64), WithBlockTokens(16))
	toks := prompt(1, 32)
	hs := ChainHashes(5, toks, 16)
	a, err := p.Acquire("a", 2)
	require.NoError(t, err)
	h0, err := a.SealTokens(0, 5, toks[:16])
	require.NoError(t, err)
	require.Equal(t, hs[0], h0)
	require.NoError(t, a.Seal(1, hs[1]))
	select {
	case <-p.KVEventsReady():
	default:
		t.Fatal("KVEventsReady not signalled")
	}
	a.Release()
	evs, dropped := p.DrainKVEvents(nil)
	require.Zero(t, dropped)
	require.Len(t, evs, 2, "release stores or removes nothing: cached blocks still serve")
	require.Equal(t, KVEvent{Seq: 1, Kind: KVBlockStored, BlockHash: hs[0],
		TokenIDs: toks[:16], BlockSize: 16}, evs[0], "a chain's first block has no parent (the seed is not a block)")
	require.Equal(t, KVEvent{Seq: 2, Kind: KVBlockStored, BlockHash: hs[1], ParentBlockHash: hs[0], HasParent: true,
		BlockSize: 16}, evs[1], "plain Seal learns the parent from the previous sealed block")

	x, err := p.Acquire("x", 4) // evicts both, tail first
	require.NoError(t, err)
	evs, _ = p.DrainKVEvents(evs[:0])
	require.Len(t, evs, 2)
	require.Equal(t, KVEvent{Seq: 3, Kind: KVBlockRemoved, BlockHash: hs[1]}, evs[0])
	require.Equal(t, KVEvent{Seq: 4, Kind: KVBlockRemoved, BlockHash: hs[0]}, evs[1])
	x.Release()
}

func TestKVEventsOverflow(t *testing.T) {
	p := newTestPool(t, 8, WithKVEvents(2))
	a, err := p.Acquire("a", 5)
	require.NoError(t, err)
	for i := range 5 {
		require.NoError(t, a.Seal(i, BlockHash(100+i)))
	}
	evs, dropped := p.DrainKVEvents(nil)
	require.Len(t, evs, 2)
	require.EqualValues(t, 3, dropped, "overflow is counted: resync needed")
	require.EqualValues(t, []uint64{1, 2}, []uint64{evs[0].Seq, evs[1].Seq})
	seq, snap := p.SnapshotKVBlocks(nil)
	require.EqualValues(t, 5, seq)
	var hashes []BlockHash
	for _, e := range snap {
		hashes = append(hashes, e.BlockHash)
	}
	require.Equal(t, []BlockHash{100, 101, 102, 103, 104}, hashes)
	require.NoError(t, a.Seal(0, 100))
	a.Extend(1)
	require.NoError(t, a.Seal(5, 200))
	evs, dropped = p.DrainKVEvents(nil)
	require.Zero(t, dropped)
	require.Len(t, evs, 1)
	require.EqualValues(t, 6, evs[0].Seq, "sequence numbers continue across the gap")
	a.Release()
	_, err = NewPool[[]byte](must(NewHostMemory(1, 1)), WithKVEvents(0))
	require.ErrorIs(t, err, ErrInvalidArgument)
}

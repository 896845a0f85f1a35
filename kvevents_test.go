package kvlease

import (
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

package kvlease

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

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

package kvlease

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

// SealChained places a block in its chain whatever its place in the
// lease: block 0 of a lease can name its parent, a later block can start
// a chain; the hash and the checks are SealTokens'.
func TestSealChainedPlacesTheBlock(t *testing.T) {
	toks := prompt(1, 48)
	hs := ChainHashes(9, toks, 16)
	p := newTestPool(t, 4, WithBlockTokens(16), WithKVEvents(16))
	l, err := p.Acquire("tier", 3)
	require.NoError(t, err)
	// A tier's lease of blocks from two places in one chain: block 2 of
	// the chain first, then its first block.
	h, err := l.SealChained(0, hs[1], true, toks[32:48])
	require.NoError(t, err)
	require.Equal(t, hs[2], h)
	h, err = l.SealChained(1, 9, false, toks[:16])
	require.NoError(t, err)
	require.Equal(t, hs[0], h)
	_, err = l.SealChained(2, hs[0], true, toks[:3])
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

package kvlease

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Release walks a lease tail first in a fast loop for private unsealed
// blocks and hands the rest to the general loop at the first block that
// is not: here the tail is private, the head shared with a prefix hit.
// The counts, the LRU order (a chain enters from its end) and the free
// stack must come out as if one loop had done it all.
func TestReleaseSwitchesFromFastToGeneralLoop(t *testing.T) {
	p := newTestPool(t, 8)
	a, err := p.Acquire("a", 4)
	require.NoError(t, err)
	h := ChainHashes(1, prompt(1, 32), 16)
	require.NoError(t, a.Seal(0, h[0]))
	require.NoError(t, a.Seal(1, h[1]))

	b, hits, err := p.AcquirePrefix("b", h, 3)
	require.NoError(t, err)
	require.Equal(t, 2, hits)

	a.Release() // blocks 3, 2 fast (free); 1, 0 general (still b's)
	require.NoError(t, p.Check())
	st := p.Stats()
	require.Equal(t, 3, st.Leased)
	require.Equal(t, 5, st.Free)

	b.Release() // b's fresh tail fast; then 1, 0 cached, tail first
	require.NoError(t, p.Check())
	st = p.Stats()
	require.Equal(t, 2, st.Cached)
	require.Equal(t, 6, st.Free)

	// Taking every free block and one more evicts the chain's end first.
	c, err := p.Acquire("c", 7)
	require.NoError(t, err)
	require.Equal(t, 1, p.CachedPrefix(h))
	c.Release()
}

// Resolve's fast loop frees a draining private block at once, leaves a
// block another open lease holds leased, and hands a draining sealed
// block to the general path, which caches it.
func TestResolveFastLoopOutcomes(t *testing.T) {
	p := newTestPool(t, 8)
	a, err := p.Acquire("a", 3)
	require.NoError(t, err)
	h := ChainHashes(1, prompt(2, 16), 16)
	require.NoError(t, a.Seal(0, h[0]))
	b, hits, err := p.AcquirePrefix("b", h, 1) // shares block 0
	require.NoError(t, err)
	require.Equal(t, 1, hits)

	tr := NewTransfer(nil)
	require.NoError(t, a.AttachRange(tr, 0, 3, Read))
	a.Release()
	st := p.Stats()
	require.Equal(t, 1, st.Leased)   // block 0, still b's
	require.Equal(t, 2, st.Draining) // blocks 1, 2
	require.Equal(t, LeaseDraining, a.State())

	b.Release() // block 0: b drops it, the transfer still gates it
	require.Equal(t, 3, p.Stats().Draining)

	require.True(t, tr.Resolve(nil))
	require.NoError(t, p.Check())
	st = p.Stats()
	require.Equal(t, 0, st.Draining)
	require.Equal(t, 1, st.Cached) // the sealed block went to the LRU
	require.Equal(t, 7, st.Free)
	require.Equal(t, LeaseSettled, a.State())
	require.Equal(t, 1, p.CachedPrefix(h))
}

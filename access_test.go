package kvlease

import (
	"math"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// A fully cached, block-aligned prompt must not hit the block holding its
// last token: the engine recomputes that token into it, so it must be a
// fresh private block (issue 11, bug 5).
func TestTokenLookupNeverHitsLastTokenBlock(t *testing.T) {
	for _, verified := range []bool{false, true} {
		opts := []Option{WithBlockTokens(4)}
		if verified {
			opts = []Option{WithVerifiedPrefix(4)}
		}
		p := newTestPool(t, 8, opts...)
		toks := prompt(3, 12) // exactly 3 full blocks
		a, err := p.Acquire("a", 3)
		require.NoError(t, err)
		parent := BlockHash(1)
		for i := range 3 {
			parent, err = a.SealTokens(i, parent, toks[i*4:(i+1)*4])
			require.NoError(t, err)
		}
		a.Release()

		require.Equal(t, 2, p.CachedPrefixTokens(1, toks), "verified=%v", verified)
		b, hits, err := p.AcquirePrefixTokens("b", 1, toks, 3)
		require.NoError(t, err)
		require.Equal(t, 2, hits, "verified=%v: the last token's block is never a hit", verified)
		w, err := b.Region(2)
		require.NoError(t, err, "the last block is fresh and private: writable")
		copy(w, "recomputed")
		for i := range 2 {
			_, err := b.Region(i)
			require.ErrorIs(t, err, ErrReadOnly)
		}
		b.Release()

		// One more token: all three full blocks may hit.
		c, hits, err := p.AcquirePrefixTokens("c", 1, append(slices.Clone(toks), 9), 4)
		require.NoError(t, err)
		require.Equal(t, 3, hits)
		c.Release()
		// A prompt shorter than a block, or empty, hits nothing.
		require.Equal(t, 0, p.CachedPrefixTokens(1, toks[:4]))
		require.Equal(t, 0, p.CachedPrefixTokens(1, nil))
		require.NoError(t, p.Check())
	}
}

// No lease can obtain a writable region of a sealed block or of one it
// shares with another lease; ReadRegion serves them (issue 11, bug 5).
func TestRegionRefusesSealedAndShared(t *testing.T) {
	p := newTestPool(t, 8)
	a, err := p.Acquire("a", 3)
	require.NoError(t, err)
	for i := range 3 {
		r, err := a.Region(i)
		require.NoError(t, err, "fresh private blocks are writable")
		r[0] = byte(i + 1)
	}
	require.NoError(t, a.Seal(0, 100))
	require.NoError(t, a.Seal(1, 101))
	_, err = a.Region(0)
	require.ErrorIs(t, err, ErrReadOnly, "sealed: immutable even for its sealer")
	r, err := a.ReadRegion(0)
	require.NoError(t, err)
	require.Equal(t, byte(1), r[0])
	_, err = a.AppendRegions(nil, 0)
	require.ErrorIs(t, err, ErrReadOnly)
	rs, err := a.AppendRegions(nil, 2)
	require.NoError(t, err, "the unsealed tail is writable")
	require.Len(t, rs, 1)
	rs, err = a.AppendReadRegions(nil, 0)
	require.NoError(t, err)
	require.Len(t, rs, 3)

	// A prefix hit shares the sealed blocks: read-only on both sides.
	b, hits, err := p.AcquirePrefix("b", []BlockHash{100, 101}, 3)
	require.NoError(t, err)
	require.Equal(t, 2, hits)
	for _, l := range []*Lease[[]byte]{a, b} {
		for i := range 2 {
			_, err := l.Region(i)
			require.ErrorIs(t, err, ErrReadOnly)
			_, err = l.ReadRegion(i)
			require.NoError(t, err)
		}
	}
	_, err = b.Region(2)
	require.NoError(t, err, "b's own fresh block")

	// Share: the shared blocks are read-only in both leases.
	s, err := a.Share("s", 2)
	require.NoError(t, err)
	_, err = s.Region(1)
	require.ErrorIs(t, err, ErrReadOnly)
	_, err = s.ReadRegion(1)
	require.NoError(t, err)

	require.False(t, a.Closed())
	a.Release()
	require.True(t, a.Closed())
	_, err = a.ReadRegion(0)
	require.ErrorIs(t, err, ErrLeaseClosed)
	_, err = a.AppendReadRegions(nil, 0)
	require.ErrorIs(t, err, ErrLeaseClosed)
	_, err = b.ReadRegion(3)
	require.ErrorIs(t, err, ErrInvalidArgument)
	b.Release()
	s.Abort(nil)
	require.True(t, s.Closed())
	require.NoError(t, p.Check())
}

// Closed tells an open quarantined lease from a closed one, which State
// cannot (issue 11, rough edges).
func TestLeaseClosedWhileQuarantined(t *testing.T) {
	p := newTestPool(t, 4)
	l, err := p.Acquire("q", 2)
	require.NoError(t, err)
	tr := NewTransfer(nil)
	require.NoError(t, l.Attach(tr))
	tr.Quarantine(nil)
	require.Equal(t, LeaseQuarantined, l.State())
	require.False(t, l.Closed())
	l.Release()
	require.Equal(t, LeaseQuarantined, l.State())
	require.True(t, l.Closed())
	tr.Resolve(nil)
	require.Equal(t, LeaseSettled, l.State())
}

// Prefix statistics count queries and hits together, for admitted
// lookups only; refused lookups are counted apart (issue 11, bug 4).
func TestPrefixStatsCountAdmittedLookups(t *testing.T) {
	p := newTestPool(t, 4)
	hs := []BlockHash{10, 11, 12}
	a, err := p.Acquire("a", 3)
	require.NoError(t, err)
	for i, h := range hs {
		require.NoError(t, a.Seal(i, h))
	}
	a.Release() // 3 cached, 1 free
	hog, err := p.Acquire("hog", 1)
	require.NoError(t, err)
	// Needs 3 hits + 2 fresh: only 0 free and no other evictable block.
	for range 3 {
		_, _, err := p.AcquirePrefix("r", hs, 5)
		require.ErrorIs(t, err, ErrExceedsCapacity) // 5 > 4: never
	}
	for range 3 {
		_, _, err := p.AcquirePrefix("r", hs, 4)
		require.ErrorIs(t, err, ErrExhausted)
	}
	hog.Release()
	l, hits, err := p.AcquirePrefix("r", hs, 4)
	require.NoError(t, err)
	require.Equal(t, 3, hits)
	st := p.Stats()
	require.EqualValues(t, 3, st.PrefixQueries, "one admitted lookup of 3 blocks")
	require.EqualValues(t, 3, st.PrefixHits)
	require.EqualValues(t, 9, st.PrefixRefused, "three refused lookups of 3 blocks")
	l.Release()
}

// SealTokens refuses a partial block in every mode (issue 11, bug 6).
func TestSealTokensRefusesPartialBlock(t *testing.T) {
	for _, opts := range [][]Option{{WithBlockTokens(16)}, {WithVerifiedPrefix(16)}, {WithBlockTokens(16), WithKVEvents(8)}, nil} {
		p := newTestPool(t, 2, opts...)
		l, err := p.Acquire("a", 1)
		require.NoError(t, err)
		_, err = l.SealTokens(0, 1, prompt(1, 3))
		require.ErrorIs(t, err, ErrInvalidArgument, "3 tokens of a 16-token block")
		_, err = l.SealTokens(0, 1, prompt(1, 17))
		require.ErrorIs(t, err, ErrInvalidArgument, "more than a block")
		if p.cfg.kvEvents > 0 {
			evs, _ := p.DrainKVEvents(nil)
			require.Empty(t, evs, "nothing published")
		}
		if opts != nil {
			_, err = l.SealTokens(0, 1, prompt(1, 16))
			require.NoError(t, err)
		} else {
			_, err = l.SealTokens(0, 1, prompt(1, 16))
			require.ErrorIs(t, err, ErrInvalidArgument, "no block size: SealTokens cannot tell")
		}
		l.Release()
	}
}

// Extend with a huge n can never succeed: ErrExceedsCapacity, not a
// retryable ErrExhausted from a wrapped sum (issue 11, bug 3).
func TestExtendHugeNExceedsCapacity(t *testing.T) {
	p := newTestPool(t, 4)
	l, err := p.Acquire("a", 2)
	require.NoError(t, err)
	for _, n := range []int{math.MaxInt, math.MaxInt - 1, math.MaxInt - 2, 3} {
		err := l.Extend(n)
		require.ErrorIs(t, err, ErrExceedsCapacity, "n=%d", n)
		require.NotErrorIs(t, err, ErrExhausted)
	}
	require.NoError(t, l.Extend(2))
	_, err = l.Share("s", math.MaxInt)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorIs(t, l.AttachRange(NewTransfer(nil), 0, math.MaxInt, Read), ErrInvalidArgument)
	require.ErrorIs(t, l.AttachRange(NewTransfer(nil), math.MinInt, 1, Read), ErrInvalidArgument)
	_, err = p.Acquire("b", math.MaxInt)
	require.ErrorIs(t, err, ErrExceedsCapacity)
	_, _, err = p.AcquirePrefix("b", []BlockHash{1}, math.MaxInt)
	require.ErrorIs(t, err, ErrExceedsCapacity)
	_, _, err = p.AcquirePrefixTokens("b", 1, prompt(1, 8), math.MaxInt)
	require.ErrorIs(t, err, ErrInvalidArgument, "no block size configured")
	l.Release()
}

// ResetCache(ResetAll) makes in-use sealed blocks unfindable too: after a
// weight update nothing old may hit. The default keeps them findable
// (issue 11, rough edges).
func TestResetCacheAll(t *testing.T) {
	p := newTestPool(t, 6, WithKVEvents(32))
	hs := []BlockHash{1, 2, 3}
	a, err := p.Acquire("a", 3)
	require.NoError(t, err)
	for i, h := range hs {
		require.NoError(t, a.Seal(i, h))
	}
	b, hits, err := p.AcquirePrefix("b", hs[:2], 2)
	require.NoError(t, err)
	require.Equal(t, 2, hits)
	b.Release() // blocks 0,1 still held by a
	c, err := p.Acquire("c", 1)
	require.NoError(t, err)
	require.NoError(t, c.Seal(0, 9))
	c.Release() // cached, unreferenced
	p.DrainKVEvents(nil)

	require.Equal(t, 1, p.ResetCache(), "default: only the unreferenced block")
	require.Equal(t, 3, p.CachedPrefix(hs), "in-use blocks stay findable by default")

	require.Equal(t, 3, p.ResetCache(ResetAll))
	require.Equal(t, 0, p.CachedPrefix(hs), "nothing old may hit")
	evs, _ := p.DrainKVEvents(nil)
	require.Equal(t, KVAllBlocksCleared, evs[len(evs)-1].Kind)
	_, seq := p.SnapshotKVCache()
	require.Empty(t, seq)
	// a still reads its sealed blocks; they stay immutable.
	_, err = a.ReadRegion(0)
	require.NoError(t, err)
	_, err = a.Region(0)
	require.ErrorIs(t, err, ErrReadOnly)
	// A new seal of the same hash by another lease is findable again.
	d, err := p.Acquire("d", 1)
	require.NoError(t, err)
	require.NoError(t, d.Seal(0, 1))
	require.Equal(t, 1, p.CachedPrefix(hs))
	a.Release()
	d.Release()
	st := p.Stats()
	require.Equal(t, 1, st.Cached, "a's blocks are free once unreferenced, not cached")
	require.Equal(t, 5, st.Free)
}

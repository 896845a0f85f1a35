package groups_test

import (
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/groups"
)

func newPool(t testing.TB, blocks int) *kvlease.Pool[[]byte] {
	t.Helper()
	mem, err := kvlease.NewHostMemory(blocks, 64)
	require.NoError(t, err)
	p, err := kvlease.NewPool[[]byte](mem)
	require.NoError(t, err)
	return p
}

// hybrid returns a coordinator over a full-attention group of 16-token
// blocks and a sliding-window group of 8-token blocks with a 32-token
// window.
func hybrid(t testing.TB, fullBlocks, swBlocks int) (*groups.Coordinator[[]byte], *kvlease.Pool[[]byte], *kvlease.Pool[[]byte]) {
	t.Helper()
	full, sw := newPool(t, fullBlocks), newPool(t, swBlocks)
	c, err := groups.New(
		groups.Group[[]byte]{Spec: groups.Spec{Name: "full", BlockTokens: 16}, Pool: full},
		groups.Group[[]byte]{Spec: groups.Spec{Name: "swa", BlockTokens: 8, Window: 32}, Pool: sw},
	)
	require.NoError(t, err)
	return c, full, sw
}

func prompt(n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(1000 + i)
	}
	return out
}

// sealAll seals every block of group g the request holds whose hash is
// known.
func sealAll(t testing.TB, r *groups.Request[[]byte], g int, hs []kvlease.BlockHash) {
	t.Helper()
	for k, h := range hs {
		if l, i, ok := r.Block(g, k); ok {
			require.NoError(t, l.Seal(i, h))
		}
	}
}

// cache seals the given blocks of hs in p under a throwaway lease and
// releases it: those hashes are cached, the others not.
func cache(t testing.TB, p *kvlease.Pool[[]byte], hs []kvlease.BlockHash, which ...int) {
	t.Helper()
	l, err := p.Acquire("seeder", len(which))
	require.NoError(t, err)
	for i, k := range which {
		require.NoError(t, l.Seal(i, hs[k]))
	}
	l.Release()
}

func stats(p *kvlease.Pool[[]byte]) (leased, free, cached int) {
	st := p.Stats()
	return st.Leased, st.Free, st.Cached
}

func TestAcquireHitsAndWindow(t *testing.T) {
	c, full, sw := hybrid(t, 16, 32)
	require.Equal(t, 16, c.Align())
	toks := prompt(64)
	hs := c.Hashes(7, toks)
	require.Len(t, hs[0], 4)
	require.Len(t, hs[1], 8)

	// A cold request: no hit; 65 tokens need 5 full and 9 window blocks.
	r, hit, err := c.Acquire("a", hs, 65)
	require.NoError(t, err)
	require.Equal(t, 0, hit)
	require.Equal(t, 5, r.Lease(0).Len())
	require.Equal(t, 9, r.Lease(1).Len())
	require.Equal(t, 0, r.Base(1))
	sealAll(t, r, 0, hs[0])
	sealAll(t, r, 1, hs[1])

	// Decode to 80 tokens: the window group keeps the blocks of the
	// last 32 tokens before each step.
	for tok := 66; tok <= 80; tok++ {
		require.NoError(t, r.Grow(tok))
	}
	require.Equal(t, 5, r.Lease(0).Len())
	require.Equal(t, 10, r.Lease(1).Len())
	require.Equal(t, (79-32)/8, r.Lease(1).Trimmed())
	_, _, ok := r.Block(1, 0)
	require.False(t, ok, "trimmed")
	leased, _, cached := stats(sw)
	require.Equal(t, 10-(79-32)/8, leased)
	require.Equal(t, (79-32)/8, cached, "trimmed sealed blocks stay cached")
	r.Release()
	<-r.Settled()

	// The same prompt again: the full group hits 4 blocks, the window
	// group only needs blocks 4..7 (tokens 32..63) and shares them.
	r2, hit, err := c.Acquire("b", hs, 65)
	require.NoError(t, err)
	require.Equal(t, 64, hit)
	require.Equal(t, 0, r2.Base(0))
	require.Equal(t, 4, r2.Base(1))
	require.Equal(t, 5, r2.Lease(1).Len(), "blocks 4..8")
	require.Equal(t, 5, full.Stats().Leased)
	r2.Release()
}

// When the window group lost the blocks just before the full group's hit,
// the hit falls back to the longest point valid in both.
func TestAcquireWindowLimitsHit(t *testing.T) {
	c, full, sw := hybrid(t, 16, 32)
	hs := c.Hashes(7, prompt(64))
	cache(t, full, hs[0], 0, 1, 2, 3) // full: all 64 tokens
	cache(t, sw, hs[1], 0, 1, 2, 3)   // window: tokens 0..31 only
	r, hit, err := c.Acquire("a", hs, 70)
	require.NoError(t, err)
	// 64 needs window blocks 4..7 (missing); 48 needs 2..5 (missing);
	// 32 needs blocks 0..3: cached.
	require.Equal(t, 32, hit)
	require.Equal(t, 0, r.Base(1))
	require.Equal(t, 5, r.Lease(0).Len())
	require.Equal(t, 9, r.Lease(1).Len())
	// The full group shares exactly 2 blocks, not 4: blocks 2..3 are
	// fresh (the engine computes tokens 32..63 into them).
	leased, _, cached := stats(full)
	require.Equal(t, 5, leased)
	require.Equal(t, 2, cached)
	r.Release()
	require.NoError(t, full.Check())
	require.NoError(t, sw.Check())
}

// A hit point whose window blocks are cached counts even when earlier
// window blocks are gone (they are not needed).
func TestAcquireWindowNeedsOnlyItsBlocks(t *testing.T) {
	c, full, sw := hybrid(t, 16, 32)
	hs := c.Hashes(7, prompt(64))
	cache(t, full, hs[0], 0, 1, 2, 3)
	cache(t, sw, hs[1], 4, 5, 6, 7) // tokens 32..63 only
	r, hit, err := c.Acquire("a", hs, 64)
	require.NoError(t, err)
	require.Equal(t, 64, hit)
	require.Equal(t, 4, r.Base(1))
	require.Equal(t, 4, r.Lease(1).Len())
	r.Release()

	// The full group limits: only 1 block cached there.
	require.Equal(t, 4, full.ResetCache(false))
	cache(t, full, hs[0], 0)
	r, hit, err = c.Acquire("b", hs, 64)
	require.NoError(t, err)
	require.Equal(t, 0, hit, "16 needs window blocks 0..1, which are gone")
	r.Release()
	require.NoError(t, sw.Check())
}

func TestAcquireAllOrNothing(t *testing.T) {
	c, full, sw := hybrid(t, 16, 4)
	_, _, err := c.Acquire("big", nil, 64) // 4 full blocks, 8 window blocks
	require.ErrorIs(t, err, kvlease.ErrExceedsCapacity)
	require.Contains(t, err.Error(), "swa")
	st := full.Stats()
	require.Equal(t, 16, st.Free, "the full group's lease was given back")
	require.Equal(t, 0, st.OpenLeases)

	r, _, err := c.Acquire("a", nil, 32) // 2 + 4
	require.NoError(t, err)
	_, _, err = c.Acquire("b", nil, 8)
	require.ErrorIs(t, err, kvlease.ErrExhausted)
	require.Equal(t, 2, full.Stats().Leased)

	// Growth: the window group would need 5 blocks at once (token 39
	// attends to tokens 7..38) in a 4-block pool: it never can, so
	// nothing grows anywhere.
	err = r.Grow(40)
	require.ErrorIs(t, err, kvlease.ErrExceedsCapacity)
	require.Equal(t, 2, r.Lease(0).Len())
	require.Equal(t, 32, r.Tokens())
	r.Release()
	require.Equal(t, 4, sw.Stats().Free)
}

func TestAcquireInvalid(t *testing.T) {
	c, _, _ := hybrid(t, 4, 4)
	_, _, err := c.Acquire("", nil, 4)
	require.ErrorIs(t, err, kvlease.ErrInvalidArgument)
	_, _, err = c.Acquire("a", nil, 0)
	require.ErrorIs(t, err, kvlease.ErrInvalidArgument)
	_, _, err = c.Acquire("a", make([][]kvlease.BlockHash, 3), 4)
	require.ErrorIs(t, err, kvlease.ErrInvalidArgument)

	p := newPool(t, 4)
	for _, gs := range [][]groups.Group[[]byte]{
		nil,
		{{Spec: groups.Spec{BlockTokens: 16}}},
		{{Spec: groups.Spec{BlockTokens: 0}, Pool: p}},
		{{Spec: groups.Spec{BlockTokens: 16, Window: -1}, Pool: p}},
		{{Spec: groups.Spec{BlockTokens: 16}, Pool: p}, {Spec: groups.Spec{BlockTokens: 16, Window: 8}, Pool: p}},
	} {
		_, err := groups.New(gs...)
		require.ErrorIs(t, err, kvlease.ErrInvalidArgument)
	}

	r, _, err := c.Acquire("a", nil, 8)
	require.NoError(t, err)
	require.ErrorIs(t, r.Grow(4), kvlease.ErrInvalidArgument)
	require.ErrorIs(t, r.Trim(9), kvlease.ErrInvalidArgument)
	// Sizes past any pool are refused before anything is taken or grown
	// (math.MaxInt tokens once overflowed the block count and "grew" a
	// request to cover them with no block).
	for _, n := range []int{65, math.MaxInt, math.MaxInt - 3} {
		_, _, err = c.Acquire("huge", nil, n)
		require.ErrorIs(t, err, kvlease.ErrExceedsCapacity, "acquire %d tokens", n)
		require.ErrorIs(t, r.Grow(n), kvlease.ErrExceedsCapacity, "grow to %d tokens", n)
		require.Equal(t, 8, r.Tokens())
	}
	require.NoError(t, r.Grow(32))
	r.Abort(errors.New("client went away"))
	require.True(t, r.Closed())
	require.ErrorIs(t, r.Grow(40), kvlease.ErrLeaseClosed)
}

// Trimming under transfers: an offload reading the window group's blocks
// keeps the trimmed ones draining until it resolves.
func TestTrimUnderTransfer(t *testing.T) {
	c, _, sw := hybrid(t, 16, 32)
	r, _, err := c.Acquire("a", nil, 64) // window blocks 0..7
	require.NoError(t, err)
	offload := kvlease.NewTransfer(nil)
	require.NoError(t, r.Lease(1).AttachRange(offload, 0, 8, kvlease.Read))
	require.NoError(t, r.Grow(80)) // trims to the block of token 32
	require.Equal(t, 4, r.Lease(1).Trimmed())
	st := sw.Stats()
	require.Equal(t, 4, st.Draining)
	require.Equal(t, 6, st.Leased)
	offload.Quarantine(nil)
	require.Equal(t, 8, sw.Stats().Quarantined, "the trimmed and the held blocks it reads")
	offload.Resolve(nil)
	st = sw.Stats()
	require.Equal(t, 0, st.Draining+st.Quarantined)
	require.Equal(t, 6, st.Leased)
	r.Release()
	<-r.Settled()
	require.NoError(t, sw.Check())
}

// Requests come from slabs, and a failed admission hands its Request to
// the next one: every admitted Request is its own, with nothing left from
// a failure or from its slab neighbours.
func TestAcquireRequestsAreDistinct(t *testing.T) {
	c, full, sw := hybrid(t, 256, 512)
	seen := map[*groups.Request[[]byte]]bool{}
	var held []*groups.Request[[]byte]
	for i := range 100 {
		if i%3 == 0 {
			_, _, err := c.Acquire("too-big", nil, 1<<20)
			require.ErrorIs(t, err, kvlease.ErrExceedsCapacity)
		}
		owner := string(rune('a' + i%26))
		r, hit, err := c.Acquire(owner, nil, 16)
		require.NoError(t, err)
		require.Zero(t, hit)
		require.False(t, seen[r], "request %d reuses an admitted Request", i)
		seen[r] = true
		require.Equal(t, owner, r.Owner())
		require.Equal(t, 16, r.Tokens())
		require.Equal(t, 1, r.Lease(0).Len())
		require.Equal(t, 2, r.Lease(1).Len())
		require.Zero(t, r.Base(1))
		held = append(held, r)
	}
	require.Equal(t, 100, full.Stats().Leased)
	for _, r := range held {
		r.Release()
	}
	require.Equal(t, 512, sw.Stats().Free)
}

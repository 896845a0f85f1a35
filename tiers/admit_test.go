package tiers

import (
	"context"
	"errors"
	"math"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
)

// serveSeq runs one request through Cache.Admit: wait for the onboard,
// check the onboarded blocks' content, compute (stamp) and commit the
// rest of the prompt, decode a few tokens, release. It returns the
// onboard.
func (r *rig) serveSeq(t *testing.T, prompt []int32) *Onboard[[]byte] {
	t.Helper()
	o, err := r.c.Admit(kvlease.SequenceSpec{Owner: "req", Seed: 5, Prompt: prompt})
	require.NoError(t, err)
	s := o.Sequence
	require.Equal(t, o.Hits(TierDevice), s.Hits(), "before Wait only device hits count")
	require.Equal(t, o.Hits(TierDevice)*4, s.Computed())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	valid, err := o.Wait(ctx)
	require.NoError(t, err)
	require.Equal(t, valid, s.Hits(), "after Wait the onboarded blocks are hits")
	require.Equal(t, valid*4, s.Computed())
	require.Equal(t, valid*4, s.CachedTokens())
	hashes := kvlease.ChainHashes(5, prompt, 4)
	for k := range valid {
		b, err := s.Lease().ReadRegion(k)
		require.NoError(t, err)
		require.True(t, holds(b, hashes[k]), "block %d of the prefix holds the wrong content", k)
	}
	for k := valid; k < s.Lease().Len(); k++ {
		b, err := s.Lease().Region(k)
		require.NoError(t, err)
		if k < len(hashes) {
			stamp(b, hashes[k])
		}
	}
	require.NoError(t, s.Commit(s.Len()-s.Computed()))
	for i := range 3 {
		require.NoError(t, s.AppendComputed(int32(900+i)))
	}
	require.Equal(t, kvlease.ChainHashes(5, s.Tokens(), 4), s.BlockHashes())
	s.Lease().Release()
	return o
}

func seqPrompt(doc, n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(doc*1000 + i)
	}
	return out
}

// TestCacheAdmit: a request admitted as a Sequence finds its prefix in
// the host tier, gets it onboarded, counts it as hits once Wait has seen
// it land, and never hits the block holding its prompt's last token.
func TestCacheAdmit(t *testing.T) {
	r := newRig(t, 8, 32, 0, WriteBack, kvlease.WithBlockTokens(4))
	a := seqPrompt(1, 17) // 5 blocks; 4 may hit
	o := r.serveSeq(t, a)
	require.Zero(t, o.Prefix())
	r.settle(t)
	// a's head stays on the device; the rest of its cached blocks (the
	// least recently used: a chain is dropped from its end) go down.
	r.dev.OfferCached(r.dev.Stats().Cached - 1)
	r.settle(t)
	hashes := kvlease.ChainHashes(5, a, 4)[:4]
	d := r.dev.CachedPrefix(hashes)
	h := r.host.CachedPrefix(hashes[d:])
	require.Equal(t, 1, d)
	require.Equal(t, 3, h, "a's blocks went down to the host")

	o = r.serveSeq(t, a)
	require.Equal(t, d, o.Hits(TierDevice))
	require.Equal(t, h, o.Hits(TierHost))
	require.Equal(t, d+h, o.Prefix())
	r.settle(t)

	// A prompt of exactly 16 tokens: its 4th block holds the last token
	// and is never a hit, though all four are cached.
	o = r.serveSeq(t, a[:16])
	require.Equal(t, 3, o.Prefix())
	r.settle(t)
	require.NoError(t, r.dev.CheckQuiescent())
	require.NoError(t, r.host.CheckQuiescent())
}

// TestCacheAdmitCopyFails: when the onload fails, Wait reports it and
// counts only the blocks before the failure as hits; the engine computes
// the rest into the same lease and commits them.
func TestCacheAdmitCopyFails(t *testing.T) {
	r := newRig(t, 8, 32, 0, WriteBack, kvlease.WithBlockTokens(4))
	a := seqPrompt(1, 17)
	r.serveSeq(t, a)
	r.settle(t)
	r.dev.OfferCached(r.dev.Stats().Cached - 1)
	r.settle(t)
	r.onload.set(true, false, nil)
	o, err := r.c.Admit(kvlease.SequenceSpec{Owner: "req", Seed: 5, Prompt: a})
	require.NoError(t, err)
	require.Equal(t, 4, o.Prefix())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	valid, err := o.Wait(ctx)
	require.Error(t, err)
	s := o.Sequence
	require.Equal(t, 1, valid)
	require.Equal(t, 1, s.Hits())
	require.Equal(t, 4, s.Computed())
	hashes := kvlease.ChainHashes(5, a, 4)
	for k := 1; k < s.Lease().Len(); k++ {
		b, err := s.Lease().Region(k)
		require.NoError(t, err, "block %d after a failed copy is the engine's to compute", k)
		if k < len(hashes) {
			stamp(b, hashes[k])
		}
	}
	require.NoError(t, s.Commit(s.Len()-s.Computed()))
	require.Equal(t, hashes, s.BlockHashes())
	s.Lease().Release()
	r.onload.set(false, false, nil)
	r.settle(t)
	require.NoError(t, r.dev.CheckQuiescent())
	require.NoError(t, r.host.CheckQuiescent())
}

// TestCacheAdmitRefuses: specs the device pool refuses, a window, and a
// write-through cache are refused, holding nothing.
func TestCacheAdmitRefuses(t *testing.T) {
	r := newRig(t, 8, 32, 0, WriteBack, kvlease.WithBlockTokens(4))
	for _, spec := range []kvlease.SequenceSpec{
		{Owner: "a", Prompt: seqPrompt(1, 8), Window: 8},
		{Owner: "a", Prompt: seqPrompt(1, 8), MaxTokens: 1 << 50},
		{Owner: "", Prompt: seqPrompt(1, 8)},
	} {
		_, err := r.c.Admit(spec)
		require.Error(t, err)
		require.True(t, errors.Is(err, kvlease.ErrInvalidArgument) || errors.Is(err, kvlease.ErrExceedsCapacity), "%v", err)
	}
	require.NoError(t, r.dev.CheckQuiescent())
	wt := newRig(t, 8, 32, 0, WriteThrough, kvlease.WithBlockTokens(4))
	_, err := wt.c.Admit(kvlease.SequenceSpec{Owner: "a", Prompt: seqPrompt(1, 8)})
	require.ErrorIs(t, err, kvlease.ErrInvalidArgument)
}

// TestOpenDiskSizes: every size of a DiskConfig is bounded before it
// sizes anything (a worker per imagined disk, an overflowing slot, a
// slot count past a BlockID); nothing is created for a refused one.
func TestOpenDiskSizes(t *testing.T) {
	dir := t.TempDir()
	for _, cfg := range []DiskConfig{
		{Dir: dir, Slots: 4, BlockBytes: 256, Workers: 1 << 40},
		{Dir: dir, Slots: 4, BlockBytes: math.MaxInt},
		{Dir: dir, Slots: 1 << 40, BlockBytes: 256},
	} {
		_, err := OpenDisk(cfg)
		require.ErrorIs(t, err, kvlease.ErrInvalidArgument, "%+v", cfg)
	}
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Empty(t, ents, "a refused config created files")
}

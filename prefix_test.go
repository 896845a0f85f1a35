package kvlease

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/cespare/xxhash/v2"
	"github.com/stretchr/testify/require"
)

func newTestPool(t testing.TB, blocks int, opts ...Option) *Pool[[]byte] {
	t.Helper()
	mem, err := NewHostMemory(blocks, 32)
	require.NoError(t, err)
	p, err := NewPool[[]byte](mem, opts...)
	require.NoError(t, err)
	t.Cleanup(func() {
		if err := p.Check(); err != nil {
			t.Errorf("pool inconsistent at the end: %v", err)
		}
	})
	return p
}

// prompt returns n deterministic tokens for prompt id.
func prompt(id, n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(id*1000 + i)
	}
	return out
}

func TestHashBlockEncoding(t *testing.T) {
	// The documented encoding, spelled out byte by byte.
	parent := BlockHash(0x0102030405060708)
	tokens := []int32{1, -1, 0x7fffffff, 42}
	var buf []byte
	buf = binary.LittleEndian.AppendUint64(buf, uint64(parent))
	for _, tk := range tokens {
		buf = binary.LittleEndian.AppendUint32(buf, uint32(tk))
	}
	require.Equal(t, BlockHash(xxhash.Sum64(buf)), HashBlock(parent, tokens))

	// Long blocks cross the internal buffer; the result must not change.
	long := prompt(3, 1000)
	buf = binary.LittleEndian.AppendUint64(nil, 7)
	for _, tk := range long {
		buf = binary.LittleEndian.AppendUint32(buf, uint32(tk))
	}
	require.Equal(t, BlockHash(xxhash.Sum64(buf)), HashBlock(7, long))
}

func TestChainHashes(t *testing.T) {
	toks := prompt(1, 16*3+5) // three full blocks and a partial one
	h := ChainHashes(99, toks, 16)
	require.Len(t, h, 3)
	parent := BlockHash(99)
	for k := range h {
		parent = HashBlock(parent, toks[k*16:(k+1)*16])
		require.Equal(t, parent, h[k], "block %d", k)
	}
	require.NotEqual(t, h, ChainHashes(100, toks, 16), "the seed separates namespaces")
	require.Nil(t, ChainHashes(1, toks, 0))
	require.Nil(t, ChainHashes(1, toks[:15], 16))
	// A change in block 0 changes every later hash (the chain).
	other := slices.Clone(toks)
	other[0]++
	h2 := ChainHashes(99, other, 16)
	for k := range h {
		require.NotEqual(t, h[k], h2[k])
	}
	allocs := testing.AllocsPerRun(100, func() { _ = ChainHashes(1, toks, 16) })
	require.Equal(t, 1.0, allocs, "only the result slice is allocated")
}

// fillSealed acquires a lease of len(hashes) blocks, writes marker content
// and seals every block.
func fillSealed(t *testing.T, p *Pool[[]byte], owner string, hashes []BlockHash) *Lease[[]byte] {
	t.Helper()
	l, hits, err := p.AcquirePrefix(owner, hashes, len(hashes))
	require.NoError(t, err)
	for i := hits; i < len(hashes); i++ {
		r, err := l.Region(i)
		require.NoError(t, err)
		binary.LittleEndian.PutUint64(r, uint64(hashes[i]))
		require.NoError(t, l.Seal(i, hashes[i]))
	}
	return l
}

func TestPrefixHitSharesContentAndGeneration(t *testing.T) {
	p := newTestPool(t, 8)
	hs := ChainHashes(1, prompt(1, 64), 16) // 4 blocks
	a := fillSealed(t, p, "a", hs[:3])
	refs := []BlockRef{a.Ref(0), a.Ref(1), a.Ref(2)}
	a.Release()
	st := p.Stats()
	require.Equal(t, 3, st.Cached)
	require.Equal(t, 5, st.Free)
	require.Equal(t, 3, p.CachedPrefix(hs))
	require.Equal(t, st, p.Stats(), "CachedPrefix changes nothing")

	b, hits, err := p.AcquirePrefix("b", hs, 4)
	require.NoError(t, err)
	require.Equal(t, 3, hits)
	for i := range 3 {
		require.Equal(t, refs[i], b.Ref(i), "a hit keeps the generation")
		r, err := b.ReadRegion(i)
		require.NoError(t, err)
		require.Equal(t, uint64(hs[i]), binary.LittleEndian.Uint64(r), "a hit sees exactly the sealed content")
		_, err = b.Region(i)
		require.ErrorIs(t, err, ErrReadOnly, "a hit is never writable")
	}
	require.NotEqual(t, refs[0].ID, b.Ref(3).ID)
	st = p.Stats()
	require.Equal(t, 4, st.Leased)
	require.Equal(t, 0, st.Cached)
	require.EqualValues(t, 3, st.PrefixHits)
	require.EqualValues(t, 3+4, st.PrefixQueries, "fillSealed asked for 3, b for 4")
	b.Release()
}

func TestPrefixSharingWhileLive(t *testing.T) {
	p := newTestPool(t, 8)
	hs := ChainHashes(1, prompt(2, 32), 16)
	a := fillSealed(t, p, "a", hs)
	b, hits, err := p.AcquirePrefix("b", hs, 3)
	require.NoError(t, err)
	require.Equal(t, 2, hits)
	st := p.Stats()
	require.Equal(t, 3, st.Leased, "a shared block is one leased block")
	a.Release()
	require.Equal(t, 3, p.Stats().Leased, "b still holds the shared blocks")
	<-a.Settled()
	b.Release()
	st = p.Stats()
	require.Equal(t, 2, st.Cached)
	require.Equal(t, 6, st.Free)
}

func TestEvictionLRUTailFirst(t *testing.T) {
	p := newTestPool(t, 6)
	chainA := ChainHashes(1, prompt(1, 48), 16) // 3 blocks
	chainB := ChainHashes(1, prompt(2, 32), 16) // 2 blocks
	a := fillSealed(t, p, "a", chainA)
	a.Release() // A is older
	b := fillSealed(t, p, "b", chainB)
	b.Release()
	require.Equal(t, 5, p.Stats().Cached)

	// One block is free: eviction waits until it is used.
	l1, err := p.Acquire("x", 1)
	require.NoError(t, err)
	require.EqualValues(t, 0, p.Stats().Evictions, "evict only when nothing is free")
	require.Equal(t, 3, p.CachedPrefix(chainA))

	// The next fresh block evicts A's tail: the least recently used, and
	// the end of its chain, so no findable block is left without parent.
	l2, err := p.Acquire("y", 1)
	require.NoError(t, err)
	require.EqualValues(t, 1, p.Stats().Evictions)
	require.Equal(t, 2, p.CachedPrefix(chainA))
	require.Equal(t, 2, p.CachedPrefix(chainB))
	require.NoError(t, l2.Extend(2))
	require.Equal(t, 0, p.CachedPrefix(chainA), "A is evicted from its end, whole")
	require.Equal(t, 2, p.CachedPrefix(chainB), "B is more recent")
	l1.Release()
	l2.Release()
}

func TestPrefixHitRefreshesRecency(t *testing.T) {
	p := newTestPool(t, 4)
	chainA := ChainHashes(1, prompt(1, 16), 16)
	chainB := ChainHashes(1, prompt(2, 16), 16)
	fillSealed(t, p, "a", chainA).Release()
	fillSealed(t, p, "b", chainB).Release()
	// Touch A: it becomes the most recently unreferenced.
	l, hits, err := p.AcquirePrefix("a2", chainA, 1)
	require.NoError(t, err)
	require.Equal(t, 1, hits)
	l.Release()
	x, err := p.Acquire("x", 3) // 2 free + 1 eviction: B goes
	require.NoError(t, err)
	require.Equal(t, 1, p.CachedPrefix(chainA))
	require.Equal(t, 0, p.CachedPrefix(chainB))
	x.Release()
}

func TestAcquirePrefixAllOrNothing(t *testing.T) {
	p := newTestPool(t, 4)
	hs := ChainHashes(1, prompt(1, 32), 16)
	fillSealed(t, p, "a", hs).Release()
	hold, err := p.Acquire("hold", 1)
	require.NoError(t, err)
	before := p.Stats()
	// 2 hits + 2 fresh needs 2 of the 1 free block: exhausted.
	_, _, err = p.AcquirePrefix("b", hs, 4)
	require.ErrorIs(t, err, ErrExhausted)
	after := p.Stats()
	require.Equal(t, before.Cached, after.Cached, "nothing evicted")
	require.Equal(t, before.Leased, after.Leased, "no reference taken")
	require.Equal(t, before.Evictions, after.Evictions)
	require.Equal(t, 2, p.CachedPrefix(hs))
	// The cached blocks themselves may not be counted as evictable for the
	// fresh part when they are the hits.
	l, hits, err := p.AcquirePrefix("b", hs, 3)
	require.NoError(t, err)
	require.Equal(t, 2, hits)
	l.Release()
	hold.Release()
}

func TestAcquirePrefixNSmallerThanHits(t *testing.T) {
	p := newTestPool(t, 8)
	hs := ChainHashes(1, prompt(1, 64), 16)
	fillSealed(t, p, "a", hs).Release()
	l, hits, err := p.AcquirePrefix("b", hs, 2)
	require.NoError(t, err)
	require.Equal(t, 2, hits)
	require.Equal(t, 2, l.Len())
	l.Release()
	_, _, err = p.AcquirePrefix("b", hs, 0)
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, _, err = p.AcquirePrefix("", hs, 1)
	require.ErrorIs(t, err, ErrInvalidArgument)
}

func TestAcquirePrefixRespectsWaiters(t *testing.T) {
	p := newTestPool(t, 2)
	hs := ChainHashes(1, prompt(1, 16), 16)
	a := fillSealed(t, p, "a", hs)
	big, err := p.Acquire("big", 1)
	require.NoError(t, err)
	ready := make(chan error, 1)
	go func() {
		l, err := p.AcquireWait(t.Context(), "waiter", 2)
		if err == nil {
			l.Release()
		}
		ready <- err
	}()
	for p.Stats().Waiters == 0 {
		runtimeGosched()
	}
	_, _, err = p.AcquirePrefix("late", hs, 1)
	require.ErrorIs(t, err, ErrExhausted, "a prefix acquire never overtakes a waiter")
	a.Release()
	big.Release()
	require.NoError(t, <-ready)
}

func TestSealRules(t *testing.T) {
	var seen []Event
	p := newTestPool(t, 8, WithObserver(ObserverFunc(func(e Event) { seen = append(seen, e) })))
	l, err := p.Acquire("a", 3)
	require.NoError(t, err)
	require.ErrorIs(t, l.Seal(3, 1), ErrInvalidArgument)
	require.ErrorIs(t, l.Seal(-1, 1), ErrInvalidArgument)
	require.NoError(t, l.Seal(0, 7))
	require.NoError(t, l.Seal(0, 7), "same hash again is a no-op")
	require.ErrorIs(t, l.Seal(0, 8), ErrInvalidArgument, "re-sealing with another hash")

	w := NewTransfer(nil)
	require.NoError(t, l.AttachRange(w, 1, 2, Write))
	require.ErrorIs(t, l.Seal(1, 9), ErrInvalidArgument, "a pending write")
	w.Quarantine(nil)
	require.ErrorIs(t, l.Seal(1, 9), ErrInvalidArgument, "a quarantined write: content unknown")
	w.Resolve(nil)
	require.NoError(t, l.Seal(1, 9))
	require.ErrorIs(t, l.AttachRange(NewTransfer(nil), 0, 2, Write), ErrInvalidArgument, "no write over sealed content")

	// A second block with a taken hash is sealed but private.
	b, err := p.Acquire("b", 1)
	require.NoError(t, err)
	require.NoError(t, b.Seal(0, 7))
	require.EqualValues(t, 1, p.Stats().DuplicateSeals)
	require.True(t, slices.ContainsFunc(seen, func(e Event) bool { return e.Kind == EventDuplicateSeal }))
	b.Release()
	require.Equal(t, 0, p.Stats().Cached, "a private sealed block is free once unreferenced")
	l.Release()
	require.Equal(t, 2, p.Stats().Cached)
	require.ErrorIs(t, l.Seal(2, 10), ErrLeaseClosed)
	h, hits, err := p.AcquirePrefix("c", []BlockHash{7, 9}, 2)
	require.NoError(t, err)
	require.Equal(t, 2, hits)
	h.Release()
}

func TestPrefixHitOnDrainingAndQuarantinedReads(t *testing.T) {
	p := newTestPool(t, 8)
	hs := ChainHashes(1, prompt(1, 32), 16)
	a := fillSealed(t, p, "a", hs)
	send := NewTransfer(nil)
	require.NoError(t, a.AttachRange(send, 0, 2, Read))
	a.Release()
	require.Equal(t, 2, p.Stats().Draining)
	b, hits, err := p.AcquirePrefix("b", hs, 2)
	require.NoError(t, err)
	require.Equal(t, 2, hits, "sealed content of a draining block is immutable")
	require.Equal(t, 2, p.Stats().Leased)
	send.Quarantine(nil)
	require.Equal(t, 2, p.Stats().Quarantined)
	b.Release()
	c, hits, err := p.AcquirePrefix("c", hs, 2)
	require.NoError(t, err)
	require.Equal(t, 2, hits, "a quarantined read keeps serving hits")
	c.Release()
	send.Resolve(nil)
	require.Equal(t, 2, p.Stats().Cached)
}

func TestShare(t *testing.T) {
	p := newTestPool(t, 8)
	hs := ChainHashes(1, prompt(1, 32), 16)
	a, err := p.Acquire("a", 3)
	require.NoError(t, err)
	require.NoError(t, a.Seal(0, hs[0]))
	_, err = a.Share("beam", 2)
	require.ErrorIs(t, err, ErrInvalidArgument, "block 1 is not sealed")
	require.NoError(t, a.Seal(1, hs[1]))
	_, err = a.Share("", 2)
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = a.Share("beam", 4)
	require.ErrorIs(t, err, ErrInvalidArgument)
	b, err := a.Share("beam", 2)
	require.NoError(t, err)
	require.Equal(t, a.Ref(0), b.Ref(0))
	require.Equal(t, a.Ref(1), b.Ref(1))
	require.NoError(t, b.Extend(1))
	require.Equal(t, 4, p.Stats().Leased)
	a.Release()
	require.Equal(t, 3, p.Stats().Leased)
	_, err = a.Share("late", 1)
	require.ErrorIs(t, err, ErrLeaseClosed)
	b.Release()
	require.Equal(t, 2, p.Stats().Cached)
	require.Equal(t, 6, p.Stats().Free)
}

func TestResetCache(t *testing.T) {
	p := newTestPool(t, 8, WithKVEvents(16))
	hs := ChainHashes(1, prompt(1, 64), 16)
	a := fillSealed(t, p, "a", hs[:2])
	a.Release()
	held := fillSealed(t, p, "b", hs)
	require.Equal(t, 4, p.CachedPrefix(hs))
	evs, _ := p.DrainKVEvents(nil)
	require.Len(t, evs, 4)
	// b holds all four (two as hits): nothing unreferenced to drop.
	require.Equal(t, 0, p.ResetCache())
	held.Release()
}

func TestResetCacheDropsUnreferenced(t *testing.T) {
	p := newTestPool(t, 8, WithKVEvents(16))
	ha := ChainHashes(1, prompt(1, 32), 16)
	hb := ChainHashes(1, prompt(2, 32), 16)
	fillSealed(t, p, "a", ha).Release()
	b := fillSealed(t, p, "b", hb)
	_, _ = p.DrainKVEvents(nil)
	require.Equal(t, 2, p.ResetCache())
	require.Equal(t, 0, p.CachedPrefix(ha))
	require.Equal(t, 2, p.CachedPrefix(hb), "referenced sealed blocks stay findable")
	st := p.Stats()
	require.Equal(t, 0, st.Cached)
	require.Equal(t, 6, st.Free)
	evs, dropped := p.DrainKVEvents(nil)
	require.Zero(t, dropped)
	require.Len(t, evs, 2)
	for _, e := range evs {
		require.Equal(t, KVBlockRemoved, e.Kind)
	}
	b.Release()
	require.Equal(t, 2, p.ResetCache())
	evs, _ = p.DrainKVEvents(nil)
	require.Len(t, evs, 1)
	require.Equal(t, KVAllBlocksCleared, evs[0].Kind, "an emptied index is one AllBlocksCleared")
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
	seq, hashes := p.SnapshotKVCache()
	require.EqualValues(t, 5, seq)
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

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func TestVerifiedModeCatchesCollision(t *testing.T) {
	const seed = BlockHash(11)
	victim := prompt(1, 16)
	attacker := prompt(2, 16)
	forged := HashBlock(seed, attacker) // the attacker's lookup hash

	for _, verified := range []bool{false, true} {
		t.Run(fmt.Sprintf("verified=%v", verified), func(t *testing.T) {
			opts := []Option{WithBlockTokens(16)}
			if verified {
				opts = []Option{WithVerifiedPrefix(16)}
			}
			p := newTestPool(t, 4, opts...)
			v, err := p.Acquire("victim", 1)
			require.NoError(t, err)
			r, _ := v.Region(0)
			copy(r, "victim's secret KV")
			// Inject a collision: the victim's block is findable by the
			// hash of the attacker's tokens.
			require.NoError(t, v.ls.seal(0, forged, &sealTokens{parent: seed, tokens: victim}))
			v.Release()

			// One more token: the forged block is not the one holding the
			// prompt's last token, so it may hit.
			l, hits, err := p.AcquirePrefixTokens("attacker", seed, append(slices.Clone(attacker), 7), 2)
			require.NoError(t, err)
			defer l.Release()
			if !verified {
				require.Equal(t, 1, hits, "plain mode trusts the hash: this is the danger")
				return
			}
			require.Equal(t, 0, hits, "verified mode turns the collision into a miss")
			require.EqualValues(t, 1, p.Stats().VerifyMismatches)
			got, _ := l.Region(0)
			require.NotContains(t, string(got), "secret")
		})
	}
}

func TestVerifiedModeRules(t *testing.T) {
	p := newTestPool(t, 8, WithVerifiedPrefix(4))
	toks := prompt(1, 12)
	a, err := p.Acquire("a", 3)
	require.NoError(t, err)
	require.ErrorIs(t, a.Seal(0, 1), ErrInvalidArgument, "verified mode needs the tokens")
	_, err = a.SealTokens(0, 0, toks[:3])
	require.ErrorIs(t, err, ErrInvalidArgument, "a block holds exactly 4 tokens")
	parent := BlockHash(9)
	for i := range 3 {
		parent, err = a.SealTokens(i, parent, toks[i*4:(i+1)*4])
		require.NoError(t, err)
	}
	a.Release()
	hs := ChainHashes(9, toks, 4)
	require.Equal(t, 0, p.CachedPrefix(hs), "hash-only lookups cannot be verified")
	require.Equal(t, 2, p.CachedPrefixTokens(9, toks), "never the block holding the last token")
	require.Equal(t, 3, p.CachedPrefixTokens(9, append(slices.Clone(toks), 1)))
	require.Equal(t, 0, p.CachedPrefixTokens(8, append(slices.Clone(toks), 1)), "another namespace")
	l, hits, err := p.AcquirePrefixTokens("b", 9, append(slices.Clone(toks), 1, 2), 4)
	require.NoError(t, err)
	require.Equal(t, 3, hits)
	l.Release()
	// A different middle block stops the match there.
	other := append(slices.Clone(toks), 1)
	other[5] = -5
	require.Equal(t, 1, p.CachedPrefixTokens(9, other))

	plain := newTestPool(t, 2)
	_, _, err = plain.AcquirePrefixTokens("x", 0, toks, 1)
	require.ErrorIs(t, err, ErrInvalidArgument, "no block size configured")
	_, err = NewPool[[]byte](must(NewHostMemory(1, 1)), WithVerifiedPrefix(0))
	require.ErrorIs(t, err, ErrInvalidArgument)
}

func TestPrefixChainNeverRepeatsABlock(t *testing.T) {
	p := newTestPool(t, 4)
	a, err := p.Acquire("a", 1)
	require.NoError(t, err)
	require.NoError(t, a.Seal(0, 5))
	a.Release()
	// A hash list naming the same block twice hits it once.
	l, hits, err := p.AcquirePrefix("b", []BlockHash{5, 5}, 2)
	require.NoError(t, err)
	require.Equal(t, 1, hits)
	require.NotEqual(t, l.Ref(0).ID, l.Ref(1).ID)
	l.Release()
	require.True(t, errors.Is(p.Check(), nil))
}

func TestExhaustedErrorsReadWell(t *testing.T) {
	p := newTestPool(t, 3)
	l, err := p.Acquire("a", 2)
	require.NoError(t, err)
	hold, err := p.Acquire("hold", 1)
	require.NoError(t, err)
	defer hold.Release()
	_, err = p.Acquire("b", 1)
	require.ErrorIs(t, err, ErrExhausted)
	require.Equal(t, `kvlease: acquire 1 blocks for "b": 0 free or evictable: kvlease: exhausted`, err.Error())
	err = l.Extend(1)
	require.ErrorIs(t, err, ErrExhausted)
	require.Contains(t, err.Error(), "extend lease")
	_, _, err = p.AcquirePrefix("c", []BlockHash{1}, 1)
	require.ErrorIs(t, err, ErrExhausted)
	l.Release()
}

package kvlease

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// cachedChain fills a pool of n blocks with one sealed chain of n blocks,
// all cached, content byte k in block k.
func cachedChain(t *testing.T, p *Pool[[]byte], n int) []BlockHash {
	t.Helper()
	hashes := make([]BlockHash, n)
	l, err := p.Acquire("fill", n)
	require.NoError(t, err)
	for k := range n {
		hashes[k] = BlockHash(100 + k)
		r, err := l.Region(k)
		require.NoError(t, err)
		for j := range r {
			r[j] = byte(k + 1)
		}
		require.NoError(t, l.Seal(k, hashes[k]))
	}
	l.Release()
	return hashes
}

type offered struct {
	l      *Lease[[]byte]
	hashes []BlockHash
}

func TestEvictHookOffersSurplusVictim(t *testing.T) {
	p := newTestPool(t, 4)
	hashes := cachedChain(t, p, 4)
	var got []offered
	p.SetEvictHook(func(l *Lease[[]byte], h []BlockHash) { got = append(got, offered{l, h}) })

	// The chain is evicted from its end: block 3 is the least recently
	// used. It is offered; the acquire takes block 2.
	l, err := p.Acquire("a", 1)
	require.NoError(t, err)
	require.Len(t, got, 1)
	o := got[0]
	require.Equal(t, []BlockHash{hashes[3]}, o.hashes)
	require.Equal(t, evictOwner, o.l.Owner())
	require.Equal(t, 1, o.l.Len())
	require.Equal(t, 2, p.CachedPrefix(hashes), "blocks 2 and 3 left the index")
	st := p.Stats()
	require.Equal(t, Stats{Capacity: 4, Cached: 2, Leased: 2}, Stats{Capacity: st.Capacity, Free: st.Free, Cached: st.Cached, Leased: st.Leased})
	require.EqualValues(t, 2, st.Evictions)

	// The offered block keeps its content and generation.
	r, err := p.Region(o.l.Ref(0))
	require.NoError(t, err)
	require.Equal(t, byte(4), r[0])
	require.NotEqual(t, o.l.Ref(0).ID, l.Ref(0).ID)

	// A copy reads it; the hook's lease closes at once; the block drains
	// until the copy resolves, then it is free, not cached.
	tr := NewTransfer(nil)
	require.NoError(t, o.l.AttachRange(tr, 0, 1, Read))
	o.l.Release()
	st = p.Stats()
	require.Equal(t, 1, st.Draining)
	require.True(t, tr.Resolve(nil))
	st = p.Stats()
	require.Equal(t, 1, st.Free)
	require.Equal(t, 2, st.Cached)
	_, err = p.Region(o.l.Ref(0))
	require.ErrorIs(t, err, ErrStaleRef)
	l.Release()
	require.NoError(t, p.Check())
}

func TestEvictHookNoSurplusEvictsAsBefore(t *testing.T) {
	p := newTestPool(t, 4)
	hashes := cachedChain(t, p, 4)
	calls := 0
	p.SetEvictHook(func(l *Lease[[]byte], h []BlockHash) { calls++; l.Release() })
	// 3 fresh of 4 cached: one surplus block is offered, then the rest are
	// evicted plainly.
	l, err := p.Acquire("a", 3)
	require.NoError(t, err)
	require.Equal(t, 1, calls)
	require.Equal(t, 0, p.CachedPrefix(hashes))
	l.Release()
	// 4 of 4: no surplus, no offer, no refusal.
	cachedChain(t, p, 4)
	calls = 0
	l, err = p.Acquire("b", 4)
	require.NoError(t, err)
	require.Zero(t, calls)
	l.Release()
	p.SetEvictHook(nil)
	cachedChain(t, p, 4)
	l, err = p.Acquire("c", 1)
	require.NoError(t, err)
	require.Zero(t, calls)
	l.Release()
}

// TestEvictHookNeverRefuses runs the same random operations on a pool with
// a hook (that closes each offered lease at once) and one without: every
// acquire succeeds or fails alike. (Plain acquires: with prefix hits the
// two caches would hold different blocks by design.)
func TestEvictHookNeverRefuses(t *testing.T) {
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 7))
		plain, hooked := newTestPool(t, 16), newTestPool(t, 16)
		offers := 0
		hooked.SetEvictHook(func(l *Lease[[]byte], h []BlockHash) {
			offers += l.Len()
			require.Len(t, h, l.Len())
			l.Release()
		})
		var live [2][]*Lease[[]byte]
		for op := range 400 {
			switch k := rng.IntN(10); {
			case k < 5:
				n := 1 + rng.IntN(6)
				var hs []BlockHash
				for j := range n {
					hs = append(hs, BlockHash(1+rng.IntN(6)*100+j))
				}
				for i, p := range []*Pool[[]byte]{plain, hooked} {
					l, err := p.Acquire("r", n)
					if err != nil {
						live[i] = append(live[i], nil)
						continue
					}
					for j := range n {
						_ = l.Seal(j, hs[j])
					}
					live[i] = append(live[i], l)
				}
				require.Equal(t, live[0][len(live[0])-1] == nil, live[1][len(live[1])-1] == nil, "seed %d op %d", seed, op)
			case k < 9 && len(live[0]) > 0:
				j := rng.IntN(len(live[0]))
				for i := range live {
					if l := live[i][j]; l != nil {
						l.Release()
					}
					live[i] = append(live[i][:j], live[i][j+1:]...)
				}
			default:
				for i := range live {
					for _, l := range live[i] {
						if l != nil {
							l.Release()
						}
					}
					live[i] = nil
				}
			}
		}
		require.Positive(t, offers, "seed %d", seed)
	}
}

func TestEvictHookConcurrent(t *testing.T) {
	p := newTestPool(t, 64)
	var wg sync.WaitGroup
	p.SetEvictHook(func(l *Lease[[]byte], h []BlockHash) {
		tr := NewTransfer(nil)
		if err := l.AttachRange(tr, 0, l.Len(), Read); err != nil {
			t.Error(err)
		}
		l.Release()
		wg.Add(1)
		go func() { defer wg.Done(); tr.Resolve(nil) }()
	})
	var workers sync.WaitGroup
	for g := range 4 {
		workers.Add(1)
		go func() {
			defer workers.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 1))
			for range 300 {
				n := 1 + rng.IntN(8)
				hs := make([]BlockHash, n)
				base := rng.IntN(40) * 100
				for j := range hs {
					hs[j] = BlockHash(base + j + 1)
				}
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				l, err := p.AcquireWait(ctx, "w", n)
				cancel()
				if err != nil {
					continue
				}
				for j := range n {
					_ = l.Seal(j, hs[j])
				}
				l.Release()
			}
		}()
	}
	workers.Wait()
	wg.Wait()
	require.NoError(t, p.Check())
	st := p.Stats()
	require.Equal(t, 64, st.Free+st.Cached)
}

func TestAcquireHits(t *testing.T) {
	p := newTestPool(t, 8)
	hashes := cachedChain(t, p, 3)
	l, err := p.AcquireHits("h", append(hashes[:2:2], 999, hashes[2]))
	require.NoError(t, err)
	require.Equal(t, 2, l.Len())
	st := p.Stats()
	require.Equal(t, 2, st.Leased)
	require.Equal(t, 1, st.Cached)
	l.Release()

	l, err = p.AcquireHits("h", []BlockHash{5, 6})
	require.NoError(t, err)
	require.Nil(t, l)

	_, err = p.AcquireHits("", hashes)
	require.ErrorIs(t, err, ErrInvalidArgument)

	// A queued waiter is never overtaken.
	hold, err := p.Acquire("hold", 8)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { _, err := p.AcquireWait(ctx, "w", 8); done <- err }()
	require.Eventually(t, func() bool { return p.Stats().Waiters == 1 }, time.Second, time.Millisecond)
	_, err = p.AcquireHits("h", hashes)
	require.ErrorIs(t, err, ErrExhausted)
	cancel()
	require.True(t, errors.Is(<-done, context.Canceled))
	hold.Release()

	require.NoError(t, p.Close())
	_, err = p.AcquireHits("h", hashes)
	require.ErrorIs(t, err, ErrPoolClosed)
}

func TestOfferCached(t *testing.T) {
	p := newTestPool(t, 8)
	hashes := cachedChain(t, p, 4)
	require.Zero(t, p.OfferCached(2), "no hook, no offer")
	var got []offered
	p.SetEvictHook(func(l *Lease[[]byte], h []BlockHash) { got = append(got, offered{l, h}) })
	require.Equal(t, 2, p.OfferCached(2))
	require.Len(t, got, 1)
	// The two least recently used (the chain's end, evicted tail first),
	// offered in ascending block order: one run.
	require.Equal(t, []BlockHash{hashes[2], hashes[3]}, got[0].hashes)
	require.Equal(t, []Run{{Start: got[0].l.Ref(0).ID, Len: 2}}, got[0].l.AppendRuns(nil, 0))
	require.Equal(t, 2, p.CachedPrefix(hashes))
	got[0].l.Release()
	require.Equal(t, 6, p.Stats().Free)
	require.Equal(t, 2, p.OfferCached(5), "only what is cached")
	got[1].l.Release()
	require.Equal(t, 8, p.Stats().Free)
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

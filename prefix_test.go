package kvlease

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

func newTestPool(t testing.TB, blocks int, opts ...Option) *Pool[[]byte] {
	t.Helper()
	p := hostPool(t, blocks, 32, opts...)
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
	require.Equal(t, 0, p.ResetCache(false))
	held.Release()
}

func TestResetCacheDropsUnreferenced(t *testing.T) {
	p := newTestPool(t, 8, WithKVEvents(16))
	ha := ChainHashes(1, prompt(1, 32), 16)
	hb := ChainHashes(1, prompt(2, 32), 16)
	fillSealed(t, p, "a", ha).Release()
	b := fillSealed(t, p, "b", hb)
	_, _ = p.DrainKVEvents(nil)
	require.Equal(t, 2, p.ResetCache(false))
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
	require.Equal(t, 2, p.ResetCache(false))
	evs, _ = p.DrainKVEvents(nil)
	require.Len(t, evs, 1)
	require.Equal(t, KVAllBlocksCleared, evs[0].Kind, "an emptied index is one AllBlocksCleared")
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
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

// A fully cached, block-aligned prompt must not hit the block holding its
// last token: the engine recomputes that token into it, so it must be a
// fresh private block.
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

// ResetCache(true) makes in-use sealed blocks unfindable too: after a
// weight update nothing old may hit. The default keeps them findable.
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

	require.Equal(t, 1, p.ResetCache(false), "default: only the unreferenced block")
	require.Equal(t, 3, p.CachedPrefix(hs), "in-use blocks stay findable by default")

	require.Equal(t, 3, p.ResetCache(true))
	require.Equal(t, 0, p.CachedPrefix(hs), "nothing old may hit")
	evs, _ := p.DrainKVEvents(nil)
	require.Equal(t, KVAllBlocksCleared, evs[len(evs)-1].Kind)
	_, snap := p.SnapshotKVBlocks(nil)
	require.Empty(t, snap)
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

func runtimeGosched() { runtime.Gosched() }

// sealedContent is what a block sealed with hash h holds in the churn
// test: anyone hitting h must read exactly this.
func sealedContent(dst []byte, h BlockHash) {
	for i := 0; i+8 <= len(dst); i += 8 {
		binary.LittleEndian.PutUint64(dst[i:], uint64(h)+uint64(i))
	}
}

// privateContent marks a block only its lease may see.
func privateContent(dst []byte, lease uint64, i int) {
	for j := 0; j+8 <= len(dst); j += 8 {
		binary.LittleEndian.PutUint64(dst[j:], lease<<20|uint64(i)<<8|uint64(j)|1<<63)
	}
}

// TestPrefixChurnMarkers runs many requests that share system prompts
// through a small verified-mode pool: hits must see exactly the sealed
// content, private blocks exactly their owner's marker, under eviction
// pressure, late transfers and aborts. Run it under -race.
func TestPrefixChurnMarkers(t *testing.T) {
	const (
		workers   = 8
		iters     = 300
		bt        = 4
		blockSize = 64
		seed      = BlockHash(0x5eed)
	)
	mem, err := NewHostMemory(48, blockSize)
	require.NoError(t, err)
	p, err := NewPool[[]byte](mem, WithVerifiedPrefix(bt))
	require.NoError(t, err)

	var wg sync.WaitGroup
	var pending sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			fail := func(format string, args ...any) {
				select {
				case errs <- fmt.Errorf(format, args...):
				default:
				}
			}
			for it := range iters {
				sys := rng.IntN(3)
				toks := prompt(sys, bt*(2+sys)) // shared system prompt
				// The user's turn: one of four conversations of this worker's
				// (ids never shared between workers), so that the sealed
				// blocks outgrow the pool however the workers are scheduled
				// (one after another included): eviction is exercised.
				toks = append(toks, prompt(100+w+workers*rng.IntN(4), bt*rng.IntN(3)+rng.IntN(bt))...)
				full := len(toks) / bt
				n := full + 1
				l, hits, err := p.AcquirePrefixTokens(fmt.Sprintf("w%d-%d", w, it), seed, toks, n)
				if errors.Is(err, ErrExhausted) {
					continue
				}
				if err != nil {
					fail("acquire: %v", err)
					return
				}
				hashes := ChainHashes(seed, toks, bt)
				for i := range hits {
					r, _ := l.ReadRegion(i)
					want := make([]byte, blockSize)
					sealedContent(want, hashes[i])
					if string(r) != string(want) {
						fail("lease %d hit block %d (%v) holds foreign content", l.ID(), i, l.Ref(i))
					}
				}
				parent := seed
				if hits > 0 {
					parent = hashes[hits-1]
				}
				for i := hits; i < n; i++ {
					r, _ := l.Region(i)
					if i < full {
						sealedContent(r, hashes[i])
						h, err := l.SealTokens(i, parent, toks[i*bt:(i+1)*bt])
						if err != nil || h != hashes[i] {
							fail("seal block %d: %v", i, err)
						}
						parent = h
					} else {
						privateContent(r, l.ID(), i)
					}
				}
				// Sometimes an asynchronous send reads the whole lease.
				var tr *Transfer
				if rng.IntN(3) == 0 {
					tr = NewTransfer(nil)
					if err := l.Attach(tr); err != nil {
						fail("attach: %v", err)
					}
				}
				r, _ := l.ReadRegion(n - 1)
				want := make([]byte, blockSize)
				privateContent(want, l.ID(), n-1)
				if string(r) != string(want) {
					fail("lease %d private block overwritten", l.ID())
				}
				if rng.IntN(4) == 0 {
					l.Abort(nil)
				} else {
					l.Release()
				}
				if tr != nil {
					pending.Add(1)
					go func() {
						defer pending.Done()
						if rng := rand.New(rand.NewPCG(tr.ID(), 1)); rng.IntN(4) == 0 {
							tr.Quarantine(nil)
						}
						tr.Resolve(nil)
					}()
				}
			}
		}()
	}
	done := make(chan struct{})
	go func() {
		for {
			select {
			case <-done:
				return
			default:
			}
			s := p.Stats()
			if sum := s.Free + s.Cached + s.Leased + s.Draining + s.Quarantined; sum != s.Capacity {
				errs <- fmt.Errorf("state counts %+v sum to %d", s, sum)
				return
			}
		}
	}()
	wg.Wait()
	pending.Wait()
	close(done)
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	require.NoError(t, p.Check())
	s := p.Stats()
	require.Zero(t, s.Leased+s.Draining+s.Quarantined, "%+v", s)
	require.Equal(t, s.Capacity, s.Free+s.Cached)
	require.NotZero(t, s.PrefixHits, "the workload must exercise hits")
	require.NotZero(t, s.Evictions, "the workload must exercise eviction")
}

// prefixModel is a deliberately naive model of the prefix cache: plain
// slices and maps, linear scans, no shared code with the pool. Blocks are
// the model's own numbers; only observable facts are compared.
type prefixModel struct {
	capacity int
	blocks   map[int]*modelBlock // live (not free) blocks by model id
	next     int
	index    map[BlockHash]int // findable hash → model block
	lru      []int             // unreferenced findable blocks, oldest first
	leases   [][]int           // open leases: model block per position

	queries, hits, refused uint64 // Stats.PrefixQueries, PrefixHits, PrefixRefused
}

type modelBlock struct {
	refs   int
	sealed bool
	hash   BlockHash
}

func newPrefixModel(capacity int) *prefixModel {
	return &prefixModel{capacity: capacity, blocks: map[int]*modelBlock{}, index: map[BlockHash]int{}}
}

func (m *prefixModel) free() int { return m.capacity - len(m.blocks) }

func (m *prefixModel) hitCount(hashes []BlockHash) int {
	seen := map[int]bool{}
	for k, h := range hashes {
		b, ok := m.index[h]
		if !ok || seen[b] {
			return k
		}
		seen[b] = true
	}
	return len(hashes)
}

// acquire mirrors AcquirePrefix: hits first, then fresh blocks from the
// free pool, then by evicting the oldest LRU entries.
func (m *prefixModel) acquire(hashes []BlockHash, n int) (int, bool) {
	if len(hashes) > n {
		hashes = hashes[:n]
	}
	h := m.hitCount(hashes)
	lruHits := 0
	for _, x := range hashes[:h] {
		if slices.Contains(m.lru, m.index[x]) {
			lruHits++
		}
	}
	if n-h > m.free()+len(m.lru)-lruHits {
		m.refused += uint64(len(hashes))
		return 0, false
	}
	m.queries += uint64(len(hashes))
	m.hits += uint64(h)
	var l []int
	for _, x := range hashes[:h] {
		b := m.index[x]
		m.lru = slices.DeleteFunc(m.lru, func(y int) bool { return y == b })
		m.blocks[b].refs++
		l = append(l, b)
	}
	for range n - h {
		if m.free() == 0 {
			old := m.lru[0]
			m.lru = m.lru[1:]
			delete(m.index, m.blocks[old].hash)
			delete(m.blocks, old)
		}
		m.next++
		m.blocks[m.next] = &modelBlock{refs: 1}
		l = append(l, m.next)
	}
	m.leases = append(m.leases, l)
	return h, true
}

func (m *prefixModel) seal(lease, i int, h BlockHash) error {
	b := m.blocks[m.leases[lease][i]]
	if b.sealed {
		if b.hash != h {
			return ErrInvalidArgument
		}
		return nil
	}
	b.sealed, b.hash = true, h
	if _, taken := m.index[h]; !taken {
		m.index[h] = m.leases[lease][i]
	}
	return nil
}

func (m *prefixModel) release(lease int) {
	l := m.leases[lease]
	m.leases = slices.Delete(m.leases, lease, lease+1)
	for i := len(l) - 1; i >= 0; i-- {
		b := m.blocks[l[i]]
		b.refs--
		if b.refs > 0 {
			continue
		}
		if b.sealed && m.index[b.hash] == l[i] {
			m.lru = append(m.lru, l[i])
		} else {
			delete(m.blocks, l[i])
		}
	}
}

func (m *prefixModel) reset(all bool) int {
	n := len(m.lru)
	for _, b := range m.lru {
		delete(m.index, m.blocks[b].hash)
		delete(m.blocks, b)
	}
	m.lru = nil
	if all {
		// In-use blocks stay sealed but leave the index.
		n += len(m.index)
		clear(m.index)
	}
	return n
}

// FuzzPrefixCache drives seal / hit / release / evict / reset sequences
// through a small pool and the model, and compares after every step.
func FuzzPrefixCache(f *testing.F) {
	f.Add([]byte{0, 0, 4, 1, 0, 0, 1, 0, 1, 2, 0, 0, 1, 4, 0, 3, 0, 0})
	f.Add([]byte{4, 6, 2, 0, 0, 1, 4, 0, 2, 1, 3, 0, 3, 0, 0})
	f.Add([]byte{0, 1, 3, 1, 0, 0, 1, 0, 1, 1, 0, 2, 2, 0, 0, 0, 2, 5, 2, 0, 0, 4, 1, 0, 2, 1, 0})
	f.Add([]byte{0, 0, 4, 1, 0, 0, 1, 0, 1, 3, 0, 1, 0, 0, 4, 2, 0, 0, 0, 0, 4})
	const capacity = 6
	chains := [][]BlockHash{
		ChainHashes(1, prompt(1, 12), 4),
		ChainHashes(1, prompt(2, 16), 4),
		ChainHashes(2, prompt(1, 12), 4), // same tokens, another namespace
	}
	f.Fuzz(func(t *testing.T, ops []byte) {
		p := newTestPool(t, capacity)
		m := newPrefixModel(capacity)
		type live struct {
			l     *Lease[[]byte]
			chain int
		}
		var leases []live
		for step := 0; step+2 < len(ops); step += 3 {
			op, a, b := ops[step]%5, int(ops[step+1]), int(ops[step+2])
			what := ""
			switch op {
			case 0: // acquire a prefix
				chain := a % len(chains)
				n := 1 + b%5
				what = fmt.Sprintf("acquire chain %d n=%d", chain, n)
				wantHits, ok := m.acquire(chains[chain], n)
				l, hits, err := p.AcquirePrefix("f", chains[chain], n)
				if !ok {
					if !errors.Is(err, ErrExhausted) && !errors.Is(err, ErrExceedsCapacity) {
						t.Fatalf("step %d %s: model says exhausted, pool says %v", step, what, err)
					}
					break
				}
				if err != nil || hits != wantHits {
					t.Fatalf("step %d %s: pool hits=%d err=%v, model hits=%d", step, what, hits, err, wantHits)
				}
				leases = append(leases, live{l, chain})
			case 1: // seal block i with its chain hash
				if len(leases) == 0 {
					continue
				}
				j := a % len(leases)
				i := b % leases[j].l.Len()
				chain := chains[leases[j].chain]
				h := BlockHash(1000 + i) // beyond the chain: a private hash
				if i < len(chain) {
					h = chain[i]
				}
				what = fmt.Sprintf("seal lease %d block %d", j, i)
				want := m.seal(j, i, h)
				if got := leases[j].l.Seal(i, h); !errors.Is(got, want) {
					t.Fatalf("step %d %s: pool %v, model %v", step, what, got, want)
				}
			case 2: // release
				if len(leases) == 0 {
					continue
				}
				j := a % len(leases)
				what = fmt.Sprintf("release lease %d", j)
				leases[j].l.Release()
				leases = slices.Delete(leases, j, j+1)
				m.release(j)
			case 3:
				all := b%2 == 1
				what = fmt.Sprintf("reset (all=%v)", all)
				var got int
				if all {
					got = p.ResetCache(true)
				} else {
					got = p.ResetCache(false)
				}
				if want := m.reset(all); got != want {
					t.Fatalf("step %d %s: pool reset %d blocks, model %d", step, what, got, want)
				}
			case 4: // plain acquire
				n := 1 + a%3
				what = fmt.Sprintf("acquire %d", n)
				_, ok := m.acquire(nil, n)
				l, err := p.Acquire("f", n)
				if ok != (err == nil) {
					t.Fatalf("step %d %s: model ok=%v, pool %v", step, what, ok, err)
				}
				if ok {
					leases = append(leases, live{l, 0})
				}
			}
			st := p.Stats()
			leased := 0
			for _, blk := range m.blocks {
				if blk.refs > 0 {
					leased++
				}
			}
			if st.Free != m.free() || st.Cached != len(m.lru) || st.Leased != leased {
				t.Fatalf("step %d %s: pool free=%d cached=%d leased=%d, model free=%d cached=%d leased=%d",
					step, what, st.Free, st.Cached, st.Leased, m.free(), len(m.lru), leased)
			}
			if st.PrefixQueries != m.queries || st.PrefixHits != m.hits || st.PrefixRefused != m.refused {
				t.Fatalf("step %d %s: pool queries=%d hits=%d refused=%d, model %d %d %d", step, what,
					st.PrefixQueries, st.PrefixHits, st.PrefixRefused, m.queries, m.hits, m.refused)
			}
			for c, chain := range chains {
				if got, want := p.CachedPrefix(chain), m.hitCount(chain); got != want {
					t.Fatalf("step %d %s: chain %d: pool prefix %d, model %d", step, what, c, got, want)
				}
			}
			if err := p.Check(); err != nil {
				t.Fatalf("step %d %s: %v", step, what, err)
			}
		}
		for _, l := range leases {
			l.l.Release()
		}
	})
}

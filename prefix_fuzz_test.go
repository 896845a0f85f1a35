package kvlease

import (
	"errors"
	"fmt"
	"slices"
	"testing"
)

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
					got = p.ResetCache(ResetAll)
				} else {
					got = p.ResetCache()
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

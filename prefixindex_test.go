package kvlease

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// indexModel drives a prefixIndex and a map side by side over a pool of
// n slots, as the pool does: a slot is in the index at most once, and
// its hash is recorded in pre before it is inserted.
type indexModel struct {
	t     testing.TB
	x     prefixIndex
	pre   []prefixSlot
	model map[BlockHash]BlockID
	in    []bool // slot is indexed
}

func newIndexModel(t testing.TB, n int) *indexModel {
	pre := make([]prefixSlot, n)
	return &indexModel{t: t, x: newPrefixIndex(pre), pre: pre,
		model: make(map[BlockHash]BlockID), in: make([]bool, n)}
}

// insert offers slot id with hash h; a slot already indexed is skipped.
func (m *indexModel) insert(id BlockID, h BlockHash) {
	if m.in[id] {
		return
	}
	_, taken := m.model[h]
	m.pre[id].hash = h
	if got := m.x.insert(h, id); got == taken {
		m.t.Fatalf("insert %x → slot %d: inserted=%v, model says taken=%v", uint64(h), id, got, taken)
	}
	if !taken {
		m.model[h] = id
		m.in[id] = true
	}
}

// remove takes slot id out if it is indexed.
func (m *indexModel) remove(id BlockID) {
	h := m.pre[id].hash
	if got := m.x.remove(h, id); got != m.in[id] {
		m.t.Fatalf("remove slot %d (%x): removed=%v, model says indexed=%v", id, uint64(h), got, m.in[id])
	}
	if m.in[id] {
		delete(m.model, h)
		m.in[id] = false
	}
}

// verify checks every model entry is found, a few absent hashes are not,
// and the table's structure.
func (m *indexModel) verify(absent ...BlockHash) {
	m.t.Helper()
	if m.x.len() != len(m.model) {
		m.t.Fatalf("len %d, model %d", m.x.len(), len(m.model))
	}
	for h, id := range m.model {
		if got, ok := m.x.find(h); !ok || got != id {
			m.t.Fatalf("find %x = %d,%v; want %d", uint64(h), got, ok, id)
		}
	}
	for _, h := range absent {
		if _, in := m.model[h]; in {
			continue
		}
		if got, ok := m.x.find(h); ok {
			m.t.Fatalf("find absent %x = slot %d", uint64(h), got)
		}
	}
	if err := m.x.check(); err != nil {
		m.t.Fatal(err)
	}
	n := 0
	for h, id := range m.x.all() {
		if m.model[h] != id {
			m.t.Fatalf("all: %x → %d, model %d", uint64(h), id, m.model[h])
		}
		n++
	}
	if n != len(m.model) {
		m.t.Fatalf("all: %d entries, model %d", n, len(m.model))
	}
}

func TestPrefixIndexBasics(t *testing.T) {
	m := newIndexModel(t, 8)
	if _, ok := m.x.find(1); ok || m.x.tab != nil {
		t.Fatal("an empty index found something or allocated")
	}
	if m.x.remove(1, 0) {
		t.Fatal("removed from an empty index")
	}
	m.insert(0, 100)
	m.insert(1, 100) // duplicate hash: refused, slot 1 stays out
	m.insert(2, 200)
	m.verify(300, 0)
	if len(m.x.tab) != 16 {
		t.Fatalf("table of %d for 8 slots", len(m.x.tab))
	}
	if m.x.remove(200, 0) {
		t.Fatal("removed slot 0 under another slot's hash")
	}
	m.remove(0)
	m.insert(1, 100) // free again: now it goes in
	m.verify(200, 100, 300)
	m.x.clear()
	clear(m.model)
	clear(m.in)
	m.verify(100, 200)
	m.insert(3, 200)
	m.verify(100)
}

// TestPrefixIndexCollidingRuns fills one probe run with hashes sharing a
// home (and a tag), wraps it around the table's end, and removes from the
// middle: backward shift must keep every later entry reachable.
func TestPrefixIndexCollidingRuns(t *testing.T) {
	const n = 32
	m := newIndexModel(t, n)
	m.x.init()
	size := uint64(len(m.x.tab))
	// Six hashes whose home is the last position and six homed at 0,
	// found by search: their runs wrap around the end and merge.
	var last, first []BlockHash
	for h := BlockHash(1); len(last) < 6 || len(first) < 6; h++ {
		switch (uint64(h) * indexMix) >> m.x.shift {
		case size - 1:
			if len(last) < 6 {
				last = append(last, h)
			}
		case 0:
			if len(first) < 6 {
				first = append(first, h)
			}
		}
	}
	id := BlockID(0)
	for i := range 6 {
		m.insert(id, last[i])
		id++
		m.insert(id, first[i])
		id++
	}
	m.verify()
	for _, k := range []BlockID{4, 1, 0, 7, 11, 2} {
		m.remove(k)
		m.verify(last[0], first[0])
	}
	for k := range id {
		m.remove(k)
	}
	m.verify(last...)
	if m.x.n != 0 {
		t.Fatalf("%d entries left", m.x.n)
	}
	for i, e := range m.x.tab {
		if e != 0 {
			t.Fatalf("position %d not empty after removing everything: %x", i, e)
		}
	}
}

// TestPrefixIndexTagCollision gives two hashes the same tag (the high 32
// bits after mixing) and so the same home: the slot's full hash tells
// them apart.
func TestPrefixIndexTagCollision(t *testing.T) {
	m := newIndexModel(t, 4)
	// indexMix is odd, so multiplication by it is a bijection mod 2^64:
	// hashes whose products differ only in the low 32 bits exist; find
	// two by inverting the multiplier.
	inv := uint64(indexMix)
	for range 6 { // Newton's iteration for the inverse mod 2^64
		inv *= 2 - indexMix*inv
	}
	a := BlockHash(uint64(0x12345678_00000001) * inv)
	b := BlockHash(uint64(0x12345678_00000002) * inv)
	if (uint64(a)*indexMix)>>32 != (uint64(b)*indexMix)>>32 {
		t.Fatal("test setup: tags differ")
	}
	m.insert(0, a)
	m.verify(b)
	m.insert(1, b)
	m.verify()
	m.remove(0)
	m.verify(a)
}

// TestPrefixIndexChurn is the pool's pattern under eviction: a full table
// where every insert follows a remove, for many rounds, against the map.
func TestPrefixIndexChurn(t *testing.T) {
	const n = 512
	m := newIndexModel(t, n)
	rng := uint64(1)
	next := func() uint64 {
		rng += 0x9E3779B97F4A7C15
		z := rng
		z = (z ^ z>>30) * 0xBF58476D1CE4E5B9
		z = (z ^ z>>27) * 0x94D049BB133111EB
		return z ^ z>>31
	}
	for id := range BlockID(n) {
		m.insert(id, BlockHash(next()))
	}
	for round := range 20000 {
		id := BlockID(next() % n)
		m.remove(id)
		h := BlockHash(next())
		if round%7 == 0 {
			h = BlockHash(next() % 64) // small values: many repeats
		}
		m.insert(id, h)
		if round%1000 == 0 {
			m.verify(BlockHash(next()))
		}
	}
	m.verify()
}

// FuzzPrefixIndex runs a sequence of inserts and removes, decoded from
// the input, against a map, with hashes drawn from a small set (so that
// duplicates, tag collisions within a run and wrap-around happen) and a
// small pool (so that runs are long).
func FuzzPrefixIndex(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13})
	f.Add([]byte("\x00\x01\x02\x03\xff\x80\x81\x82\x01\x01\x00"))
	f.Fuzz(func(t *testing.T, data []byte) {
		const n = 12
		m := newIndexModel(t, n)
		// 16 hashes over a table of 32 positions: runs form and merge.
		var hs [16]BlockHash
		for i := range hs {
			hs[i] = BlockHash(i)
		}
		for _, op := range data {
			id := BlockID(op % n)
			if op&0x80 != 0 {
				m.remove(id)
			} else {
				m.insert(id, hs[(op>>3)&15])
			}
			m.verify(hs[:]...)
		}
	})
}

// mapIndex is the Go map the flat index replaced: BenchmarkPrefixIndex's
// baseline, with the index's operations.
type mapIndex map[BlockHash]BlockID

func (m mapIndex) find(h BlockHash) (BlockID, bool) { id, ok := m[h]; return id, ok }

func (m mapIndex) insert(h BlockHash, id BlockID) bool {
	if _, taken := m[h]; taken {
		return false
	}
	m[h] = id
	return true
}

func (m mapIndex) remove(h BlockHash, id BlockID) bool {
	if got, ok := m[h]; !ok || got != id {
		return false
	}
	delete(m, h)
	return true
}

// BenchmarkPrefixIndex is the index under eviction churn (evict a slot,
// reuse it for a new hash, look one up) on 2^18 slots, the flat table
// against the Go map it replaced.
func BenchmarkPrefixIndex(b *testing.B) {
	const n = 1 << 18
	type index interface {
		find(BlockHash) (BlockID, bool)
		insert(BlockHash, BlockID) bool
		remove(BlockHash, BlockID) bool
	}
	for _, kind := range []string{"flat", "map"} {
		b.Run(kind+"/evict-insert", func(b *testing.B) {
			pre := make([]prefixSlot, n)
			var x index
			if kind == "map" {
				x = make(mapIndex)
			} else {
				flat := newPrefixIndex(pre)
				x = &flat
			}
			h := uint64(1)
			for id := range BlockID(n) {
				h = h*6364136223846793005 + 1442695040888963407
				pre[id].hash = BlockHash(h)
				x.insert(pre[id].hash, id)
			}
			b.ResetTimer()
			id := BlockID(0)
			for range b.N {
				// Evict slot id, reuse it for a new hash, look one up.
				x.remove(pre[id].hash, id)
				h = h*6364136223846793005 + 1442695040888963407
				pre[id].hash = BlockHash(h)
				x.insert(pre[id].hash, id)
				if _, ok := x.find(pre[(id*7919)&(n-1)].hash); !ok {
					b.Fatal("lost an entry")
				}
				id = (id + 1) & (n - 1)
			}
		})
	}
}

// The prefix probe's fast loop equals its general path (find per hash):
// a pool with sealed blocks in every state (cached, leased, shared,
// under a pending write, evicted), probed with random lookups (hits,
// misses, a block named twice, hashes that collide in the table), gives
// the same prefix, the same hit slots, the same cached count and the
// same stamped slots either way. (Checked builds mix the two at random
// under the fuzzers as well.)
func TestProbeFastEqualsGeneral(t *testing.T) {
	for seed := range uint64(30) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { probeEqualsGeneral(t, seed) })
	}
}

func probeEqualsGeneral(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 11))
	const n = 24
	p := newTestPool(t, n)
	c := &p.core
	var open []*Lease[[]byte]
	var hashes []BlockHash
	for step := range 60 {
		switch rng.IntN(4) {
		case 0, 1: // seal a lease's blocks; keep some open
			k := 1 + rng.IntN(4)
			l, err := p.Acquire("s", k)
			if err != nil {
				continue
			}
			for i := range k {
				h := BlockHash(rng.IntN(40)) // small values: collisions and duplicates
				_ = l.Seal(i, h)
				hashes = append(hashes, h)
			}
			if rng.IntN(2) == 0 {
				l.Release()
			} else {
				open = append(open, l)
			}
		case 2: // a pending write over an unsealed block keeps its slot out of hits
			if l, err := p.Acquire("w", 1); err == nil {
				tr := NewTransfer(nil)
				_ = l.Attach(tr)
				_ = l.Seal(0, BlockHash(rng.IntN(40)))
				if rng.IntN(2) == 0 {
					tr.Resolve(nil)
				}
				l.Release()
			}
		case 3:
			if len(open) > 0 {
				i := rng.IntN(len(open))
				open[i].Release()
				open = slices.Delete(open, i, i+1)
			}
		}
		if len(hashes) == 0 {
			continue
		}
		for range 8 {
			q := make([]BlockHash, rng.IntN(8))
			for i := range q {
				if rng.IntN(4) == 0 {
					q[i] = BlockHash(rng.IntN(60))
				} else {
					q[i] = hashes[rng.IntN(len(hashes))]
				}
			}
			c.mu.Lock()
			if c.index.len() == 0 {
				c.mu.Unlock()
				continue
			}
			c.stamp++
			gn, gids, gc := c.index.probeGeneral(c.tab.View(), c.pre, c.stamp, q, make([]int32, 0, rng.IntN(8)))
			gmarks := stamped(c.pre, c.stamp)
			c.stamp++
			fn, fids, fc := c.index.probeFast(c.tab.View(), c.pre, c.stamp, q, make([]int32, 0, cap(gids)))
			fmarks := stamped(c.pre, c.stamp)
			c.mu.Unlock()
			if gn != fn || !slices.Equal(gids, fids) || gc != fc || !slices.Equal(gmarks, fmarks) {
				t.Fatalf("step %d, lookup %x: general (%d, %v, %d, stamped %v), fast (%d, %v, %d, stamped %v)",
					step, q, gn, gids, gc, gmarks, fn, fids, fc, fmarks)
			}
		}
	}
	for _, l := range open {
		l.Release()
	}
}

// stamped lists the slots a probe with stamp marked.
func stamped(pre []prefixSlot, stamp uint32) []int {
	var out []int
	for id := range pre {
		if pre[id].mark == stamp {
			out = append(out, id)
		}
	}
	return out
}

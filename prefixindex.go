package kvlease

import (
	"fmt"
	"iter"
	"math/bits"

	"github.com/kvlease/kvlease/internal/invariants"
	"github.com/kvlease/kvlease/internal/slots"
)

// prefixIndex is the prefix cache's index: BlockHash → the slot findable
// by it. It is a flat open-addressing table sized to the pool, with
// linear probing and backward-shift deletion, so that constant eviction
// leaves no tombstones to probe through.
//
// Why not a Go map: a prefix-heavy replay with a pool kept full of cached
// blocks (nearly every fresh block evicts one) spent over 40% of the
// pool's time in map operations (BenchmarkPrefixIndex compares the two;
// bench/README.md has the replay's figures). Here the key is already a
// uniformly distributed hash and the number of entries is bounded by the
// pool's capacity (a slot is in the index at most once), so a table of
// twice the capacity, rounded up to a power of two, never fills past half
// and never grows.
//
// Each entry is one word: the high 32 bits of the mixed hash (its tag,
// whose top bits are also the entry's home position) and the slot id plus
// one in the low 32 bits (zero: empty). The full hash lives in the slot's
// prefix state (prefixSlot.hash); a lookup compares tags and reads the
// slot's hash only on a tag match, so a miss rarely leaves the table and a
// delete (which knows the slot) never does. At 262,144 blocks the table is
// 4 MiB.
//
// The table is allocated by the first insert: a pool that never seals
// pays nothing. Guarded by the pool's mutex.
type prefixIndex struct {
	tab   []uint64
	shift uint8        // 64 - log2(len(tab)): home = mixed >> shift
	n     int          // entries
	pre   []prefixSlot // the pool's: each slot's hash, to confirm a tag match
}

// indexMix spreads a hash over the high bits (Fibonacci hashing): chained
// hashes are already uniform, but tests and callers of Seal may use small
// or structured values, and a multiply costs less than a cluster.
const indexMix = 0x9E3779B97F4A7C15

// indexEntry makes the entry for slot id under mixed hash m.
func indexEntry(m uint64, id BlockID) uint64 {
	return m&^(1<<32-1) | uint64(uint32(id)+1)
}

// newPrefixIndex returns an empty index over the pool's prefix state pre
// (one entry per slot, which holds each indexed slot's hash).
func newPrefixIndex(pre []prefixSlot) prefixIndex {
	return prefixIndex{pre: pre}
}

// init allocates the table on first use.
func (x *prefixIndex) init() {
	size := max(16, 2*len(x.pre))
	lg := bits.Len(uint(size - 1)) // size rounded up to 1<<lg
	x.tab = make([]uint64, 1<<lg)
	x.shift = uint8(64 - lg)
}

// len returns the number of entries.
func (x *prefixIndex) len() int {
	return x.n
}

// find returns the slot findable by h.
func (x *prefixIndex) find(h BlockHash) (BlockID, bool) {
	tab := x.tab
	if len(tab) == 0 {
		return -1, false
	}
	m := uint64(h) * indexMix
	mask := uint64(len(tab) - 1)
	tag := m >> 32
	for i := m >> x.shift; ; i = (i + 1) & mask {
		e := tab[i]
		if e == 0 {
			return -1, false
		}
		if e>>32 == tag {
			if id := BlockID(uint32(e) - 1); x.pre[id].hash == h {
				return id, true
			}
		}
	}
}

// insert makes slot id findable by h unless another slot already is; it
// reports whether it did. (The slot's recorded hash need not be h yet.)
func (x *prefixIndex) insert(h BlockHash, id BlockID) bool {
	if x.tab == nil {
		x.init()
	}
	tab := x.tab
	m := uint64(h) * indexMix
	mask := uint64(len(tab) - 1)
	tag := m >> 32
	for i := m >> x.shift; ; i = (i + 1) & mask {
		e := tab[i]
		if e == 0 {
			tab[i] = indexEntry(m, id)
			x.n++
			return true
		}
		if e>>32 == tag && x.pre[BlockID(uint32(e)-1)].hash == h {
			return false
		}
	}
}

// remove takes slot id, findable by h, out of the index and reports
// whether it was there. Later entries of the probe run shift back into
// the hole (backward-shift deletion), so no tombstone is left.
func (x *prefixIndex) remove(h BlockHash, id BlockID) bool {
	tab := x.tab
	if len(tab) == 0 {
		return false
	}
	m := uint64(h) * indexMix
	mask := uint64(len(tab) - 1)
	want := indexEntry(m, id)
	i := m >> x.shift
	for {
		e := tab[i]
		if e == want {
			break
		}
		if e == 0 {
			return false
		}
		i = (i + 1) & mask
	}
	// Shift back every later entry of the run that may move into the
	// hole: one whose home is not in the cyclic interval (hole, j].
	shift := x.shift
	for j := (i + 1) & mask; ; j = (j + 1) & mask {
		e := tab[j]
		if e == 0 {
			break
		}
		home := e >> shift // the tag's top bits (shift ≥ 32)
		if (j-home)&mask >= (j-i)&mask {
			tab[i] = e
			i = j
		}
	}
	tab[i] = 0
	x.n--
	return true
}

// all iterates over the entries: each findable hash and its slot.
func (x *prefixIndex) all() iter.Seq2[BlockHash, BlockID] {
	return func(yield func(BlockHash, BlockID) bool) {
		for _, e := range x.tab {
			if e != 0 {
				id := BlockID(uint32(e) - 1)
				if !yield(x.pre[id].hash, id) {
					return
				}
			}
		}
	}
}

// check returns the first structural inconsistency of the table: an entry
// whose tag does not match its slot's hash, a slot listed twice, an empty
// position between an entry and its home (the entry would be unreachable),
// or a count that disagrees with the entries.
func (x *prefixIndex) check() error {
	pre := x.pre
	mask := uint64(len(x.tab) - 1)
	n := 0
	seen := make(map[BlockID]bool)
	for p, e := range x.tab {
		if e == 0 {
			continue
		}
		n++
		id := BlockID(uint32(e) - 1)
		if id < 0 || int(id) >= len(pre) {
			return fmt.Errorf("prefix index: entry %d names slot %d outside the pool", p, id)
		}
		if seen[id] {
			return fmt.Errorf("prefix index: slot %d listed twice", id)
		}
		seen[id] = true
		m := uint64(pre[id].hash) * indexMix
		if e>>32 != m>>32 {
			return fmt.Errorf("prefix index: entry %d for slot %d: tag %08x, slot's hash %016x has %08x",
				p, id, e>>32, uint64(pre[id].hash), m>>32)
		}
		for q := m >> x.shift; q != uint64(p); q = (q + 1) & mask {
			if x.tab[q] == 0 {
				return fmt.Errorf("prefix index: entry %d for slot %d is unreachable: position %d, between it and its home, is empty", p, id, q)
			}
		}
	}
	if n != x.n {
		return fmt.Errorf("prefix index: %d entries, counted %d", n, x.n)
	}
	return nil
}

// clear removes every entry.
func (x *prefixIndex) clear() {
	clear(x.tab)
	x.n = 0
}

// probe is the prefix lookup without verification: the length of the
// cached prefix of hashes, the hit slots appended to ids (up to its
// capacity) and how many hits are cached (on the LRU). A hit stops at a
// slot with a pending write (view) or one already stamped by this
// lookup (pre[id].mark == stamp: a block named twice); each hit slot is
// stamped. Called with the pool's mutex held.
//
// The loop is find's probe written into it, one probe per hash, with the
// tables in registers: a find call per hash, and the reloads it forced,
// made a hit much dearer (BenchmarkAcquirePrefix guards it, measured in
// instructions with bench/instr: numbers in bench/README.md). It mirrors
// probeGeneral, which is find per hash; checked builds take the general
// path sometimes, and TestProbeFastEqualsGeneral holds the two equal, as
// the slot table's fast loops are held to its transition function.
func (x *prefixIndex) probe(view slots.View, pre []prefixSlot, stamp uint32, hashes []BlockHash, ids []int32) (int, []int32, int) {
	if invariants.Enabled { // (a constant: production builds pay nothing)
		if invariants.Sometimes(generalPercent) {
			return x.probeGeneral(view, pre, stamp, hashes, ids)
		}
	}
	return x.probeFast(view, pre, stamp, hashes, ids)
}

// generalPercent is how often, in checked builds, probe takes its
// general path.
const generalPercent = 25

// probeGeneral is probe by find: the reference the fast loop mirrors.
func (x *prefixIndex) probeGeneral(view slots.View, pre []prefixSlot, stamp uint32, hashes []BlockHash, ids []int32) (int, []int32, int) {
	cached := 0
	for k, h := range hashes {
		id, ok := x.find(h)
		if !ok {
			return k, ids, cached
		}
		wpins, class := view.Probe(int32(id))
		if wpins > 0 || pre[id].mark == stamp {
			return k, ids, cached
		}
		pre[id].mark = stamp
		if class == slots.Cached {
			cached++
		}
		if len(ids) < cap(ids) {
			ids = append(ids, int32(id))
		}
	}
	return len(hashes), ids, cached
}

// probeFast is probe's loop: probeGeneral with find's probe written in.
func (x *prefixIndex) probeFast(view slots.View, pre []prefixSlot, stamp uint32, hashes []BlockHash, ids []int32) (int, []int32, int) {
	tab, shift := x.tab, x.shift&63 // (the mask spares the shift's range check)
	mask := uint64(len(tab) - 1)
	cached := 0
	for k, h := range hashes {
		m := uint64(h) * indexMix
		tag := m >> 32
		var p *prefixSlot
		var id BlockID
		for i := m >> shift; ; i = (i + 1) & mask {
			e := tab[i]
			if e == 0 {
				return k, ids, cached
			}
			if e>>32 == tag {
				id = BlockID(uint32(e) - 1)
				if p = &pre[id]; p.hash == h {
					break
				}
			}
		}
		wpins, class := view.Probe(int32(id))
		if wpins > 0 || p.mark == stamp {
			return k, ids, cached
		}
		p.mark = stamp
		if class == slots.Cached {
			cached++
		}
		if len(ids) < cap(ids) {
			ids = append(ids, int32(id))
		}
	}
	return len(hashes), ids, cached
}

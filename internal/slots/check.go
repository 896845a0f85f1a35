package slots

import "fmt"

// Check walks the whole table and calls bad for every inconsistency it
// finds: each slot's class matches its holds, the counts match the slots
// and sum to the length, the free stack and the LRU hold exactly the
// unheld slots (a parked slot on its tenant's list only), the
// quarantined-and-leased count is right, and every tenant's charges,
// list and reservation agree with the slots (checkTenants). O(len).
func (t *Table) Check(bad func(format string, args ...any)) {
	var counts [NumClasses]int
	onFree, onLRU, ql := 0, 0, 0
	for i := range t.s {
		s := &t.s[i]
		if s.refs < 0 || s.pins < 0 || s.quar < 0 || s.wpins < 0 {
			bad("slot %d: negative holds refs=%d pins=%d quar=%d wpins=%d", i, s.refs, s.pins, s.quar, s.wpins)
		}
		if s.wpins > s.pins+s.quar {
			bad("slot %d: %d write pins but only %d pending+quarantined", i, s.wpins, s.pins+s.quar)
		}
		if got := s.classify(); got != s.class {
			bad("slot %d: recorded %v, holds say %v", i, s.class, got)
		}
		if s.class >= NumClasses {
			bad("slot %d: class %d", i, s.class)
			continue
		}
		counts[s.class]++
		switch s.class {
		case Free:
			onFree++
			if s.held() || s.index || s.sealed {
				bad("slot %d: free but held=%v indexed=%v sealed=%v", i, s.held(), s.index, s.sealed)
			}
		case Cached:
			onLRU++
			if s.held() || !s.index {
				bad("slot %d: cached but held=%v indexed=%v", i, s.held(), s.index)
			}
		}
		if s.index && !s.sealed {
			bad("slot %d: indexed but not sealed", i)
		}
		if s.quar > 0 && s.refs > 0 {
			ql++
		}
	}
	if ql != t.quarLeased {
		bad("%d quarantined slots are leased, counted %d", ql, t.quarLeased)
	}
	if counts != t.counts {
		bad("state counts %v, slots say %v", t.counts, counts)
	}
	sum := 0
	for _, n := range t.counts {
		sum += n
	}
	if sum != len(t.s) {
		bad("state counts sum to %d, capacity %d", sum, len(t.s))
	}
	if onFree != len(t.free) {
		bad("free stack has %d ids, %d slots are free", len(t.free), onFree)
	}
	seen := make([]bool, len(t.s))
	for _, id := range t.free {
		if id < 0 || int(id) >= len(t.s) || seen[id] || t.s[id].class != Free {
			bad("free stack: slot %d out of range, listed twice or not free", id)
			continue
		}
		seen[id] = true
	}
	parked := t.checkTenants(bad)
	n := 0
	for r := range t.lru {
		prev := Nil
		m := 0
		for id := t.lru[r].head; id != Nil && n <= len(t.s); id = t.links[id].next {
			if t.s[id].class != Cached {
				bad("LRU %d: slot %d is %v", r, id, t.s[id].class)
			}
			if t.ret[id] != uint8(r) {
				bad("LRU %d: slot %d has retention %d", r, id, t.ret[id])
			}
			if t.s[id].flags&flagParked != 0 {
				bad("LRU %d: slot %d is parked", r, id)
			}
			if t.links[id].prev != prev {
				bad("LRU %d: slot %d links back to %d, not %d", r, id, t.links[id].prev, prev)
			}
			prev = id
			n++
			m++
		}
		if prev != t.lru[r].tail {
			bad("LRU %d: ends at %d, tail is %d", r, prev, t.lru[r].tail)
		}
		if (m > 0) != (t.lruMask&(1<<r) != 0) {
			bad("LRU %d: %d linked, mask %08b", r, m, t.lruMask)
		}
	}
	if n+parked != t.lruLen || onLRU != t.lruLen {
		bad("LRU: %d linked and %d parked, %d counted, %d slots cached", n, parked, t.lruLen, onLRU)
	}
}

// CheckCounts is the O(1) check checked builds run after every locked
// operation: no count is negative and the counts sum to the length. It
// panics otherwise (an impossible internal state).
func (t *Table) CheckCounts() {
	sum := 0
	for _, n := range t.counts {
		if n < 0 {
			panic(fmt.Sprintf("kvlease: negative state count %v", t.counts))
		}
		sum += n
	}
	if sum != len(t.s) {
		panic(fmt.Sprintf("kvlease: state counts %v sum to %d, capacity %d", t.counts, sum, len(t.s)))
	}
}

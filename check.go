package kvlease

import (
	"errors"
	"fmt"
)

// Check walks the whole slot table and returns every inconsistency it
// finds (nil when there is none), like bbolt's Tx.Check: each slot's state
// matches its holds, the state counts match the slots and sum to capacity,
// the free stack and the LRU hold exactly the unheld slots, and the prefix
// index points at sealed slots. It takes the pool's lock for O(capacity)
// time; tests and audits call it, the hot path never does.
func (p *Pool[R]) Check() error {
	c := &p.core
	c.mu.Lock()
	defer c.mu.Unlock()
	var errs []error
	bad := func(format string, args ...any) {
		if len(errs) < 32 {
			errs = append(errs, fmt.Errorf(format, args...))
		}
	}
	var counts [numClasses]int
	onFreeN, onLRUN := 0, 0
	for i := range c.slots {
		s := &c.slots[i]
		if s.refs < 0 || s.pins < 0 || s.quar < 0 || s.wpins < 0 {
			bad("slot %d: negative holds refs=%d pins=%d quar=%d wpins=%d", i, s.refs, s.pins, s.quar, s.wpins)
		}
		if s.wpins > s.pins+s.quar {
			bad("slot %d: %d write pins but only %d pending+quarantined", i, s.wpins, s.pins+s.quar)
		}
		if got := s.classify(); got != s.class {
			bad("slot %d: recorded %v, holds say %v", i, s.class, got)
		}
		counts[s.class]++
		switch s.class {
		case classFree:
			onFreeN++
			if s.held() || s.index || s.sealed {
				bad("slot %d: free but held=%v indexed=%v sealed=%v", i, s.held(), s.index, s.sealed)
			}
		case classCached:
			onLRUN++
			if s.held() || !s.index {
				bad("slot %d: cached but held=%v indexed=%v", i, s.held(), s.index)
			}
		}
		if s.index {
			h := c.pre[i].hash
			if got, ok := c.index.find(h); !s.sealed || !ok || got != BlockID(i) {
				bad("slot %d: marked indexed but index[%x]=%d (found %v) sealed=%v", i, h, got, ok, s.sealed)
			}
		}
	}
	ql := 0
	for i := range c.slots {
		if s := &c.slots[i]; s.quar > 0 && s.refs > 0 {
			ql++
		}
	}
	if ql != c.quarLeased {
		bad("%d quarantined slots are leased, counted %d", ql, c.quarLeased)
	}
	if counts != c.counts {
		bad("state counts %v, slots say %v", c.counts, counts)
	}
	sum := 0
	for _, n := range c.counts {
		sum += n
	}
	if sum != len(c.slots) {
		bad("state counts sum to %d, capacity %d", sum, len(c.slots))
	}
	if onFreeN != len(c.free) {
		bad("free stack has %d ids, %d slots are free", len(c.free), onFreeN)
	}
	seen := make([]bool, len(c.slots))
	for _, id := range c.free {
		if seen[id] || c.slots[id].class != classFree {
			bad("free stack: slot %d listed twice or %v", id, c.slots[id].class)
		}
		seen[id] = true
	}
	n := 0
	for id := c.lruHead; id != nilID && n <= len(c.slots); id = c.pre[id].next {
		if c.slots[id].class != classCached {
			bad("LRU: slot %d is %v", id, c.slots[id].class)
		}
		n++
	}
	if n != c.lruLen || onLRUN != c.lruLen {
		bad("LRU: %d linked, %d counted, %d slots cached", n, c.lruLen, onLRUN)
	}
	if err := c.index.check(); err != nil {
		bad("%v", err)
	}
	for h, id := range c.index.all() {
		if s := &c.slots[id]; !s.index || c.pre[id].hash != h {
			bad("index[%x] = slot %d, which is indexed=%v with hash %x", h, id, s.index, c.pre[id].hash)
		}
	}
	return errors.Join(errs...)
}

// checkCounts is the O(1) check run after every operation in checked
// builds: the five state counts sum to capacity.
func (c *core) checkCounts() {
	sum := 0
	for _, n := range c.counts {
		if n < 0 {
			panic(fmt.Sprintf("kvlease: negative state count %v", c.counts))
		}
		sum += n
	}
	if sum != len(c.slots) {
		panic(fmt.Sprintf("kvlease: state counts %v sum to %d, capacity %d", c.counts, sum, len(c.slots)))
	}
}

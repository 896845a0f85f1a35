package kvlease

import (
	"errors"
	"fmt"

	"github.com/kvlease/kvlease/internal/invariants"
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
	c.tab.Check(bad)
	for i := range c.tab.Len() {
		id := int32(i)
		if !c.tab.Indexed(id) {
			continue
		}
		h := c.pre[i].hash
		if got, ok := c.index.find(h); !ok || got != BlockID(i) {
			bad("slot %d: marked indexed but index[%x]=%d (found %v)", i, h, got, ok)
		}
	}
	if err := c.index.check(); err != nil {
		bad("%v", err)
	}
	for h, id := range c.index.all() {
		if !c.tab.Indexed(int32(id)) || c.pre[id].hash != h {
			bad("index[%x] = slot %d, which is indexed=%v with hash %x", h, id, c.tab.Indexed(int32(id)), c.pre[id].hash)
		}
	}
	return errors.Join(errs...)
}

// unlock ends a locked operation: checked builds first verify the state
// counts (they sum to capacity, none negative), as doc.go promises.
func (c *core) unlock() {
	if invariants.Enabled {
		c.tab.CheckCounts()
	}
	c.mu.Unlock()
}

package kvlease

import (
	"fmt"

	"github.com/kvlease/kvlease/internal/slots"
)

// Retention is a sealed block's eviction class. When a fresh block is
// needed and none is free, the pool evicts the least recently used cached
// block of the lowest class that has one: an unloaded adapter's blocks or
// a low-priority tenant's go before everyone else's, and within a class
// the order is the LRU's. Every operation stays O(1): cached blocks sit
// on one list per class and a bit mask finds the lowest non-empty one.
//
// A block gets its class when it is sealed: the lower of its lease's
// (Lease.SetRetention) and its adapter's (Pool.SetAdapterRetention, for
// a lease tagged with Lease.SetAdapter), RetentionDefault when neither is
// set. Prefix hits do not change a block's class.
type Retention uint8

// The classes: RetentionMin is evicted first, RetentionMax last.
const (
	RetentionMin     Retention = 0
	RetentionDefault Retention = slots.DefaultRetention
	RetentionMax     Retention = slots.NumRetention - 1
)

// retentionState is what the pool keeps for retention by adapter.
type retentionState struct {
	byAdapter   map[int]Retention // SetAdapterRetention
	slotAdapter []int32           // per slot: the adapter id of the lease that sealed it
}

// SetRetention gives the blocks this lease seals from now on retention r
// (blocks it sealed before keep theirs). An r above RetentionMax wraps
// ErrInvalidArgument; a closed lease, ErrLeaseClosed.
func (l *Lease[R]) SetRetention(r Retention) error {
	ls := &l.ls
	if r > RetentionMax {
		return fmt.Errorf("kvlease: lease %d (%s): retention %d above %d: %w", ls.id, ls.owner, r, RetentionMax, ErrInvalidArgument)
	}
	c := ls.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if ls.closed {
		return fmt.Errorf("kvlease: set retention of lease %d (%s): %w", ls.id, ls.owner, ErrLeaseClosed)
	}
	e := ls.ext()
	e.ret, e.hasRet = r, true
	return nil
}

// SetAdapterRetention sets the retention class of adapter id's blocks
// (id as in Adapter.ID; 0 is the base model): every block sealed by a
// lease tagged with that adapter, cached or in use, now has class r, and
// blocks sealed from now on get at most r. Lower an unloaded adapter's
// class to have its blocks evicted first; raise it again when it is
// loaded. Cached blocks that change class join their new class as its
// most recently used, in the order they had (a chain still leaves from
// its end). It walks the slot table once (O(capacity), under
// the pool's lock): an operation for adapter loads, not for requests. An
// r above RetentionMax wraps ErrInvalidArgument.
func (p *Pool[R]) SetAdapterRetention(id int, r Retention) error {
	if r > RetentionMax {
		return fmt.Errorf("kvlease: adapter %d: retention %d above %d: %w", id, r, RetentionMax, ErrInvalidArgument)
	}
	c := &p.core
	c.mu.Lock()
	defer c.mu.Unlock()
	rs := c.retState()
	rs.byAdapter[id] = r
	c.tab.SetRetentionWhere(uint8(r), func(s int32) bool {
		return rs.slotAdapter[s] == int32(id) && c.tab.Sealed(s)
	})
	return nil
}

// CachedByRetention returns how many cached blocks each retention class
// holds now (index r: class r).
func (p *Pool[R]) CachedByRetention() [RetentionMax + 1]int {
	c := &p.core
	c.mu.Lock()
	defer c.mu.Unlock()
	var out [RetentionMax + 1]int
	for r := range out {
		out[r] = c.tab.CachedIn(uint8(r))
	}
	return out
}

func (c *core) retState() *retentionState {
	if c.ret == nil {
		c.ret = &retentionState{byAdapter: map[int]Retention{}, slotAdapter: make([]int32, c.tab.Len())}
	}
	return c.ret
}

// retentionOf is the class block id gets when lease l seals it, and
// records the block's adapter. Called with c.mu held; inlined into every
// seal, so the common case (nothing set anywhere) costs two tests.
func (c *core) retentionOf(l *lease, id BlockID) Retention {
	if l.extra == nil && c.ret == nil {
		return RetentionDefault
	}
	return c.retentionSlow(l, id)
}

func (c *core) retentionSlow(l *lease, id BlockID) Retention {
	r := RetentionDefault
	if e := l.extra; e != nil && e.hasRet {
		r = e.ret
	}
	a := l.adapter()
	if a.ID == 0 && c.ret == nil {
		return r
	}
	rs := c.retState()
	rs.slotAdapter[id] = int32(a.ID)
	if ar, ok := rs.byAdapter[a.ID]; ok && ar < r {
		r = ar
	}
	return r
}

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
//
// Classes order eviction within what a fill may evict; a tenant's quota
// (quota.go) decides that first: a tenant at its cap evicts its own
// blocks, least recently cached first, whatever their class, and no
// other tenant's fill evicts its reserved blocks.
type Retention uint8

// The classes: RetentionMin is evicted first, RetentionMax last.
const (
	RetentionMin     Retention = 0
	RetentionDefault Retention = slots.DefaultRetention
	RetentionMax     Retention = slots.NumRetention - 1
)

// retentionState is what the pool keeps for retention by adapter. An
// adapter is its name (see Adapter); the slot table records each sealed
// block's interned adapter (core.adapters), and byIx caches each interned
// adapter's class so that a seal reads a slice, not a map.
type retentionState struct {
	byName      map[string]Retention // SetAdapterRetention, by adapter name ("": the base model)
	byIx        []int8               // per interned adapter: its name's class, -1 for none
	slotAdapter []int32              // per slot: the interned adapter of the lease that sealed it
}

// interned records the class of a newly interned adapter ix called name.
func (rs *retentionState) interned(ix int32, name string) {
	for len(rs.byIx) <= int(ix) {
		rs.byIx = append(rs.byIx, -1)
	}
	if r, ok := rs.byName[name]; ok {
		rs.byIx[ix] = int8(r)
	}
}

// of is interned adapter ix's class, or -1 when its name has none.
func (rs *retentionState) of(ix int32) int8 {
	if int(ix) < len(rs.byIx) {
		return rs.byIx[ix]
	}
	return -1
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

// SetAdapterRetention sets the retention class of the adapter called
// name (Adapter.Name; "" is the base model, the blocks of untagged
// leases): every block sealed by a lease tagged with that adapter,
// whatever id it declared, cached or in use, now has class r, and blocks
// sealed from now on get at most r. Lower an unloaded adapter's class to
// have its blocks evicted first; raise it again when it is loaded. An
// engine that reuses ids (unload A from slot 1, load B into it) keeps
// them apart: each follows its own name. Cached blocks that change class
// join their new class as its most recently used, in the order they had
// (a chain still leaves from its end). It walks the slot table once
// (O(capacity), under the pool's lock): an operation for adapter loads,
// not for requests. An r above RetentionMax wraps ErrInvalidArgument.
func (p *Pool[R]) SetAdapterRetention(name string, r Retention) error {
	if r > RetentionMax {
		return fmt.Errorf("kvlease: adapter %q: retention %d above %d: %w", name, r, RetentionMax, ErrInvalidArgument)
	}
	c := &p.core
	c.mu.Lock()
	defer c.unlock()
	rs := c.retState()
	rs.byName[name] = r
	match := make([]bool, max(len(c.adapters), 1)) // by interned adapter
	match[0] = name == ""
	rs.interned(0, "")
	for ix, a := range c.adapters {
		if a.Name == name {
			match[ix] = true
		}
		rs.interned(int32(ix), a.Name)
	}
	c.tab.SetRetentionWhere(uint8(r), func(s int32) bool {
		return match[rs.slotAdapter[s]] && c.tab.Sealed(s)
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
		c.ret = &retentionState{byName: map[string]Retention{}, slotAdapter: make([]int32, c.tab.Len())}
		for ix, a := range c.adapters {
			c.ret.interned(int32(ix), a.Name)
		}
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
	var ix int32 // the lease's interned adapter (0: the base model)
	if e := l.extra; e != nil {
		if e.hasRet {
			r = e.ret
		}
		ix = e.tagIx
	}
	if ix == 0 && c.ret == nil {
		return r
	}
	rs := c.retState()
	rs.slotAdapter[id] = ix
	if ar := rs.of(ix); ar >= 0 && Retention(ar) < r {
		r = Retention(ar)
	}
	return r
}

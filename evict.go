package kvlease

import (
	"fmt"
)

// evictOwner is the owner of the leases an eviction hook receives
// (SetEvictHook).
const evictOwner = "kvlease/evict"

// SetEvictHook installs hook as the pool's eviction hook (nil removes it):
// the write-back half of a tiered cache. Without a hook, a cached block
// chosen for eviction is handed out fresh at once and its content is lost.
// With one, when an acquire (or Extend, or a served waiter) must evict and
// the cache has more evictable blocks than the acquire still needs, the
// least recently used block is not reused: it leaves the prefix index (it
// is no longer findable here; KV events report it removed) but keeps its
// content and generation, and is offered to the hook, and the acquire
// takes another victim instead. At its first eviction, a fill of n blocks
// offers up to n victims in a row (so a chain evicted from its end reaches
// the next tier whole), then evicts the next ones for itself as before:
// their content is lost. The evicting acquire is therefore never blocked
// by the hook nor refused because of it: it only offers blocks it could
// spare. Without such a surplus victims are evicted as before. (A cache
// that must lose nothing copies blocks when they are sealed instead:
// write-through.)
//
// The offered blocks of one operation arrive as one open lease owned by
// evictOwner, with hashes[i] the hash block i was findable by; a
// stretch of victims whose ids descend one by one (a chain evicted from
// its end) is listed ascending, so that it is one run (Lease.AppendRuns)
// for the hook's copy. The hook
// runs after the operation, with no lock held, on the goroutine that
// evicted (an Acquire, a Release that served a waiter, a Resolve), so it
// must be quick: start a copy (attach it to the lease as a Read) and
// return. The hook owns the lease and must close it, typically right after
// attaching the copy: the blocks then drain until the copy resolves and
// only then become free (they are not cached again here: the lower tier
// holds them now). An offered block is sealed, so read it with
// Pool.Region(lease.Ref(i)). Until the hook's lease closes and its
// transfers resolve, offered blocks count as Leased (then Draining) and are
// not available to acquires.
func (p *Pool[R]) SetEvictHook(hook func(offered *Lease[R], hashes []BlockHash)) {
	c := &p.core
	c.mu.Lock()
	defer c.unlock()
	if hook == nil {
		c.hook = nil
		return
	}
	c.hook = &evictHook[R]{p: p, fn: hook}
}

// offerer is what the non-generic core keeps of an eviction hook.
type offerer interface {
	// offerVictims offers what the cache can spare before the evicting
	// fill takes its next victim (see core.offerVictim). Called with c.mu
	// held; it must not call out. It takes and returns the operation's
	// outbox list rather than a pointer to its outbox, which an interface
	// call would move to the heap on every acquire and release.
	offerVictims(need int, list []observed) []observed
}

type evictHook[R any] struct {
	p  *Pool[R]
	fn func(*Lease[R], []BlockHash)
}

// evictBatch collects the blocks one operation offers. It is delivered as
// an entry of the operation's outbox, so the hook runs wherever the operation
// flushes its outbox: after every lock is released.
type evictBatch[R any] struct {
	h      *evictHook[R]
	refs   []BlockRef
	hashes []BlockHash
	taken  int // victims the operation took for itself
}

// offerVictim runs before a fill evicts a victim for itself, need being
// the blocks the fill still has to hand out (this one included). Called
// from takeFresh with c.mu held, the free stack empty.
func (c *core) offerVictim(need int, ev *outbox) { ev.list = c.hook.offerVictims(need, ev.list) }

// offerVictims offers the least recently used cached blocks, as long as
// the cache keeps enough for the fill (more than need) and the operation
// has offered fewer blocks than it evicts for itself: at its first
// eviction a fill of need blocks offers up to need victims in a row, so
// a chain evicted from its end reaches the next tier whole, then takes
// the next need victims.
func (h *evictHook[R]) offerVictims(need int, list []observed) []observed {
	ev := &outbox{list: list}
	c := &h.p.core
	var b *evictBatch[R]
	for i := len(ev.list) - 1; i >= 0; i-- {
		if x, ok := ev.list[i].obs.(*evictBatch[R]); ok && x.h == h {
			b = x
			break
		}
	}
	offered, taken := 0, 0
	if b != nil {
		offered, taken = len(b.refs), b.taken
	}
	for c.tab.Evictable() > need && offered < taken+need {
		b = h.offerHead(b, ev)
		offered++
	}
	if b != nil {
		b.taken++
	}
	return ev.list
}

// offerHead moves the least recently used cached block into batch b
// (made and queued on ev when nil) and returns b. Called with c.mu held.
func (h *evictHook[R]) offerHead(b *evictBatch[R], ev *outbox) *evictBatch[R] {
	c := &h.p.core
	// Out of the index (never hit here again), but the content stays:
	// sealed, at the same generation, held by the offered lease.
	r := ref(c.tab.Offer())
	hash := c.pre[r.ID].hash
	c.index.remove(hash, r.ID)
	if c.kv != nil {
		c.kv.removed(hash)
	}
	c.stats.evictions++
	if b == nil {
		b = &evictBatch[R]{h: h}
		ev.add(b, Event{Kind: EventAcquired, Owner: evictOwner})
	}
	b.refs = append(b.refs, r)
	b.hashes = append(b.hashes, hash)
	return b
}

// OfferCached offers up to k of the least recently used cached blocks to
// the eviction hook now, as one lease, and returns how many it offered
// (none without a hook). It is how a tier keeps a reserve of free blocks
// ahead of demand (a watermark): offered blocks become free once their
// copies resolve, so later acquires find free blocks and evict nothing
// they would lose. The hook runs before OfferCached returns, on the
// caller's goroutine, with no lock held.
func (p *Pool[R]) OfferCached(k int) int {
	c := &p.core
	var ev outbox
	c.mu.Lock()
	h, _ := c.hook.(*evictHook[R])
	n := 0
	if h != nil {
		var b *evictBatch[R]
		for ; n < k && c.tab.Evictable() > 0; n++ {
			b = h.offerHead(b, &ev)
		}
	}
	c.unlock()
	ev.flush()
	return n
}

// Observe delivers the batch: the held blocks become an open lease, handed
// to the hook. Called by outbox.flush with no lock held.
func (b *evictBatch[R]) Observe(Event) {
	p := b.h.p
	c := &p.core
	var ev outbox
	c.mu.Lock()
	l := p.newLease(evictOwner, len(b.refs))
	ascend(b.refs, b.hashes) // runs, for the hook's copy (and the free stack after it)
	copy(l.ls.blocks, b.refs)
	c.opened(&l.ls, 0, &ev)
	c.unlock()
	ev.flush()
	b.h.fn(l, b.hashes)
}

// AcquireHits acquires exactly the cached prefix of hashes and nothing
// else: the longest run of leading hashes findable now, shared with
// whoever else holds them, and no fresh block. It returns nil and no error
// when nothing hits. What a tiered cache pins before it decides where the
// rest of a prompt comes from. It obeys Acquire's rule about queued
// waiters (a hit on a cached block takes it out of the evictable set) and
// returns Acquire's errors. In verified mode nothing hits by hash alone.
func (p *Pool[R]) AcquireHits(owner string, hashes []BlockHash) (*Lease[R], error) {
	c := &p.core
	if owner == "" {
		return nil, c.reject(owner, len(hashes), fmt.Errorf("kvlease: acquire hits: empty owner: %w", ErrInvalidArgument))
	}
	var ev outbox
	c.mu.Lock()
	if c.closed.Load() {
		c.unlock()
		return nil, c.reject(owner, len(hashes), closedErr(owner, len(hashes)))
	}
	if q := c.queued(); q > 0 {
		c.unlock()
		return nil, c.reject(owner, len(hashes), &exhaustedError{op: "acquire", owner: owner, n: len(hashes), queued: q})
	}
	n, _ := c.probe(hashes, nil)
	if n == 0 {
		c.stats.prefixQueries += uint64(len(hashes))
		c.unlock()
		return nil, nil
	}
	l := p.newLease(owner, n)
	hits, err := c.fillPrefix(&l.ls, hashes, n, nil, &ev)
	if err != nil { // cannot happen: hits need no fresh block
		c.unlock()
		ev.flush()
		return nil, c.reject(owner, n, err)
	}
	c.opened(&l.ls, hits, &ev)
	c.unlock()
	ev.flush()
	return l, nil
}

// evicted takes a block the slot table just evicted (see slots.Table.Take)
// out of the prefix index: its content is forfeit. Called with c.mu held.
func (c *core) evicted(id BlockID) {
	h := c.pre[id].hash
	c.index.remove(h, id)
	if c.kv != nil {
		c.kv.removed(h)
	}
	c.stats.evictions++
}

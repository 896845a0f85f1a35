package kvlease

import (
	"fmt"
)

// Seal declares block i full and immutable from now on, findable by h for
// prefix hits once nobody references it (and while they do). If another
// block is already findable by h, Seal still returns nil: the existing
// block stays findable and this one is sealed but private (counted in
// Stats.DuplicateSeals and reported as EventDuplicateSeal; once
// unreferenced it is free, not cached). Sealing again with the same hash is
// a no-op.
//
// Errors wrap ErrLeaseClosed after Release or Abort, and
// ErrInvalidArgument for an i outside the lease, a block with a pending or
// quarantined write (its content is not known), or a block already sealed
// with a different hash.
func (l *Lease[R]) Seal(i int, h BlockHash) error {
	return l.ls.seal(i, h, nil)
}

// sealTokens carries what verified mode records: the parent hash and the
// block's tokens; chain overrides where its KV event places the block in
// its chain (SealChained).
type sealTokens struct {
	parent BlockHash
	tokens []int32
	chain  chainPlace
}

// chainPlace says where a sealed block sits in its chain, for its KV event.
type chainPlace uint8

const (
	chainByLease  chainPlace = iota // block 0 of the lease starts a chain, later blocks follow parent
	chainChild                      // parent is a block: the event names it, whatever i is
	chainStartAny                   // the chain's first block: no parent, whatever i is
)

func (l *lease) seal(i int, h BlockHash, st *sealTokens) error {
	c := l.c
	var ev events
	c.mu.Lock()
	err := l.sealLocked(i, h, st, &ev)
	c.mu.Unlock()
	ev.flush()
	return err
}

func (l *lease) sealLocked(i int, h BlockHash, st *sealTokens, ev *events) error {
	c := l.c
	if l.closed {
		return fmt.Errorf("kvlease: seal block %d of lease %d (%s): %w", i, l.id, l.owner, ErrLeaseClosed)
	}
	if i < l.first() || i >= len(l.blocks) {
		return fmt.Errorf("kvlease: seal block %d of lease %d (%s) with %d blocks: %w", i, l.id, l.owner, len(l.blocks), ErrInvalidArgument)
	}
	id := l.blocks[i].ID
	s := &c.slots[id]
	if s.sealed {
		if old := c.pre[id].hash; old != h {
			return fmt.Errorf("kvlease: seal block %d of lease %d (%s) with hash %016x: already sealed with %016x: %w",
				i, l.id, l.owner, uint64(h), uint64(old), ErrInvalidArgument)
		}
		return nil
	}
	if s.wpins > 0 {
		return fmt.Errorf("kvlease: seal block %d of lease %d (%s): a transfer is still writing it: %w",
			i, l.id, l.owner, ErrInvalidArgument)
	}
	if st != nil || c.meta != nil { // (a plain Seal on a plain pool has nothing to check)
		if err := c.checkSealTokens(st); err != nil {
			return fmt.Errorf("kvlease: seal block %d of lease %d (%s): %w", i, l.id, l.owner, err)
		}
	}
	s.sealed, c.pre[id].hash = true, h
	c.recordSeal(id, st)
	if !c.index.insert(h, id) {
		c.stats.duplicateSeals++
		if c.obs != nil {
			ev.add(c.obs, Event{Kind: EventDuplicateSeal, Owner: l.owner, Lease: l.id, Blocks: 1})
		}
		return nil
	}
	s.index = true
	if c.kv != nil {
		c.kv.sealed(c, l, i, id, h, st)
	}
	return nil
}

// SealTokens seals block i with the hash of its tokens under parent (the
// previous block's hash, or the namespace seed for the first block) and
// returns that hash. It is Seal with the hash computed for you, and the
// only way to seal in verified mode (WithVerifiedPrefix), where the pool
// keeps parent and tokens to check every later hit against. In every mode
// tokens must be exactly one full block (the configured block tokens): a
// partial block is never sealed (its KV will still grow), and a pool
// without WithBlockTokens or WithVerifiedPrefix refuses SealTokens. Both
// wrap ErrInvalidArgument; other errors as Seal.
func (l *Lease[R]) SealTokens(i int, parent BlockHash, tokens []int32) (BlockHash, error) {
	h := HashBlock(parent, tokens)
	return h, l.ls.seal(i, h, &sealTokens{parent: parent, tokens: tokens})
}

// SealChained is SealTokens for a block whose place in its chain is not
// its place in the lease, such as a lower tier's copy of a block (a tiered
// cache offloads blocks of many chains in one lease). hasParent says
// whether parent is a block, so that the block's KV event names it as the
// parent even for block 0 of the lease, or the namespace seed (the block
// starts its chain: the event names no parent, even for a later block of
// the lease). The hash, the checks and the errors are SealTokens'.
func (l *Lease[R]) SealChained(i int, parent BlockHash, hasParent bool, tokens []int32) (BlockHash, error) {
	h := HashBlock(parent, tokens)
	place := chainStartAny
	if hasParent {
		place = chainChild
	}
	return h, l.ls.seal(i, h, &sealTokens{parent: parent, tokens: tokens, chain: place})
}

// Share returns a second lease, owned by owner, over the first n blocks of
// this one: the same slots at the same generations, reference counted, for
// parallel sampling and beam search. Every shared block must be sealed
// (shared content must be immutable): a block still being written is
// refused with ErrInvalidArgument, as is an n outside [1, Len()]. The new
// lease is independent: it may Extend with fresh blocks and is released on
// its own. Errors also wrap ErrLeaseClosed and ErrPoolClosed.
func (l *Lease[R]) Share(owner string, n int) (*Lease[R], error) {
	ls := &l.ls
	c := ls.c
	if owner == "" {
		return nil, fmt.Errorf("kvlease: share lease %d (%s): empty owner: %w", ls.id, ls.owner, ErrInvalidArgument)
	}
	var ev events
	c.mu.Lock()
	var err error
	switch {
	case ls.closed:
		err = fmt.Errorf("kvlease: share lease %d (%s): %w", ls.id, ls.owner, ErrLeaseClosed)
	case c.closed.Load():
		err = fmt.Errorf("kvlease: share lease %d (%s): %w", ls.id, ls.owner, ErrPoolClosed)
	case n <= 0 || n > len(ls.blocks) || ls.first() > 0:
		err = fmt.Errorf("kvlease: share %d blocks of lease %d (%s) with %d blocks: %w", n, ls.id, ls.owner, len(ls.blocks), ErrInvalidArgument)
	default:
		for i, r := range ls.blocks[:n] {
			if !c.slots[r.ID].sealed {
				err = fmt.Errorf("kvlease: share block %d of lease %d (%s): not sealed, its content may still change: %w",
					i, ls.id, ls.owner, ErrInvalidArgument)
				break
			}
		}
	}
	if err != nil {
		c.mu.Unlock()
		return nil, err
	}
	nl := l.p.newLease(owner, n)
	for _, r := range ls.blocks[:n] {
		c.slots[r.ID].refs++
		c.settleSlot(r.ID)
	}
	copy(nl.ls.blocks, ls.blocks[:n])
	c.opened(&nl.ls, n, &ev)
	c.mu.Unlock()
	ev.flush()
	return nl, nil
}

// ResetMode says what ResetCache makes unfindable.
type ResetMode uint8

const (
	// ResetUnreferenced, the default, drops the cached blocks nobody
	// references. Sealed blocks that leases still hold (or that transfers
	// still gate) stay findable: a request may still hit them.
	ResetUnreferenced ResetMode = iota
	// ResetAll also makes every block still in use unfindable: after it,
	// nothing sealed before can be hit, which is what a weight or adapter
	// update needs. Blocks in use stay sealed (immutable, readable by their
	// leases) but private: once unreferenced they are free, not cached.
	ResetAll
)

// ResetCache drops every cached block nobody references: each leaves the
// prefix index and goes to the free list, so it will never be hit again.
// By default (ResetUnreferenced) sealed blocks that leases still hold stay
// findable; pass ResetAll to make them unfindable too. It returns how
// many blocks stopped being findable. With KV events on, it emits
// AllBlocksCleared when the index is left empty, else one BlockRemoved
// per block.
func (p *Pool[R]) ResetCache(mode ...ResetMode) int {
	all := false
	for _, m := range mode {
		all = all || m == ResetAll
	}
	c := &p.core
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	quiet := c.kv != nil && (c.lruLen == c.index.len() || all)
	for c.lruHead != nilID {
		id := c.lruHead
		c.lruRemove(id)
		s := &c.slots[id]
		c.index.remove(c.pre[id].hash, id)
		if c.kv != nil && !quiet {
			c.kv.removed(c.pre[id].hash)
		}
		s.index = false
		c.unseal(id)
		c.free = append(c.free, id)
		s.class = classFree
		c.counts[classCached]--
		c.counts[classFree]++
		n++
	}
	if all {
		// What is left is in use: unfindable from now on, still sealed.
		for _, id := range c.index.all() {
			c.slots[id].index = false
			n++
		}
		c.index.clear()
	}
	if quiet && n > 0 {
		c.kv.cleared()
	}
	return n
}

// AcquirePrefix acquires n blocks whose first hits (at most n) are the
// longest cached prefix of hashes, shared with whoever else holds them
// (reference counted, same generation: the content is the same), and the
// rest fresh. It is all or nothing: a failed call changes no reference
// count and evicts nothing. It obeys Acquire's rule about queued waiters
// and returns Acquire's errors.
//
// A match may hit a leased or draining block (sealed content is
// immutable) and stops at the first miss or at a block whose content is
// not known (a pending or quarantined write). In verified mode
// (WithVerifiedPrefix) hashes alone prove nothing and every lookup
// misses: use AcquirePrefixTokens.
//
// Hit blocks are sealed and shared: the lease may read them (ReadRegion)
// but never write them (Region refuses with ErrReadOnly). So pass only the
// hashes of blocks the request will not write: never the hash of the block
// that holds the prompt's last token, whose KV the engine must compute to
// sample the first output token (vLLM's rule; AcquirePrefixTokens applies
// it for you). For a prompt of t tokens in blocks of b, that is the first
// (t-1)/b hashes.
func (p *Pool[R]) AcquirePrefix(owner string, hashes []BlockHash, n int) (*Lease[R], int, error) {
	if len(hashes) == 0 {
		l, err := p.Acquire(owner, n)
		return l, 0, err
	}
	return p.acquire(owner, hashes, nil, n)
}

// CachedPrefix returns how many leading hashes would hit now, changing
// nothing (not even recency): for planning chunked prefill.
func (p *Pool[R]) CachedPrefix(hashes []BlockHash) int {
	c := &p.core
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.probe(hashes, nil)
}

// probe returns the length of the cached prefix of hashes. In verified
// mode v supplies the tokens to check each hit against (nil: no hit can
// be verified). Called with c.mu held. It stamps each hit slot so that a
// block named twice ends the prefix (a lease holds a block once per
// position, and chained hashes never repeat).
func (c *core) probe(hashes []BlockHash, v *verifier) int {
	n, _, _ := c.probeIDs(hashes, v, nil)
	return n
}

// probeIDs is probe that also appends the hit slots to ids (up to its
// capacity, so the caller's stack buffer never grows), sparing the caller
// a second lookup, and counts the hits that are cached (on the LRU: they
// stop being evictable when leased).
func (c *core) probeIDs(hashes []BlockHash, v *verifier, ids []BlockID) (int, []BlockID, int) {
	if c.index.len() == 0 {
		return 0, ids, 0
	}
	c.stamp++
	if c.index.legacy == nil && c.meta == nil {
		return probeFlat(&c.index, c.slots, c.pre, c.stamp, hashes, ids)
	}
	cached := 0
	for k, h := range hashes {
		id, ok := c.index.find(h)
		if !ok {
			return k, ids, cached
		}
		s := &c.slots[id]
		if s.wpins > 0 || c.pre[id].mark == c.stamp {
			return k, ids, cached
		}
		if c.meta != nil && !c.verify(id, k, v) {
			return k, ids, cached
		}
		c.pre[id].mark = c.stamp
		if s.class == classCached {
			cached++
		}
		if len(ids) < cap(ids) {
			ids = append(ids, id)
		}
	}
	return len(hashes), ids, cached
}

// probeFlat is probeIDs for the flat index without verification: the
// index's probe written into the loop, one probe per hash, with the
// tables in registers (find's call, its map switch and the reloads it
// forced cost about a third of a hit: callgrind).
func probeFlat(x *prefixIndex, slots []slot, pre []prefixSlot, stamp uint32, hashes []BlockHash, ids []BlockID) (int, []BlockID, int) {
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
		s := &slots[id]
		if s.wpins > 0 || p.mark == stamp {
			return k, ids, cached
		}
		p.mark = stamp
		if s.class == classCached {
			cached++
		}
		if len(ids) < cap(ids) {
			ids = append(ids, id)
		}
	}
	return len(hashes), ids, cached
}

// fillPrefix fills l with n blocks: the cached prefix of hashes, then
// fresh ones. All or nothing. Called with c.mu held.
func (c *core) fillPrefix(l *lease, hashes []BlockHash, n int, v *verifier, ev *events) (int, error) {
	if len(hashes) > n {
		hashes = hashes[:n]
	}
	var buf [64]BlockID
	// lruHits: hit blocks that stop being evictable.
	hits, ids, lruHits := c.probeIDs(hashes, v, buf[:0])
	if fresh, avail := n-hits, c.available()-lruHits; fresh > avail {
		// Refused lookups are counted apart: a request refused three times
		// then admitted is one lookup, not four (as vLLM counts).
		c.stats.prefixRefused += uint64(len(hashes))
		held := 0 // usable blocks the hits hold already
		for k := range hits {
			if c.slots[c.hitID(ids, hashes, k)].quar == 0 {
				held++
			}
		}
		if err := c.boundErr(l.owner, fresh, held); err != nil {
			return 0, err
		}
		return 0, &exhaustedError{op: "acquire", owner: l.owner, n: n, hits: hits, avail: avail}
	}
	// Queries and hits are counted together, for admitted lookups only.
	c.stats.prefixQueries += uint64(len(hashes))
	c.stats.prefixHits += uint64(hits)
	// The common case first: recorded hits that were cached.
	done := c.reviveCached(l.blocks, ids[:min(hits, len(ids))])
	revived := 0 // cached blocks that become leased, after the first done
	for k := done; k < hits; k++ {
		id := c.hitID(ids, hashes, k)
		s := &c.slots[id]
		s.refs++
		switch {
		case s.class == classCached:
			// Unheld until now: straight from cached to leased.
			c.lruRemove(id)
			s.class = classLeased
			revived++
		case s.class == classLeased:
			// Another lease holds it: unchanged.
		case s.class == classQuarantined:
			// A quarantined read: unchanged, but now leased.
			if s.refs == 1 {
				c.quarLeased++
			}
		default:
			c.settleSlot(id) // draining: leased again
		}
		l.blocks[k] = BlockRef{ID: id, Gen: s.gen}
	}
	c.counts[classCached] -= revived
	c.counts[classLeased] += revived
	c.fill(l.blocks[hits:n], ev)
	return hits, nil
}

// reviveCached leases the leading hits ids that are cached (unheld, on
// the LRU), taking each off the LRU, into blocks[k], and returns how many
// it did: it stops at the first hit in any other class. One loop with the
// LRU's ends in registers. Called with c.mu held.
func (c *core) reviveCached(blocks []BlockRef, ids []BlockID) int {
	slots, pre := c.slots, c.pre
	head, tail := c.lruHead, c.lruTail
	k := 0
	for ; k < len(ids) && k < len(blocks); k++ {
		id := ids[k]
		s := &slots[id]
		if s.class != classCached {
			break
		}
		s.refs++
		s.class = classLeased
		p := &pre[id]
		prev, next := p.prev, p.next
		if prev == nilID {
			head = next
		} else {
			pre[prev].next = next
		}
		if next == nilID {
			tail = prev
		} else {
			pre[next].prev = prev
		}
		p.prev, p.next = nilID, nilID
		blocks[k] = BlockRef{ID: id, Gen: s.gen}
	}
	c.lruHead, c.lruTail = head, tail
	c.lruLen -= k
	c.counts[classCached] -= k
	c.counts[classLeased] += k
	return k
}

// hitID returns the slot of hit k: from ids when the probe recorded it,
// else from the index.
func (c *core) hitID(ids []BlockID, hashes []BlockHash, k int) BlockID {
	if k < len(ids) {
		return ids[k]
	}
	id, _ := c.index.find(hashes[k])
	return id
}

// evict takes a cached block out of the prefix index: its content is
// forfeit. Called with c.mu held, the block already off the LRU.
func (c *core) evict(id BlockID) {
	p := &c.pre[id]
	c.index.remove(p.hash, id)
	if c.kv != nil {
		c.kv.removed(p.hash)
	}
	// unseal, with the slot's flags cleared at once.
	s := &c.slots[id]
	s.index, s.sealed, p.hash = false, false, 0
	if c.meta != nil {
		c.meta[id] = sealMeta{}
	}
	c.stats.evictions++
}

// unseal forgets a slot's sealed content: it is leaving the cache for the
// free list or being evicted. Called with c.mu held.
func (c *core) unseal(id BlockID) {
	c.slots[id].sealed, c.pre[id].hash = false, 0
	if c.meta != nil {
		c.meta[id] = sealMeta{}
	}
}

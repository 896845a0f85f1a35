package kvlease

import (
	"fmt"
	"github.com/kvlease/kvlease/internal/slots"
)

// ResetCache drops every cached block nobody references: each leaves the
// prefix index and goes to the free list, so it will never be hit again.
// With all false, sealed blocks that leases still hold (or that transfers
// still gate) stay findable; with all true they become unfindable too:
// after it, nothing sealed before can be hit, which is what a weight or
// adapter update needs (vLLM's reset_prefix_cache with running requests).
// Blocks in use stay sealed (immutable, readable by their leases) but
// private: once unreferenced they are free, not cached. It returns how
// many blocks stopped being findable. With KV events on, it emits
// AllBlocksCleared when the index is left empty, else one BlockRemoved
// per block.
func (p *Pool[R]) ResetCache(all bool) int {
	c := &p.core
	c.mu.Lock()
	defer c.unlock()
	n := 0
	quiet := c.kv != nil && (c.tab.LRULen() == c.index.len() || all)
	for id := c.tab.LRUHead(); id != slots.Nil; id = c.tab.LRUHead() {
		h := c.pre[id].hash
		c.index.remove(h, BlockID(id))
		if c.kv != nil && !quiet {
			c.kv.removed(h)
		}
		c.tab.SetIndexed(id, false) // cached → free
		n++
	}
	if all {
		// What is left is in use: unfindable from now on, still sealed.
		for _, id := range c.index.all() {
			c.tab.SetIndexed(int32(id), false)
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
	return p.acquire(owner, 0, hashes, nil, n)
}

// CachedPrefix returns how many leading hashes would hit now, changing
// nothing (not even recency): for planning chunked prefill.
func (p *Pool[R]) CachedPrefix(hashes []BlockHash) int {
	c := &p.core
	c.mu.Lock()
	defer c.unlock()
	n, _ := c.probe(hashes, nil)
	return n
}

// probe returns the length of the cached prefix of hashes, and whether
// it ended at a verified-mode mismatch (the caller that acquires counts
// it). In verified mode v supplies the tokens to check each hit against
// (nil: no hit can be verified). Called with c.mu held. It changes
// nothing a caller can see (no recency, no counter): its only write is
// the probe stamp of each hit slot, scratch that lets a block named
// twice end the prefix (a lease holds a block once per position, and
// chained hashes never repeat).
func (c *core) probe(hashes []BlockHash, v *verifier) (int, bool) {
	n, _, _, mismatch := c.probeIDs(hashes, v, nil)
	return n, mismatch
}

// probeIDs is probe that also appends the hit slots to ids (up to its
// capacity, so the caller's stack buffer never grows), sparing the caller
// a second lookup, and counts the hits that are cached (on the LRU: they
// stop being evictable when leased).
func (c *core) probeIDs(hashes []BlockHash, v *verifier, ids []int32) (int, []int32, int, bool) {
	if c.index.len() == 0 {
		return 0, ids, 0, false
	}
	c.stamp++
	if !c.verified {
		n, ids, cached := c.index.probe(c.tab.View(), c.pre, c.stamp, hashes, ids)
		return n, ids, cached, false
	}
	cached := 0
	for k, h := range hashes {
		id, ok := c.index.find(h)
		if !ok {
			return k, ids, cached, false
		}
		wpins, class := c.tab.View().Probe(int32(id))
		if wpins > 0 || c.pre[id].mark == c.stamp {
			return k, ids, cached, false
		}
		if !c.verify(id, k, v) {
			return k, ids, cached, v != nil
		}
		c.pre[id].mark = c.stamp
		if class == slots.Cached {
			cached++
		}
		if len(ids) < cap(ids) {
			ids = append(ids, int32(id))
		}
	}
	return len(hashes), ids, cached, false
}

// fillPrefix fills l with n blocks: the cached prefix of hashes, then
// fresh ones. All or nothing. Called with c.mu held.
func (c *core) fillPrefix(l *lease, hashes []BlockHash, n int, v *verifier, ev *outbox) (int, error) {
	if len(hashes) > n {
		hashes = hashes[:n]
	}
	var buf [64]int32
	// lruHits: hit blocks that stop being evictable.
	hits, ids, lruHits, mismatch := c.probeIDs(hashes, v, buf[:0])
	if mismatch {
		c.stats.verifyMismatches++
	}
	tn := l.tenant
	if c.tenants != nil { // (quota.go)
		var own int
		if lruHits, own = c.hitsCost(tn, ids, hashes, hits); tn != 0 {
			if err := c.quotaErr("acquire", l.owner, tn, n-hits, own); err != nil {
				c.stats.prefixRefused += uint64(len(hashes))
				return 0, err
			}
		}
	}
	if fresh, avail := n-hits, c.availableFor(tn)-lruHits; fresh > avail {
		// Refused lookups are counted apart: a request refused three times
		// then admitted is one lookup, not four (as vLLM counts).
		c.stats.prefixRefused += uint64(len(hashes))
		held := 0 // usable blocks the hits hold already
		for k := range hits {
			if !c.tab.Quarantined(int32(c.hitID(ids, hashes, k))) {
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
	if tn != 0 {
		c.tenants[tn].queries += uint64(len(hashes))
		c.tenants[tn].hits += uint64(hits)
	}
	// The hits the probe recorded, then the rest (a long prefix) looked
	// up again a buffer at a time.
	rec := ids[:min(hits, len(ids))]
	if done := c.tab.Revive(refs(l.blocks), rec); done < len(rec) { // (all cached: one call)
		c.leaseHits(l.blocks[done:len(rec)], rec[done:])
	}
	for k := len(rec); k < hits; {
		more := buf[:0]
		for ; k < hits && len(more) < cap(more); k++ {
			id, _ := c.index.find(hashes[k])
			more = append(more, int32(id))
		}
		c.leaseHits(l.blocks[k-len(more):k], more)
	}
	if tn != 0 {
		c.fillFor(l.blocks[hits:n], tn, ev)
	} else if !c.tab.Fill(refs(l.blocks[hits:n])) { // a fill, in line (see fillEvict)
		c.fillEvict(l.blocks[hits:n], 0, ev)
	}
	return hits, nil
}

// leaseHits adds the lease's hold on each hit slot ids[k] and records it
// in dst[k]: runs of cached hits (taken off the LRU) and of hits other
// leases hold, in turn, by the slot table's fast loops, and any other
// (draining, or quarantined with no lease) one by one. Called with c.mu
// held.
func (c *core) leaseHits(dst []BlockRef, ids []int32) {
	done := 0
	for done < len(ids) {
		done += c.tab.Revive(refs(dst[done:]), ids[done:])
		if done == len(ids) {
			break
		}
		if n := c.tab.RefHeld(refs(dst[done:]), ids[done:]); n > 0 {
			done += n
			continue
		}
		id := ids[done]
		c.tab.Ref(id) // draining, or quarantined with no lease: leased now
		dst[done] = BlockRef{ID: BlockID(id), Gen: c.tab.Gen(id)}
		done++
	}
}

// hitID returns the slot of hit k: from ids when the probe recorded it,
// else from the index.
func (c *core) hitID(ids []int32, hashes []BlockHash, k int) BlockID {
	if k < len(ids) {
		return BlockID(ids[k])
	}
	id, _ := c.index.find(hashes[k])
	return id
}

// AcquirePrefixTokens is AcquirePrefix for a prompt given as tokens under
// the namespace seed: it chains the hashes of the prompt's full blocks
// itself and, in verified mode, checks every hit's parent and tokens, so a
// hash collision is a miss, never someone else's KV.
//
// It never hits the block that holds the prompt's last token (vLLM's
// rule): a prompt of k full blocks gets at most k-1 hits, so the engine
// recomputes that token into a fresh, private block it may write. With
// len(tokens) ≤ block tokens nothing can hit. The pool needs
// WithBlockTokens or WithVerifiedPrefix; otherwise the error wraps
// ErrInvalidArgument. A Hasher's error (WithHasher) is returned wrapped; other
// errors as AcquirePrefix.
func (p *Pool[R]) AcquirePrefixTokens(owner string, seed BlockHash, tokens []int32, n int) (*Lease[R], int, error) {
	bt := p.cfg.blockTokens
	if bt == 0 {
		err := fmt.Errorf("kvlease: AcquirePrefixTokens needs WithBlockTokens or WithVerifiedPrefix: %w", ErrInvalidArgument)
		return nil, 0, p.reject(owner, n, err)
	}
	var buf [64]BlockHash
	v, err := p.newVerifier(seed, tokens, bt, max(n, 0), buf[:])
	if err != nil {
		return nil, 0, p.reject(owner, n, err)
	}
	if len(v.hashes) == 0 {
		l, err := p.Acquire(owner, n)
		return l, 0, err
	}
	vp := &v
	if !p.verified {
		vp = nil // plain mode: the hashes are the claim
	}
	return p.acquire(owner, 0, v.hashes, vp, n)
}

// CachedPrefixTokens is CachedPrefix for a prompt given as tokens, verified
// in verified mode, under AcquirePrefixTokens' rule: the block holding the
// prompt's last token never counts. It returns 0 when the pool has no
// block size or its Hasher fails. Like CachedPrefix it changes nothing:
// no recency, no counter (a verified mismatch is counted by acquires,
// not by queries).
func (p *Pool[R]) CachedPrefixTokens(seed BlockHash, tokens []int32) int {
	bt := p.cfg.blockTokens
	if bt == 0 {
		return 0
	}
	var buf [64]BlockHash
	v, err := p.newVerifier(seed, tokens, bt, len(tokens), buf[:])
	if err != nil {
		return 0 // a hash that cannot be computed finds nothing
	}
	vp := &v
	if !p.verified {
		vp = nil
	}
	c := &p.core
	c.mu.Lock()
	defer c.unlock()
	n, _ := c.probe(v.hashes, vp) // a query: a mismatch is not counted
	return n
}

package kvlease

import "fmt"

// Sliding-window admission.
//
// A token of a sliding-window layer attends only to the window of tokens
// before it, so a prefix hit at block p needs only the blocks of the
// window before p cached: those from windowStart(p·B) up to p. Earlier
// blocks may have been evicted (a window request trims them as it goes,
// so they reach the LRU first) and the hit still holds. vLLM's
// sliding-window manager finds the longest such hit from the right; so
// does acquireWindow, under one lock, so what it plans is what it takes:
// it probes the window of the longest candidate and, at the first block
// missing at m, knows that no hit longer than m can hold (its window
// would include m) and tries m next. Each probe moves the candidate
// left, so the search costs O(candidates + probes × window blocks).

// acquireWindow is acquire for a sliding-window sequence of tenant tn: hashes are the
// candidate hit blocks (vLLM's last-token rule applied), n the prompt's
// blocks. It returns a lease of n-base blocks, its index 0 the sequence's
// block base, whose first hit-base blocks are hits. Errors as acquire's.
func (p *Pool[R]) acquireWindow(owner string, tn uint16, hashes []BlockHash, v *verifier, n, bt, window int) (*Lease[R], int, int, error) {
	c := &p.core
	if owner == "" || n <= 0 || n > c.tab.Len() {
		return nil, 0, 0, c.reject(owner, n, c.precheckErr(owner, n))
	}
	c.mu.Lock()
	if c.closed.Load() {
		c.unlock()
		return nil, 0, 0, c.reject(owner, n, closedErr(owner, n))
	}
	if q := c.queued(); q > 0 {
		err := &exhaustedError{op: "acquire", owner: owner, n: n, queued: q}
		c.unlock()
		return nil, 0, 0, c.reject(owner, n, err)
	}
	hit, base := c.windowHit(hashes, v, bt, window)
	var ev outbox
	l := p.newLease(owner, n-base)
	l.ls.tenant = tn
	hits, err := c.fillPrefix(&l.ls, hashes[base:hit], n-base, v.from(base), &ev)
	if err == nil && hits != hit-base {
		// Cannot happen: the plan's probe ran under this lock.
		err = fmt.Errorf("kvlease: acquire %q: planned %d window hits, took %d: %w", owner, hit-base, hits, ErrExhausted)
	}
	if err != nil {
		c.unlock()
		ev.flush()
		return nil, 0, 0, c.reject(owner, n, err)
	}
	c.opened(&l.ls, hits, &ev)
	c.unlock()
	ev.flush()
	return l, base, hit, nil
}

// windowHit returns the longest hit (in blocks, at most len(hashes))
// whose window is cached now, and the window's first block. Called with
// c.mu held.
func (c *core) windowHit(hashes []BlockHash, v *verifier, bt, window int) (hit, base int) {
	for p := len(hashes); p > 0; {
		ws := 0
		if pos := p * bt; pos > window {
			ws = (pos - window) / bt
		}
		k, mismatch := c.probe(hashes[ws:p], v.from(ws))
		if mismatch {
			c.stats.verifyMismatches++ // an admission's lookup
		}
		if k == p-ws {
			return p, ws
		}
		p = ws + k // the first block missing: every longer hit needs it
	}
	return 0, 0
}

// from returns v for the lookup of the blocks from k on (nil for nil):
// the parent of its first block is block k-1's hash.
func (v *verifier) from(k int) *verifier {
	if v == nil || k == 0 {
		return v
	}
	w := *v
	w.seed = v.hashes[k-1]
	w.hashes = v.hashes[k:]
	w.tokens = v.tokens[k*v.blockTokens:]
	w.base = v.base + k
	return &w
}

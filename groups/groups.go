// Package groups coordinates the KV-cache groups of one model: one pool
// per group (full attention, sliding window, each with its own block
// size), and requests admitted, grown, trimmed and released in every group
// at once.
//
// A hybrid model (Gemma 3, Llama 4, gpt-oss) keeps several kinds of layer
// side by side. Full-attention layers need the KV of every token before
// the one they compute; sliding-window layers need only the last Window
// tokens. Each kind is a group with its own pool. The Coordinator acquires
// a request's leases in every group or in none (Acquire), and computes one
// prefix hit length
// valid for every group: a full-attention group needs the whole prefix
// cached; a sliding-window group needs only the blocks covering the
// Window tokens before the hit point. As a request decodes, sliding-window
// groups give back (TrimTo) the blocks that fell out of the window; sealed
// ones stay cached for later hits.
//
// Positions are absolute in every group: block k of group g covers tokens
// k·B … k·B+B-1 (B the group's BlockTokens). A sliding-window lease may
// start after block 0 (a prefix hit needs only the window) and trims its
// front as it goes; Request.Base says which absolute block its index 0 is.
package groups

import (
	"fmt"
	"sync"

	"github.com/kvlease/kvlease"
)

// ErrInvalidArgument is kvlease.ErrInvalidArgument: groups returns the
// root package's sentinels, wrapped with context.
var ErrInvalidArgument = kvlease.ErrInvalidArgument

// Spec describes one KV-cache group.
type Spec struct {
	// Name names the group in errors (e.g. "full", "swa").
	Name string
	// BlockTokens is the number of tokens per block of this group's pool.
	BlockTokens int
	// Window is 0 for full attention, or the sliding window in tokens: a
	// token attends to the Window tokens before it.
	Window int
}

// Sliding reports whether the group is a sliding-window group.
func (s Spec) Sliding() bool { return s.Window > 0 }

// Group is one KV-cache group: its spec and its pool.
type Group[R any] struct {
	Spec
	Pool *kvlease.Pool[R]
}

// maxGroups bounds the groups of one coordinator; a request keeps its
// per-group state inline.
const maxGroups = 8

// Coordinator admits requests across its groups. All methods are safe for
// concurrent use; admissions and growth are serialized by one mutex so
// that the hit length planned from the pools' prefix indexes still holds
// when the leases are taken (when the pools are used only through the
// coordinator; otherwise Acquire retries, see Acquire).
type Coordinator[R any] struct {
	groups []Group[R]
	align  int // least common multiple of the groups' block tokens
	mu     sync.Mutex
	// slab hands out Requests requestSlab at a time (one allocation per
	// requestSlab admissions, as the pools carve their leases); spare is
	// a Request a failed admission gave back. Guarded by mu.
	slab  []Request[R]
	spare *Request[R]
}

// requestSlab is how many Requests one allocation holds. A Request that
// stays reachable keeps its slab's memory (a few KiB) alive.
const requestSlab = 32

// newRequest returns a zero Request. Called with c.mu held.
func (c *Coordinator[R]) newRequest() *Request[R] {
	if r := c.spare; r != nil {
		c.spare = nil
		return r
	}
	if len(c.slab) == 0 {
		c.slab = make([]Request[R], requestSlab)
	}
	r := &c.slab[0]
	c.slab = c.slab[1:]
	return r
}

// giveBack returns a Request no caller has seen. Called with c.mu held.
func (c *Coordinator[R]) giveBack(r *Request[R]) {
	*r = Request[R]{}
	c.spare = r
}

// New returns a coordinator over groups (at least one, at most 8). Errors
// wrap ErrInvalidArgument for a nil pool, a non-positive BlockTokens, a
// negative Window, a pool named twice or no full-attention group and a
// window of fewer tokens than a block.
func New[R any](groups ...Group[R]) (*Coordinator[R], error) {
	if len(groups) == 0 || len(groups) > maxGroups {
		return nil, fmt.Errorf("groups: %d groups: need 1..%d: %w", len(groups), maxGroups, ErrInvalidArgument)
	}
	align := 1
	for i, g := range groups {
		switch {
		case g.Pool == nil:
			return nil, fmt.Errorf("groups: group %d (%s): nil pool: %w", i, g.Name, ErrInvalidArgument)
		case g.BlockTokens <= 0:
			return nil, fmt.Errorf("groups: group %d (%s): block tokens %d: %w", i, g.Name, g.BlockTokens, ErrInvalidArgument)
		case g.Window < 0:
			return nil, fmt.Errorf("groups: group %d (%s): window %d: %w", i, g.Name, g.Window, ErrInvalidArgument)
		}
		for j := range i {
			if groups[j].Pool == g.Pool {
				return nil, fmt.Errorf("groups: groups %d and %d share a pool: %w", j, i, ErrInvalidArgument)
			}
		}
		align = lcm(align, g.BlockTokens)
	}
	return &Coordinator[R]{groups: append([]Group[R](nil), groups...), align: align}, nil
}

func gcd(a, b int) int {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

func lcm(a, b int) int { return a / gcd(a, b) * b }

// Groups returns the number of groups.
func (c *Coordinator[R]) Groups() int { return len(c.groups) }

// Group returns group g.
func (c *Coordinator[R]) Group(g int) Group[R] { return c.groups[g] }

// Align returns the granularity of hit lengths: the least common multiple
// of the groups' block tokens. Every hit Acquire reports is a multiple of it.
func (c *Coordinator[R]) Align() int { return c.align }

// Hashes returns each group's chain hashes of tokens (full blocks only,
// kvlease.ChainHashes with the group's block size), the hashes Acquire
// takes. (A pool with its own Hasher hashes with that Hasher
// instead.)
func (c *Coordinator[R]) Hashes(seed kvlease.BlockHash, tokens []int32) [][]kvlease.BlockHash {
	out := make([][]kvlease.BlockHash, len(c.groups))
	for g, gr := range c.groups {
		out[g] = kvlease.ChainHashes(seed, tokens, gr.BlockTokens)
	}
	return out
}

// blocksFor returns how many blocks of bt tokens cover tokens ≥ 0 tokens,
// without overflow for any int.
func blocksFor(tokens, bt int) int {
	n := tokens / bt
	if tokens%bt != 0 {
		n++
	}
	return n
}

// windowStart returns the first block a sliding-window group needs to
// compute position pos: the block holding token pos-Window (0 for full
// attention or when the window reaches the start).
func (s Spec) windowStart(pos int) int {
	if s.Window == 0 || pos <= s.Window {
		return 0
	}
	return (pos - s.Window) / s.BlockTokens
}

// Request is one admitted request: a lease in every group. Its methods are
// safe for concurrent use, but an engine drives a request from one
// goroutine; an Abort may come from any.
type Request[R any] struct {
	c      *Coordinator[R]
	owner  string
	n      int
	tokens int // tokens the leases cover
	leases [maxGroups]*kvlease.Lease[R]
	base   [maxGroups]int
}

// Owner returns the owner named at admission.
func (r *Request[R]) Owner() string { return r.owner }

// Lease returns group g's lease. Its index i is absolute block Base(g)+i.
func (r *Request[R]) Lease(g int) *kvlease.Lease[R] { return r.leases[:r.n][g] }

// Base returns the absolute block index of group g's lease index 0: 0 for
// full attention; for a sliding window admitted with a prefix hit, the
// first block of the window.
func (r *Request[R]) Base(g int) int { return r.base[:r.n][g] }

// Tokens returns how many tokens the request's leases cover.
func (r *Request[R]) Tokens() int {
	r.c.mu.Lock()
	defer r.c.mu.Unlock()
	return r.tokens
}

// Release releases every group's lease.
func (r *Request[R]) Release() {
	for _, l := range r.leases[:r.n] {
		l.Release()
	}
}

// Abort aborts every group's lease with cause.
func (r *Request[R]) Abort(cause error) {
	for _, l := range r.leases[:r.n] {
		l.Abort(cause)
	}
}

// Closed reports whether the request was released or aborted (in any
// group: they close together).
func (r *Request[R]) Closed() bool {
	for _, l := range r.leases[:r.n] {
		if st := l.State(); st == kvlease.LeaseDraining || st == kvlease.LeaseSettled {
			return true
		}
	}
	return false
}

// Settled returns a channel closed once every group's lease has settled.
func (r *Request[R]) Settled() <-chan struct{} {
	ch := make(chan struct{})
	go func() {
		for _, l := range r.leases[:r.n] {
			<-l.Settled()
		}
		close(ch)
	}()
	return ch
}

// release releases the leases taken so far by a failed admission.
func releaseAll[R any](ls []*kvlease.Lease[R]) {
	for _, l := range ls {
		if l != nil {
			l.Release()
		}
	}
}

// Acquire takes a request's leases for tokens tokens in every group, all
// or nothing: the multi-group kvlease.Pool.AcquirePrefix. It returns the
// request with hit: how many leading tokens have their KV cached in every
// group (a multiple of Align; the engine computes from hit on).
// hashes[g] are group g's chain hashes of the prompt (Hashes; nil or
// shorter for fewer candidates): full-attention group g holds blocks
// 0..⌈tokens/B⌉-1, the first hit/B of them shared cached blocks; a
// sliding-window group holds only the blocks from the window before hit,
// those up to hit shared.
//
// Acquire first takes each group's lease with its longest prefix
// (AcquirePrefix: the common case where every group has the same prefix
// cached costs one lookup per group); if the groups disagree it gives the
// leases back, finds the longest hit valid in every group with
// CachedPrefix and takes them again. If a pool changed in between (it is
// shared with users outside the coordinator) it retries, and finally
// admits with no hit.
//
// On failure nothing is held: leases taken in earlier groups are released
// (the pools count their acquires and the failing pool its rejection).
// Errors wrap kvlease's sentinels: ErrInvalidArgument (empty owner, tokens
// ≤ 0, hashes for the wrong number of groups), ErrExceedsCapacity (more
// tokens than a full-attention group's pool could ever hold: checked
// before anything is taken), ErrExhausted, ErrPoolClosed; they name the
// group.
func (c *Coordinator[R]) Acquire(owner string, hashes [][]kvlease.BlockHash, tokens int) (*Request[R], int, error) {
	switch {
	case owner == "":
		return nil, 0, fmt.Errorf("groups: acquire: empty owner: %w", ErrInvalidArgument)
	case tokens <= 0:
		return nil, 0, fmt.Errorf("groups: acquire %q: %d tokens: %w", owner, tokens, ErrInvalidArgument)
	case hashes != nil && len(hashes) != len(c.groups):
		return nil, 0, fmt.Errorf("groups: acquire %q: hashes for %d groups, have %d: %w", owner, len(hashes), len(c.groups), ErrInvalidArgument)
	}
	for g, gr := range c.groups {
		if n := blocksFor(tokens, gr.BlockTokens); !gr.Sliding() && n > gr.Pool.Memory().Blocks() {
			return nil, 0, fmt.Errorf("groups: acquire %q: %d tokens need %d blocks of group %d (%s), its pool has %d: %w",
				owner, tokens, n, g, gr.Name, gr.Pool.Memory().Blocks(), kvlease.ErrExceedsCapacity)
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	r := c.newRequest()
	*r = Request[R]{c: c, owner: owner, n: len(c.groups), tokens: tokens}

	// The longest hit the hashes allow in every group.
	limit := tokens
	for g, gr := range c.groups {
		h := 0
		if hashes != nil {
			h = len(hashes[g])
		}
		limit = min(limit, min(h, blocksFor(tokens, gr.BlockTokens))*gr.BlockTokens)
	}
	limit -= limit % c.align

	// Fast path: full-attention groups take their longest prefix; the
	// hit is the shortest of theirs; sliding-window groups take the
	// window before it.
	hit, ok, err := c.take(r, hashes, limit, true)
	if err != nil {
		c.giveBack(r)
		return nil, 0, err
	}
	for try := 0; !ok; try++ {
		releaseAll(r.leases[:r.n])
		r.leases = [maxGroups]*kvlease.Lease[R]{}
		hit = 0
		if try < 3 {
			hit = c.plan(hashes, limit)
		}
		if hit, ok, err = c.take(r, hashes, hit, false); err != nil {
			c.giveBack(r)
			return nil, 0, err
		}
	}
	return r, hit, nil
}

// take acquires every group's lease for a hit of at most p tokens (exactly
// p unless greedy, where full-attention groups take their longest prefix
// up to p and the hit becomes the shortest of theirs). ok is false when
// the leases disagree with the hit: the caller releases them and replans.
// On an error nothing is held. Called with c.mu held.
func (c *Coordinator[R]) take(r *Request[R], hashes [][]kvlease.BlockHash, p int, greedy bool) (int, bool, error) {
	var hits [maxGroups]int
	// Full-attention groups first: with greedy, their hits decide p.
	for pass := range 2 {
		for g, gr := range c.groups {
			if gr.Sliding() != (pass == 1) {
				continue
			}
			n := blocksFor(r.tokens, gr.BlockTokens)
			ws, pe := gr.windowStart(p), p/gr.BlockTokens
			var l *kvlease.Lease[R]
			var err error
			if pe > ws {
				l, hits[g], err = gr.Pool.AcquirePrefix(r.owner, hashes[g][ws:pe], n-ws)
			} else {
				l, err = gr.Pool.Acquire(r.owner, n-ws)
			}
			if err != nil {
				releaseAll(r.leases[:r.n])
				r.leases = [maxGroups]*kvlease.Lease[R]{}
				return 0, false, fmt.Errorf("groups: acquire %q: group %d (%s): %w", r.owner, g, gr.Name, err)
			}
			r.leases[g], r.base[g] = l, ws
			if greedy && !gr.Sliding() {
				p = min(p, hits[g]*gr.BlockTokens)
				p -= p % c.align
			}
		}
	}
	// Every group must agree with the final p: a full-attention group
	// with more hits would share blocks the engine is about to compute.
	for g, gr := range c.groups {
		ws, pe := gr.windowStart(p), p/gr.BlockTokens
		if r.base[g] != ws || hits[g] != pe-ws {
			return p, false, nil
		}
	}
	return p, true, nil
}

// plan returns the longest hit of at most limit tokens (a multiple of
// Align) valid in every group now: full-attention groups have every block
// before it cached, sliding-window groups the blocks of the window before
// it. Called with c.mu held.
func (c *Coordinator[R]) plan(hashes [][]kvlease.BlockHash, limit int) int {
	if limit <= 0 {
		return 0
	}
	for g, gr := range c.groups {
		if !gr.Sliding() {
			limit = min(limit, gr.Pool.CachedPrefix(hashes[g][:limit/gr.BlockTokens])*gr.BlockTokens)
		}
	}
	limit -= limit % c.align
	for p := limit; p > 0; p -= c.align {
		valid := true
		for g, gr := range c.groups {
			if gr.Sliding() {
				ws, pe := gr.windowStart(p), p/gr.BlockTokens
				if gr.Pool.CachedPrefix(hashes[g][ws:pe]) < pe-ws {
					valid = false
					break
				}
			}
		}
		if valid {
			return p
		}
	}
	return 0
}

// Grow makes every group's lease cover tokens tokens (Extend where a group
// needs more blocks) and then trims each sliding-window group to the
// window of the first token this step computes (the previous Tokens()):
// blocks that fell out of it go back to the pool (sealed ones stay cached,
// those a transfer still gates drain). Call it before each decode step or
// prefill chunk with the new total.
//
// Growth is all or nothing when the pools are used only through the
// coordinator: it checks every pool's capacity and Available first.
// Errors wrap ErrInvalidArgument (tokens below Tokens()), ErrLeaseClosed,
// ErrPoolClosed, ErrExceedsCapacity or ErrExhausted and name the group; if
// a pool shared with others ran out between the check and the Extend, the
// groups extended before it keep their new blocks (the next Grow uses
// them).
func (r *Request[R]) Grow(tokens int) error {
	c := r.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if tokens < r.tokens {
		return fmt.Errorf("groups: grow %q to %d tokens: it covers %d already: %w", r.owner, tokens, r.tokens, ErrInvalidArgument)
	}
	var need [maxGroups]int
	for g, gr := range c.groups {
		l := r.leases[g]
		need[g] = blocksFor(tokens, gr.BlockTokens) - r.base[g] - l.Len()
		if need[g] > 0 {
			if avail := gr.Pool.Available(); avail < need[g] {
				if held := l.Len() - l.Trimmed(); need[g] > gr.Pool.Memory().Blocks()-held {
					return fmt.Errorf("groups: grow %q to %d tokens: group %d (%s) would hold %d more blocks than its %d-block pool: %w",
						r.owner, tokens, g, gr.Name, need[g]+held-gr.Pool.Memory().Blocks(), gr.Pool.Memory().Blocks(), kvlease.ErrExceedsCapacity)
				}
				return fmt.Errorf("groups: grow %q to %d tokens: group %d (%s) needs %d blocks, %d free or evictable: %w",
					r.owner, tokens, g, gr.Name, need[g], avail, kvlease.ErrExhausted)
			}
		}
	}
	for g, gr := range c.groups {
		if need[g] > 0 {
			if err := r.leases[g].Extend(need[g]); err != nil {
				return fmt.Errorf("groups: grow %q to %d tokens: group %d (%s): %w", r.owner, tokens, g, gr.Name, err)
			}
		}
	}
	old := r.tokens
	r.tokens = tokens
	return r.trimLocked(old)
}

// Trim gives back, in every sliding-window group, the blocks a
// computation starting at token pos no longer needs (those before the
// block of token pos-Window). Grow does this itself; Trim is for an
// engine that computes in chunks it plans on its own. Errors wrap
// ErrLeaseClosed or ErrInvalidArgument (pos beyond Tokens()).
func (r *Request[R]) Trim(pos int) error {
	r.c.mu.Lock()
	defer r.c.mu.Unlock()
	if pos < 0 || pos > r.tokens {
		return fmt.Errorf("groups: trim %q at token %d of %d: %w", r.owner, pos, r.tokens, ErrInvalidArgument)
	}
	return r.trimLocked(pos)
}

func (r *Request[R]) trimLocked(pos int) error {
	for g, gr := range r.c.groups {
		if !gr.Sliding() {
			continue
		}
		if to := gr.windowStart(pos) - r.base[g]; to > 0 {
			if err := r.leases[g].TrimTo(to); err != nil {
				return fmt.Errorf("groups: trim %q at token %d: group %d (%s): %w", r.owner, pos, g, gr.Name, err)
			}
		}
	}
	return nil
}

// Block returns the lease and its index holding absolute block k of group
// g, with ok false when the request does not hold it (before Base, or
// trimmed, or beyond its end).
func (r *Request[R]) Block(g, k int) (l *kvlease.Lease[R], i int, ok bool) {
	l = r.Lease(g)
	i = k - r.base[g]
	if i < 0 || i >= l.Len() || i < l.Trimmed() {
		return l, i, false
	}
	return l, i, true
}

package kvlease

import "fmt"

// A Sequence is one request's tokens over one lease: the bookkeeping every
// engine otherwise writes by hand (vLLM's allocate_slots plus
// cache_blocks). It takes the prompt with its prefix hits, then tokens one
// by one or in chunks, grows the lease at block boundaries and seals every
// block as it fills, chaining each block's hash to its parent's.
//
// Tokens pass through two stages. Append gives the sequence tokens whose
// KV the next model step will write: it makes sure a block slot exists for
// each (Extend at a block boundary), and an Append refused for want of
// blocks (ErrExhausted) changes nothing, so the engine can preempt. Commit
// says the KV of the next n appended tokens is written: every block that
// became full is sealed (findable by later prompts, read-only from then
// on). Tokens appended but not committed can be taken back with Rollback
// (rejected speculative tokens): a block is sealed only once all its
// tokens are committed, so a rollback never touches sealed content.
//
// Commit is never implied, and never silently missing: Append refuses
// (ErrInvalidArgument) while tokens appended earlier are neither
// committed nor rolled back, so an engine that forgets to Commit hears
// of it at its first decode step instead of caching nothing. (The model
// samples a token from the KV of every token before it: by the time a
// token is appended, the step that wrote the earlier tokens has run and
// its tokens are committed. An engine that schedules a step before the
// previous one has run commits when it schedules, as vLLM caches blocks
// when it allocates them.)
//
//	seq, _ := pool.Admit(kvlease.SequenceSpec{Owner: "req-1", Seed: seed, Prompt: prompt})
//	for seq.Computed() < seq.Len() { // chunked prefill; hits: seq.CachedTokens()
//		n := min(chunk, seq.Len()-seq.Computed())
//		// ... compute KV of seq.Tokens()[seq.Computed():][:n] ...
//		seq.Commit(n)
//	}
//	for !done { // decode
//		t := sample()
//		if err := seq.Append(t); err != nil { /* preempt */ }
//		// ... next step computes t's KV ...
//		seq.Commit(1)
//	}
//	seq.Lease().Release()
//
// The prompt is hashed once: admission chains the hashes of its full
// blocks (one Hasher call), looks the prefix up with them and seals the
// prompt's later blocks with the same hashes as they are committed.
// Block k's hash is h[k] = the pool's hash of h[k-1] and block k's tokens
// (and extra keys) with h[-1] = the seed, exactly ChainHashes over all
// the sequence's tokens for a pool without a Hasher or extra keys.
//
// Block k of the sequence is block k of its lease, except in a
// sliding-window sequence (SequenceSpec.Window): its lease starts at
// absolute block Base() (a prefix hit needs only the window before it)
// and gives back (Lease.TrimTo) the blocks that fall out of the window as
// tokens are committed, so lease index i is block Base()+i.
//
// A Sequence is not safe for concurrent use: one scheduler goroutine
// drives it. Its lease is (Lease returns it): an Abort from a request's
// HTTP goroutine may race the scheduler, whose next Append or Commit then
// fails with ErrLeaseClosed.
type Sequence[R any] struct {
	l         *Lease[R]
	bt        int
	seed      BlockHash
	tokens    []int32     // prompt, then generated; tokens[:computed] have KV
	hashes    []BlockHash // hashes[k]: block k's chain hash (the prompt's full blocks from the start, later ones as sealed)
	computed  int         // tokens whose KV is written
	sealed    int         // blocks 0..sealed-1 are sealed (or cached before Base): always computed/bt
	hits      int         // blocks 0..hits-1 needed no computing at admission
	promptLen int
	spans     []ExtraKey // extra keys over token ranges (SequenceSpec.Extra, empty ones left out)
	nblocks   int        // the lease's length: only the sequence grows it (Lease.Len takes the pool's lock)
	base      int        // absolute block of lease index 0 (sliding window; else 0)
	window    int        // SequenceSpec.Window: 0 for full attention
	trimmed   int        // lease indices below it were given back (Lease.Trimmed, without the lock)

	// The decode fast path's bounds, kept by setBounds: an Append of one
	// token to a sequence of n < room tokens needs no growth and no new
	// array; a commit up to calm-1 tokens seals and trims nothing; fast
	// is min(room, calm-1), AppendComputed's one bound.
	room, calm, fast int
}

// SequenceSpec is a request as Pool.Admit takes it. Every size in it is
// checked before anything is sized or acquired: a spec that could never
// be admitted is refused with ErrInvalidArgument (a malformed value) or
// ErrExceedsCapacity (more than the pool could ever hold), and holds
// nothing.
type SequenceSpec struct {
	Owner  string    // the lease's owner (the request id)
	Seed   BlockHash // the chain root: model, adapter, tenant (Pool.TenantSeed); see Hasher
	Prompt []int32   // the prompt's tokens (TokensInt32 for uint32 ids); copied
	// Extra lists extra keys over token ranges of the sequence (an
	// image's placeholder tokens and its content hash): each is mixed
	// into the hash of exactly the blocks holding one of its tokens,
	// recorded with their seals (verified mode checks them) and
	// published with their BlockStored events (extra_keys). Blocks before
	// the first key's range are shared with prompts without it. Ranges
	// may reach past the prompt (generated tokens). An empty range
	// (Start == End) covers no token and is ignored, as llm-d ignores
	// it; a negative Start, an End before Start, more than 4096 keys or
	// a key longer than 64 KiB is refused.
	Extra []ExtraKey
	// Adapter tags the blocks the sequence seals (Lease.SetAdapter).
	Adapter Adapter
	// Tenant, when it names a tenant registered with Pool.Tenant, charges
	// the sequence's fresh blocks to it, under its quota (its Seed should
	// come from Pool.TenantSeed). Another name charges no one.
	Tenant string
	// MaxTokens, when larger than the prompt, is the most tokens the
	// sequence will hold (prompt plus max_tokens): its token and hash
	// tables are made that large at once, so decoding
	// allocates nothing more. Negative is refused; more than the pool
	// could ever hold (its blocks × block tokens) is ErrExceedsCapacity,
	// except in a sliding-window sequence, whose tables are then made
	// that large and grow as needed.
	MaxTokens int
	// Window, when positive, makes a sliding-window sequence: a token
	// attends to the Window tokens before it (Gemma's, gpt-oss's
	// sliding-window layers, each in a pool of their own). Its prefix
	// hit needs only the blocks of the window before the hit point
	// (vLLM's rule: the longest such hit is found), its lease starts
	// there (Sequence.Base), and Commit gives back (Lease.TrimTo) the
	// blocks that fell out of the window of the next token to compute;
	// sealed ones stay cached. Negative is refused.
	Window int
}

// The limits on a spec's extra keys: each key is mixed into the hash of
// every block it covers and travels with their seal records and events.
const (
	maxExtraKeys     = 4096    // extra keys in one SequenceSpec
	maxExtraKeyBytes = 1 << 16 // bytes in one extra key (a content hash or a salt, not content)
)

// Admit admits a request (spec.Owner, spec.Seed, spec.Prompt; extra
// keys, an adapter, a reservation or a sliding window: see
// SequenceSpec): it hashes the prompt's full blocks once (under the
// seed, the chain root, in one Hasher call), acquires a lease whose
// leading blocks are the longest cached prefix of the prompt (under
// AcquirePrefixTokens' rule: never the block holding the prompt's last
// token; verified in verified mode) and whose other blocks are fresh, one
// slot for every prompt token. The hit tokens count as computed
// (CachedTokens); the rest of the prompt is appended, not yet computed.
//
// The pool needs a block size (WithBlockTokens or WithVerifiedPrefix),
// the owner must not be empty and the prompt must have at least one
// token; otherwise the error wraps ErrInvalidArgument, as does a spec
// out of its bounds. A prompt of more blocks than the pool has is
// ErrExceedsCapacity. Other errors are AcquirePrefix's, or the Hasher's:
// the request holds nothing after an error. The sequence keeps its own
// copy of the prompt.
func (p *Pool[R]) Admit(spec SequenceSpec) (*Sequence[R], error) {
	return p.admit(spec, nil)
}

// AdmitWith is Admit with the lease taken by acquire instead of the
// pool's own prefix lookup: a tiered cache that finds hits below the
// device (tiers.Cache.Admit) admits sequences with it. The pool checks
// the spec and hashes the prompt, then calls acquire once with the
// hashes a prefix may hit (those before the block holding the prompt's
// last token: vLLM's rule is applied before acquire sees them) and n,
// the prompt's blocks. acquire returns a lease of this pool with n
// blocks whose first hits blocks (0 ≤ hits ≤ len(hashes)) hold the
// prefix's first hits hashes, sealed as such, or an error, which
// AdmitWith returns as it is. A lease of another pool or another length,
// or hits out of range, is released and refused with ErrInvalidArgument.
// A sliding-window spec is refused (ErrInvalidArgument).
func (p *Pool[R]) AdmitWith(spec SequenceSpec, acquire func(hashes []BlockHash, n int) (*Lease[R], int, error)) (*Sequence[R], error) {
	if acquire == nil || spec.Window != 0 {
		err := fmt.Errorf("kvlease: admit %q with an acquire function (nil: %v) and a window of %d tokens (AdmitWith takes none): %w",
			spec.Owner, acquire == nil, spec.Window, ErrInvalidArgument)
		return nil, p.reject(spec.Owner, 0, err)
	}
	return p.admit(spec, acquire)
}

// checkSpec refuses a spec before anything is sized: the owner, the block
// size, the prompt, the sizes and the extra keys. It returns the number
// of extra keys that cover tokens.
func (p *Pool[R]) checkSpec(spec *SequenceSpec) (int, error) {
	owner, bt := spec.Owner, p.cfg.blockTokens
	var err error
	switch {
	case owner == "":
		err = fmt.Errorf("kvlease: admit a sequence of %d tokens: empty owner: %w", len(spec.Prompt), ErrInvalidArgument)
	case bt == 0 || len(spec.Prompt) == 0:
		err = fmt.Errorf("kvlease: admit %q: a sequence of %d tokens needs a block size (WithBlockTokens or WithVerifiedPrefix) and a prompt: %w",
			owner, len(spec.Prompt), ErrInvalidArgument)
	case spec.MaxTokens < 0 || spec.Window < 0:
		err = fmt.Errorf("kvlease: admit %q: max tokens %d, window %d: neither may be negative: %w", owner, spec.MaxTokens, spec.Window, ErrInvalidArgument)
	case len(spec.Extra) > maxExtraKeys:
		err = fmt.Errorf("kvlease: admit %q: %d extra keys, at most %d: %w", owner, len(spec.Extra), maxExtraKeys, ErrInvalidArgument)
	case spec.Adapter.Name == "" && spec.Adapter.ID != 0:
		err = fmt.Errorf("kvlease: admit %q: adapter id %d without a name: %w", owner, spec.Adapter.ID, ErrInvalidArgument)
	}
	if err != nil {
		return 0, err
	}
	capTokens := p.tab.Len() * bt // no overflow: capacity < 2³¹, block tokens ≤ maxBlockTokens
	if blocks := (len(spec.Prompt) + bt - 1) / bt; blocks > p.tab.Len() {
		return 0, fmt.Errorf("kvlease: admit %q: a prompt of %d tokens needs %d blocks of %d, the pool has %d: %w",
			owner, len(spec.Prompt), blocks, bt, p.tab.Len(), ErrExceedsCapacity)
	}
	if spec.Window == 0 && spec.MaxTokens > capTokens {
		return 0, fmt.Errorf("kvlease: admit %q: %d tokens at most, the pool holds %d (%d blocks of %d): %w",
			owner, spec.MaxTokens, capTokens, p.tab.Len(), bt, ErrExceedsCapacity)
	}
	keys := 0
	for i, e := range spec.Extra {
		switch {
		case e.Start < 0 || e.End < e.Start:
			return 0, fmt.Errorf("kvlease: admit %q: extra key %d covers [%d, %d): %w", owner, i, e.Start, e.End, ErrInvalidArgument)
		case len(e.Key) > maxExtraKeyBytes:
			return 0, fmt.Errorf("kvlease: admit %q: extra key %d has %d bytes, at most %d: %w", owner, i, len(e.Key), maxExtraKeyBytes, ErrInvalidArgument)
		case e.End > e.Start:
			keys++
		}
	}
	return keys, nil
}

// admit is Admit and AdmitWith (acquire non-nil).
func (p *Pool[R]) admit(spec SequenceSpec, acquire func([]BlockHash, int) (*Lease[R], int, error)) (*Sequence[R], error) {
	owner, prompt := spec.Owner, spec.Prompt
	keys, err := p.checkSpec(&spec)
	if err != nil {
		return nil, p.reject(owner, 0, err)
	}
	bt := p.cfg.blockTokens
	n := (len(prompt) + bt - 1) / bt
	s := &Sequence[R]{bt: bt, seed: spec.Seed, promptLen: len(prompt), window: spec.Window}
	if keys > 0 {
		s.spans = make([]ExtraKey, 0, keys)
		for _, e := range spec.Extra {
			if e.End > e.Start {
				s.spans = append(s.spans, e)
			}
		}
	}
	total := min(max(spec.MaxTokens, len(prompt)+bt), p.tab.Len()*bt)
	total = max(total, len(prompt))
	full := len(prompt) / bt
	s.tokens = make([]int32, len(prompt), total)
	copy(s.tokens, prompt)
	s.hashes = make([]BlockHash, full, max(n, total/bt)+1)
	var extra [][]string
	if len(s.spans) > 0 {
		extra = make([][]string, full)
		for k := range extra {
			extra[k] = s.extraOf(nil, k)
		}
	}
	if err := p.hashChain(spec.Seed, s.tokens[:full*bt], extra, s.hashes); err != nil {
		return nil, p.reject(owner, n, fmt.Errorf("kvlease: admit %q: %w", owner, err))
	}
	var (
		l    *Lease[R]
		hits int
	)
	hb := hitBlocks(len(prompt), bt)
	var vp *verifier
	if p.verified && hb > 0 {
		vp = &verifier{seed: spec.Seed, hashes: s.hashes[:hb], tokens: s.tokens, blockTokens: bt, spans: s.spans}
	}
	tn := p.tenantIndex(spec.Tenant)
	switch {
	case acquire != nil:
		l, hits, err = p.acquireBy(acquire, owner, s.hashes[:hb], n)
	case s.window > 0:
		l, s.base, hits, err = p.acquireWindow(owner, tn, s.hashes[:hb], vp, n, bt, s.window)
	case hb > 0:
		l, hits, err = p.acquire(owner, tn, s.hashes[:hb], vp, n)
	default:
		l, _, err = p.acquire(owner, tn, nil, nil, n)
	}
	if err != nil {
		return nil, err
	}
	if spec.Adapter != (Adapter{}) {
		if err := l.SetAdapter(spec.Adapter); err != nil {
			l.Release()
			return nil, err
		}
	}
	s.l = l
	s.nblocks = n - s.base
	s.hits = hits
	s.sealed = hits
	s.computed = hits * bt
	s.setBounds()
	return s, nil
}

// acquireBy calls AdmitWith's acquire and checks what it returns.
func (p *Pool[R]) acquireBy(acquire func([]BlockHash, int) (*Lease[R], int, error), owner string, hashes []BlockHash, n int) (*Lease[R], int, error) {
	l, hits, err := acquire(hashes, n)
	if err != nil {
		if l != nil {
			l.Release()
		}
		return nil, 0, err
	}
	if l == nil || l.p != p || l.Len() != n || hits < 0 || hits > len(hashes) {
		if l != nil && l.p == p {
			l.Release()
		}
		return nil, 0, fmt.Errorf("kvlease: admit %q: acquire returned a lease of another pool, of other than %d blocks, or %d hits of %d hashes: %w",
			owner, n, hits, len(hashes), ErrInvalidArgument)
	}
	return l, hits, nil
}

// extraOf appends block k's extra keys to dst.
func (s *Sequence[R]) extraOf(dst []string, k int) []string {
	if len(s.spans) == 0 {
		return dst
	}
	return blockExtras(dst, s.spans, k, s.bt)
}

// setBounds recomputes the fast path's bounds (see room and calm) after
// anything they depend on changed: the lease's length, the token array's
// capacity, the sealed blocks or the trim point.
func (s *Sequence[R]) setBounds() {
	s.room = min((s.base+s.nblocks)*s.bt, cap(s.tokens))
	calm := (s.sealed + 1) * s.bt // computed reaching it fills block sealed
	if s.window > 0 {
		// The window's first block moves past the trim point when
		// windowStart(computed) > base+trimmed.
		calm = min(calm, s.window+(s.base+s.trimmed+1)*s.bt)
	}
	s.calm = calm
	s.fast = min(s.room, calm-1)
}

// windowStart is the first block the token at position pos attends to.
func (s *Sequence[R]) windowStart(pos int) int {
	if s.window == 0 || pos <= s.window {
		return 0
	}
	return (pos - s.window) / s.bt
}

// Lease returns the sequence's lease: its block table (AppendBlockIDs),
// its regions, and the Abort a request's own goroutine may call. Lease
// index i is the sequence's block Base()+i.
func (s *Sequence[R]) Lease() *Lease[R] { return s.l }

// Base returns the sequence's block that is its lease's index 0: 0 but
// for a sliding-window sequence admitted with a prefix hit, whose lease
// starts at the window before the hit.
func (s *Sequence[R]) Base() int { return s.base }

// Len returns the tokens appended so far, prompt included.
func (s *Sequence[R]) Len() int { return len(s.tokens) }

// Computed returns the tokens whose KV is written (committed, or prefix
// hits).
func (s *Sequence[R]) Computed() int { return s.computed }

// PromptLen returns the prompt's length in tokens.
func (s *Sequence[R]) PromptLen() int { return s.promptLen }

// Hits returns how many leading blocks needed no computing at admission:
// prefix hits (a sliding-window sequence holds only those from Base()).
func (s *Sequence[R]) Hits() int { return s.hits }

// CachedTokens returns the prompt tokens served from the prefix cache
// (vLLM's usage.prompt_tokens_details.cached_tokens): Hits × block tokens.
func (s *Sequence[R]) CachedTokens() int { return s.hits * s.bt }

// Tokens returns the sequence's tokens, prompt first. The slice is the
// sequence's own: read it, do not write or keep it past the next Append.
func (s *Sequence[R]) Tokens() []int32 { return s.tokens }

// BlockHashes returns the chain hashes of the sealed blocks, block 0
// first (read only; valid until the next Commit).
func (s *Sequence[R]) BlockHashes() []BlockHash { return s.hashes[:s.sealed] }

// parent returns the hash the next block to seal chains from: the last
// sealed block's hash, or the seed before any block is sealed.
func (s *Sequence[R]) parent() BlockHash {
	if s.sealed == 0 {
		return s.seed
	}
	return s.hashes[s.sealed-1]
}

// Append adds tokens whose KV the next step computes, growing the lease
// so that each has a slot (one Extend when it crosses block boundaries).
// All or nothing: on an error (Extend's: ErrExhausted, ErrLeaseClosed,
// ErrExceedsCapacity, ErrPoolClosed) no token is appended. Tokens
// appended earlier must all be committed (or rolled back) first;
// otherwise the error wraps ErrInvalidArgument (see Sequence), or
// ErrLeaseClosed once the lease is closed.
func (s *Sequence[R]) Append(tokens ...int32) error {
	// A decode step's token, in room and with nothing pending: no growth,
	// no copy loop. (Small enough to inline: the slow path is one call.)
	if n := len(s.tokens); len(tokens) == 1 && n == s.computed && n < s.room {
		s.tokens = s.tokens[:n+1]
		s.tokens[n] = tokens[0]
		return nil
	}
	return s.appendSlow(tokens)
}

func (s *Sequence[R]) appendSlow(tokens []int32) error {
	if len(tokens) == 0 {
		return nil
	}
	if pending := len(s.tokens) - s.computed; pending > 0 {
		if s.l.Closed() { // an Abort's ErrLeaseClosed says more
			return fmt.Errorf("kvlease: append %d tokens to %q: %w", len(tokens), s.l.Owner(), ErrLeaseClosed)
		}
		return fmt.Errorf("kvlease: append %d tokens to %q: the %d tokens appended before are not committed (Commit those the last step computed, Rollback the others): %w",
			len(tokens), s.l.Owner(), pending, ErrInvalidArgument)
	}
	if end := len(s.tokens) + len(tokens); end > (s.base+s.nblocks)*s.bt {
		if err := s.grow(end); err != nil {
			return err
		}
	}
	s.tokens = append(s.tokens, tokens...)
	s.setBounds()
	return nil
}

// grow extends the lease to hold end tokens.
func (s *Sequence[R]) grow(end int) error {
	need := (end+s.bt-1)/s.bt - s.base
	if err := s.l.Extend(need - s.nblocks); err != nil {
		return err
	}
	s.nblocks = need
	return nil
}

// Commit records that the KV of the next n appended tokens is written and
// seals every block that became full, each with its chain hash (the
// prompt's hashes computed at admission, later blocks hashed as they
// fill), its parent and its tokens: the seal SealTokens makes, so KV
// events carry them and verified mode checks them on later hits. A
// sliding-window sequence then gives back the blocks before the window of
// the next token to compute. n must be in [0, Len()-Computed()],
// otherwise ErrInvalidArgument; a seal's error (ErrLeaseClosed, the
// Hasher's) leaves Computed at the last block sealed.
func (s *Sequence[R]) Commit(n int) error {
	// A decode step's commit: no block fills, nothing to trim. (Small
	// enough to inline: the slow path is one call.)
	if to := s.computed + n; uint(n) <= uint(len(s.tokens)-s.computed) && to < s.calm {
		s.computed = to
		return nil
	}
	return s.commitSlow(n)
}

func (s *Sequence[R]) commitSlow(n int) error {
	if n < 0 || n > len(s.tokens)-s.computed {
		return fmt.Errorf("kvlease: commit %d tokens of a sequence with %d appended and %d computed: %w",
			n, len(s.tokens), s.computed, ErrInvalidArgument)
	}
	to := s.computed + n
	bt := s.bt
	for (s.sealed+1)*bt <= to {
		if err := s.sealNext(); err != nil {
			s.setBounds()
			return err
		}
		s.computed = s.sealed * bt
	}
	s.computed = to
	var err error
	if s.window > 0 {
		if first := s.windowStart(to) - s.base; first > s.trimmed {
			if err = s.l.TrimTo(first); err == nil {
				s.trimmed = first
			}
		}
	}
	s.setBounds()
	return err
}

// sealNext seals block s.sealed, which is full of committed tokens.
func (s *Sequence[R]) sealNext() error {
	bt := s.bt
	k := s.sealed
	toks := s.tokens[k*bt : (k+1)*bt]
	parent := s.parent()
	var extra []string
	if len(s.spans) > 0 {
		extra = s.extraOf(nil, k) // kept by the seal: its own slice
	}
	var h BlockHash
	switch {
	case k < len(s.hashes):
		h = s.hashes[k] // a prompt block: hashed at admission
	case extra == nil && s.l.ls.c.cfg.hasher == nil:
		h = hashInto(parent, toks) // a decoded block, the usual hash
		s.hashes = append(s.hashes, h)
	default:
		var err error
		if h, err = s.hashNext(parent, toks, extra); err != nil {
			return err
		}
	}
	st := sealTokens{parent: parent, tokens: toks, extra: extra}
	if err := s.l.ls.seal(k-s.base, h, &st); err != nil {
		return err
	}
	s.sealed++
	return nil
}

// hashNext hashes block len(s.hashes) and records its hash there.
func (s *Sequence[R]) hashNext(parent BlockHash, toks []int32, extra []string) (BlockHash, error) {
	c := s.l.ls.c
	k := len(s.hashes)
	if c.cfg.hasher == nil {
		h := hashInto(parent, toks)
		if len(extra) > 0 {
			h = mixExtra(h, extra)
		}
		s.hashes = append(s.hashes, h)
		return h, nil
	}
	// The Hasher writes into the sequence's own table: no allocation.
	s.hashes = append(s.hashes, 0)
	var ex [][]string
	if len(extra) > 0 {
		ex = [][]string{extra}
	}
	if err := c.hashChain(parent, toks, ex, s.hashes[k:k+1]); err != nil {
		s.hashes = s.hashes[:k]
		return 0, fmt.Errorf("kvlease: commit %q: %w", s.l.Owner(), err)
	}
	return s.hashes[k], nil
}

// AppendComputed is Append then Commit of the same tokens: for an engine
// that hands the sequence a token after its KV is written.
func (s *Sequence[R]) AppendComputed(tokens ...int32) error {
	// A decode step's token: room, nothing pending, no block fills.
	n := len(s.tokens)
	if len(tokens) != 1 || n != s.computed || n >= s.fast {
		return s.appendComputedSlow(tokens)
	}
	s.tokens = s.tokens[:n+1]
	s.tokens[n] = tokens[0]
	s.computed = n + 1
	return nil
}

func (s *Sequence[R]) appendComputedSlow(tokens []int32) error {
	// A decode step's token at a block boundary, in the token array's
	// room and with nothing pending: the two cases every block meets
	// once, without appendSlow's general checks.
	if n := len(s.tokens); len(tokens) == 1 && n == s.computed && n < cap(s.tokens) {
		switch {
		case n < s.room: // it fills its block (or moves the window): a seal
			s.tokens = s.tokens[:n+1]
			s.tokens[n] = tokens[0]
			k, bt := s.sealed, s.bt
			if s.window > 0 || n+1 != (k+1)*bt {
				return s.commitSlow(1)
			}
			// Commit(1), straight: one block sealed, no trim; the bounds
			// move by a block (setBounds' result, incrementally). A
			// decoded block with the usual hash is sealNext by hand (its
			// call would be one more per block: BenchmarkSequenceDecode).
			if k == 0 || k != len(s.hashes) || len(s.spans) > 0 || s.l.ls.c.cfg.hasher != nil {
				if err := s.sealNext(); err != nil {
					return err
				}
			} else {
				toks := s.tokens[k*bt : n+1]
				parent := s.hashes[k-1]
				h := hashInto(parent, toks)
				if err := s.l.ls.seal(k-s.base, h, &sealTokens{parent: parent, tokens: toks}); err != nil {
					return err
				}
				s.hashes = append(s.hashes, h)
				s.sealed++
			}
			s.computed = n + 1
			s.calm += s.bt
			s.fast = min(s.room, s.calm-1)
			return nil
		case n == (s.base+s.nblocks)*s.bt && s.window == 0 && s.bt > 1:
			// It starts a block: one more, and (a block holding more
			// than this token) nothing to seal.
			if err := s.l.Extend(1); err != nil {
				return err
			}
			s.nblocks++
			s.tokens = s.tokens[:n+1]
			s.tokens[n] = tokens[0]
			s.computed = n + 1
			s.room = min(s.room+s.bt, cap(s.tokens))
			s.fast = min(s.room, s.calm-1)
			return nil
		}
	}
	if err := s.appendSlow(tokens); err != nil {
		return err
	}
	return s.Commit(len(tokens))
}

// Onboarded records that the KV of the next blocks blocks after the hits
// arrived from elsewhere (a lower tier's copy: tiers' Onboard.Wait calls
// it): they count as hits (Hits, CachedTokens) and as computed, and are
// sealed with their chain hashes (a no-op for a block the copy has sealed
// already). It must come before anything past the hits is committed and
// cover only blocks a prefix may hit (those before the block holding the
// prompt's last token), in a sequence without a window; otherwise
// ErrInvalidArgument. Other errors are Commit's.
func (s *Sequence[R]) Onboarded(blocks int) error {
	if hb := hitBlocks(s.promptLen, s.bt); blocks < 0 || blocks > hb-s.hits || s.computed != s.hits*s.bt || s.window > 0 {
		return fmt.Errorf("kvlease: %q onboarded %d blocks after %d hits, %d tokens computed: %w",
			s.l.Owner(), blocks, s.hits, s.computed, ErrInvalidArgument)
	}
	if err := s.Commit(blocks * s.bt); err != nil {
		return err
	}
	s.hits += blocks
	return nil
}

// Rollback takes back the last n appended tokens whose KV is not
// committed (draft tokens the target model rejected). Their slots stay
// in the lease, unsealed and private, for the tokens appended next. n
// must be in [0, Len()-Computed()], otherwise ErrInvalidArgument. It may
// take back prompt tokens not yet prefilled too.
func (s *Sequence[R]) Rollback(n int) error {
	if n < 0 || n > len(s.tokens)-s.computed {
		return fmt.Errorf("kvlease: roll back %d tokens of a sequence with %d appended and %d computed: %w",
			n, len(s.tokens), s.computed, ErrInvalidArgument)
	}
	s.tokens = s.tokens[:len(s.tokens)-n]
	if nb := len(s.tokens) / s.bt; nb < len(s.hashes) {
		s.hashes = s.hashes[:nb] // prompt blocks hashed at admission, no longer whole
	}
	return nil
}

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
//	seq, _ := pool.NewSequence("req-1", seed, prompt) // hits: seq.CachedTokens()
//	for seq.Computed() < seq.Len() {                   // chunked prefill
//		n := min(chunk, seq.Len()-seq.Computed())
//		// ... compute KV of seq.Tokens()[seq.Computed():][:n] ...
//		seq.Commit(n)
//	}
//	for !done {                                        // decode
//		t := sample()
//		if err := seq.Append(t); err != nil { /* preempt */ }
//		// ... next step computes t's KV ...
//		seq.Commit(1)
//	}
//	seq.Release()
//
// The prompt is hashed once: NewSequence chains the hashes of its full
// blocks, looks the prefix up with them and seals the prompt's later
// blocks with the same hashes as they are committed. Block k of the
// sequence is block k of its lease; its hash is h[k] = HashBlock(h[k-1],
// block k's tokens) with h[-1] = the seed, exactly ChainHashes over all
// the sequence's tokens.
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
	sealed    int         // blocks 0..sealed-1 are sealed: always computed/bt
	hits      int         // prefix-hit blocks at admission
	promptLen int
	spans     []ExtraKey // extra keys over token ranges (SequenceSpec.Extra)
	nblocks   int        // the lease's length: only the sequence grows it (Lease.Len takes the pool's lock)
}

// SequenceSpec is a request as Pool.Admit takes it.
type SequenceSpec struct {
	Owner  string    // the lease's owner (the request id)
	Seed   BlockHash // the namespace: model, adapter, tenant (Pool.TenantSeed)
	Prompt []int32   // the prompt's tokens (TokensInt32 for uint32 ids); copied
	// Extra lists extra keys over token ranges of the sequence (an
	// image's placeholder tokens and its content hash): each is mixed
	// into the hash of exactly the blocks holding one of its tokens,
	// recorded with their seals (verified mode checks them) and
	// published with their BlockStored events (extra_keys). Blocks before
	// the first key's range are shared with prompts without it. Ranges
	// may reach past the prompt (generated tokens).
	Extra []ExtraKey
	// Adapter tags the blocks the sequence seals (Lease.SetAdapter).
	Adapter Adapter
	// Tenant, when it names a tenant registered with Pool.Tenant, charges
	// the sequence's fresh blocks to it, under its quota (its Seed should
	// come from Pool.TenantSeed). Another name charges no one.
	Tenant string
	// MaxTokens, when larger than the prompt, is the most tokens the
	// sequence will hold (prompt plus max_tokens): its token and hash
	// tables are made that large at once (Reserve), so decoding
	// allocates nothing more.
	MaxTokens int
}

// NewSequence admits a request: it hashes the prompt's full blocks once
// (under the namespace seed, as ChainHashes does), acquires a lease whose
// leading blocks are the longest cached prefix of the prompt (under
// AcquirePrefixTokens' rule: never the block holding the prompt's last
// token; verified in verified mode) and whose other blocks are fresh, one
// slot for every prompt token. The hit tokens count as computed
// (CachedTokens); the rest of the prompt is appended, not yet computed.
//
// The pool needs a block size (WithBlockTokens or WithVerifiedPrefix) and
// the prompt at least one token; otherwise the error wraps
// ErrInvalidArgument. Other errors are AcquirePrefix's: the request
// holds nothing after an error. The sequence keeps its own copy of the
// prompt.
func (p *Pool[R]) NewSequence(owner string, seed BlockHash, prompt []int32) (*Sequence[R], error) {
	return p.Admit(SequenceSpec{Owner: owner, Seed: seed, Prompt: prompt})
}

// Admit is NewSequence for a request with extra keys or an adapter (see
// SequenceSpec); the errors are NewSequence's, and an extra key whose
// range is empty or negative wraps ErrInvalidArgument.
func (p *Pool[R]) Admit(spec SequenceSpec) (*Sequence[R], error) {
	owner, seed, prompt := spec.Owner, spec.Seed, spec.Prompt
	for i, e := range spec.Extra {
		if e.Start < 0 || e.End <= e.Start {
			err := fmt.Errorf("kvlease: admit %s: extra key %d covers [%d, %d): %w", owner, i, e.Start, e.End, ErrInvalidArgument)
			return nil, p.reject(owner, 0, err)
		}
	}
	if a := spec.Adapter; a.Name == "" && a.ID != 0 {
		err := fmt.Errorf("kvlease: admit %s: adapter id %d without a name: %w", owner, a.ID, ErrInvalidArgument)
		return nil, p.reject(owner, 0, err)
	}
	bt := p.cfg.blockTokens
	if bt == 0 || len(prompt) == 0 {
		err := fmt.Errorf("kvlease: new sequence of %d tokens needs a block size (WithBlockTokens or WithVerifiedPrefix) and a prompt: %w",
			len(prompt), ErrInvalidArgument)
		return nil, p.reject(owner, 0, err)
	}
	n := (len(prompt) + bt - 1) / bt
	s := &Sequence[R]{bt: bt, seed: seed, promptLen: len(prompt), spans: spec.Extra}
	total := max(spec.MaxTokens, len(prompt)+bt)
	s.tokens = make([]int32, len(prompt), total)
	copy(s.tokens, prompt)
	full := len(prompt) / bt
	s.hashes = make([]BlockHash, full, max(n, total/bt)+1)
	parent := seed
	for k := range full {
		// (extraOf allocates only for a spec with extra keys: a stack
		// buffer would escape through a WithHasher's call.)
		parent = p.hashBlock(parent, s.tokens[k*bt:(k+1)*bt], s.extraOf(nil, k))
		s.hashes[k] = parent
	}
	var (
		l    *Lease[R]
		hits int
		err  error
	)
	if hb := hitBlocks(len(prompt), bt); hb > 0 {
		var vp *verifier
		if p.verified {
			vp = &verifier{seed: seed, hashes: s.hashes[:hb], tokens: s.tokens, blockTokens: bt, spans: s.spans}
		}
		l, hits, err = p.acquire(owner, p.tenantIndex(spec.Tenant), s.hashes[:hb], vp, n)
	} else {
		l, _, err = p.acquire(owner, p.tenantIndex(spec.Tenant), nil, nil, n)
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
	s.nblocks = n
	s.hits = hits
	s.sealed = hits
	s.computed = hits * bt
	return s, nil
}

// extraOf appends block k's extra keys to dst.
func (s *Sequence[R]) extraOf(dst []string, k int) []string {
	if len(s.spans) == 0 {
		return dst
	}
	return blockExtras(dst, s.spans, k, s.bt)
}

// Lease returns the sequence's lease: its block table (AppendBlockIDs),
// its regions, and the Abort a request's own goroutine may call.
func (s *Sequence[R]) Lease() *Lease[R] { return s.l }

// Blocks returns how many blocks the sequence's lease holds (Lease.Len
// without the pool's lock: the sequence alone grows its lease).
func (s *Sequence[R]) Blocks() int { return s.nblocks }

// Len returns the tokens appended so far, prompt included.
func (s *Sequence[R]) Len() int { return len(s.tokens) }

// Computed returns the tokens whose KV is written (committed, or prefix
// hits).
func (s *Sequence[R]) Computed() int { return s.computed }

// PromptLen returns the prompt's length in tokens.
func (s *Sequence[R]) PromptLen() int { return s.promptLen }

// Hits returns how many leading blocks were prefix hits at admission.
func (s *Sequence[R]) Hits() int { return s.hits }

// CachedTokens returns the prompt tokens served from the prefix cache
// (vLLM's usage.prompt_tokens_details.cached_tokens): Hits × block tokens.
func (s *Sequence[R]) CachedTokens() int { return s.hits * s.bt }

// Tokens returns the sequence's tokens, prompt first. The slice is the
// sequence's own: read it, do not write or keep it past the next Append.
func (s *Sequence[R]) Tokens() []int32 { return s.tokens }

// Sealed returns how many leading blocks are sealed.
func (s *Sequence[R]) Sealed() int { return s.sealed }

// BlockHashes returns the chain hashes of the sealed blocks, block 0
// first (read only; valid until the next Commit).
func (s *Sequence[R]) BlockHashes() []BlockHash { return s.hashes[:s.sealed] }

// Parent returns the hash the next block to seal chains from: the last
// sealed block's hash, or the seed before any block is sealed.
func (s *Sequence[R]) Parent() BlockHash {
	if s.sealed == 0 {
		return s.seed
	}
	return s.hashes[s.sealed-1]
}

// Reserve makes room for the sequence to hold total tokens without
// allocating again (an engine knows a request's prompt plus max_tokens).
// It changes no block: growth stays with Append.
func (s *Sequence[R]) Reserve(total int) {
	if total > cap(s.tokens) {
		t := make([]int32, len(s.tokens), total)
		copy(t, s.tokens)
		s.tokens = t
	}
	if nb := total/s.bt + 1; nb > cap(s.hashes) {
		h := make([]BlockHash, len(s.hashes), nb)
		copy(h, s.hashes)
		s.hashes = h
	}
}

// Append adds tokens whose KV the next step computes, growing the lease
// so that each has a slot (one Extend when it crosses block boundaries).
// All or nothing: on an error (Extend's: ErrExhausted, ErrLeaseClosed,
// ErrExceedsCapacity, ErrPoolClosed) no token is appended.
func (s *Sequence[R]) Append(tokens ...int32) error {
	if end := len(s.tokens) + len(tokens); end > s.nblocks*s.bt {
		if err := s.grow(end); err != nil {
			return err
		}
	}
	if len(tokens) == 1 { // a decode step's token: no copy loop
		s.tokens = append(s.tokens, tokens[0])
	} else {
		s.tokens = append(s.tokens, tokens...)
	}
	return nil
}

// grow extends the lease to hold end tokens.
func (s *Sequence[R]) grow(end int) error {
	need := (end + s.bt - 1) / s.bt
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
// events carry them and verified mode checks them on later hits. n must
// be in [0, Len()-Computed()], otherwise ErrInvalidArgument; a seal's
// error (ErrLeaseClosed) leaves Computed where it was.
func (s *Sequence[R]) Commit(n int) error {
	if n < 0 || n > len(s.tokens)-s.computed {
		return fmt.Errorf("kvlease: commit %d tokens of a sequence with %d appended and %d computed: %w",
			n, len(s.tokens), s.computed, ErrInvalidArgument)
	}
	to := s.computed + n
	bt := s.bt
	if to < (s.sealed+1)*bt { // no block filled: a decode step's commit
		s.computed = to
		return nil
	}
	for (s.sealed+1)*bt <= to {
		k := s.sealed
		toks := s.tokens[k*bt : (k+1)*bt]
		parent := s.Parent()
		var extra []string
		if len(s.spans) > 0 {
			extra = s.extraOf(nil, k) // kept by the seal: its own slice
		}
		var h BlockHash
		if k < len(s.hashes) {
			h = s.hashes[k] // a prompt block: hashed at admission
		} else {
			h = s.l.ls.c.hashBlock(parent, toks, extra)
		}
		st := sealTokens{parent: parent, tokens: toks, extra: extra}
		if err := s.l.ls.seal(k, h, &st); err != nil {
			return err
		}
		if k == len(s.hashes) {
			s.hashes = append(s.hashes, h)
		}
		s.sealed++
	}
	s.computed = to
	return nil
}

// AppendComputed is Append then Commit of the same tokens: for an engine
// that hands the sequence a token after its KV is written.
func (s *Sequence[R]) AppendComputed(tokens ...int32) error {
	if err := s.Append(tokens...); err != nil {
		return err
	}
	return s.Commit(len(tokens))
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

// Release ends the request: its lease is released (sealed blocks stay
// cached for later prompts). Idempotent, as Lease.Release.
func (s *Sequence[R]) Release() { s.l.Release() }

// Abort ends the request with a cause, as Lease.Abort.
func (s *Sequence[R]) Abort(cause error) { s.l.Abort(cause) }

package kvlease

import (
	"fmt"
	"slices"
)

// Verified mode.
//
// A 64-bit hash hit is a probabilistic claim. With b distinct blocks
// cached, the chance that some two of them share a hash (the birthday
// bound) is about b²/2⁶⁵: 2.7·10⁻⁸ at 10⁶ cached blocks and 2.7·10⁻² at
// 10⁹. Accidental collisions are that rare; crafted ones are not: xxhash is
// not a cryptographic hash, so a tenant who can choose token ids can
// construct a block whose chained hash equals another tenant's and, in
// plain mode, be handed that tenant's KV. In verified mode the pool keeps
// every sealed block's parent hash and token ids and checks them on every
// hit, so no collision, accidental or crafted, can ever hand one request
// another's KV: a mismatch is a miss (counted in Stats.VerifyMismatches).
// Use it wherever tenants do not trust each other. It costs blocks ×
// blockTokens × 4 bytes of token storage and one comparison per hit block.

// WithBlockTokens tells the pool how many tokens fill a block. It enables
// AcquirePrefixTokens and CachedPrefixTokens, and fills BlockSize in KV
// events. blockTokens must be positive.
func WithBlockTokens(blockTokens int) Option {
	return newOption(fmt.Sprintf("WithBlockTokens(%d)", blockTokens), func(c *config) error {
		return c.setBlockTokens(blockTokens)
	})
}

// WithVerifiedPrefix turns on verified mode (see the package's Prefix
// cache section) for blocks of blockTokens tokens: blocks are sealed only
// with SealTokens, and every prefix hit of AcquirePrefixTokens is checked
// against the sealed block's parent and tokens. Hash-only lookups
// (AcquirePrefix, CachedPrefix) cannot be verified and always miss. It
// sets the block tokens as WithBlockTokens does: the two may be combined
// only with the same value.
func WithVerifiedPrefix(blockTokens int) Option {
	return newOption(fmt.Sprintf("WithVerifiedPrefix(%d)", blockTokens), func(c *config) error {
		if err := c.setBlockTokens(blockTokens); err != nil {
			return err
		}
		c.verify = true
		return nil
	})
}

func (c *config) setBlockTokens(blockTokens int) error {
	if blockTokens <= 0 {
		return fmt.Errorf("kvlease: %s: block tokens must be positive: %w", c.applyingName, ErrInvalidArgument)
	}
	if err := c.claim("block tokens", c.blockTokens == blockTokens); err != nil {
		return err
	}
	c.blockTokens = blockTokens
	return nil
}

// sealMeta is what verified mode keeps per slot besides the tokens, which
// live in the pool's token arena at id*blockTokens.
type sealMeta struct {
	parent BlockHash
	ok     bool // tokens recorded at seal
}

// verifier carries what a lookup by tokens checks hits against: the
// expected parent of each block and its tokens.
type verifier struct {
	seed        BlockHash
	hashes      []BlockHash
	tokens      []int32
	blockTokens int
}

func (v *verifier) parent(k int) BlockHash {
	if k == 0 {
		return v.seed
	}
	return v.hashes[k-1]
}

// checkSealTokens refuses seals that would publish or record a block that
// is not exactly one full block: SealTokens needs the block size
// (WithBlockTokens or WithVerifiedPrefix) and exactly that many tokens,
// in every mode; verified mode also refuses Seal (no tokens to check
// later hits against).
func (c *core) checkSealTokens(st *sealTokens) error {
	if st == nil {
		if c.meta != nil {
			return fmt.Errorf("verified mode keeps each block's tokens: seal with SealTokens: %w", ErrInvalidArgument)
		}
		return nil
	}
	if c.cfg.blockTokens == 0 {
		return fmt.Errorf("SealTokens needs the block size (WithBlockTokens or WithVerifiedPrefix) to tell a full block from a partial one: %w", ErrInvalidArgument)
	}
	if len(st.tokens) != c.cfg.blockTokens {
		return fmt.Errorf("%d tokens, a block holds %d: only a full block can be sealed: %w", len(st.tokens), c.cfg.blockTokens, ErrInvalidArgument)
	}
	return nil
}

// recordSeal stores parent and tokens for verification. Called with c.mu
// held, after checkSealTokens.
func (c *core) recordSeal(id BlockID, st *sealTokens) {
	if c.meta == nil {
		return
	}
	bt := c.cfg.blockTokens
	copy(c.tokens[int(id)*bt:(int(id)+1)*bt], st.tokens)
	c.meta[id] = sealMeta{parent: st.parent, ok: true}
}

// verify checks hit k (slot id) of a lookup against what was sealed.
// Hash-only lookups (v == nil) cannot be verified and miss quietly.
func (c *core) verify(id BlockID, k int, v *verifier) bool {
	if v == nil {
		return false
	}
	bt := c.cfg.blockTokens
	m := c.meta[id]
	if !m.ok || m.parent != v.parent(k) ||
		!slices.Equal(c.tokens[int(id)*bt:(int(id)+1)*bt], v.tokens[k*bt:(k+1)*bt]) {
		c.stats.verifyMismatches++
		return false
	}
	return true
}

// hitBlocks is how many leading full blocks of a prompt of ntokens tokens
// may be prefix hits: those before the block holding the prompt's last
// token (vLLM's rule). An engine must compute that token's KV to sample
// the first output token, and it writes it into that block: were the block
// a hit, it would be shared and sealed, and the engine would write into
// another request's KV (or, refused by Region, could not proceed).
func hitBlocks(ntokens, bt int) int {
	if ntokens <= 0 {
		return 0
	}
	return (ntokens - 1) / bt
}

// newVerifier chains the hashes of the full blocks of tokens (at most
// limit blocks) into buf's storage when it fits.
func newVerifier(seed BlockHash, tokens []int32, bt, limit int, buf []BlockHash) verifier {
	n := min(hitBlocks(len(tokens), bt), limit)
	hashes := buf[:0]
	parent := seed
	for k := range n {
		parent = hashInto(parent, tokens[k*bt:(k+1)*bt])
		hashes = append(hashes, parent)
	}
	return verifier{seed: seed, hashes: hashes, tokens: tokens, blockTokens: bt}
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
// ErrInvalidArgument. Other errors as AcquirePrefix.
func (p *Pool[R]) AcquirePrefixTokens(owner string, seed BlockHash, tokens []int32, n int) (*Lease[R], int, error) {
	bt := p.cfg.blockTokens
	if bt == 0 {
		err := fmt.Errorf("kvlease: AcquirePrefixTokens needs WithBlockTokens or WithVerifiedPrefix: %w", ErrInvalidArgument)
		return nil, 0, p.reject(owner, n, err)
	}
	var buf [64]BlockHash
	v := newVerifier(seed, tokens, bt, max(n, 0), buf[:])
	if len(v.hashes) == 0 {
		l, err := p.Acquire(owner, n)
		return l, 0, err
	}
	vp := &v
	if p.meta == nil {
		vp = nil // plain mode: the hashes are the claim
	}
	return p.acquire(owner, v.hashes, vp, n)
}

// CachedPrefixTokens is CachedPrefix for a prompt given as tokens, verified
// in verified mode, under AcquirePrefixTokens' rule: the block holding the
// prompt's last token never counts. It returns 0 when the pool has no
// block size.
func (p *Pool[R]) CachedPrefixTokens(seed BlockHash, tokens []int32) int {
	bt := p.cfg.blockTokens
	if bt == 0 {
		return 0
	}
	var buf [64]BlockHash
	v := newVerifier(seed, tokens, bt, len(tokens), buf[:])
	vp := &v
	if p.meta == nil {
		vp = nil
	}
	c := &p.core
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.probe(v.hashes, vp)
}

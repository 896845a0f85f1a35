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

// extraDigest condenses a block's extra keys for verification: 0 for
// none, else mixExtra over them (a verified hit must carry the same keys).
func extraDigest(extra []string) BlockHash {
	if len(extra) == 0 {
		return 0
	}
	return mixExtra(0, extra)
}

// verifier carries what a lookup by tokens checks hits against: the
// expected parent of each block and its tokens.
type verifier struct {
	seed        BlockHash
	hashes      []BlockHash
	tokens      []int32
	blockTokens int
	spans       []ExtraKey // the lookup's extra keys (a Sequence's); nil: none
	base        int        // block k here is block base+k of the sequence (a window's lookup)
}

// extra is the digest of block k's extra keys under the lookup's spans.
func (v *verifier) extra(k int) BlockHash {
	if len(v.spans) == 0 {
		return 0
	}
	var buf [4]string
	return extraDigest(blockExtras(buf[:0], v.spans, v.base+k, v.blockTokens))
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
	if st == nil || st.noTokens {
		if c.verified {
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

// verify checks hit k (slot id) of a lookup against what was sealed.
// Hash-only lookups (v == nil) cannot be verified and miss quietly. It
// only reads: the acquires count a mismatch (Stats.VerifyMismatches), a
// query (CachedPrefixTokens) does not.
func (c *core) verify(id BlockID, k int, v *verifier) bool {
	if v == nil {
		return false
	}
	bt := c.cfg.blockTokens
	r, tokens := c.sealRecord(id)
	if !r.known || tokens == nil || r.parent != v.parent(k) || r.extraDigest() != v.extra(k) ||
		!slices.Equal(tokens, v.tokens[k*bt:(k+1)*bt]) {
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
// limit blocks, before the block of the last token) into buf's storage
// when it fits, in one Hasher call.
func (c *core) newVerifier(seed BlockHash, tokens []int32, bt, limit int, buf []BlockHash) (verifier, error) {
	n := min(hitBlocks(len(tokens), bt), limit)
	var hashes []BlockHash
	if n <= len(buf) {
		hashes = buf[:n]
	} else {
		hashes = make([]BlockHash, n)
	}
	err := c.hashChainStack(seed, tokens[:n*bt], nil, hashes)
	return verifier{seed: seed, hashes: hashes, tokens: tokens, blockTokens: bt}, err
}

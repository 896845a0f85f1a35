package kvlease

import (
	"encoding/binary"
	"fmt"

	"github.com/cespare/xxhash/v2"
)

// Extra keys.
//
// A block's KV can depend on more than its token ids: the content of an
// image whose placeholder tokens it holds, an adapter. vLLM and llm-d mix
// such extra keys into the hash of exactly the blocks they cover, so that
// text before an image is still shared and the image's blocks are not
// shared with another image's. kvlease does the same: a block's extra
// keys are mixed into its hash (HashBlock's extra keys), recorded with its seal
// (verified mode compares them on every hit) and published with its
// BlockStored event (extra_keys).

func mixExtra(h BlockHash, extra []string) BlockHash {
	var d xxhash.Digest
	d.Reset()
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(h))
	_, _ = d.Write(b[:])
	for _, k := range extra {
		binary.LittleEndian.PutUint32(b[:4], uint32(len(k)))
		_, _ = d.Write(b[:4])
		_, _ = d.WriteString(k)
	}
	return BlockHash(d.Sum64())
}

// A Hasher computes the chain hashes of consecutive full blocks in one
// call: out[k] is the hash of block k, its tokens tokens[k·B:(k+1)·B]
// (B = len(tokens)/len(out), the pool's block tokens) and its extra keys
// extra[k], chained: block 0's parent is parent, block k's is out[k-1].
// extra is nil when none of the blocks has extra keys; otherwise it has
// len(out) entries, nil for a block without. The pool hands it every
// block it has at hand at once (a prompt's full blocks at admission are
// one call; a decoding sequence calls it once per block as each fills),
// so a hasher with a fixed cost per call (an encoder to set up, a cgo
// call) pays it once per prompt, not once per block.
//
// The chain root is the caller's: the parent of a chain's first block is
// exactly the seed passed to Pool.Admit (SequenceSpec.Seed),
// AcquirePrefixTokens or CachedPrefixTokens (or the parent
// given to SealTokens), handed to the hasher unchanged; the pool mixes in
// nothing of its own. An engine that reproduces another system's hashes
// passes that system's root as the seed: llm-d's is the hash of its
// HashSeed's FNV-64a with the model name as extra data (see
// ExampleWithHasher), vLLM's the NONE_HASH of its PYTHONHASHSEED. A
// tenant seed (Pool.TenantSeed) is a root of kvlease's own: hashes under
// it match no other system's.
//
// A non-nil error means the blocks could not be hashed: the pool does
// nothing it needed the hashes for (an admission holds nothing, a
// Commit seals nothing and keeps Computed, a seal is refused) and
// returns the error wrapped, so errors.Is finds the hasher's own
// sentinels; a lookup that cannot report errors (CachedPrefixTokens)
// counts it as a miss. A Hasher must be deterministic and safe for
// concurrent use, must not keep tokens, extra or out after it returns,
// and runs under no lock of the pool. Without WithHasher the pool hashes
// each block with HashBlock.
type Hasher func(parent BlockHash, tokens []int32, extra [][]string, out []BlockHash) error

// An ExtraKey covers the tokens [Start, End) of a sequence (an image's
// placeholder tokens, say): every block holding one of them carries Key
// among its extra keys. A key for the whole prompt (an adapter) is a span
// of all of it.
type ExtraKey struct {
	Start, End int
	Key        string
}

// blockExtras appends to dst the keys of the spans that overlap block k
// of bt tokens, in span order.
func blockExtras(dst []string, spans []ExtraKey, k, bt int) []string {
	lo, hi := k*bt, (k+1)*bt
	for _, s := range spans {
		if s.Start < hi && s.End > lo {
			dst = append(dst, s.Key)
		}
	}
	return dst
}

// WithHasher makes h the pool's block hash function: SealTokens,
// SealAs, AcquirePrefixTokens, CachedPrefixTokens and sequences hash
// with it (see Hasher for the chain
// root, errors and batching). Without it the pool uses HashBlock. A
// nil h is refused (ErrInvalidArgument), as are two hashers.
func WithHasher(h Hasher) Option {
	return newOption("WithHasher", func(c *config) error {
		if h == nil {
			return fmt.Errorf("kvlease: WithHasher(nil): %w", ErrInvalidArgument)
		}
		if err := c.claim("hasher", false); err != nil {
			return err
		}
		c.hasher = h
		return nil
	})
}

// hashChain is every chain the pool hashes: out[k] for the len(out)
// blocks of tokens, chained from parent. out escapes to the Hasher:
// callers hashing into a stack buffer use hashChainStack.
func (c *core) hashChain(parent BlockHash, tokens []int32, extra [][]string, out []BlockHash) error {
	if h := c.cfg.hasher; h != nil {
		if err := h(parent, tokens, extra, out); err != nil {
			return fmt.Errorf("kvlease: hash %d blocks: %w", len(out), err)
		}
		return nil
	}
	defaultChain(parent, tokens, extra, out)
	return nil
}

// hashChainStack is hashChain into out without letting out escape: a
// Hasher gets a copy on the heap (an allocation only with WithHasher).
func (c *core) hashChainStack(parent BlockHash, tokens []int32, extra [][]string, out []BlockHash) error {
	if c.cfg.hasher != nil {
		tmp := make([]BlockHash, len(out))
		err := c.hashChain(parent, tokens, extra, tmp)
		copy(out, tmp)
		return err
	}
	defaultChain(parent, tokens, extra, out)
	return nil
}

// defaultChain is HashBlock chained over len(out) blocks.
func defaultChain(parent BlockHash, tokens []int32, extra [][]string, out []BlockHash) {
	if len(out) == 0 {
		return
	}
	bt := len(tokens) / len(out)
	for k := range out {
		h := hashInto(parent, tokens[k*bt:(k+1)*bt])
		if extra != nil && len(extra[k]) > 0 {
			h = mixExtra(h, extra[k])
		}
		out[k] = h
		parent = h
	}
}

// hashBlock is one block's hash: parent, tokens and its extra keys (nil:
// none). Without a Hasher it allocates nothing.
func (c *core) hashBlock(parent BlockHash, tokens []int32, extra []string) (BlockHash, error) {
	if c.cfg.hasher == nil {
		h := hashInto(parent, tokens)
		if len(extra) > 0 {
			h = mixExtra(h, extra)
		}
		return h, nil
	}
	return c.hashOneSlow(parent, tokens, extra)
}

// hashOneSlow is hashBlock through the pool's Hasher: its out (and extra)
// are on the heap, as the Hasher may keep what it is given no further
// than its return but the compiler cannot know.
func (c *core) hashOneSlow(parent BlockHash, tokens []int32, extra []string) (BlockHash, error) {
	if bt := c.cfg.blockTokens; len(tokens) != bt {
		// (A Hasher is only ever given whole blocks.)
		return 0, fmt.Errorf("kvlease: hash %d tokens, a block holds %d: only a full block is hashed: %w", len(tokens), bt, ErrInvalidArgument)
	}
	out := make([]BlockHash, 1)
	var ex [][]string
	if len(extra) > 0 {
		ex = [][]string{extra}
	}
	err := c.hashChain(parent, tokens, ex, out)
	return out[0], err
}

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
// keys are mixed into its hash (HashBlockExtra), recorded with its seal
// (verified mode compares them on every hit) and published with its
// BlockStored event (extra_keys).

// HashBlockExtra returns the hash of a block with extra keys: HashBlock
// when extra is empty; otherwise xxhash64 (seed 0) over HashBlock's
// result as 8 little-endian bytes followed by each key as its length
// (4 little-endian bytes) and its bytes. Keys are taken in order: the
// same keys in another order are another block.
func HashBlockExtra(parent BlockHash, tokens []int32, extra []string) BlockHash {
	h := hashInto(parent, tokens)
	if len(extra) == 0 {
		return h
	}
	return mixExtra(h, extra)
}

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

// A Hasher computes a block's chain hash from its parent's hash, its
// tokens and its extra keys (nil when it has none). A pool uses
// HashBlockExtra unless given another with WithHasher: an engine that
// must reproduce another system's block hashes (vLLM's sha256 over CBOR,
// its --hash-seed) plugs that in, and every hash the pool computes (seal,
// lookup by tokens, a Sequence's chain) is then that function's. It must
// be deterministic and safe for concurrent use; it runs under no lock of
// the pool.
type Hasher func(parent BlockHash, tokens []int32, extra []string) BlockHash

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
// SealChained, AcquirePrefixTokens, CachedPrefixTokens and sequences hash
// with it, and Pool.HashBlock returns its hashes for callers that compute
// chains themselves (AcquirePrefix). Without it the pool uses
// HashBlockExtra. A nil h is refused (ErrInvalidArgument), as are two
// hashers.
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

// HashBlock returns the pool's hash of a block: its Hasher's (WithHasher)
// or HashBlockExtra's.
func (p *Pool[R]) HashBlock(parent BlockHash, tokens []int32, extra []string) BlockHash {
	return p.hashBlock(parent, tokens, extra)
}

// hashBlock is every hash the pool computes.
func (c *core) hashBlock(parent BlockHash, tokens []int32, extra []string) BlockHash {
	if c.cfg.hasher != nil {
		return c.cfg.hasher(parent, tokens, extra)
	}
	h := hashInto(parent, tokens)
	if len(extra) > 0 {
		h = mixExtra(h, extra)
	}
	return h
}

package kvlease

import (
	"encoding/binary"
	"unsafe"

	"github.com/cespare/xxhash/v2"
)

// BlockHash identifies the content of a full block together with
// everything before it: the hash of its parent block and its own tokens.
type BlockHash uint64

// HashBlock returns the hash of one full block: xxhash64 (seed 0) over the
// parent hash as 8 little-endian bytes followed by each token id as 4
// little-endian bytes (its two's-complement uint32). Any language with
// xxhash64 reproduces it: h = XXH64(le64(parent) ‖ le32(t0) ‖ le32(t1) ‖ …).
func HashBlock(parent BlockHash, tokens []int32) BlockHash {
	var d xxhash.Digest
	return hashInto(&d, parent, tokens)
}

// littleEndian is true where int32s sit in memory in the hash's byte
// order, so a block's tokens can be copied instead of encoded one by one.
var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// hashBuf is the stack buffer a block's bytes are laid out in: blocks of
// up to 32 tokens are hashed in one call of the one-shot xxhash.Sum64.
const hashBuf = 8 + 4*32

// hashInto hashes one block. Blocks that fit hashBuf go through the
// one-shot Sum64; longer ones stream through d (reset first). Nothing is
// allocated.
func hashInto(d *xxhash.Digest, parent BlockHash, tokens []int32) BlockHash {
	n := 8 + 4*len(tokens)
	if n <= hashBuf {
		var buf [hashBuf]byte
		binary.LittleEndian.PutUint64(buf[:8], uint64(parent))
		b := buf[8:n]
		if littleEndian && len(tokens) > 0 {
			// In memory, []int32 already is the little-endian encoding.
			copy(b, tokenBytes(tokens))
		} else {
			for i, t := range tokens {
				binary.LittleEndian.PutUint32(b[4*i:], uint32(t))
			}
		}
		return BlockHash(xxhash.Sum64(buf[:n]))
	}
	d.Reset()
	var p [8]byte
	binary.LittleEndian.PutUint64(p[:], uint64(parent))
	_, _ = d.Write(p[:])
	if littleEndian {
		_, _ = d.Write(tokenBytes(tokens))
	} else {
		var buf [hashBuf]byte
		for len(tokens) > 0 {
			k := min(len(tokens), hashBuf/4)
			for i, t := range tokens[:k] {
				binary.LittleEndian.PutUint32(buf[4*i:], uint32(t))
			}
			_, _ = d.Write(buf[:4*k])
			tokens = tokens[k:]
		}
	}
	return BlockHash(d.Sum64())
}

// tokenBytes views tokens as their in-memory bytes (non-empty tokens).
func tokenBytes(tokens []int32) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(&tokens[0])), 4*len(tokens))
}

// ChainHashes returns the chained hashes of the full blocks of tokens:
// h[k] = HashBlock(h[k-1], tokens[k*blockTokens:(k+1)*blockTokens]) with
// h[-1] = seed. A trailing partial block gets no hash (it is not immutable
// yet). seed separates namespaces: derive it from the model, the adapter,
// and any multimodal inputs, so equal token ids under different models
// never share KV. It allocates only the result; blockTokens ≤ 0 yields nil.
func ChainHashes(seed BlockHash, tokens []int32, blockTokens int) []BlockHash {
	if blockTokens <= 0 {
		return nil
	}
	n := len(tokens) / blockTokens
	if n == 0 {
		return nil
	}
	out := make([]BlockHash, n)
	var d xxhash.Digest
	parent := seed
	for k := range out {
		parent = hashInto(&d, parent, tokens[k*blockTokens:(k+1)*blockTokens])
		out[k] = parent
	}
	return out
}

package kvlease

import "math/bits"

// BlockHash identifies the content of a full block together with
// everything before it: the hash of its parent block and its own tokens.
type BlockHash uint64

// HashBlock returns the hash of one full block: xxhash64 (seed 0) over the
// parent hash as 8 little-endian bytes followed by each token id as 4
// little-endian bytes (its two's-complement uint32). Any language with
// xxhash64 reproduces it: h = XXH64(le64(parent) ‖ le32(t0) ‖ le32(t1) ‖ …).
//
// With extra keys (an image's content hash over its placeholder tokens,
// an adapter-specific key), the block's hash is xxhash64 (seed 0) over h
// as 8 little-endian bytes followed by each key as its length (4
// little-endian bytes) and its bytes. Keys are taken in order: the same
// keys in another order are another block.
func HashBlock(parent BlockHash, tokens []int32, extra ...string) BlockHash {
	h := hashInto(parent, tokens)
	if len(extra) == 0 {
		return h
	}
	return mixExtra(h, extra)
}

// hashInto hashes one block without laying its bytes out anywhere: it is
// xxhash64 (seed 0, as specified at github.com/Cyan4973/xxHash) computed
// directly over the 8-byte parent and the tokens read in little-endian
// pairs. The chain makes every block wait for the hash of the one before,
// so what counts is latency: copying the block into a buffer first cost
// about half as much again as xxhash itself. The tests check it against
// the xxhash library for every length from 0 to 200 tokens and by fuzzing.
func hashInto(parent BlockHash, t []int32) BlockHash {
	n := len(t)
	var h uint64
	i := 0           // next token to consume
	pending := true  // the parent word is still to be consumed
	if 8+4*n >= 32 { // at least one 32-byte stripe: parent and 6 tokens
		v1 := seedV1
		v2 := prime2
		v3 := uint64(0)
		v4 := seedV4
		v1 = round(v1, uint64(parent))
		v2 = round(v2, pair(t[0], t[1]))
		v3 = round(v3, pair(t[2], t[3]))
		v4 = round(v4, pair(t[4], t[5]))
		for i = 6; n-i >= 8; i += 8 {
			s := t[i : i+8]
			v1 = round(v1, pair(s[0], s[1]))
			v2 = round(v2, pair(s[2], s[3]))
			v3 = round(v3, pair(s[4], s[5]))
			v4 = round(v4, pair(s[6], s[7]))
		}
		h = bits.RotateLeft64(v1, 1) + bits.RotateLeft64(v2, 7) + bits.RotateLeft64(v3, 12) + bits.RotateLeft64(v4, 18)
		h = mergeRound(h, v1)
		h = mergeRound(h, v2)
		h = mergeRound(h, v3)
		h = mergeRound(h, v4)
		pending = false
	} else {
		h = prime5
	}
	h += uint64(8 + 4*n)
	if pending {
		h ^= round(0, uint64(parent))
		h = bits.RotateLeft64(h, 27)*prime1 + prime4
	}
	for ; n-i >= 2; i += 2 {
		h ^= round(0, pair(t[i], t[i+1]))
		h = bits.RotateLeft64(h, 27)*prime1 + prime4
	}
	if i < n {
		h ^= uint64(uint32(t[i])) * prime1
		h = bits.RotateLeft64(h, 23)*prime2 + prime3
	}
	h ^= h >> 33
	h *= prime2
	h ^= h >> 29
	h *= prime3
	h ^= h >> 32
	return BlockHash(h)
}

// The xxhash64 primes.
const (
	prime1 uint64 = 11400714785074694791
	prime2 uint64 = 14029467366897019727
	prime3 uint64 = 1609587929392839161
	prime4 uint64 = 9650029242287828579
	prime5 uint64 = 2870177450012600261
)

// The first and fourth lanes' start for seed 0: prime1+prime2 and
// -prime1, modulo 2⁶⁴.
const (
	seedV1 uint64 = 6983438078262162902
	seedV4 uint64 = 7046029288634856825
)

// pair is two tokens as the 8 little-endian bytes they are hashed as.
func pair(a, b int32) uint64 { return uint64(uint32(a)) | uint64(uint32(b))<<32 }

func round(acc, input uint64) uint64 {
	acc += input * prime2
	acc = bits.RotateLeft64(acc, 31)
	return acc * prime1
}

func mergeRound(acc, val uint64) uint64 {
	acc ^= round(0, val)
	return acc*prime1 + prime4
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
	parent := seed
	for k := range out {
		parent = hashInto(parent, tokens[k*blockTokens:(k+1)*blockTokens])
		out[k] = parent
	}
	return out
}

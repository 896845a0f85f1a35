package kvlease

import (
	"encoding/binary"
	"testing"

	"github.com/cespare/xxhash/v2"
)

// reference is the documented encoding hashed by the xxhash library.
func reference(parent BlockHash, tokens []int32) BlockHash {
	buf := binary.LittleEndian.AppendUint64(nil, uint64(parent))
	for _, t := range tokens {
		buf = binary.LittleEndian.AppendUint32(buf, uint32(t))
	}
	return BlockHash(xxhash.Sum64(buf))
}

// HashBlock's own xxhash64 must agree with the library for every length:
// below one stripe, at the stripe boundaries, odd and even token counts.
func TestHashBlockMatchesXXHashEveryLength(t *testing.T) {
	for n := 0; n <= 200; n++ {
		toks := make([]int32, n)
		for i := range toks {
			toks[i] = int32(i*2654435761) ^ int32(n)
		}
		for _, parent := range []BlockHash{0, 1, 0xdeadbeefcafef00d, ^BlockHash(0)} {
			if got, want := HashBlock(parent, toks), reference(parent, toks); got != want {
				t.Fatalf("%d tokens, parent %x: HashBlock %x, xxhash %x", n, parent, got, want)
			}
		}
	}
}

func FuzzHashBlock(f *testing.F) {
	f.Add(uint64(7), []byte{1, 2, 3, 4, 5, 6, 7, 8})
	f.Add(uint64(0), make([]byte, 4*37))
	f.Fuzz(func(t *testing.T, parent uint64, raw []byte) {
		toks := make([]int32, len(raw)/4)
		for i := range toks {
			toks[i] = int32(binary.LittleEndian.Uint32(raw[4*i:]))
		}
		if got, want := HashBlock(BlockHash(parent), toks), reference(BlockHash(parent), toks); got != want {
			t.Fatalf("%d tokens: HashBlock %x, xxhash %x", len(toks), got, want)
		}
	})
}

package kvlease

import (
	"encoding/binary"
	"slices"
	"testing"

	"github.com/cespare/xxhash/v2"
	"github.com/stretchr/testify/require"
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

func TestHashBlockEncoding(t *testing.T) {
	// The documented encoding, spelled out byte by byte.
	parent := BlockHash(0x0102030405060708)
	tokens := []int32{1, -1, 0x7fffffff, 42}
	var buf []byte
	buf = binary.LittleEndian.AppendUint64(buf, uint64(parent))
	for _, tk := range tokens {
		buf = binary.LittleEndian.AppendUint32(buf, uint32(tk))
	}
	require.Equal(t, BlockHash(xxhash.Sum64(buf)), HashBlock(parent, tokens))

	// Long blocks cross the internal buffer; the result must not change.
	long := prompt(3, 1000)
	buf = binary.LittleEndian.AppendUint64(nil, 7)
	for _, tk := range long {
		buf = binary.LittleEndian.AppendUint32(buf, uint32(tk))
	}
	require.Equal(t, BlockHash(xxhash.Sum64(buf)), HashBlock(7, long))
}

func TestChainHashes(t *testing.T) {
	toks := prompt(1, 16*3+5) // three full blocks and a partial one
	h := ChainHashes(99, toks, 16)
	require.Len(t, h, 3)
	parent := BlockHash(99)
	for k := range h {
		parent = HashBlock(parent, toks[k*16:(k+1)*16])
		require.Equal(t, parent, h[k], "block %d", k)
	}
	require.NotEqual(t, h, ChainHashes(100, toks, 16), "the seed separates namespaces")
	require.Nil(t, ChainHashes(1, toks, 0))
	require.Nil(t, ChainHashes(1, toks[:15], 16))
	// A change in block 0 changes every later hash (the chain).
	other := slices.Clone(toks)
	other[0]++
	h2 := ChainHashes(99, other, 16)
	for k := range h {
		require.NotEqual(t, h[k], h2[k])
	}
	allocs := testing.AllocsPerRun(100, func() { _ = ChainHashes(1, toks, 16) })
	require.Equal(t, 1.0, allocs, "only the result slice is allocated")
}

package kvlease

import (
	"slices"
	"testing"
)

func TestTokensUint32(t *testing.T) {
	u := []uint32{0, 1, 1 << 31, 3000000000, 1<<32 - 1, 42, 7, 8, 9}
	i := TokensInt32(u)
	if len(i) != len(u) || i[2] != -1<<31 || uint32(i[3]) != 3000000000 {
		t.Fatalf("view %v", i)
	}
	if &TokensUint32(i)[0] != &u[0] {
		t.Fatal("TokensUint32 copied")
	}
	ref := make([]int32, len(u))
	for k, v := range u {
		ref[k] = int32(v) // a copy, the old way
	}
	if HashBlock(5, TokensInt32(u)) != HashBlock(5, ref) {
		t.Fatal("hash differs from the copied tokens'")
	}
	if !slices.Equal(ChainHashes(3, TokensInt32(u), 4), ChainHashes(3, ref, 4)) {
		t.Fatal("the chain of the view differs")
	}
	if TokensInt32([]uint32{}) != nil || TokensUint32([]int32(nil)) != nil {
		t.Fatal("empty views")
	}
	if n := testing.AllocsPerRun(10, func() { _ = HashBlock(1, TokensInt32(u)) }); n != 0 {
		t.Fatalf("hashing the view allocates %v", n)
	}
}

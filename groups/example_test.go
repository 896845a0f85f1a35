package groups_test

import (
	"fmt"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/groups"
)

// A hybrid model: full-attention layers and sliding-window layers of 32
// tokens, one pool each. The second request with the same prompt hits in
// both groups; the window group holds only the blocks of its window.
func Example() {
	fullMem, _ := kvlease.NewHostMemory(16, 1024)
	swMem, _ := kvlease.NewHostMemory(16, 1024)
	full, _ := kvlease.NewPool[[]byte](fullMem)
	sw, _ := kvlease.NewPool[[]byte](swMem)
	c, _ := groups.New(
		groups.Group[[]byte]{Spec: groups.Spec{Name: "full", BlockTokens: 16}, Pool: full},
		groups.Group[[]byte]{Spec: groups.Spec{Name: "swa", BlockTokens: 16, Window: 32}, Pool: sw},
	)
	tokens := make([]int32, 64)
	for i := range tokens {
		tokens[i] = int32(i)
	}
	hs := c.Hashes(1, tokens)

	r, hit, _ := c.Acquire("req-1", hs, 65)
	fmt.Println("req-1 hit", hit)
	for g := range c.Groups() { // prefill done: seal the full blocks
		for k, h := range hs[g] {
			if l, i, ok := r.Block(g, k); ok {
				_ = l.Seal(i, h)
			}
		}
	}
	for tok := 66; tok <= 96; tok++ { // decode
		_ = r.Grow(tok)
	}
	fmt.Println("req-1 window blocks held from", r.Lease(1).Trimmed(), "of", r.Lease(1).Len())
	r.Release()

	r2, hit, _ := c.Acquire("req-2", hs, 65)
	fmt.Println("req-2 hit", hit, "window lease starts at block", r2.Base(1))
	r2.Release()
	// Output:
	// req-1 hit 0
	// req-1 window blocks held from 3 of 6
	// req-2 hit 64 window lease starts at block 2
}

package kvlease_test

import (
	"fmt"

	"github.com/kvlease/kvlease"
)

// A sliding-window request keeps only the blocks its window covers: as it
// decodes, it trims the blocks that fell out. Indices stay absolute.
func ExampleLease_TrimTo() {
	const blockTokens, window = 16, 32
	mem, _ := kvlease.NewHostMemory(8, 1024)
	pool, _ := kvlease.NewPool[[]byte](mem)

	lease, _ := pool.Acquire("sliding", 4) // tokens 0..63
	for tokens := 64; tokens <= 96; tokens += 16 {
		// Keep the blocks covering the last `window` tokens.
		_ = lease.TrimTo((tokens - window) / blockTokens)
		if tokens < 96 {
			_ = lease.Extend(1)
		}
		fmt.Printf("tokens %d: Len %d Trimmed %d table %v free %d\n",
			tokens, lease.Len(), lease.Trimmed(), lease.AppendBlockIDs(nil, lease.Trimmed()), pool.Stats().Free)
	}
	lease.Release()
	// Output:
	// tokens 64: Len 5 Trimmed 2 table [1 0 3] free 5
	// tokens 80: Len 6 Trimmed 3 table [0 3 1] free 5
	// tokens 96: Len 6 Trimmed 4 table [3 1] free 6
}

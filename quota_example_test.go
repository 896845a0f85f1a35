package kvlease_test

import (
	"errors"
	"fmt"

	"github.com/kvlease/kvlease"
)

// A tenant with a cap evicts its own cached blocks once it holds its cap
// (its flood evicts itself), and an acquire its cap cannot make room for
// is refused with ErrQuota; a tenant with a reservation keeps its newest
// cached blocks whatever others do.
func ExampleTenant_SetQuota() {
	mem, _ := kvlease.NewHostMemory(8, 64)
	pool, _ := kvlease.NewPool[[]byte](mem)
	flood, _ := pool.Tenant("flood")
	_ = flood.SetQuota(kvlease.Quota{Cap: 4})
	steady, _ := pool.Tenant("steady")
	_ = steady.SetQuota(kvlease.Quota{Reserve: 2})

	cache := func(t *kvlease.Tenant[[]byte], h kvlease.BlockHash, n int) {
		l, err := t.Acquire("req", n)
		if err != nil {
			fmt.Println(err)
			return
		}
		for i := range n {
			_ = l.Seal(i, h+kvlease.BlockHash(i))
		}
		l.Release()
	}
	cache(steady, 100, 2) // its prefix
	for k := range 6 {    // unique prompts, three times the pool
		cache(flood, kvlease.BlockHash(1000*(k+1)), 4)
	}
	fmt.Println("steady's prefix cached:", pool.CachedPrefix([]kvlease.BlockHash{100, 101}))
	st := pool.TenantStats(nil)[0] // flood registered first
	fmt.Println("flood holds", st.Held, "evicted its own", st.EvictedOwn)

	l, _ := flood.Acquire("req", 4) // its cap's worth, in use
	_, err := flood.Acquire("more", 1)
	fmt.Println(errors.Is(err, kvlease.ErrQuota), errors.Is(err, kvlease.ErrExhausted))
	l.Release()
	// Output:
	// steady's prefix cached: 2
	// flood holds 4 evicted its own 20
	// true true
}

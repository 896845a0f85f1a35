package tiers_test

import (
	"context"
	"fmt"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/tiers"
)

// A device pool of 8 blocks over a host tier of 32: three prompts of four
// blocks do not fit the device, so the least recently used one goes down
// to the host (write-back), and asking for it again onboards it from
// there.
func ExampleCache() {
	dm, _ := kvlease.NewHostMemory(8, 64)
	hm, _ := kvlease.NewHostMemory(32, 64)
	dev, _ := kvlease.NewPool[[]byte](dm, kvlease.WithBlockTokens(4), kvlease.WithSealRecords())
	host, _ := kvlease.NewPool[[]byte](hm, kvlease.WithBlockTokens(4), kvlease.WithSealRecords())
	cache, err := tiers.New(tiers.Config[[]byte]{
		// A MemCopy that knows both memories copies each run of blocks at once.
		Device: dev, Host: host, Offload: tiers.NewMemCopy(dm, hm), Onload: tiers.NewMemCopy(dm, hm),
		DeviceReserve: -1, // eviction alone offers blocks down
	})
	if err != nil {
		panic(err)
	}
	defer cache.Close()

	quiet := func() { // as an engine's step would, let the copies land
		for dev.Stats().Leased+dev.Stats().Draining+host.Stats().Leased+host.Stats().Draining > 0 {
			time.Sleep(100 * time.Microsecond)
		}
	}
	serve := func(doc int32) {
		tokens := make([]int32, 16)
		for i := range tokens {
			tokens[i] = doc*100 + int32(i)
		}
		hashes := kvlease.ChainHashes(7, tokens, 4)
		// vLLM's last-token rule: never look up the block holding the
		// prompt's last token (its KV is computed to sample).
		o, err := cache.Acquire("req", hashes[:(len(tokens)-1)/4], len(hashes))
		if err != nil {
			panic(err)
		}
		valid, err := o.Wait(context.Background())
		if err != nil {
			panic(err)
		}
		// Compute (here: nothing) and seal what did not hit.
		parent := kvlease.BlockHash(7)
		if valid > 0 {
			parent = hashes[valid-1]
		}
		for k := valid; k < len(hashes); k++ {
			if parent, err = cache.SealTokens(o.Lease, k, parent, tokens[4*k:4*k+4]); err != nil {
				panic(err)
			}
		}
		o.Lease.Release()
		quiet()
		fmt.Printf("doc %d: device %d host %d fresh %d\n", doc, o.Hits(tiers.TierDevice), o.Hits(tiers.TierHost), len(hashes)-o.Prefix())
	}
	serve(1)
	serve(2)
	serve(3) // evicts: doc 1 goes down to the host, doc 2 is lost
	serve(1)
	st := cache.Stats().Tiers[tiers.TierHost]
	fmt.Printf("host tier: offloaded %d onboarded %d\n", st.Offloaded, st.Onboarded)
	// Output:
	// doc 1: device 0 host 0 fresh 4
	// doc 2: device 0 host 0 fresh 4
	// doc 3: device 0 host 0 fresh 4
	// doc 1: device 0 host 3 fresh 1
	// host tier: offloaded 4 onboarded 3
}

// Cache.Admit admits a request as a Sequence: the device pool hashes the
// prompt, the lookup runs across the tiers under the last-token rule, and
// Wait records the blocks onboarded from below as hits, so the engine
// computes from Computed on and commits as for any sequence.
func ExampleCache_Admit() {
	dm, _ := kvlease.NewHostMemory(8, 64)
	hm, _ := kvlease.NewHostMemory(32, 64)
	dev, _ := kvlease.NewPool[[]byte](dm, kvlease.WithBlockTokens(4), kvlease.WithSealRecords())
	host, _ := kvlease.NewPool[[]byte](hm, kvlease.WithBlockTokens(4), kvlease.WithSealRecords())
	cache, _ := tiers.New(tiers.Config[[]byte]{Device: dev, Host: host,
		Offload: tiers.NewMemCopy(dm, hm), Onload: tiers.NewMemCopy(dm, hm), DeviceReserve: -1})
	defer cache.Close()
	quiet := func() {
		for dev.Stats().Leased+dev.Stats().Draining+host.Stats().Leased+host.Stats().Draining > 0 {
			time.Sleep(100 * time.Microsecond)
		}
	}
	prompt := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14} // 3 full blocks may hit; the 4th holds the last token
	serve := func() {
		o, err := cache.Admit(kvlease.SequenceSpec{Owner: "req", Seed: 7, Prompt: prompt})
		if err != nil {
			panic(err)
		}
		s := o.Sequence
		before := s.CachedTokens()
		if _, err := o.Wait(context.Background()); err != nil {
			panic(err)
		}
		fmt.Printf("device %d host %d: cached tokens %d, then %d after Wait\n",
			o.Hits(tiers.TierDevice), o.Hits(tiers.TierHost), before, s.CachedTokens())
		_ = s.Commit(s.Len() - s.Computed()) // compute the rest of the prompt
		s.Lease().Release()
		quiet()
	}
	serve()
	dev.OfferCached(dev.Stats().Cached) // the device's blocks go down
	quiet()
	serve()
	fmt.Println("quiescent:", dev.CheckQuiescent(), host.CheckQuiescent())
	// Output:
	// device 0 host 0: cached tokens 0, then 0 after Wait
	// device 0 host 3: cached tokens 0, then 12 after Wait
	// quiescent: <nil> <nil>
}

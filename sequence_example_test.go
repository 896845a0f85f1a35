package kvlease_test

import (
	"fmt"

	"github.com/kvlease/kvlease"
)

// A request's life as a Sequence: admission with its prefix hits, chunked
// prefill, decode one token at a time (growth and sealing are the
// sequence's), a speculative draft partly rolled back, release.
func ExampleSequence() {
	mem, _ := kvlease.NewHostMemory(64, 1024)
	pool, _ := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(4))
	seed := kvlease.BlockHash(1) // the model's namespace
	prompt := []int32{10, 11, 12, 13, 14, 15, 16, 17, 18, 19}

	first, _ := pool.Admit(kvlease.SequenceSpec{Owner: "req-1", Seed: seed, Prompt: prompt})
	for first.Computed() < first.Len() { // chunked prefill, 3 tokens a step
		_ = first.Commit(min(3, first.Len()-first.Computed()))
	}
	for t := range int32(6) { // decode: each token's KV written, then handed over
		_ = first.AppendComputed(100 + t)
	}
	fmt.Println("tokens", first.Len(), "blocks", first.Lease().Len(), "sealed", len(first.BlockHashes()))
	first.Lease().Release()

	second, _ := pool.Admit(kvlease.SequenceSpec{Owner: "req-2", Seed: seed, Prompt: prompt})
	fmt.Println("cached tokens", second.CachedTokens())
	_ = second.Commit(second.Len() - second.Computed())
	_ = second.Append(7, 8, 9) // a draft of three tokens
	_ = second.Commit(1)       // the target model accepted one
	_ = second.Rollback(2)     // and rejected two
	fmt.Println("tokens", second.Len(), "computed", second.Computed())
	second.Lease().Release()
	fmt.Println("leased", pool.Stats().Leased, "check", pool.Check())
	// Output:
	// tokens 16 blocks 4 sealed 4
	// cached tokens 8
	// tokens 11 computed 11
	// leased 0 check <nil>
}

// Token ids from a tokenizer that uses uint32 are hashed without a copy,
// and ids of 2³¹ or more keep their value.
func ExampleTokensInt32() {
	ids := []uint32{1, 2, 3000000000, 4}
	h := kvlease.HashBlock(0, kvlease.TokensInt32(ids))
	fmt.Println(h == kvlease.HashBlock(0, []int32{1, 2, -1294967296, 4}))
	fmt.Println(kvlease.TokensUint32(kvlease.TokensInt32(ids))[2])
	// Output:
	// true
	// 3000000000
}

// Tenants share a pool but never each other's prefixes: the seed comes
// from a secret the pool holds per tenant, so a copied public salt does
// not help.
func ExamplePool_TenantSeed() {
	key := make([]byte, 32) // in production: 32 bytes from crypto/rand, kept in the process
	mem, _ := kvlease.NewHostMemory(64, 1024)
	pool, _ := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(4), kvlease.WithTenantKey(key))
	const salt = kvlease.BlockHash(42) // public: the model, a cache_salt
	prompt := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9}

	alice, _ := pool.TenantSeed("alice", salt)
	s, _ := pool.Admit(kvlease.SequenceSpec{Owner: "alice-1", Seed: alice, Prompt: prompt})
	_ = s.Commit(s.Len())
	s.Lease().Release()

	bob, _ := pool.TenantSeed("bob", salt)
	fmt.Println("bob's hits", pool.CachedPrefixTokens(bob, prompt))
	fmt.Println("alice's hits", pool.CachedPrefixTokens(alice, prompt))
	// Output:
	// bob's hits 0
	// alice's hits 2
}

// Leased plus QuarantinedLeased is what running requests hold, whatever
// state the blocks count in.
func ExampleStats() {
	mem, _ := kvlease.NewHostMemory(8, 64)
	pool, _ := kvlease.NewPool[[]byte](mem)
	lease, _ := pool.Acquire("req-1", 3)
	st := pool.Stats()
	fmt.Println("in use", st.Leased+st.QuarantinedLeased)
	lease.Release()
	st = pool.Stats()
	fmt.Println("in use", st.Leased+st.QuarantinedLeased)
	// Output:
	// in use 3
	// in use 0
}

// A multimodal prompt under a LoRA adapter: the image's content hash is
// an extra key of exactly the blocks holding its placeholder tokens, so
// the text before it is shared with prompts carrying another image; the
// adapter tags the blocks' KV events.
func ExamplePool_Admit() {
	mem, _ := kvlease.NewHostMemory(64, 1024)
	pool, _ := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(4), kvlease.WithKVEvents(64))
	prompt := []int32{1, 2, 3, 4, 9, 9, 9, 9, 5, 6, 7} // 9: the image's placeholder tokens
	withImage := func(key string) []kvlease.ExtraKey { return []kvlease.ExtraKey{{Start: 4, End: 8, Key: key}} }

	s, _ := pool.Admit(kvlease.SequenceSpec{Owner: "req-1", Seed: 1, Prompt: prompt,
		Extra: withImage("sha256:aaaa"), Adapter: kvlease.Adapter{ID: 1, Name: "sql-lora"}})
	_ = s.Commit(s.Len())
	s.Lease().Release()
	evs, _ := pool.DrainKVEvents(nil)
	for _, ev := range evs {
		fmt.Println("stored", ev.LoraName, ev.ExtraKeys)
	}

	other, _ := pool.Admit(kvlease.SequenceSpec{Owner: "req-2", Seed: 1, Prompt: prompt, Extra: withImage("sha256:bbbb")})
	fmt.Println("another image hits", other.Hits(), "block")
	other.Lease().Release()
	// Output:
	// stored sql-lora []
	// stored sql-lora [sha256:aaaa]
	// another image hits 1 block
}

// Blocks of an unloaded adapter are evicted before everyone else's; a
// low-priority lease's blocks likewise.
func ExamplePool_SetAdapterRetention() {
	mem, _ := kvlease.NewHostMemory(4, 64)
	pool, _ := kvlease.NewPool[[]byte](mem)
	seal := func(owner string, h kvlease.BlockHash, a kvlease.Adapter) {
		l, _ := pool.Acquire(owner, 2)
		_ = l.SetAdapter(a)
		_ = l.Seal(0, h)
		_ = l.Seal(1, h+1)
		l.Release()
	}
	seal("base", 10, kvlease.Adapter{})
	seal("sql", 20, kvlease.Adapter{ID: 1, Name: "sql-lora"})
	_ = pool.SetAdapterRetention("sql-lora", kvlease.RetentionMin) // the adapter is unloaded
	fmt.Println("cached by class", pool.CachedByRetention())

	l, _ := pool.Acquire("next", 2) // evicts two cached blocks: the adapter's
	fmt.Println("base still cached:", pool.CachedPrefix([]kvlease.BlockHash{10, 11}), "adapter:", pool.CachedPrefix([]kvlease.BlockHash{20, 21}))
	l.Release()
	// Output:
	// cached by class [2 0 0 0 2 0 0 0]
	// base still cached: 2 adapter: 0
}

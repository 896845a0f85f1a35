package handoff_test

import (
	"errors"
	"fmt"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/inproc"
)

// One envelope for the whole deployment: validated, checked for agreement
// between components, and asked before any block is acquired.
func ExampleEnvelope() {
	env := handoff.Envelope{
		BlockTokens: 16, BlockBytes: 4096, PoolBlocks: 256,
		MaxContextTokens: 4096, MaxPrefillTokens: 512, MaxRunningRequests: 32,
	}
	fmt.Println("valid:", env.Validate() == nil)
	fmt.Println("blocks for a 1000-token prompt:", env.BlocksFor(1000))

	// The decode pool was configured for a longer context than it can hold.
	decode := env
	decode.MaxContextTokens = 8192
	err := handoff.AgreeEnvelopes(
		handoff.NamedEnvelope{Name: "frontend", Envelope: env},
		handoff.NamedEnvelope{Name: "decode", Envelope: decode},
	)
	var ee *handoff.EnvelopeError
	if errors.As(err, &ee) {
		for _, p := range ee.Problems {
			fmt.Println(p)
		}
	}

	err = env.CheckRequest(4000, 200) // prompt + max new tokens
	fmt.Println(errors.Is(err, kvlease.ErrExceedsCapacity), err)
	// Output:
	// valid: true
	// blocks for a 1000-token prompt: 63
	// MaxContextTokens: components disagree: frontend=4096 decode=8192
	// MaxContextTokens: decode: a 8192-token request needs 512 blocks of 16 tokens, the pool has 256 (PoolBlocks)
	// true kvlease: check request: prompt 4000 + 200 new tokens exceeds the context limit of 4096 tokens: kvlease: exceeds capacity
}

// handoffPools makes a prefill and a decode pool of 16 blocks of 64 bytes
// and the envelope they share.
func handoffPools() (prefill, decode *kvlease.Pool[[]byte], env handoff.Envelope) {
	env = handoff.Envelope{BlockTokens: 16, BlockBytes: 64, PoolBlocks: 16,
		MaxContextTokens: 256, MaxPrefillTokens: 64, MaxRunningRequests: 4}
	pm, _ := kvlease.NewHostMemory(16, 64)
	dm, _ := kvlease.NewHostMemory(16, 64)
	prefill, _ = kvlease.NewPool[[]byte](pm)
	decode, _ = kvlease.NewPool[[]byte](dm)
	return prefill, decode, env
}

func printHistory(h *handoff.Handoff[[]byte, []byte]) {
	for _, s := range h.History() {
		fmt.Printf("  %v → %v by %s (%v)\n", s.From, s.To, s.By, s.Event)
	}
}

// A prefill worker hands a request's KV to a decode worker: the decode
// side accepts (holding its own lease) before one transfer copies the
// blocks, and the destination lease becomes the request's only when the
// transport proves the copy complete.
func ExampleHandoff() {
	prefillPool, decodePool, env := handoffPools()
	transport, _ := inproc.New(inproc.Config{}) // copies on a goroutine

	src, _ := prefillPool.Acquire("req-7", 3)
	for i := range src.Len() {
		b, _ := src.Region(i)
		copy(b, fmt.Sprintf("KV of req-7, block %d", i))
	}

	h, err := handoff.Propose(src, decodePool, handoff.Config{
		Envelope: env, Source: "prefill", Destination: "decode"})
	if err != nil {
		panic(err)
	}
	if err := h.Accept(); err != nil { // the decode side acquires 3 blocks
		fmt.Println("rejected:", err)
		return
	}
	if err := h.Start(transport); err != nil {
		fmt.Println("start:", err)
		return
	}
	<-h.Done()
	fmt.Println(h.State())
	printHistory(h)

	dst := h.Destination() // now the request's
	b, _ := dst.Region(2)
	fmt.Printf("decode block 2: %s\n", b[:20])
	src.Release() // the prefill side is done
	dst.Release() // ...and so is decode, eventually
	fmt.Println("free:", prefillPool.Stats().Free, decodePool.Stats().Free)
	// Output:
	// delivered
	//   none → proposed by prefill (propose)
	//   proposed → accepted by decode (accept)
	//   accepted → transferring by transport (attach)
	//   transferring → delivered by transport (resolve)
	// decode block 2: KV of req-7, block 2
	// free: 16 16
}

// A rejected handoff is final: it can never start a transfer, and the
// source lease is untouched.
func ExampleHandoff_Reject() {
	prefillPool, decodePool, env := handoffPools()
	transport, _ := inproc.New(inproc.Config{})
	src, _ := prefillPool.Acquire("req-8", 2)
	h, _ := handoff.Propose(src, decodePool, handoff.Config{Envelope: env, Destination: "decode"})

	_ = h.Reject("decode", errors.New("draining for maintenance"))
	err := h.Start(transport)
	fmt.Println(errors.Is(err, handoff.ErrState))
	fmt.Println(h.State(), src.State(), transport.Stats().Started)
	// Output:
	// true
	// rejected active 0
}

// The copy stops but its acknowledgement is lost. Giving up (Expire, or
// the handoff's deadline) quarantines the transfer: both leases' blocks
// stay out of reuse until the late evidence lifts the quarantine.
func ExampleHandoff_Expire() {
	prefillPool, decodePool, env := handoffPools()
	transport, _ := inproc.New(inproc.Config{
		Decide: func(uint64, int) inproc.Plan { return inproc.Plan{Fate: inproc.FateLoseAck} },
	})
	src, _ := prefillPool.Acquire("req-9", 2)
	h, _ := handoff.Propose(src, decodePool, handoff.Config{Envelope: env, Source: "prefill", Destination: "decode"})
	_ = h.Accept()
	_ = h.Start(transport)
	transport.Wait() // the copy stopped; nobody told the handoff

	_ = h.Expire("supervisor", errors.New("no acknowledgement"))
	fmt.Println(h.State(), "quarantined blocks:", prefillPool.Stats().Quarantined, decodePool.Stats().Quarantined)

	transport.Acknowledge(h.Transfer()) // the late evidence
	<-h.Done()
	fmt.Println(h.State(), "free blocks:", prefillPool.Stats().Free, decodePool.Stats().Free)
	printHistory(h)
	// Output:
	// quarantined quarantined blocks: 2 2
	// aborted free blocks: 16 16
	//   none → proposed by prefill (propose)
	//   proposed → accepted by decode (accept)
	//   accepted → transferring by transport (attach)
	//   transferring → quarantined by supervisor (expire)
	//   quarantined → aborted by transport (resolve)
}

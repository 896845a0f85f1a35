package kvlease_test

import (
	"errors"
	"fmt"

	"github.com/kvlease/kvlease"
)

// A lease's blocks stay out of the pool after Release until the transfer
// attached to them resolves: Release is a request, reclamation an event.
func Example() {
	mem, _ := kvlease.NewHostMemory(8, 4096) // 8 blocks of 4 KiB
	pool, _ := kvlease.NewPool[[]byte](mem)

	lease, _ := pool.Acquire("req-1", 3)
	region, _ := lease.Region(0)
	copy(region, "prefill output")

	// An asynchronous send reads blocks 0..2 of the lease.
	send := kvlease.NewTransfer(nil)
	_ = lease.AttachRange(send, 0, 3, kvlease.Read)

	lease.Release() // closed at once: no new work, no Region
	st := pool.Stats()
	fmt.Println("after release:", lease.State(), "draining", st.Draining, "free", st.Free)

	send.Resolve(nil) // the transport proves the copy is done
	<-lease.Settled()
	st = pool.Stats()
	fmt.Println("after resolve:", lease.State(), "draining", st.Draining, "free", st.Free)
	// Output:
	// after release: draining draining 3 free 5
	// after resolve: settled draining 0 free 8
}

// A transfer that ends without proof quarantines its blocks: they are
// never reused until late evidence arrives.
func ExampleTransfer_Quarantine() {
	mem, _ := kvlease.NewHostMemory(4, 64)
	pool, _ := kvlease.NewPool[[]byte](mem)
	lease, _ := pool.Acquire("req-2", 2)
	recv := kvlease.NewTransfer(nil)
	_ = lease.AttachRange(recv, 0, 2, kvlease.Write)

	recv.Quarantine(fmt.Errorf("peer vanished mid-write"))
	lease.Abort(nil)
	fmt.Println(lease.State(), pool.Stats().Quarantined)

	recv.Resolve(nil) // the peer's fence finally arrives
	fmt.Println(lease.State(), pool.Stats().Free)
	// Output:
	// quarantined 2
	// settled 4
}

// A prefix hit is shared and sealed: the lease reads it with ReadRegion;
// Region, the writable accessor, refuses it.
func ExampleLease_ReadRegion() {
	mem, _ := kvlease.NewHostMemory(4, 64)
	pool, _ := kvlease.NewPool[[]byte](mem)
	a, _ := pool.Acquire("a", 1)
	w, _ := a.Region(0)
	copy(w, "shared prompt KV")
	_ = a.Seal(0, 42)

	b, hits, _ := pool.AcquirePrefix("b", []kvlease.BlockHash{42}, 2)
	r, _ := b.ReadRegion(0)
	_, err := b.Region(0)
	fmt.Println("hits:", hits, "reads:", string(r[:16]))
	fmt.Println("write refused:", errors.Is(err, kvlease.ErrReadOnly))
	_, err = b.Region(1)
	fmt.Println("own fresh block writable:", err == nil)
	a.Release()
	b.Release()
	// Output:
	// hits: 1 reads: shared prompt KV
	// write refused: true
	// own fresh block writable: true
}

// Quarantine shrinks what a pool can ever serve: a request larger than
// Stats.Usable fails with ErrQuarantineBound (an ErrExhausted that retrying
// cannot cure until late evidence arrives), and the observer is alerted.
func ExampleWithQuarantineAlert() {
	mem, _ := kvlease.NewHostMemory(8, 64)
	alert := kvlease.ObserverFunc(func(e kvlease.Event) {
		if e.Kind == kvlease.EventQuarantineAlert {
			fmt.Println("alert:", e.Blocks, "blocks quarantined")
		}
	})
	pool, _ := kvlease.NewPool[[]byte](mem, kvlease.WithObserver(alert), kvlease.WithQuarantineAlert(0.1))

	l, _ := pool.Acquire("lost-ack", 1)
	t := kvlease.NewTransfer(nil)
	_ = l.Attach(t)
	t.Quarantine(nil) // the peer vanished mid-transfer
	l.Release()

	_, err := pool.Acquire("max-context", 8)
	fmt.Println("usable:", pool.Stats().Usable, "of", pool.Memory().Blocks())
	fmt.Println("bound:", errors.Is(err, kvlease.ErrQuarantineBound), "retryable:", errors.Is(err, kvlease.ErrExhausted))
	t.Resolve(nil) // late evidence lifts it
	fmt.Println("usable:", pool.Stats().Usable)
	// Output:
	// alert: 1 blocks quarantined
	// usable: 7 of 8
	// bound: true retryable: true
	// usable: 8
}

// After a weight update, ResetCache(true) makes every old block
// unfindable, including blocks running requests still hold.
func ExamplePool_ResetCache() {
	mem, _ := kvlease.NewHostMemory(4, 64)
	pool, _ := kvlease.NewPool[[]byte](mem)
	l, _ := pool.Acquire("running", 1)
	_ = l.Seal(0, 7)
	hs := []kvlease.BlockHash{7}
	pool.ResetCache(false)
	fmt.Println("ResetCache(false) keeps in-use blocks findable:", pool.CachedPrefix(hs))
	pool.ResetCache(true)
	fmt.Println("after ResetCache(true):", pool.CachedPrefix(hs))
	l.Release()
	// Output:
	// ResetCache(false) keeps in-use blocks findable: 1
	// after ResetCache(true): 0
}

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
	// tokens 64: Len 5 Trimmed 2 table [2 3 0] free 5
	// tokens 80: Len 6 Trimmed 3 table [3 0 2] free 5
	// tokens 96: Len 6 Trimmed 4 table [0 2] free 6
}

// A block copied into another pool is sealed as its original was: the
// original's record (Pool.SealInfo) seals the copy (Lease.SealAs), so
// both pools name the same parent and keep the same tokens.
func ExamplePool_SealInfo() {
	memA, _ := kvlease.NewHostMemory(4, 64)
	memB, _ := kvlease.NewHostMemory(4, 64)
	a, _ := kvlease.NewPool[[]byte](memA, kvlease.WithBlockTokens(4), kvlease.WithSealRecords())
	b, _ := kvlease.NewPool[[]byte](memB, kvlease.WithBlockTokens(4), kvlease.WithSealRecords())

	la, _ := a.Acquire("req", 2)
	h0, _ := la.SealTokens(0, 42, []int32{1, 2, 3, 4})
	_, _ = la.SealTokens(1, h0, []int32{5, 6, 7, 8})

	buf := make([]int32, 0, 4) // room for a block: SealInfo allocates nothing
	info, ok := a.SealInfo(la.Ref(1), buf)
	fmt.Println(ok, info.Parent == h0, info.Chained, info.Tokens)

	lb, _ := b.Acquire("copy", 1) // the copy is block 0 of its lease
	_ = lb.SealAs(0, info)
	copied, _ := b.SealInfo(lb.Ref(0), nil)
	fmt.Println(copied.Hash == info.Hash, copied.Parent == h0, copied.Chained, copied.Tokens)
	// Output:
	// true true true [5 6 7 8]
	// true true true [5 6 7 8]
}

// OnResolve acts on a transfer's evidence without a goroutine waiting on
// Done: the callback runs inside the winning Resolve, after the blocks
// are back.
func ExampleTransfer_OnResolve() {
	mem, _ := kvlease.NewHostMemory(4, 64)
	pool, _ := kvlease.NewPool[[]byte](mem)
	lease, _ := pool.Acquire("req-3", 2)
	copyT := kvlease.NewTransfer(nil)
	_ = lease.AttachRange(copyT, 0, 2, kvlease.Read)
	lease.Release()

	copyT.OnResolve(func(err error) {
		fmt.Println("resolved:", err, "free", pool.Stats().Free)
	})
	copyT.Resolve(nil)
	// Output:
	// resolved: <nil> free 4
}

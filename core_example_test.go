package kvlease_test

import (
	"errors"
	"fmt"

	"github.com/kvlease/kvlease"
)

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
// Usable fails with ErrQuarantineBound (an ErrExhausted that retrying
// cannot cure until late evidence arrives), and the observer is alerted.
func ExamplePool_Usable() {
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
	fmt.Println("usable:", pool.Usable(), "of", pool.Capacity())
	fmt.Println("bound:", errors.Is(err, kvlease.ErrQuarantineBound), "retryable:", errors.Is(err, kvlease.ErrExhausted))
	t.Resolve(nil) // late evidence lifts it
	fmt.Println("usable:", pool.Usable())
	// Output:
	// alert: 1 blocks quarantined
	// usable: 7 of 8
	// bound: true retryable: true
	// usable: 8
}

// After a weight update, ResetCache(ResetAll) makes every old block
// unfindable, including blocks running requests still hold.
func ExamplePool_ResetCache() {
	mem, _ := kvlease.NewHostMemory(4, 64)
	pool, _ := kvlease.NewPool[[]byte](mem)
	l, _ := pool.Acquire("running", 1)
	_ = l.Seal(0, 7)
	hs := []kvlease.BlockHash{7}
	pool.ResetCache()
	fmt.Println("default keeps in-use blocks findable:", pool.CachedPrefix(hs))
	pool.ResetCache(kvlease.ResetAll)
	fmt.Println("after ResetAll:", pool.CachedPrefix(hs))
	l.Release()
	// Output:
	// default keeps in-use blocks findable: 1
	// after ResetAll: 0
}

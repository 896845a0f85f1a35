// Command quickstart walks one lease through its life: acquire, write,
// attach an asynchronous copy, release, and settle only once the copy
// proves it is done. Run it with:
//
//	go run ./examples/quickstart
package main

import (
	"fmt"
	"os"
	"time"

	"github.com/kvlease/kvlease"
)

func main() {
	mem, err := kvlease.NewHostMemory(16, 4096)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	pool, err := kvlease.NewPool[[]byte](mem, kvlease.WithLeakCheck(true)) // watched: CheckQuiescent names holders
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	show := func(when string) {
		s := pool.Stats()
		fmt.Printf("%-28s free=%d cached=%d leased=%d draining=%d quarantined=%d\n",
			when, s.Free, s.Cached, s.Leased, s.Draining, s.Quarantined)
	}

	fmt.Println("1. acquire 4 blocks and write the prompt's KV into them")
	lease, err := pool.Acquire("request-1", 4)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	for i := range lease.Len() {
		r, _ := lease.Region(i)
		copy(r, fmt.Sprintf("request-1 block %d", i))
	}
	show("after acquire:")

	fmt.Println("2. start an asynchronous send of all 4 blocks (it reads them)")
	dst := make([][]byte, lease.Len())
	send := kvlease.NewTransfer(nil)
	if err := lease.AttachRange(send, 0, lease.Len(), kvlease.Read); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	srcs := make([][]byte, lease.Len())
	for i := range srcs {
		srcs[i], _ = lease.ReadRegion(i) // a send reads: the read accessor
	}
	go func() {
		time.Sleep(20 * time.Millisecond) // the wire
		for i, r := range srcs {
			dst[i] = append([]byte(nil), r[:17]...)
		}
		send.Resolve(nil) // evidence: the copy is complete
	}()

	fmt.Println("3. release at once: the lease closes, its blocks drain")
	lease.Release()
	show("after release:")
	fmt.Println("   quiescent?", pool.CheckQuiescent())
	if _, err := lease.ReadRegion(0); err != nil {
		fmt.Println("   region after release:", err)
	}

	<-lease.Settled()
	show("after the copy resolved:")
	fmt.Println("   lease state:", lease.State())
	fmt.Printf("   the receiver got %q\n", dst[3])

	fmt.Println("4. the old BlockRef is stale once the slot is reused")
	ref := lease.Ref(0)
	next, _ := pool.Acquire("request-2", 16)
	if _, err := pool.Region(ref); err != nil {
		fmt.Println("   ", err)
	}
	next.Release()
	show("at the end:")
	fmt.Println("   quiescent (nothing open, leased, draining or quarantined):", pool.CheckQuiescent())
}

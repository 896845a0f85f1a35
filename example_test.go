package kvlease_test

import (
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

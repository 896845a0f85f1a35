package audit_test

import (
	"fmt"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/audit"
)

// Markers: stamp a lease's blocks with its request's marker, check them
// later. A block reused by another request (a new generation) no longer
// holds the old marker.
func ExampleStampLease() {
	mem, _ := kvlease.NewHostMemory(2, 64)
	pool, _ := kvlease.NewPool[[]byte](mem)

	a, _ := pool.Acquire("request-1", 2)
	_ = audit.StampLease(a, 1)
	fmt.Println(audit.CheckLease(a, 1))
	a.Release()

	b, _ := pool.Acquire("request-2", 1)
	fmt.Println(audit.CheckLease(b, 1) != nil)
	// Output:
	// <nil>
	// true
}

// Run the audit against a deployment: here two workers of 256 blocks with
// 64-token blocks of 2 KiB, the envelope they agree on, and more lost
// acknowledgements than the defaults.
func ExampleRun() {
	cfg := audit.DefaultConfig()
	cfg.Seed = 42
	cfg.Ops = 1500
	cfg.Workers, cfg.Blocks = 2, 256
	cfg.BlockTokens, cfg.BlockBytes = 64, 512
	cfg.MaxContextTokens, cfg.MaxPrefillTokens, cfg.MaxPrompt = 4096, 2048, 1500
	cfg.Faults.LostAck = 0.05

	rep, err := audit.Run(cfg)
	if err != nil {
		fmt.Println("bad configuration:", err)
		return
	}
	fmt.Println("violations:", rep.Total())
	fmt.Println("lost acknowledgements seen:", rep.LostAcks > 0)
	// Output:
	// violations: 0
	// lost acknowledgements seen: true
}

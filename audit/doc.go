// Package audit is kvlease's isolation audit: markers that prove whose KV
// a block holds, and a fault-injecting stress driver that exercises the
// transitions where isolation breaks (rejected, cancelled, interrupted,
// moved between workers, memory reused under pressure) and checks, as it
// goes, that it never does.
//
// # Markers
//
// Stamp writes a Marker (request, block index, generation) into a block;
// Check tells whether the block still holds exactly it, and if not whose
// marker it holds instead (MismatchError). StampLease and CheckLease do a
// whole lease of host memory; StampLeaseIO and CheckLeaseIO do any region
// type through a BlockIO that copies blocks to and from the host (for
// device memory, the GPU copy engine). Markers are synthetic: run audits
// with them, never with real tenants' data.
//
// # The driver
//
// Run builds Config.Workers pools (workers), agrees one envelope among
// them, and drives a synthetic workload: requests with shared prefixes
// (AcquirePrefixTokens, Seal), waiting for memory (AcquireWait, with
// timeouts), growing (Extend), handed off between workers (Propose,
// Accept or Reject, Start over in-process transports), and the faults of
// Config.Faults: transfers that fail, ignore cancels or lose their
// acknowledgement, clients that go away mid-transfer, deadlines that pass
// mid-copy, rejections by the envelope, by exhaustion and by policy. It
// checks:
//
//   - every live lease holds only its own markers, or the sealed content
//     its prefix hit (MarkerMix, BadHit);
//   - a block is handed out fresh only when no open lease and no
//     unresolved transfer holds it, and with a new generation
//     (DoubleLease);
//   - at the moment each block is copied, both its source and its
//     destination are still the slots, at the generations, the transfer
//     was attached to, and the transfer has not resolved (LateWrite,
//     LateRead, EarlyResolve);
//   - the state counts sum to capacity and agree with the audit's own
//     model of leases and transfers; Pool.Check finds nothing
//     (CountMismatch, PoolCheck);
//   - handoffs keep their contract (HandoffBroken);
//   - after the drain (every copy finished, lost acknowledgements
//     delivered or given up on), every block is free or cached except
//     those held by transfers still quarantined, exactly those (Leak).
//
// # Determinism and replay
//
// One goroutine draws every operation from one random source seeded by
// Config.Seed, and the driver steps every copy one block at a time (the
// copy parks in the transport's BeforeWrite hook until its next OpStep),
// waits for waiters to queue and for handoffs to record evidence before
// it goes on. A run is therefore a function of its seed and
// configuration. Each operation carries its decisions (an Op), so when a
// check fails the report holds the trace that leads there, minimised by
// delta debugging when Config.Minimise is on, and Replay (or kvaudit
// -replay) runs it again. Config.Concurrent trades that for real races:
// copies run on their own with real latency while the driver aborts,
// expires and acknowledges them.
//
// # Running it against your deployment
//
// Start from DefaultConfig, set what your deployment has (workers, pool
// sizes, block tokens and bytes, context and prefill limits, requests per
// worker, pool options such as WithVerifiedPrefix) and the fault rates you
// want, and run it next to your ordinary performance runs:
//
//	cfg := audit.DefaultConfig()
//	cfg.Workers, cfg.Blocks = 8, 4096
//	cfg.BlockTokens, cfg.BlockBytes = 16, 16<<10
//	cfg.Ops = 1_000_000
//	rep, err := audit.Run(cfg)
//	...
//	rep.Write(os.Stdout) // non-zero rep.Total() means isolation broke
//
// or from the command line:
//
//	go run ./audit/cmd/kvaudit -ops 1000000 -workers 8 -blocks 4096 -seed 7
//
// The report gives the operations by kind, the rates of rejections, aborts
// mid-transfer, failed transfers and lost acknowledgements, the violations
// by kind, the blocks by state and the throughput. The package's tests
// also run three deliberately broken variants (a transport whose cancel
// frees at once, a handoff that copies after a rejection, a deadline taken
// as evidence) to show that each is caught within a few hundred
// operations.
package audit

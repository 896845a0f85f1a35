// Package bench measures kvlease under pressure, always next to a
// baseline timed in the same run, because the machines these numbers come
// from are shared and noisy: an absolute ns/op from one run says little, a
// ratio to a bare free list measured seconds apart on the same cores says
// much more.
//
// Run the benchmarks with
//
//	go test -run '^$' -bench . -benchmem ./bench/
//
// # Method
//
// Every benchmark with a target times its baseline inside the same
// benchmark function. For serial benchmarks (see paired in bench_test.go)
// the b.N iterations of the target and of each baseline are interleaved
// in up to sixteen rounds: in each round the benchmark timer is stopped, a
// chunk of baseline iterations is timed with a stopwatch, the timer is
// restarted and the same number of target iterations runs. So ns/op,
// B/op and allocs/op are the target's alone, and each extra metric
// "x-NAME" is target ns/op ÷ NAME's ns/op over the same b.N iterations,
// measured seconds apart on the same cores. Parallel benchmarks
// (RunParallel) bracket the target between two runs of the baseline under
// the same GOMAXPROCS and average those.
//
// The baselines (package bench/baseline) are what an engine writes by
// hand: "bare" is a mutex-guarded stack of free ids (pop n, push n, no
// allocation), "chan" a buffered channel of ids, "map" a request-keyed
// map of block tables plus a block→owner map.
//
// # Targets
//
//   - Lease cycle (Acquire(n) + Release): x-bare ≤ 3 for 1 block, ≤ 2 for
//     16 and 256 blocks.
//   - Lease cycle with a transfer attached and resolved: x-bare ≤ 3
//     against bare(16).
//   - AcquireWait with many waiters on a nearly full pool: throughput
//     within 3× of the uncontended cycle (x-uncontended ≤ 3). No lost
//     wake-ups and FIFO order are asserted by tests, not timed.
//   - Trace replay (bench/replay, go run ./bench/cmd/replay): at least 10⁶
//     block operations per second.
//
// The trace format and its generator live in bench/trace; the replaying
// engine in bench/replay; README.md has the measured table.
package bench

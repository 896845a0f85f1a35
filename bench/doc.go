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
// allocation), "slots" the same plus one packed word per slot (a
// generation bumped on hand-out and checked on return: the floor of any
// allocator that hands out BlockRefs, rule 5), "chan" a buffered channel
// of ids, "map" a request-keyed map of block tables plus a block→owner map.
//
// # Targets
//
// The first targets (x-bare ≤ 2 at 16 and 256 blocks) were below the
// per-block floor: SlotList alone is about 2× bare at 16 blocks and 10×
// or more at 256. They are restated against that floor, measured in the
// same run:
//
//   - Acquire(1) + Release: x-bare ≤ 3.
//   - Acquire(16) + Release: x-slots ≤ 2; Acquire(256) + Release:
//     x-slots ≤ 1.5.
//   - Acquire(16) with one transfer attached, released and resolved:
//     x-slots ≤ 3 against slots(16).
//   - At most one allocation per cycle (the transfer, where there is one).
//   - Parallel Acquire(4) + Release on all cores: x-bare ≤ 3 against a
//     parallel bare list.
//   - AcquireWait under contention: x-bare ≤ 1.1 against the bare FIFO of
//     channels (BareList.PopWait) under the same contention.
//   - ChainHashes per 16-token block: ≤ 1.1× chained xxhash64 over the same
//     bytes (the root package's BenchmarkChainHashes, x-chained).
//   - Prefix-heavy replay shaped like production (BenchmarkProductionReplay:
//     ~750-block prompts, a 262,144-block pool, 128 live requests, nearly
//     every fresh block evicting): ≤ 15 ns of pool time per block
//     operation (the flat prefix index against the Go map it replaced:
//     the root package's BenchmarkPrefixIndex).
//   - EvictionChurn per block ≤ 2× an unsealed lease cycle, AcquirePrefix
//     per hit block ≤ 10 ns (root package).
//   - Trace replay (bench/replay, go run ./bench/cmd/replay): at least 10⁶
//     block operations per second.
//
// The trace format and its generator live in bench/trace; the replaying
// engine in bench/replay; bench/instr/instr.py takes callgrind
// instruction counts, which do not depend on the machine's load;
// README.md has the measured tables.
package bench

#!/usr/bin/env bash
# UCX data plane: the two-process teaching example over UCX_TLS=tcp, as
# the README runs it: authenticated by default (the prefill process hands
# the decode process a pre-shared key through an inherited pipe), then
# once -insecure. UCX is installed and the module's tests (its fault,
# exposure and integrity suites among them) run in .ci/run with the other
# nested modules.
set -euo pipefail
cd "$(dirname "$0")/../../ucx"
# Fuzz budgets are counts (-fuzztime Nx), not durations: with a duration,
# Go 1.26's fuzz coordinator can fail a clean run with 'context deadline
# exceeded' when a loaded machine starves its workers (golang/go#75804).
out=$(go run ./examples/disagg -seed 1)
echo "$out" | sed -n "/^ledger:/,\$p"   # the ledger, whatever its length
echo "$out" | grep -Eq '^  marker mismatches +0$'
echo "$out" | grep -Eq '^  late writes +0 '
echo "$out" | grep -Eq '^  authenticated psk '
out=$(go run ./examples/disagg -seed 1 -insecure -quiet)
echo "$out" | grep -Eq '^  authenticated none '
echo "$out" | grep -Eq '^  marker mismatches +0$'
echo "$out" | grep -Eq '^  late writes +0 '
# The plane bytes come from the peer: a short fuzz of each parser.
for f in FuzzParsePushAccept FuzzParsePushStart FuzzParseStart FuzzParseAccept; do
	out=$(go test -run '^$' -fuzz "^$f\$" -fuzztime 10000x . 2>&1) || { echo "$out" | tail -20; exit 1; }
done
# Runs: the benchmark's layouts once (its bytes are checked; the tests
# count the descriptors), so that it keeps running.
out=$(go test -run '^$' -bench '^BenchmarkRuns256x4K$' -benchtime 1x . 2>&1) || { echo "$out" | tail -20; exit 1; }
echo "$out" | grep -E '^BenchmarkRuns256x4K/'
# Reused connections: the latency benchmarks a few times (each checks
# that the reusing side connected once), so that they keep running.
out=$(go test -run '^$' -bench '^Benchmark(Handoff|Plane)16Latency$' -benchtime 20x . 2>&1) || { echo "$out" | tail -20; exit 1; }
echo "$out" | grep -E '^Benchmark(Handoff|Plane)16Latency'

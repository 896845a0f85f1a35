#!/usr/bin/env bash
# Issue 35, the gpu package's copy kernel without a GPU:
#  - the descriptor ring and the Start's key set fuzzed briefly (counts,
#    not durations: see 60-tiers.sh);
#  - the ring, cancel, attach-failure and fault tests under -race a few
#    more times (on the CPU fallback and the fake driver);
#  - one allocation per Start (TestStartAllocs skips itself under -race,
#    so it runs here without, and must pass, not skip);
#  - gpu/devicecheck.sh dryrun: the device check's whole run against the
#    fake driver (gpu/testdata/fakecuda.c as "CUDA device 0") with small
#    sizes: examples/tiers and examples/hybrid on -gpu with their marker
#    lines, kvaudit -tiers -gpu (the audit's device mode) and its verdict,
#    every target row measured and given a verdict.
set -euo pipefail
cd "$(dirname "$0")/../.."
go test -run '^$' -fuzz '^FuzzRing$' -fuzztime 20000x ./gpu
go test -run '^$' -fuzz '^FuzzKeySet$' -fuzztime 20000x ./gpu
go test -race -count=3 -run '^(TestRing|TestKernelCancel|TestKernelAttachFailure|TestKernelFaultIsSticky|TestConcurrentCopies|TestCalibrate$)' ./gpu
out=$(go test -count=1 -run '^TestStartAllocs$' -v ./gpu)
echo "$out" | grep -E '^(--- |ok)'
grep -q '^--- PASS: TestStartAllocs' <<<"$out"

timeout 420 bash gpu/devicecheck.sh dryrun

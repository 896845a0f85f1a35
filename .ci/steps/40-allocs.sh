#!/usr/bin/env bash
# The allocation budget of issue 16 (TestLeaseCycleAllocs): the root CI
# run is -race, where checked builds allocate more and the test skips
# itself, so it runs here once more without the race detector (a few
# seconds), and must have passed, not skipped.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(go test -count=1 -run '^TestLeaseCycleAllocs$' -v ./bench/)
echo "$out"
grep -q '^--- PASS: TestLeaseCycleAllocs' <<<"$out"

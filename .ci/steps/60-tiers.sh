#!/usr/bin/env bash
# The disk tier's slot decoder fuzzed briefly, then the tiers audit:
# onboarding across device, host and disk tiers with injected copy
# failures, stalls, quarantines, disk failures and corruption; every
# onboarded block's marker is checked. Both policies, bounded (a few
# seconds each). Then the tiers example, whose last line must be a zero
# mismatch count.
set -euo pipefail
cd "$(dirname "$0")/../.."
# Fuzz budgets are counts (-fuzztime Nx), not durations: with a duration,
# Go 1.26's fuzz coordinator can fail a clean run with 'context deadline
# exceeded' when a loaded machine starves its workers (golang/go#75804).
# The disk slot decoder reads what a file holds after a crash or tampering.
go test -run '^$' -fuzz '^FuzzDiskDecode$' -fuzztime 10000x -fuzzminimizetime 2s ./tiers
for args in "-seed 17" "-seed 18 -write-through"; do
  out=$(timeout 120 go run ./audit/cmd/kvaudit -tiers -ops 6000 $args)
  echo "$out" | tail -4
  last=$(echo "$out" | tail -n 1)
  [[ "$last" == OK* ]] || { echo "tiers audit ($args) did not end with OK"; echo "$out"; exit 1; }
done
out=$(timeout 120 go run ./examples/tiers)
echo "$out"
[[ "$(echo "$out" | tail -n 1)" == "marker mismatches 0" ]] || { echo "examples/tiers: marker mismatches"; exit 1; }

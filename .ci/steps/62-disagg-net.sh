#!/usr/bin/env bash
# The disaggregation example as the README runs it: in one process, then
# with -net (the decode side a child process, every handoff over
# 127.0.0.1). Each must exit 0 and end its ledger with zero marker
# mismatches and zero late writes.
set -euo pipefail
cd "$(dirname "$0")/../.."
for args in "" "-net"; do
  out=$(timeout 120 go run ./examples/disagg $args) || { echo "examples/disagg $args failed"; echo "$out"; exit 1; }
  echo "$out" | tail -n 14
  for line in 'marker mismatches +0$' 'late writes +0 '; do
    echo "$out" | grep -Eq "^  $line" || { echo "examples/disagg $args: no line matching '$line'"; exit 1; }
  done
done

#!/usr/bin/env bash
# The disaggregation example as the README runs it: in one process, then
# with -net (the decode side a child process, every handoff over
# 127.0.0.1, authenticated with a key handed down an inherited pipe), then
# with -net -insecure. Each must exit 0 and end its ledger with zero
# marker mismatches and zero late writes; the -net runs say how they were
# authenticated. -net -stream hands every request off streaming and after
# its prefill and prints both layer timelines.
set -euo pipefail
cd "$(dirname "$0")/../.."
for args in "" "-net" "-net -insecure" "-net -stream"; do
  out=$(timeout 120 go run ./examples/disagg $args) || { echo "examples/disagg $args failed"; echo "$out"; exit 1; }
  echo "$out" | tail -n 15
  for line in 'marker mismatches +0$' 'late writes +0 '; do
    echo "$out" | grep -Eq "^  $line" || { echo "examples/disagg $args: no line matching '$line'"; exit 1; }
  done
  case "$args" in
    "-net"|"-net -stream") want='authenticated psk' ;;
    "-net -insecure") want='authenticated none' ;;
    *) want='' ;;
  esac
  if [ -n "$want" ]; then
    echo "$out" | grep -q "^  $want" || { echo "examples/disagg $args: no line '$want'"; exit 1; }
  fi
done

#!/usr/bin/env bash
# Brief fuzzing; the seed corpora already ran with the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
# Fuzz budgets are counts (-fuzztime Nx), not durations: with a duration,
# Go 1.26's fuzz coordinator can fail a clean run with 'context deadline
# exceeded' when a loaded machine starves its workers (golang/go#75804).
for target in FuzzLifecycle FuzzPrefixCache FuzzSequenceSpec; do # (FuzzSequence: 70-engine.sh)
  go test -run '^$' -fuzz "^${target}\$" -fuzztime 10000x -fuzzminimizetime 2s .
done
# FuzzDriver finds a new input every few runs from an empty cache (about
# 150 in 1,500): minimizing each for up to 2 s took 3 of CI's minutes, so
# its minimization is bounded by count.
go test -run '^$' -fuzz '^FuzzDriver$' -fuzztime 1500x -fuzzminimizetime 50x ./audit
go test -run '^$' -fuzz '^FuzzParseOp$' -fuzztime 10000x -fuzzminimizetime 2s ./audit
go test -run '^$' -fuzz '^FuzzProgress$' -fuzztime 10000x -fuzzminimizetime 2s ./handoff

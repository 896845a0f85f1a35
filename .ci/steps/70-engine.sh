#!/usr/bin/env bash
# The reference engine: its load test at five times go test's size
# (requests sharing prefixes over loopback, a third of the streamed ones
# cancelled mid-stream; no leak, exact cached_tokens, events decode),
# brief fuzzing of the sequence and of both request parsers, and the
# command itself, which must end with a clean pool check.
set -euo pipefail
cd "$(dirname "$0")/../.."
# Fuzz budgets are counts (-fuzztime Nx), not durations: with a duration,
# Go 1.26's fuzz coordinator can fail a clean run with 'context deadline
# exceeded' when a loaded machine starves its workers (golang/go#75804).
KVLEASE_ENGINE_LOAD=1500 go test -race -count=1 -run '^TestEngineLoad$' -v ./examples/engine | tail -3
go test -run '^$' -fuzz '^FuzzSequence$' -fuzztime 10000x -fuzzminimizetime 2s .
go test -run '^$' -fuzz '^FuzzParseCompletion$' -fuzztime 10000x -fuzzminimizetime 2s ./examples/engine
go test -run '^$' -fuzz '^FuzzParseChat$' -fuzztime 10000x -fuzzminimizetime 2s ./examples/engine
out=$(timeout 120 go run ./examples/engine -addr 127.0.0.1:0 -duration 1s)
echo "$out"
[[ "$(echo "$out" | tail -n 1)" == *"kv mismatches 0;"*"check <nil>" ]] || { echo "examples/engine: unclean end"; exit 1; }

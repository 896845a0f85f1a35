#!/usr/bin/env bash
# The cross-process handoff: the fault suite (the test binary re-executes
# itself as the peer) a few more times under -race, the control
# protocol's fuzz target briefly, and the two-process benchmarks once as
# a smoke run (they print the handoff and raw rows; nothing is asserted
# on speed).
set -euo pipefail
cd "$(dirname "$0")/../.."
go test -race -count=5 -run 'TestProc|TestLoopback' ./handoff/tcp
go test -run '^$' -fuzz '^FuzzReadFrame$' -fuzztime 10s -fuzzminimizetime 2s ./handoff
go test -run '^$' -bench . -benchtime 5x ./handoff/tcp

#!/usr/bin/env bash
# The cross-process handoff (each run here is one more after the README's
# command): the fault suite (the test binary re-executes itself as the
# peer) once more under -race, the attack suite (the
# test binary re-executes itself as the attacker: unauthenticated and
# wrong-key proposers, stolen and replayed tokens, a replayed record, a
# spliced stream, a pool hog, a hello flood, connections held before
# their handshake or hello from one and eight addresses, one identity
# hogging the pool from three sessions, 2,000 idle sessions) under -race,
# the per-identity and session bounds and forward secrecy, the streaming
# handoffs (faults included) a few more times, the control
# protocol's, the record layer's, the handshake's, the data hello's and
# the frame layout's and the stream frame header's fuzz targets briefly, the run-merging tests, and the two-process benchmarks once as a smoke run
# (they print the handoff and raw rows; nothing is asserted on speed).
set -euo pipefail
cd "$(dirname "$0")/../.."
# Fuzz budgets are counts (-fuzztime Nx), not durations: with a duration,
# Go 1.26's fuzz coordinator can fail a clean run with 'context deadline
# exceeded' when a loaded machine starves its workers (golang/go#75804).
go test -race -count=1 -run 'TestProc|TestLoopback|TestTLSAcrossProcesses' ./handoff/tcp
go test -race -count=1 -run 'TestAttack|TestSeal|TestSenderRefuses|TestReceiverAccept|TestKeyedPipeline|TestFrames|TestRun|TestReadLayout' ./handoff/tcp
go test -race -count=2 -run 'TestStream|ExampleSender_SendStream' ./handoff/tcp
go test -race -count=1 -run 'TestAuth|TestHandshake|TestHalvesRefuse|TestRecord|TestReplayed|TestStartTimeout|TestSessionCaps|TestRejectedProposals|TestListen|TestIdentity|TestSessionLimits|TestSessionIdleTimeout|TestForwardSecrecy|TestLowOrderShare' ./handoff
go test -race -count=5 ./internal/pending
go test -run '^$' -fuzz '^FuzzSet$' -fuzztime 10000x -fuzzminimizetime 2s ./internal/pending
go test -run '^$' -fuzz '^FuzzReadFrame$' -fuzztime 10000x -fuzzminimizetime 2s ./handoff
go test -run '^$' -fuzz '^FuzzRecord$' -fuzztime 10000x -fuzzminimizetime 2s ./handoff
go test -run '^$' -fuzz '^FuzzHandshake$' -fuzztime 10000x -fuzzminimizetime 2s ./handoff
go test -run '^$' -fuzz '^FuzzCheckHello$' -fuzztime 10000x -fuzzminimizetime 2s ./handoff/tcp
go test -run '^$' -fuzz '^FuzzParseAccept$' -fuzztime 10000x -fuzzminimizetime 2s ./handoff/tcp
go test -run '^$' -fuzz '^FuzzCheckFrameHeader$' -fuzztime 10000x -fuzzminimizetime 2s ./handoff/tcp
go test -run '^$' -fuzz '^FuzzParseLayout$' -fuzztime 10000x -fuzzminimizetime 2s ./handoff/tcp
go test -run '^$' -fuzz '^FuzzStreamHeader$' -fuzztime 10000x -fuzzminimizetime 2s ./handoff/tcp
go test -run '^$' -bench . -benchtime 5x ./handoff/tcp
go test -run '^$' -bench '^BenchmarkHandshake$' -benchtime 5x ./handoff

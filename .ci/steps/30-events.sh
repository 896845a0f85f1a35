#!/usr/bin/env bash
# KV events: the fuzz targets of the publisher's parsers briefly (the
# batch decoder, and every byte a ZMTP peer can send: greeting, READY,
# frames, commands, subscriptions) and of the per-address connection
# table against its model, the flood tests again under -race (a router
# on 127.0.0.1 beside floods from 127.0.0.2 and up), and one short run
# of each event benchmark (so they keep working). The hostile-peer tests
# run with the package's tests in .ci/run; the llm-d interop module's
# tests run there with the other nested modules.
set -euo pipefail
cd "$(dirname "$0")/../.."
# Fuzz budgets are counts (-fuzztime Nx), not durations: with a duration,
# Go 1.26's fuzz coordinator can fail a clean run with 'context deadline
# exceeded' when a loaded machine starves its workers (golang/go#75804).
go test -run '^$' -fuzz '^FuzzDecodeBatch$' -fuzztime 10000x -fuzzminimizetime 2s ./events
go test -run '^$' -fuzz '^FuzzZMTPPeer$' -fuzztime 10000x -fuzzminimizetime 2s ./events
go test -run '^$' -fuzz '^FuzzParseReady$' -fuzztime 10000x -fuzzminimizetime 2s ./events
go test -run '^$' -fuzz '^FuzzReplayRequests$' -fuzztime 10000x -fuzzminimizetime 2s ./events
go test -run '^$' -fuzz '^FuzzPeerTable$' -fuzztime 20000x -fuzzminimizetime 2s ./events
go test -race -count=3 -run '^(TestFlood|TestSubscriberWithoutSubscriptionDropped|TestReplayIdleClientDropped)' ./events
go test -run '^$' -bench '^BenchmarkPublisherThroughput$' -benchtime 200x ./events
go test -run '^$' -bench '^BenchmarkReplayEvents$' -benchtime 1x ./bench

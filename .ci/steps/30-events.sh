#!/usr/bin/env bash
# KV events: the publisher's fuzz target briefly, one short run of each
# event benchmark (so they keep working), then the llm-d interop nested
# module (its own go.mod; the root go test does not reach it).
set -euo pipefail
cd "$(dirname "$0")/../.."
go test -run '^$' -fuzz '^FuzzDecodeBatch$' -fuzztime 10s -fuzzminimizetime 2s ./events
go test -run '^$' -bench '^BenchmarkPublisherThroughput$' -benchtime 200x ./events
go test -run '^$' -bench '^BenchmarkReplayEvents$' -benchtime 1x ./bench
cd interop/llmd
go vet ./...
go test -race -count=1 ./...

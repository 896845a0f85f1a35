#!/usr/bin/env bash
# KV events: the publisher's fuzz target briefly and one short run of each
# event benchmark (so they keep working). The llm-d interop module's tests
# run in .ci/run with the other nested modules.
set -euo pipefail
cd "$(dirname "$0")/../.."
go test -run '^$' -fuzz '^FuzzDecodeBatch$' -fuzztime 10s -fuzzminimizetime 2s ./events
go test -run '^$' -bench '^BenchmarkPublisherThroughput$' -benchtime 200x ./events
go test -run '^$' -bench '^BenchmarkReplayEvents$' -benchtime 1x ./bench

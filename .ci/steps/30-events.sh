#!/usr/bin/env bash
# KV events: the publisher's fuzz target briefly, then the llm-d interop
# nested module (its own go.mod; the root go test does not reach it).
set -euo pipefail
cd "$(dirname "$0")/../.."
go test -run '^$' -fuzz '^FuzzDecodeBatch$' -fuzztime 10s -fuzzminimizetime 2s ./events
cd interop/llmd
go vet ./...
go test -race -count=1 ./...

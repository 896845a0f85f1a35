// Package llmd proves kvlease's KV event publisher against a real
// consumer: llm-d's KV-cache indexer (github.com/llm-d/llm-d-kv-cache),
// its own ZeroMQ subscriber, event pool and in-memory index, run in
// process. It is a nested module so the root module never carries the
// indexer's Kubernetes dependencies; .ci/steps/30-events.sh tests it.
package llmd

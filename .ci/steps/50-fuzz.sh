#!/usr/bin/env bash
# Brief fuzzing; the seed corpora already ran with the tests.
set -euo pipefail
cd "$(dirname "$0")/../.."
for target in FuzzLifecycle FuzzPrefixCache; do
  go test -run '^$' -fuzz "^${target}\$" -fuzztime 20s -fuzzminimizetime 2s .
done
go test -run '^$' -fuzz '^FuzzDriver$' -fuzztime 15s -fuzzminimizetime 2s ./audit
go test -run '^$' -fuzz '^FuzzParseOp$' -fuzztime 5s -fuzzminimizetime 2s ./audit

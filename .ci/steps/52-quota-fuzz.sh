#!/usr/bin/env bash
# Brief fuzzing of tenants' quota bookkeeping against its model (issue 32);
# the seed corpus already ran with the tests. Counts, not durations (see
# 50-fuzz.sh). About 30 s on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
go test -run '^$' -fuzz '^FuzzQuota$' -fuzztime 15000x -fuzzminimizetime 2s .
go test -race -count=3 -run 'Quota|Tenant' . ./internal/slots

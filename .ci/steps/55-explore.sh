#!/usr/bin/env bash
# Issue 33: the protocol proven by exploration (handoff/EXPLORER.md). The
# schedule explorer over the two handoff halves without the race detector
# (the root -race run explores every configuration to depth 5 only):
# every interleaving of the small configurations, the larger ones to a
# depth and by seeded random walks, the mutation suite (every mutant must
# be caught). Then the pool's linearizability check. About 90 s on 2
# cores; -explore.long (by hand) goes deeper.
set -euo pipefail
cd "$(dirname "$0")/../.."
go test -count=1 ./handoff/internal/explore
go test -count=1 -run 'TestExplore' ./handoff
go test -count=1 -run 'TestLineariz' .

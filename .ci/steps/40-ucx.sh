#!/usr/bin/env bash
# UCX data plane: the two-process teaching example over UCX_TLS=tcp, once,
# as the README runs it. UCX is installed and the module's tests (its
# fault suite among them) run in .ci/run with the other nested modules.
set -euo pipefail
cd "$(dirname "$0")/../../ucx"
out=$(go run ./examples/disagg -seed 1)
echo "$out" | tail -12
echo "$out" | grep -Eq '^  marker mismatches +0$'
echo "$out" | grep -Eq '^  late writes +0 '

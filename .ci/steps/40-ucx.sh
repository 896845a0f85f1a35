#!/usr/bin/env bash
# UCX data plane: the nested module ucx/ (cgo over libucx). Installs UCX
# (Debian bookworm: 1.13.1), vets and tests the module (its two-process
# fault suite over UCX_TLS=tcp on lo among them), and runs the teaching
# example once.
set -euo pipefail
cd "$(dirname "$0")/../.."
export DEBIAN_FRONTEND=noninteractive
if ! [ -e /usr/include/ucp/api/ucp.h ] || ! command -v ucx_info >/dev/null; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq libucx-dev ucx-utils >/dev/null
fi
ucx_info -v | head -1
cd ucx
go vet ./...
go test -race -count=1 ./...
out=$(go run ./examples/disagg -seed 1)
echo "$out" | tail -12
echo "$out" | grep -Eq '^  marker mismatches +0$'
echo "$out" | grep -Eq '^  late writes +0 '

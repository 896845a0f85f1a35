#!/usr/bin/env bash
# promtool check metrics on what the reference engine and the fleet
# example serve with -vllm-metrics=false (vLLM's names carry colons,
# which Prometheus reserves for recording rules: promtool reports them,
# so they are behind that flag). promtool comes with Debian's
# "prometheus" package, installed here when missing. About 30 s.
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! command -v promtool >/dev/null; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
promtool --version | head -1
work=$(mktemp -d)
pid=""
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# scrape OUTFILE: the body of GET /metrics at the first "metrics
# http://HOST:PORT/metrics" line a command printed to OUTFILE (bash's
# /dev/tcp: no curl needed).
scrape() {
  local hp=""
  for _ in $(seq 1 300); do
    hp=$(sed -n 's|^metrics http://\([^/]*\)/metrics$|\1|p' "$1" | head -n 1)
    [ -n "$hp" ] && break
    sleep 0.1
  done
  [ -n "$hp" ] || { echo "no metrics address in $1:" >&2; cat "$1" >&2; return 1; }
  exec 3<>"/dev/tcp/${hp%:*}/${hp##*:}"
  printf 'GET /metrics HTTP/1.0\r\nHost: %s\r\n\r\n' "$hp" >&3
  sed '1,/^\r$/d' <&3
  exec 3<&-
}

go build -o "$work/engine" ./examples/engine
go build -o "$work/fleet" ./examples/fleet

"$work/engine" -addr 127.0.0.1:0 -vllm-metrics=false -events tcp://127.0.0.1:0 -duration 60s >"$work/engine.out" 2>&1 &
pid=$!
scrape "$work/engine.out" >"$work/engine.metrics"
grep -q '^kvlease_blocks' "$work/engine.metrics" || { echo "no kvlease metrics:"; cat "$work/engine.metrics" "$work/engine.out"; exit 1; }
promtool check metrics <"$work/engine.metrics"
echo "engine: promtool check metrics clean ($(grep -vc '^#' "$work/engine.metrics") samples)"
kill -INT "$pid"
wait "$pid"
pid=""

"$work/fleet" -metrics 127.0.0.1:0 -vllm-metrics=false -duration 5s >"$work/fleet.out" 2>&1 &
pid=$!
for _ in $(seq 1 300); do grep -q '^running ' "$work/fleet.out" && break; sleep 0.1; done
scrape "$work/fleet.out" >"$work/fleet.metrics"
grep -q '^kvlease_kv_events_published_total' "$work/fleet.metrics" || { echo "no event metrics:"; cat "$work/fleet.metrics" "$work/fleet.out"; exit 1; }
promtool check metrics <"$work/fleet.metrics"
echo "fleet: promtool check metrics clean ($(grep -vc '^#' "$work/fleet.metrics") samples)"
wait "$pid"
pid=""

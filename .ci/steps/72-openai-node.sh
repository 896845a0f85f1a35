#!/usr/bin/env bash
# The official OpenAI Node client (npm "openai", the version pinned in
# examples/engine/testdata/openai-node/package.json) against the
# reference engine: the model list, completions and chat completions,
# streamed and not, the cached tokens of a second request over a shared
# prefix, and OpenAI's errors as the client parses them. Node and npm
# come from apt-get when the machine lacks them; the client from npm, in
# a scratch directory. About 30 s.
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
fi
node --version
work=$(mktemp -d)
engine_pid=""
cleanup() {
  if [ -n "$engine_pid" ]; then kill "$engine_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
cp examples/engine/testdata/openai-node/package.json examples/engine/testdata/openai-node/check.mjs "$work/"
(cd "$work" && timeout 180 npm install --no-audit --no-fund --loglevel=error)
go build -o "$work/engine" ./examples/engine
"$work/engine" -addr 127.0.0.1:0 -duration 120s >"$work/engine.out" 2>&1 &
engine_pid=$!
url=""
for _ in $(seq 1 200); do
  url=$(sed -n 's|^engine serving .* on \(http://[^/]*\)/v1/completions.*|\1|p' "$work/engine.out")
  [ -n "$url" ] && break
  sleep 0.1
done
[ -n "$url" ] || { echo "the engine did not start:"; cat "$work/engine.out"; exit 1; }
(cd "$work" && ENGINE_URL="$url" timeout 120 node check.mjs)
kill -INT "$engine_pid"
wait "$engine_pid"
engine_pid=""
tail -n 1 "$work/engine.out"
[[ "$(tail -n 1 "$work/engine.out")" == *"kv mismatches 0;"* ]] || { echo "examples/engine: unclean end"; exit 1; }

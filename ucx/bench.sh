#!/usr/bin/env bash
# Numbers for the UCX data plane, over UCX_TLS=tcp on loopback:
#  - BenchmarkPush256x64K: one handoff of 256 blocks of 64 KiB in the push
#    model (the default): rows pull (the baseline, same run), insecure
#    (crc32c sums) and authenticated (GMAC sums under the session's key);
#    ratio-to-pull = each row's bandwidth over pull's.
#  - BenchmarkPull256x64K (Config.Pull): one handoff of 256 blocks of 64 KiB through the
#    planes (worker per handoff on each side, handshake, registration,
#    gets, flush, revocation), next to ucx_perftest's get bandwidth at the
#    same message size and window, measured in the same run (ratio = ours
#    over perftest; the target is >= 0.8). get=64KiB reads one block per
#    get like perftest; get=1MiB is the plane's default coalescing.
#  - BenchmarkRegister256: ucp_mem_map + ucp_rkey_pack + ucp_mem_unmap of
#    256 blocks of 64 KiB (256 runs, and 1 run), next to one get of the
#    same 16 MiB (get-ns; ratio = registration over get).
#  - BenchmarkRuns256x4K: one handoff of 256 blocks of 4 KiB, scattered
#    (no two blocks adjacent), contiguous (one run) and as the same bytes
#    in one buffer, alternating in one run, for push (crc32c), push
#    (gmac) and pull: MB/s per layout, registrations and ops (messages or
#    gets) per handoff, and contiguous-%-of-one-buffer (the goal is >= 80);
#    push-gmac-fresh is push-gmac with a worker and a connect per handoff
#    (Config.MaxIdle -1), the cost before connections were reused.
#  - BenchmarkHandoff16Latency: propose -> delivered of a 16-block handoff
#    between the halves (PSK), p50/p99, reused connections vs a connect
#    per handoff, next to a 64-byte UCX tag round trip and a 64-byte TCP
#    round trip, same run (goal: reuse/ucx-rtt-p50 <= 3).
#  - BenchmarkPlane16Latency: the same handoff through the planes alone
#    (Prepare -> the destination's evidence, and -> the source's).
# Needs libucx-dev and ucx-utils (ucx_perftest).
set -euo pipefail
cd "$(dirname "$0")"
export UCX_TLS=tcp UCX_NET_DEVICES=lo
ucx_info -v | head -1
go test -run '^$' -bench 'Push256x64K|Pull256x64K|Register256|Runs256x4K' -benchtime "${BENCHTIME:-10x}" -count "${COUNT:-3}" -benchmem .
go test -run '^$' -bench 'Handoff16Latency|Plane16Latency' -benchtime "${LATENCY_N:-300x}" -count "${COUNT:-3}" .

#!/usr/bin/env bash
# devicecheck.sh: the GPU check of package gpu, as one prepared script.
#
#   gpu/devicecheck.sh build   here: builds the test binary (needs Go and a C
#                              compiler) into gpu/.devcheck/ (git-ignored),
#                              records the glibc it needs, self-checks it
#                              and prints the command to run on the GPU
#                              machine
#   gpu/devicecheck.sh run     there, from the repository root (no Go
#                              needed): one run of at most BUDGET seconds
#                              (default 285, under the five minutes one
#                              device call allows)
#
# run's steps, each under its own timeout (they sum to less than BUDGET,
# and a step never gets more than what is left of it):
#   env          15 s  driver and GPU (nvidia-smi, PCIe link now and max),
#                      glibc here vs what the binary needs
#   tests        75 s  every test (driver tests, each shared test's cuda
#                      subtest), the correctness loop excepted
#   correctness  25 s  20 x pageable upload, then at once a scattered
#                      download, compared byte for byte
#   bandwidth   110 s  16, 64 and 256 KiB blocks; HtoD, DtoH, DtoD (copy
#                      engine, batched and looped) and DtoDkernel (gather
#                      kernel): contiguous vs scattered, wall and GPU
#                      (event) time, time for Start to return, path counts
#   latency      50 s  p50/p99 of 8- and 64-block scattered copies
#
# The report, $OUT/devicecheck.md (or gpu/.devcheck/devicecheck.md), is
# rewritten after every step, so a step that hangs (killed by its timeout)
# still leaves everything before it, plus the step's own log so far.
# Exit status: 0 all ran and passed, 1 a test failed, 3 a step timed out
# or did not fit in the budget, 2 no binary.
#
# Environment for run: BUDGET (seconds, default 285), BENCHBYTES (bytes
# per copy in the bandwidth rows, default 256 MiB), BENCHTIME (default 5x),
# LATTIME (latency samples per row, default 200x).
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dir="$here/.devcheck"
bin="$dir/gpu.test"

build() {
	mkdir -p "$dir" || exit 1
	(cd "$here/.." && CGO_ENABLED=1 go test -c -o "$bin" ./gpu) || exit 1
	need=$(objdump -T "$bin" 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
	echo "${need:-unknown}" >"$dir/glibc-needed"
	echo "built $bin ($(du -h "$bin" | cut -f1)); glibc it needs: ${need:-unknown}"
	echo "self-check here (expect SKIP without a GPU):"
	(cd "$here" && "$bin" -test.run '^TestDriverInfo$' -test.v 2>&1 | sed 's/^/  /')
	cat <<MSG

On the GPU machine, from the repository root, carrying gpu/.devcheck:
  bash gpu/devicecheck.sh run
(device tool: command "bash gpu/devicecheck.sh run", carry ["gpu/.devcheck"], timeout_s 330)
MSG
}

# bwtable turns BenchmarkCopyBandwidth output into markdown rows. The
# verdict column applies to GPU rows at 64 KiB: scattered/contiguous ≥ 0.80
# for HtoD and DtoH on the default (batched) path, ≥ 0.70 for the kernel.
bwtable() {
	awk '
	/^BenchmarkCopyBandwidth\// {
		name = $1; sub(/^BenchmarkCopyBandwidth\//, "", name); sub(/-[0-9]+$/, "", name)
		n = split(name, part, "/")
		devk = part[1]; block = part[2]; direction = part[3]; mode = (n >= 4) ? part[4] : "-"
		delete m
		for (i = 3; i < NF; i += 2) m[$(i+1)] = $i
		ratio = ("gpu-scatter/contig" in m) ? m["gpu-scatter/contig"] : m["scatter/contig"]
		verdict = "-"
		if (devk == "cuda" && block == "64KiB" && mode != "/loop" && mode != "loop") {
			if (direction == "HtoD" || direction == "DtoH") verdict = (ratio + 0 >= 0.80) ? "PASS (>= 0.80)" : "BELOW 0.80"
			if (direction == "DtoDkernel") verdict = (ratio + 0 >= 0.70) ? "PASS (>= 0.70)" : "BELOW 0.70"
		}
		if (devk == "cuda") gpu++
		printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | b%s l%s k%s | %s |\n", devk, block, direction, mode,
			m["contig-GB/s"], m["scatter-GB/s"], m["scatter/contig"],
			("gpu-contig-GB/s" in m) ? m["gpu-contig-GB/s"] : "-", ("gpu-scatter-GB/s" in m) ? m["gpu-scatter-GB/s"] : "-",
			("gpu-scatter/contig" in m) ? m["gpu-scatter/contig"] : "-", m["start-µs"],
			m["batched/op"], m["looped/op"], m["kernel/op"], verdict
	}
	END { if (!gpu) print "\nNo GPU rows (no driver or device, or the step did not get that far; see bench.log)." }
	'
}

lattable() {
	awk '
	/^BenchmarkCopyLatency\// {
		name = $1; sub(/^BenchmarkCopyLatency\//, "", name); sub(/-[0-9]+$/, "", name)
		split(name, part, "/")
		delete m
		for (i = 3; i < NF; i += 2) m[$(i+1)] = $i
		printf "| %s | %s | %s | %s | %s | %s | %s | b%s l%s k%s |\n", part[1], part[2], part[3], part[4],
			m["p50-µs"], m["p99-µs"], m["start-µs"], m["batched/op"], m["looped/op"], m["kernel/op"]
	}'
}

# envinfo prints the driver, GPU and glibc facts (run under a timeout by
# step, hence exported).
envinfo() {
	echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
	echo "host: $(uname -srm)"
	echo "gpus: $(timeout 6 nvidia-smi -L 2>&1 | tr '\n' ';')"
	echo "gpu: $(timeout 6 nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,clocks.max.memory --format=csv,noheader 2>&1 | head -4 | tr '\n' ';')"
	echo "  (name, driver, memory, PCIe gen now/max, width now/max, max memory clock; an idle GPU may show a lower link gen now)"
	echo "libcuda: $(ldconfig -p 2>/dev/null | grep -m1 'libcuda.so.1 ' | sed 's/.*=> //')"
	have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
	need=$(cat "$dir/glibc-needed" 2>/dev/null || echo unknown)
	verdict="OK"
	if [ -z "$have" ] || [ "$need" = unknown ]; then
		verdict="cannot tell"
	elif [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -1)" != "$need" ]; then
		verdict="TOO OLD: rebuild the binary on an older system"
	fi
	echo "glibc: here ${have:-?}, binary needs ${need}: $verdict"
}

export -f envinfo
export dir

run() {
	if [ ! -x "$bin" ]; then
		echo "devicecheck: $bin is missing: run 'gpu/devicecheck.sh build' first, and carry gpu/.devcheck" >&2
		exit 2
	fi
	out="${OUT:-$dir}"
	mkdir -p "$out"
	report="$out/devicecheck.md"
	budget="${BUDGET:-285}"
	t_start=$SECONDS
	incomplete=0
	cd "$here" || exit 1 # the tests read testdata/ relative to the package directory
	: >"$out/steps.txt"

	# step NAME SECONDS LOG CMD...: runs CMD with stdout and stderr to LOG,
	# killed after min(SECONDS, what is left of the budget), and records
	# its outcome in steps.txt.
	step() {
		local name=$1 limit=$2 log=$3
		shift 3
		local left=$((budget - (SECONDS - t_start) - 5))
		if [ "$left" -lt 10 ]; then
			echo "$name: not run (budget of ${budget}s spent)" | tee -a "$out/steps.txt"
			incomplete=1
			return 124
		fi
		[ "$limit" -gt "$left" ] && limit=$left
		local t0=$SECONDS
		timeout -k 5 "$limit" "$@" >"$log" 2>&1
		local rc=$?
		local verdict="exit $rc"
		if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
			verdict="TIMED OUT after ${limit}s (exit $rc): partial log kept"
			incomplete=1
		fi
		echo "$name: $verdict in $((SECONDS - t0))s" | tee -a "$out/steps.txt"
		return "$rc"
	}

	# write_report rewrites the report from whatever the steps left so far.
	write_report() {
		{
			echo "# gpu device check"
			echo
			echo "Steps (budget ${budget}s, $((SECONDS - t_start))s used so far):"
			echo
			sed 's/^/    /' "$out/steps.txt"
			echo
			[ -f "$out/env.txt" ] && { echo "## Driver and GPU"; echo; sed 's/^/    /' "$out/env.txt"; echo; }
			if [ -f "$out/tests.log" ]; then
				echo "## Tests"
				echo
				echo "$(grep -c -- '--- PASS' "$out/tests.log") passed, $(grep -c -- '--- FAIL' "$out/tests.log") failed, $(grep -c -- '--- SKIP' "$out/tests.log") skipped (tests.log). Driver tests, cuda subtests and failures:"
				echo
				grep -E -- '--- (PASS|FAIL|SKIP): [^ ]*(cuda|Driver)|--- FAIL|^panic|GLIBC|device [0-9]+:|JIT|first scattered|512 MiB' "$out/tests.log" | head -80 | sed 's/^/    /'
				echo
			fi
			if [ -f "$out/correctness.log" ]; then
				echo "## Correctness loop (20 x pageable upload, then a scattered download)"
				echo
				grep -E -- '--- (PASS|FAIL|SKIP)|identical|differs|panic' "$out/correctness.log" | head -20 | sed 's/^/    /'
				echo
			fi
			if [ -f "$out/bench.log" ]; then
				echo "## Bandwidth"
				echo
				echo "One copy of N blocks contiguous on both sides (merged into one copy) vs the same N blocks scattered (random permutations), same run. GPU columns: CUDA events around the copies. start: mean time for Start to return (scattered). paths: submissions per scattered copy, b(atched) l(ooped) k(ernel). Targets at 64 KiB: HtoD/DtoH scattered ≥ 0.80 × contiguous; the gather kernel ≥ 0.70 × the contiguous device-to-device copy (GPU-time ratio when measured)."
				echo
				echo "| device | block | direction | mode | contig GB/s | scatter GB/s | ratio | GPU contig GB/s | GPU scatter GB/s | GPU ratio | start µs | paths | target |"
				echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
				bwtable <"$out/bench.log"
				grep -E 'SKIP|FAIL|panic|failures during' "$out/bench.log" | head -10 | sed 's/^/    /'
				echo
			fi
			if [ -f "$out/latency.log" ]; then
				echo "## Latency (Start until resolved, scattered)"
				echo
				echo "| device | block | direction | blocks | p50 µs | p99 µs | start µs | paths |"
				echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
				lattable <"$out/latency.log"
				grep -E 'SKIP|FAIL|panic' "$out/latency.log" | head -5 | sed 's/^/    /'
				echo
			fi
		} >"$report.tmp" && mv "$report.tmp" "$report"
	}

	step env 15 "$out/env.txt" bash -c envinfo
	cat "$out/env.txt"
	write_report

	step tests 75 "$out/tests.log" "$bin" -test.v -test.count 1 -test.timeout 70s -test.skip '^TestUploadThenScatteredDownload$'
	write_report

	step correctness 25 "$out/correctness.log" "$bin" -test.v -test.count 1 -test.timeout 22s -test.run '^TestUploadThenScatteredDownload$'
	write_report

	step bandwidth 110 "$out/bench.log" "$bin" -test.run '^$' -test.bench '^BenchmarkCopyBandwidth/cuda/' \
		-test.benchtime "${BENCHTIME:-5x}" -gpu.benchbytes "${BENCHBYTES:-268435456}" -test.timeout 105s
	write_report

	step latency 50 "$out/latency.log" "$bin" -test.run '^$' -test.bench '^BenchmarkCopyLatency/cuda/' \
		-test.benchtime "${LATTIME:-200x}" -test.timeout 46s
	write_report

	cat "$report"
	grep -q -- '--- FAIL' "$out/tests.log" "$out/correctness.log" 2>/dev/null && exit 1
	[ "$incomplete" -ne 0 ] && exit 3 # a step timed out or was not run
	exit 0
}

case "${1:-}" in
build) build ;;
run) run ;;
*)
	echo "usage: $0 build|run" >&2
	exit 2
	;;
esac

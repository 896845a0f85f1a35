#!/usr/bin/env bash
# devicecheck.sh: the GPU check of package gpu, as one prepared script.
#
#   gpu/devicecheck.sh build   here: builds the test binary (needs Go and a C
#                              compiler) into gpu/.devcheck/ (git-ignored) and
#                              prints the command to run on the GPU machine
#   gpu/devicecheck.sh run     there, from the repository root (no Go needed):
#                              runs the tests (the driver tests and every
#                              shared test's cuda subtest among them), then
#                              BenchmarkCopyBandwidth, and writes a table to
#                              $OUT/devicecheck.md (or gpu/.devcheck/)
#
# Environment for run: BENCHTIME (default 20x), BENCHBYTES (bytes per copy
# on the GPU, default 256 MiB), HOSTBENCHBYTES (on the CPU fallback, default
# 64 MiB). Without a GPU, run still works: the cuda tests and benchmarks
# report SKIP with the reason and the table says there are no GPU rows.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dir="$here/.devcheck"
bin="$dir/gpu.test"

build() {
	mkdir -p "$dir" || exit 1
	(cd "$here/.." && CGO_ENABLED=1 go test -c -o "$bin" ./gpu) || exit 1
	echo "built $bin ($(du -h "$bin" | cut -f1)); glibc it needs: $(objdump -T "$bin" 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)"
	echo "self-check here (expect SKIP without a GPU):"
	(cd "$here" && "$bin" -test.run '^TestDriverInfo$' -test.v 2>&1 | sed 's/^/  /')
	cat <<MSG

On the GPU machine, from the repository root, carrying gpu/.devcheck:
  bash gpu/devicecheck.sh run
(device tool: command "bash gpu/devicecheck.sh run", carry ["gpu/.devcheck"], timeout_s 420)
MSG
}

# table turns benchmark output into a markdown table. The target applies
# to GPU rows on the default path (batched when the driver has it) with
# blocks of 64 KiB or more.
table() {
	awk '
	/^BenchmarkCopyBandwidth\// {
		name = $1; sub(/^BenchmarkCopyBandwidth\//, "", name); sub(/-[0-9]+$/, "", name)
		n = split(name, part, "/")
		devk = part[1]; block = part[2]; direction = part[3]; path = (n >= 4) ? part[4] : (devk == "cuda" ? "loop (no batch API)" : "worker memcpy")
		c = s = r = "?"
		for (i = 3; i < NF; i += 2) {
			if ($(i+1) == "contig-GB/s") c = $i
			if ($(i+1) == "scatter-GB/s") s = $i
			if ($(i+1) == "scatter/contig") r = $i
		}
		kib = block; sub(/KiB$/, "", kib)
		verdict = "-"
		if (devk == "cuda" && kib + 0 >= 64 && path != "loop") verdict = (r + 0 >= 0.80) ? "PASS" : "BELOW"
		if (devk == "cuda") gpu++
		printf "| %s | %s | %s | %s | %s | %s | %.2f | %s |\n", devk, block, direction, path, c, s, r, verdict
	}
	END { if (!gpu) print "\nNo GPU rows: BenchmarkCopyBandwidth/cuda skipped (no driver or device here; see tests.log)." }
	'
}

run() {
	if [ ! -x "$bin" ]; then
		echo "devicecheck: $bin is missing: run 'gpu/devicecheck.sh build' first, and carry gpu/.devcheck" >&2
		exit 2
	fi
	out="${OUT:-$dir}"
	mkdir -p "$out"
	cd "$here" || exit 1 # the tests read testdata/ relative to the package directory
	{
		echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
		echo "host: $(uname -srm)"
		echo "gpus: $(nvidia-smi -L 2>/dev/null | tr '\n' ';')"
		echo "libcuda: $(ldconfig -p 2>/dev/null | grep -m1 'libcuda.so.1 ' | sed 's/.*=> //' || true)"
	} | tee "$out/env.txt"

	echo "== tests"
	timeout 300 "$bin" -test.v -test.count 1 -test.timeout 280s >"$out/tests.log" 2>&1
	tests_rc=$?
	grep -E -- '--- (PASS|FAIL|SKIP): [^ ]*(cuda|Driver)|--- FAIL|^panic|GLIBC' "$out/tests.log" | head -60
	reason=$(grep -m1 -o 'SKIP (.*' "$out/tests.log")
	[ -n "$reason" ] && echo "skip reason: $reason"
	echo "tests: exit $tests_rc; $(grep -c -- '--- PASS' "$out/tests.log") passed, $(grep -c -- '--- FAIL' "$out/tests.log") failed, $(grep -c -- '--- SKIP' "$out/tests.log") skipped"
	if [ "$tests_rc" -ne 0 ] && grep -q 'GLIBC_' "$out/tests.log"; then
		echo "hint: the binary needs a newer glibc than this machine has; build it on an older system"
	fi

	echo "== bandwidth"
	timeout 200 "$bin" -test.run '^$' -test.bench '^BenchmarkCopyBandwidth/cuda/' -test.benchtime "${BENCHTIME:-20x}" \
		-gpu.benchbytes "${BENCHBYTES:-268435456}" -test.timeout 190s >"$out/bench.log" 2>&1
	timeout 120 "$bin" -test.run '^$' -test.bench '^BenchmarkCopyBandwidth/host/' -test.benchtime "${BENCHTIME:-20x}" \
		-gpu.benchbytes "${HOSTBENCHBYTES:-67108864}" -test.timeout 110s >>"$out/bench.log" 2>&1
	grep -E 'SKIP|FAIL|panic' "$out/bench.log" | head -5

	{
		echo "# gpu device check"
		echo
		sed 's/^/    /' "$out/env.txt"
		echo
		echo "tests: exit $tests_rc; $(grep -c -- '--- PASS' "$out/tests.log") passed, $(grep -c -- '--- FAIL' "$out/tests.log") failed, $(grep -c -- '--- SKIP' "$out/tests.log") skipped (tests.log)"
		echo
		echo "Each row: one copy of N blocks contiguous on both sides (merged into one copy) vs the same N blocks scattered (random permutations), same run. Target: scattered ≥ 0.80 × contiguous for blocks ≥ 64 KiB on the GPU's default path."
		echo
		echo "| device | block | direction | path | contiguous GB/s | scattered GB/s | scattered/contiguous | target |"
		echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
		table <"$out/bench.log"
	} >"$out/devicecheck.md"
	cat "$out/devicecheck.md"
	exit "$tests_rc"
}

case "${1:-}" in
build) build ;;
run) run ;;
*)
	echo "usage: $0 build|run" >&2
	exit 2
	;;
esac

#!/usr/bin/env bash
# devicecheck.sh: the GPU check of package gpu (issue 35), as one prepared
# script.
#
#   gpu/devicecheck.sh build    here (Go and a C compiler): builds the test
#                               binary, examples/tiers, examples/hybrid and
#                               kvaudit into gpu/.devcheck/ (git-ignored),
#                               stripped, records the glibc they need and
#                               prints the command to run on the GPU machine
#   gpu/devicecheck.sh run      there, from the repository root (no Go
#                               needed): one run of at most BUDGET seconds
#                               (default 285, under five minutes)
#   gpu/devicecheck.sh dryrun   here: build (unless SKIPBUILD=1), then run
#                               against the gpu package's fake driver
#                               (testdata/fakecuda.c, as "CUDA device 0")
#                               with small sizes, and check that the report
#                               has every target row with a verdict: the
#                               script's logic without a GPU (CI runs it)
#
# run's steps, each under its own timeout (a step never gets more than
# what is left of the budget):
#   env          driver and GPU (nvidia-smi, PCIe link), glibc here vs needed
#   calibrate    Device.Calibrate's table: both paths, every direction
#   bandwidth    BenchmarkCopyBandwidth: 4, 16, 64, 256 KiB blocks, HtoD,
#                DtoH, DtoD, paths auto (the target rows), kernel and copy
#                engine, scattered vs one contiguous copy in the same run
#   latency      BenchmarkCopyLatency: 8 and 64 blocks of 16 KiB, p50/p99
#   layered      BenchmarkLayeredRoundTrip: 32 layers × K/V, 32 KiB and
#                1 KiB pieces, vs one contiguous copy each way
#   start        BenchmarkStart: Start's host time per piece, 1,024 pieces
#   examples     examples/tiers -gpu (write-back, write-through) and
#                examples/hybrid -gpu: their marker lines
#   audit        kvaudit -tiers -gpu: the tiers audit's device mode, verdict
#   tests        every test (driver tests, each shared test's cuda subtest)
#   correctness  20 x pageable upload, then a scattered download, compared
#   sanitizer    compute-sanitizer memcheck and racecheck over the kernel
#                tests, when the tool is there
#
# The report, $OUT/devicecheck.md (or gpu/.devcheck/devicecheck.md), is
# rewritten after every step, so a step that hangs (killed by its timeout)
# still leaves everything before it. It ends with the targets, each
# measured value with PASS or BELOW (NOT MEASURED when its step did not
# get there), and the correctness checks with PASS or FAIL; run prints
# the targets last.
# Exit status: 0 everything ran and no correctness check failed (numbers
# BELOW their target are reported, not failures), 1 a test or check
# failed, 3 a step timed out or did not fit in the budget, 2 no binary.
#
# Environment for run: BUDGET (seconds, default 285), BENCHBYTES (bytes
# per copy in the bandwidth rows, default 256 MiB), BENCHTIME (default
# 5x), LATTIME (samples per latency row, default 200x), LAYTIME (default
# 5x), STARTTIME (default 2000x), AUDITOPS (kvaudit requests, default
# 3000), TIERSREQ (examples/tiers requests, default 2000), TESTS (the
# tests step's -test.run, default every test), LIMITSCALE (multiplies every
# step's time limit and test timeout; default 1, the dryrun 3).
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dir="$here/.devcheck"
bin="$dir/gpu.test"

build() {
	mkdir -p "$dir" || exit 1
	local root
	root=$(cd "$here/.." && pwd)
	(cd "$root" && CGO_ENABLED=1 go test -c -ldflags='-s -w' -o "$bin" ./gpu) || exit 1
	for cmd in examples/tiers examples/hybrid audit/cmd/kvaudit; do
		(cd "$root" && CGO_ENABLED=1 go build -ldflags='-s -w' -o "$dir/$(basename "$cmd")" "./$cmd") || exit 1
	done
	need=$(for b in "$bin" "$dir/tiers" "$dir/hybrid" "$dir/kvaudit"; do objdump -T "$b" 2>/dev/null; done |
		grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
	echo "${need:-unknown}" >"$dir/glibc-needed"
	echo "built in $dir ($(du -sh "$dir" | cut -f1) to carry): gpu.test tiers hybrid kvaudit; glibc they need: ${need:-unknown}"
	cat <<MSG

On the GPU machine, from the repository root, carrying gpu/.devcheck:
  bash gpu/devicecheck.sh run
(device tool: command "bash gpu/devicecheck.sh run", carry ["gpu/.devcheck"], timeout_s 330)
Check the script's logic here first, against the fake driver:
  SKIPBUILD=1 bash gpu/devicecheck.sh dryrun
MSG
}

# envinfo prints the driver, GPU and glibc facts (run under a timeout by
# step, hence exported).
envinfo() {
	echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
	echo "host: $(uname -srm), $(nproc) CPUs"
	echo "gpus: $(timeout 6 nvidia-smi -L 2>&1 | tr '\n' ';')"
	echo "gpu: $(timeout 6 nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,clocks.max.memory --format=csv,noheader 2>&1 | head -4 | tr '\n' ';')"
	echo "  (name, driver, memory, PCIe gen now/max, width now/max, max memory clock; an idle GPU may show a lower link gen now)"
	echo "libcuda: ${KVLEASE_LIBCUDA:-$(ldconfig -p 2>/dev/null | grep -m1 'libcuda.so.1 ' | sed 's/.*=> //')}"
	echo "compute-sanitizer: $(sanitizer || echo none)"
	have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
	need=$(cat "$dir/glibc-needed" 2>/dev/null || echo unknown)
	verdict="OK"
	if [ -z "$have" ] || [ "$need" = unknown ]; then
		verdict="cannot tell"
	elif [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -1)" != "$need" ]; then
		verdict="TOO OLD: rebuild the binaries on an older system"
	fi
	echo "glibc: here ${have:-?}, binaries need ${need}: $verdict"
}

# sanitizer prints the path of compute-sanitizer, if there is one.
sanitizer() {
	command -v compute-sanitizer 2>/dev/null && return 0
	for p in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer; do
		[ -x "$p" ] && { echo "$p"; return 0; }
	done
	return 1
}

export -f envinfo sanitizer
export dir

# targets reads the logs in $1 and prints one line per target: what it
# is, what was measured, PASS / BELOW / FAIL / NOT MEASURED.
targets() {
	local out=$1
	cat "$out"/bench.log "$out"/latency.log "$out"/layered.log "$out"/start.log 2>/dev/null |
		awk -v examples="$out/examples.log" -v audit="$out/audit.log" -v san="$out/sanitizer.log" -v sanok="$out/sanitizer.ok" '
	/^Benchmark[A-Za-z]+\/cuda\// {
		name = $1; sub(/^Benchmark/, "", name); sub(/-[0-9]+$/, "", name)
		for (i = 3; i < NF; i += 2) M[name, $(i+1)] = $i
	}
	function row(desc, measured, ok) {
		printf "| %s | %s | %s |\n", desc, measured, ok
		if (ok == "BELOW") below++
		if (ok == "FAIL") failed++
		if (ok == "NOT MEASURED") missing++
	}
	# num checks metric of row key against want; path rows (ctas >= 0)
	# say what carried the copy, and with ctas > 0 a launch of more CTAs
	# than that misses the target too.
	function num(desc, key, metric, op, want, ctas,   v, c, ok, m) {
		if (!((key, metric) in M)) { row(desc, "-", "NOT MEASURED"); return }
		v = M[key, metric]
		ok = (op == ">=") ? (v + 0 >= want) : (v + 0 <= want)
		m = v
		if (ctas >= 0) {
			if ((key, "ctas") in M) {
				c = M[key, "ctas"]
				m = v " (kernel, " c " CTAs)"
				if (ctas > 0 && c + 0 > ctas) ok = 0
			} else {
				m = v " (copy engine)"
			}
		}
		row(desc, m, ok ? "PASS" : "BELOW")
	}
	END {
		print "| target | measured | verdict |"
		print "| --- | --- | --- |"
		split("4 16 64 256", sizes, " ")
		for (d = 1; d <= 2; d++) {
			dir = (d == 1) ? "HtoD" : "DtoH"
			for (s = 1; s <= 4; s++) {
				want = (sizes[s] == 4) ? 0.85 : 0.90
				num(sprintf("%s %s KiB scattered / contiguous >= %.2f%s", dir, sizes[s], want, sizes[s] >= 16 ? ", <= 16 CTAs" : ""),
					sprintf("CopyBandwidth/cuda/%sKiB/%s/auto", sizes[s], dir), "scatter/contig", ">=", want, sizes[s] >= 16 ? 16 : 0)
			}
		}
		for (s = 2; s <= 4; s++)
			num(sprintf("DtoD %s KiB scattered / contiguous (wall) >= 0.85", sizes[s]), sprintf("CopyBandwidth/cuda/%sKiB/DtoD/auto", sizes[s]), "scatter/contig", ">=", 0.85, 0)
		num("layered round trip, 32 KiB pieces, / contiguous >= 0.85", "LayeredRoundTrip/cuda/32KiB", "layered/contig", ">=", 0.85, 0)
		num("layered round trip, 1 KiB pieces, / contiguous >= 0.60", "LayeredRoundTrip/cuda/1KiB", "layered/contig", ">=", 0.60, 0)
		num("8 x 16 KiB HtoD, Start to resolved, p50 <= 20 us", "CopyLatency/cuda/16KiB/HtoD/8blocks/auto", "p50-µs", "<=", 20, 0)
		num("64 x 16 KiB HtoD, Start to resolved, p50 <= 40 us", "CopyLatency/cuda/16KiB/HtoD/64blocks/auto", "p50-µs", "<=", 40, 0)
		num("Start host time at 1,024 pieces (kernel path) <= 50 ns a piece", "Start/cuda/1024/kernel", "ns/piece", "<=", 50, -1)

		# Correctness: the examples marker lines, the audit verdict, the sanitizer.
		n = 0
		while ((getline line < examples) > 0) {
			if (line ~ /^== /) { what = substr(line, 4); continue }
			if (line ~ /^marker mismatches /) { n++; split(line, f, " "); row(what ": " line, f[3], f[3] == "0" ? "PASS" : "FAIL") }
		}
		if (n < 3) row("examples on -gpu (tiers write-back, write-through, hybrid): marker lines", n " of 3", "NOT MEASURED")
		last = ""
		while ((getline line < audit) > 0) if (line != "") last = line
		if (last == "") row("kvaudit -tiers -gpu verdict", "-", "NOT MEASURED")
		else row("kvaudit -tiers -gpu verdict", last, last ~ /^OK/ ? "PASS" : "FAIL")
		s = ""
		while ((getline line < san) > 0) {
			if (line ~ /^== /) tool = substr(line, 4)
			if (line ~ /ERROR SUMMARY/) { s = s tool ": " line "; "; if (line !~ /: 0 errors/) sbad = 1 }
			if (line ~ /^SKIPPED/) skipped = line
		}
		if (skipped != "") printf "| compute-sanitizer memcheck, racecheck | %s | SKIPPED |\n", skipped
		else if (s == "") row("compute-sanitizer memcheck, racecheck", "-", "NOT MEASURED")
		else row("compute-sanitizer memcheck, racecheck over the kernel tests", s, (sbad || (getline x < sanok) <= 0) ? "FAIL" : "PASS")
		printf "\n%d BELOW, %d FAIL, %d NOT MEASURED\n", below, failed, missing
	}'
}

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
	rm -f "$out"/{env.txt,calibrate.log,bench.log,latency.log,layered.log,start.log,examples.log,audit.log,tests.log,correctness.log,sanitizer.log,sanitizer.ok,targets.md}

	# step NAME SECONDS LOG CMD...: runs CMD with stdout and stderr to LOG,
	# killed after min(SECONDS, what is left of the budget), and records
	# its outcome in steps.txt.
	step() {
		local name=$1 limit=$2 log=$3
		shift 3
		limit=$((limit * ${LIMITSCALE:-1})) # the dryrun scales the limits: a shared CI machine is slower than a GPU host
		local left=$((budget - (SECONDS - t_start) - 5))
		if [ "$left" -lt 10 ]; then
			echo "$name: not run (budget of ${budget}s spent)" | tee -a "$out/steps.txt"
			incomplete=1
			return 124
		fi
		[ "$limit" -gt "$left" ] && limit=$left
		local t0=$SECONDS
		timeout -k 5 "$limit" "$@" >>"$log" 2>&1
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
		targets "$out" >"$out/targets.md"
		{
			echo "# gpu device check (issue 35)"
			echo
			echo "Steps (budget ${budget}s, $((SECONDS - t_start))s used so far):"
			echo
			sed 's/^/    /' "$out/steps.txt"
			echo
			[ -f "$out/env.txt" ] && { echo "## Driver and GPU"; echo; sed 's/^/    /' "$out/env.txt"; echo; }
			echo "## Targets"
			echo
			cat "$out/targets.md"
			echo
			if [ -f "$out/calibrate.log" ]; then
				echo "## Calibration (Device.Calibrate: Start until resolved, fastest of 3)"
				echo
				grep -E 'calibration in|KiB ×|kernel off|--- (PASS|FAIL|SKIP)' "$out/calibrate.log" | sed 's/^ *//; s/^/    /'
				echo
			fi
			for f in bench latency layered start; do
				[ -f "$out/$f.log" ] || continue
				echo "## $f rows (raw benchmark lines; metrics are value-unit pairs)"
				echo
				grep -E '^Benchmark|SKIP|FAIL|panic|failures during' "$out/$f.log" | sed 's/^/    /'
				echo
			done
			if [ -f "$out/examples.log" ]; then
				echo "## Examples on -gpu"
				echo
				grep -E '^== |^tier |marker mismatches|hit rate|offload|error|panic|on .*CUDA device' "$out/examples.log" | sed 's/^/    /'
				echo
			fi
			if [ -f "$out/audit.log" ]; then
				echo "## kvaudit -tiers -gpu"
				echo
				sed 's/^/    /' "$out/audit.log" | tail -20
				echo
			fi
			if [ -f "$out/tests.log" ]; then
				echo "## Tests"
				echo
				echo "$(grep -c -- '--- PASS' "$out/tests.log") passed, $(grep -c -- '--- FAIL' "$out/tests.log") failed, $(grep -c -- '--- SKIP' "$out/tests.log") skipped (tests.log). Driver tests, cuda subtests and failures:"
				echo
				grep -E -- '--- (PASS|FAIL|SKIP): [^ ]*(cuda|Driver)|--- FAIL|^panic|GLIBC|device [0-9]+:|JIT|first kernel|512 MiB|calibration in' "$out/tests.log" | head -80 | sed 's/^/    /'
				echo
			fi
			if [ -f "$out/correctness.log" ]; then
				echo "## Correctness loop (20 x pageable upload, then a scattered download)"
				echo
				grep -E -- '--- (PASS|FAIL|SKIP)|identical|differs|panic' "$out/correctness.log" | head -20 | sed 's/^/    /'
				echo
			fi
			if [ -f "$out/sanitizer.log" ]; then
				echo "## compute-sanitizer"
				echo
				grep -E '^== |ERROR SUMMARY|^SKIPPED|--- FAIL|Invalid|Race' "$out/sanitizer.log" | head -30 | sed 's/^/    /'
				echo
			fi
		} >"$report.tmp" && mv "$report.tmp" "$report"
	}

	# The rows only the cuda device kind measures (the CPU fallback's
	# rows are left out: they are not the targets).
	step env 10 "$out/env.txt" bash -c envinfo
	cat "$out/env.txt"
	write_report

	step calibrate 20 "$out/calibrate.log" "$bin" -test.v -test.count 1 -test.run '^TestDriverCalibrate$' -test.timeout $((18 * ${LIMITSCALE:-1}))s
	write_report

	step bandwidth 90 "$out/bench.log" "$bin" -test.run '^$' -test.bench '^BenchmarkCopyBandwidth/cuda/' \
		-test.benchtime "${BENCHTIME:-5x}" -gpu.benchbytes "${BENCHBYTES:-268435456}" -test.timeout $((88 * ${LIMITSCALE:-1}))s
	write_report

	step latency 20 "$out/latency.log" "$bin" -test.run '^$' -test.bench '^BenchmarkCopyLatency/cuda/' \
		-test.benchtime "${LATTIME:-200x}" -test.timeout $((18 * ${LIMITSCALE:-1}))s
	write_report

	step layered 25 "$out/layered.log" "$bin" -test.run '^$' -test.bench '^BenchmarkLayeredRoundTrip/cuda/' \
		-test.benchtime "${LAYTIME:-5x}" -test.timeout $((23 * ${LIMITSCALE:-1}))s
	write_report

	step start 15 "$out/start.log" "$bin" -test.run '^$' -test.bench '^BenchmarkStart/cuda/1024/' \
		-test.benchtime "${STARTTIME:-2000x}" -test.timeout $((13 * ${LIMITSCALE:-1}))s
	write_report

	for ex in "tiers -policy write-back" "tiers -policy write-through" "hybrid"; do
		set -- $ex
		name=$1
		shift
		echo "== $name -gpu${*:+ $*}" >>"$out/examples.log"
		extra=()
		[ "$name" = tiers ] && extra=(-requests "${TIERSREQ:-2000}")
		step "examples $name${*:+ $*}" 30 "$out/examples.log" "$dir/$name" -gpu "$@" ${extra[@]+"${extra[@]}"}
	done
	write_report

	step audit 30 "$out/audit.log" "$dir/kvaudit" -tiers -gpu -ops "${AUDITOPS:-3000}" -seed 35
	write_report

	step tests 60 "$out/tests.log" "$bin" -test.v -test.count 1 -test.timeout $((58 * ${LIMITSCALE:-1}))s -test.run "${TESTS:-.}" -test.skip '^TestUploadThenScatteredDownload$'
	write_report

	step correctness 20 "$out/correctness.log" "$bin" -test.v -test.count 1 -test.timeout $((18 * ${LIMITSCALE:-1}))s -test.run '^TestUploadThenScatteredDownload$'
	write_report

	if san=$(sanitizer); then
		for tool in memcheck racecheck; do
			echo "== $tool" >>"$out/sanitizer.log"
			step "sanitizer $tool" 40 "$out/sanitizer.log" "$san" --tool "$tool" --error-exitcode 9 \
				"$bin" -test.v -test.count 1 -test.timeout $((35 * ${LIMITSCALE:-1}))s -test.run '^(TestDriverKernelLoads|TestKernelCopies|TestRingWraps|TestKernelSingleCopy)$/^cuda$' &&
				echo "$tool" >>"$out/sanitizer.ok"
		done
		[ "$(wc -l <"$out/sanitizer.ok" 2>/dev/null || echo 0)" -ge 2 ] || rm -f "$out/sanitizer.ok"
	else
		echo "SKIPPED: no compute-sanitizer on this machine" >"$out/sanitizer.log"
	fi
	write_report

	cat "$report"
	echo
	echo "== targets"
	cat "$out/targets.md"
	grep -q -- '--- FAIL' "$out/tests.log" "$out/correctness.log" 2>/dev/null && exit 1
	grep -q '| FAIL |' "$out/targets.md" && exit 1
	[ "$incomplete" -ne 0 ] && exit 3 # a step timed out or was not run
	exit 0
}

# dryrun checks the script's logic against the fake driver: every target
# row must have a verdict (PASS or BELOW: the fake's numbers mean nothing),
# the examples and the audit must pass.
dryrun() {
	command -v "${CC:-gcc}" >/dev/null || { echo "devicecheck dryrun: needs a C compiler for the fake driver" >&2; exit 2; }
	[ "${SKIPBUILD:-0}" = 1 ] && [ -x "$bin" ] || build >/dev/null || exit 1
	"${CC:-gcc}" -shared -fPIC -O1 -pthread -o "$dir/libfakecuda.so" "$here/testdata/fakecuda.c" || exit 1
	local out="$dir/dryrun"
	rm -rf "$out"
	mkdir -p "$out"
	(
		export KVLEASE_LIBCUDA="$dir/libfakecuda.so" OUT="$out"
		export BENCHBYTES=${BENCHBYTES:-4194304} BENCHTIME=${BENCHTIME:-1x} LATTIME=${LATTIME:-20x} LAYTIME=${LAYTIME:-1x}
		export STARTTIME=${STARTTIME:-50x} AUDITOPS=${AUDITOPS:-300} TIERSREQ=${TIERSREQ:-200} BUDGET=${BUDGET:-240} LIMITSCALE=${LIMITSCALE:-3}
		export TESTS=${TESTS:-'^TestDriver(Info|KernelLoads|Calibrate)$'}
		run
	) >"$out/run.out" 2>&1
	local rc=$?
	echo "devicecheck dryrun: run exited $rc against the fake driver (report: $out/devicecheck.md)"
	sed -n '/^== targets/,$p' "$out/run.out"
	local bad=0
	rows=$(grep '^| ' "$out/targets.md" | grep -vc '^| target |\|^| --- |')
	[ "$rows" -ge 21 ] || { echo "dryrun: $rows target rows, want at least 21"; bad=1; }
	if grep -q '| NOT MEASURED |' "$out/targets.md"; then
		echo "dryrun: rows without a measurement:"
		grep '| NOT MEASURED |' "$out/targets.md"
		bad=1
	fi
	if grep -q '| FAIL |' "$out/targets.md"; then
		echo "dryrun: failed checks:"
		grep '| FAIL |' "$out/targets.md"
		bad=1
	fi
	[ "$rc" -eq 0 ] || { echo "dryrun: run exited $rc"; tail -40 "$out/run.out"; bad=1; }
	[ "$bad" -eq 0 ] && echo "devicecheck dryrun: OK"
	exit "$bad"
}

case "${1:-}" in
build) build ;;
run) run ;;
dryrun) dryrun ;;
*)
	echo "usage: $0 build|run|dryrun" >&2
	exit 2
	;;
esac

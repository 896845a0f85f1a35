#!/bin/sh
# rows.sh: the instruction count of every row of bench/README.md's table
# (issue 16's rows, then issue 32's), inclusive per op, with its floor, from callgrind.
#
#   sh bench/instr/rows.sh [TESTBIN]
#
# TESTBIN is the root package's test binary (built here with go test -c
# when absent). Each line is instr.py's output for one row.
cd "$(dirname "$0")/../.."
bin=${1:-}
if [ -z "$bin" ]; then
	bin=$(mktemp -d)/root.test
	go test -c -o "$bin" .
fi
i="python3 bench/instr/instr.py"
k=kvlease
# valgrind 3.19 cannot run rdtscp, which the runtime's lock spinning
# reaches now and then (SIGILL): a row is tried up to three times.
row() {
	echo "== $1"
	shift
	for try in 1 2 3; do
		if out=$($i "$@" 2>&1); then
			echo "$out"
			return
		fi
	done
	echo "failed three times: $out" | tail -3
}
row "Acquire(1)+Release" "$bin" 'LeaseCycle/blocks=1$' 20000 60000 \
	$k.BenchmarkLeaseCycle.func1.1 $k.compare.bareCycle.func1 $k.compare.slotCycle.func2
row "Acquire(16)+Release" "$bin" 'LeaseCycle/blocks=16$' 5000 25000 \
	$k.BenchmarkLeaseCycle.func1.1 $k.compare.slotCycle.func2
row "Acquire(256)+Release" "$bin" 'LeaseCycle/blocks=256$' 1000 3000 \
	$k.BenchmarkLeaseCycle.func1.1 $k.compare.slotCycle.func2
row "Acquire(16)+transfer, released, resolved" "$bin" 'LeaseCycleTransfer$' 5000 25000 \
	$k.BenchmarkLeaseCycleTransfer.func1 $k.compare.slotCycle.func2
row "EvictionChurn (a cycle of 8 blocks; func2 the unsealed cycle)" "$bin" 'EvictionChurn$' 5000 25000 \
	$k.BenchmarkEvictionChurn.func1 $k.BenchmarkEvictionChurn.func2
row "AcquirePrefix/plain/hits=32 (func1.1: plain Acquire(32))" "$bin" 'AcquirePrefix/plain/hits=32$' 5000 25000 \
	$k.BenchmarkAcquirePrefix.func1.2 $k.BenchmarkAcquirePrefix.func1.1
row "ChainHashes (1024 tokens; func2 chained xxhash64)" "$bin" 'ChainHashes$' 2000 6000 \
	$k.BenchmarkChainHashes.func3 $k.BenchmarkChainHashes.func2
row "ProductionReplay/alone (a request of 2338 block ops)" "$bin" 'ProductionReplay/alone$' 20 60 \
	$k.BenchmarkProductionReplay.func1
# Issue 32: a tenant's cycles under quotas (func1, func1.2) next to the
# same cycles in a pool without tenants (func2, func1.3), same run.
row "QuotaCycle: Acquire(16)+Release as a capped tenant (func2: no tenants)" "$bin" 'QuotaCycle$' 10000 50000 \
	$k.BenchmarkQuotaCycle.func1 $k.BenchmarkQuotaCycle.func2
row "QuotaChurn/at-cap: EvictionChurn's cycle at the tenant's cap (func1.3: no tenants)" "$bin" 'QuotaChurn/at-cap$' 5000 25000 \
	$k.BenchmarkQuotaChurn.func1.2 $k.BenchmarkQuotaChurn.func1.3
row "QuotaChurn/reserve: the same, evicting past another's reservation (func1.3: no tenants)" "$bin" 'QuotaChurn/reserve$' 5000 25000 \
	$k.BenchmarkQuotaChurn.func1.2 $k.BenchmarkQuotaChurn.func1.3

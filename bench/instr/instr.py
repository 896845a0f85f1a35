#!/usr/bin/env python3
"""instr.py: instructions per op of a benchmark's closures, from callgrind.

    python3 bench/instr/instr.py [-cache] [-own SRCDIR] TESTBIN BENCH N1 N2 FUNC...

Runs the test binary TESTBIN (built with `go test -c`) under
valgrind --tool=callgrind twice, with -test.bench BENCH and
-test.benchtime N1x, then N2x, and prints for each FUNC its inclusive
instruction count per op, marginal between the two runs:
(Ir(N2) - Ir(N1)) / (N2 - N1), so that set-up and the b.N=1 probe cancel.

FUNC is matched against the end of callgrind's function names
("kvlease.BenchmarkLeaseCycle.func1.1" matches
"github.com/kvlease/kvlease.BenchmarkLeaseCycle.func1.1"). A function's
inclusive count is the sum of the costs recorded on every call to it
(callgrind's "calls=" records), so everything it calls counts: the
runtime's locks, allocation, memmove, map operations. Summing call records
rather than reading callgrind_annotate's table keeps inlined code in,
whatever file it came from.

With -own SRCDIR it also prints the self count, per op, of the code
compiled from the non-test Go files directly in SRCDIR (a comma-separated
list of directories: -own .,internal/slots counts the core and its slot
table) (inlined code
included wherever it landed; the runtime's code, even inlined, excluded):
the measure the earlier tables in bench/README.md used ("kvlease's own
functions"). It counts every benchmark's share of that code, baselines
included, so it suits benchmarks whose baselines are test code.

With -cache, callgrind also simulates the caches (--cache-sim=yes) with a
fixed geometry, so that counts do not depend on the host either: 48 KiB
12-way first-level data, 32 KiB instruction, and a 16 MiB 16-way last
level (an engine's share of a server's L3), 64-byte lines. Every event is printed per op: Ir, data reads and
writes (Dr, Dw), and misses in the first level (I1mr, D1mr, D1mw) and the
last level (ILmr, DLmr, DLmw): a last-level miss is a trip to DRAM.

The garbage collector is off (GOGC=off), and so is asynchronous preemption
(callgrind cannot follow its signals); GOMAXPROCS is 1. Unlike wall time,
these counts do not depend on the machine's load. They are not cycles: a
cache miss costs one instruction here and a hundred cycles on the machine.
"""
import os
import re
import subprocess
import sys
import tempfile


def inclusive(path):
    """Sums of call costs (one list per event) per callee name in a
    callgrind output file, and the event names."""
    names = {}  # compressed id -> name, for cfn
    incl = {}
    events = ["Ir"]
    cfn = None
    pending = False
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if pending:
                pending = False
                parts = line.split()
                if len(parts) >= 2 and cfn is not None:
                    costs = [int(x) for x in parts[1:]]
                    acc = incl.setdefault(cfn, [0] * len(events))
                    for i, x in enumerate(costs):
                        acc[i] += x
                continue
            if line.startswith("events:"):
                events = line.split()[1:]
            if line.startswith("cfn="):
                m = re.match(r"cfn=\((\d+)\)(?: (.*))?$", line)
                if m:
                    if m.group(2) is not None:
                        names[m.group(1)] = m.group(2)
                    cfn = names.get(m.group(1))
                else:
                    cfn = line[4:]
            elif line.startswith("fn="):
                m = re.match(r"fn=\((\d+)\)(?: (.*))?$", line)
                if m and m.group(2) is not None:
                    names[m.group(1)] = m.group(2)
            elif line.startswith("calls="):
                pending = True
    return incl, events


def own(path, srcdir):
    """Self cost (first event) of the code compiled from the non-test Go
    files directly in srcdir, inlined code included wherever it landed:
    the earlier sessions' "kvlease's own functions, runtime excluded"."""
    files = {}  # compressed id -> file name (fl, fi, fe share one table)
    cur = fl = None
    pending = False
    tot = 0
    dirs = {os.path.abspath(d) for d in srcdir.split(",")}

    def mine(f):
        return (f is not None and os.path.dirname(f) in dirs
                and f.endswith(".go") and not f.endswith("_test.go"))

    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if pending:  # the cost line of a call: inclusive, not self
                pending = False
                continue
            m = re.match(r"(fl|fi|fe)=\((\d+)\)(?: (.*))?$", line)
            if m:
                if m.group(3) is not None:
                    files[m.group(2)] = m.group(3)
                cur = files.get(m.group(2))
                if m.group(1) == "fl":
                    fl = cur
                continue
            if line.startswith("fn="):
                cur = fl  # a function starts in its own file
                continue
            m = re.match(r"cf[il]=\((\d+)\) (.*)$", line)
            if m:  # a call's file: named here if first seen here
                files[m.group(1)] = m.group(2)
                continue
            if line.startswith(("cfn=", "cfi=", "cfl=", "cob=", "ob=")):
                continue
            if line.startswith("calls="):
                pending = True
                continue
            if line and (line[0].isdigit() or line[0] in "+-*") and mine(cur):
                parts = line.split()
                if len(parts) >= 2:
                    tot += int(parts[1])
    return tot


def run(binary, bench, n, out, cache):
    env = dict(os.environ, GODEBUG="asyncpreemptoff=1,cpu.rdtscp=off", GOGC="off", GOMAXPROCS="1")
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=" + out]
    if cache:
        cmd += ["--cache-sim=yes", "--D1=49152,12,64", "--I1=32768,8,64", "--LL=16777216,16,64"]
    cmd += [binary,
           "-test.run", "^$", "-test.bench", bench, "-test.benchtime", "%dx" % n, "-test.count", "1"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(r.stdout + r.stderr)
    return inclusive(out)


def main():
    args = sys.argv[1:]
    cache = bool(args) and args[0] == "-cache"
    if cache:
        args = args[1:]
    srcdir = None
    if len(args) > 1 and args[0] == "-own":
        srcdir, args = args[1], args[2:]
    if len(args) < 5:
        sys.exit(__doc__)
    binary, bench, n1, n2 = args[0], args[1], int(args[2]), int(args[3])
    with tempfile.TemporaryDirectory() as d:
        a, events = run(binary, bench, n1, os.path.join(d, "cg.1"), cache)
        b, _ = run(binary, bench, n2, os.path.join(d, "cg.2"), cache)
        if srcdir is not None:
            oa = own(os.path.join(d, "cg.1"), srcdir)
            ob = own(os.path.join(d, "cg.2"), srcdir)
            print("%10.1f  own code of %s (self, runtime excluded)" % ((ob - oa) / (n2 - n1), srcdir))
    if cache:
        print("  ".join("%10s" % e for e in events))
    for f in args[4:]:
        def pick(incl):
            # Only f's own name: f'2 is callgrind's name for a recursive
            # activation, whose calls are inside the outer one's cost.
            tot = [0] * len(events)
            hits = [k for k in incl if k.split("/")[-1] == f]
            for k in hits:
                for i, x in enumerate(incl[k]):
                    tot[i] += x
            return tot, hits
        ca, _ = pick(a)
        cb, hb = pick(b)
        if not hb:
            print("%s: not found" % f, file=sys.stderr)
            continue
        per = [(y - x) / (n2 - n1) for x, y in zip(ca, cb)]
        if cache:
            print("  ".join("%10.1f" % x for x in per) + "  " + f)
        else:
            print("%10.1f  %s" % (per[0], f))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""instr.py: instructions per op of a benchmark's closures, from callgrind.

    python3 bench/instr/instr.py TESTBIN BENCH N1 N2 FUNC...

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
    """Sum of call costs per callee name in a callgrind output file."""
    names = {}  # compressed id -> name, for cfn
    incl = {}
    cfn = None
    pending = False
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if pending:
                pending = False
                parts = line.split()
                if len(parts) >= 2 and cfn is not None:
                    incl[cfn] = incl.get(cfn, 0) + int(parts[-1])
                continue
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
    return incl


def run(binary, bench, n, out):
    env = dict(os.environ, GODEBUG="asyncpreemptoff=1", GOGC="off", GOMAXPROCS="1")
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=" + out, binary,
           "-test.run", "^$", "-test.bench", bench, "-test.benchtime", "%dx" % n, "-test.count", "1"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(r.stdout + r.stderr)
    return inclusive(out)


def main():
    if len(sys.argv) < 6:
        sys.exit(__doc__)
    binary, bench, n1, n2 = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    with tempfile.TemporaryDirectory() as d:
        a = run(binary, bench, n1, os.path.join(d, "cg.1"))
        b = run(binary, bench, n2, os.path.join(d, "cg.2"))
    for f in sys.argv[5:]:
        def pick(incl):
            # name'2 is callgrind's name for a recursive activation: its
            # calls are already inside the outer one's cost.
            hits = [k for k in incl if k.split("/")[-1] == f]
            return sum(incl[k] for k in hits), hits
        ca, ha = pick(a)
        cb, hb = pick(b)
        if not hb:
            print("%s: not found" % f, file=sys.stderr)
            continue
        print("%10.1f  %s" % ((cb - ca) / (n2 - n1), f))


if __name__ == "__main__":
    main()

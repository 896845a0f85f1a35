// Command kvaudit runs kvlease's isolation audit: a seeded synthetic
// workload over several pools, handing requests off between them through
// a faulty in-process transport, checking markers, late writes and block
// accounting as it goes. It prints a progress line every second and a
// report at the end, and exits with status 1 if it found any violation
// (2 for bad flags).
//
//	go run ./audit/cmd/kvaudit -ops 1000000 -seed 7
//	go run ./audit/cmd/kvaudit -duration 30s -workers 8 -blocks 1024
//	go run ./audit/cmd/kvaudit -seed 7 -replay trace.txt
//
// With -tiers it runs the tiers audit instead (audit.RunTiers): -ops
// requests onboard their prefixes across a device, a host and a disk tier
// while copies fail, stall and are quarantined and disk slots fail or are
// corrupted; every onboarded block's marker is checked.
//
//	go run ./audit/cmd/kvaudit -tiers -ops 3000 -seed 7
//
// With -tiers -gpu it runs the tiers audit's device mode on CUDA device 0
// (gpu.Open): device and pinned memory, real copies through the copy
// kernel and the copy engine alternately, with cancels and aborts
// mid-copy; the last line is the verdict, OK or FAIL.
//
//	go run ./audit/cmd/kvaudit -tiers -gpu -ops 3000
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/audit"
	"github.com/kvlease/kvlease/gpu"
	"github.com/kvlease/kvlease/tiers"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	cfg := audit.DefaultConfig()
	fs := flag.NewFlagSet("kvaudit", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the run")
	fs.IntVar(&cfg.Ops, "ops", cfg.Ops, "lifecycle operations to run (0: until -duration)")
	fs.DurationVar(&cfg.Duration, "duration", 0, "wall time to run for (with -ops 0), or a bound on it")
	fs.IntVar(&cfg.Workers, "workers", cfg.Workers, "pools, one per worker")
	fs.IntVar(&cfg.Blocks, "blocks", cfg.Blocks, "blocks per pool")
	pools := fs.String("pool-blocks", "", "comma-separated blocks of each pool (overrides -blocks and -workers)")
	fs.IntVar(&cfg.BlockBytes, "block-bytes", cfg.BlockBytes, "bytes per block")
	fs.IntVar(&cfg.BlockTokens, "block-tokens", cfg.BlockTokens, "tokens per block")
	fs.IntVar(&cfg.MaxContextTokens, "max-context", cfg.MaxContextTokens, "envelope: context limit in tokens")
	fs.IntVar(&cfg.MaxPrefillTokens, "max-prefill", cfg.MaxPrefillTokens, "envelope: prefill budget in tokens")
	fs.IntVar(&cfg.MaxRunningRequests, "max-running", cfg.MaxRunningRequests, "envelope: requests a worker runs before refusing handoffs")
	fs.IntVar(&cfg.MaxLive, "live", cfg.MaxLive, "requests in flight at once")
	fs.IntVar(&cfg.MaxPrompt, "max-prompt", cfg.MaxPrompt, "longest prompt in tokens")
	fs.IntVar(&cfg.MaxNew, "max-new", cfg.MaxNew, "most tokens a request generates")
	fs.IntVar(&cfg.Docs, "docs", cfg.Docs, "shared documents (prefixes)")
	verified := fs.Bool("verified", false, "pools in verified prefix mode")
	f := &cfg.Faults
	fs.Float64Var(&f.Fail, "fail", f.Fail, "probability that a transfer fails")
	fs.Float64Var(&f.LostAck, "lost-ack", f.LostAck, "probability that a transfer loses its acknowledgement")
	fs.Float64Var(&f.IgnoreCancel, "ignore-cancel", f.IgnoreCancel, "probability that a transfer ignores a cancel")
	fs.Float64Var(&f.Abort, "abort", f.Abort, "probability that a client goes away mid-transfer")
	fs.Float64Var(&f.EarlyAbort, "early-abort", f.EarlyAbort, "probability that a client goes away after acceptance")
	fs.Float64Var(&f.Deadline, "deadline", f.Deadline, "probability that a transfer passes its deadline mid-copy")
	fs.Float64Var(&f.LateAck, "late-ack", f.LateAck, "share of lost acknowledgements delivered late at the drain")
	fs.Float64Var(&f.PolicyReject, "reject", f.PolicyReject, "probability that a destination refuses a handoff by policy")
	fs.Float64Var(&f.Revoke, "revoke", f.Revoke, "probability that a destination revokes an acceptance")
	fs.Float64Var(&f.OverContext, "over-context", f.OverContext, "probability that a request exceeds the context limit")
	fs.Float64Var(&f.Wait, "wait", f.Wait, "probability that a request waits for blocks")
	fs.Float64Var(&f.Timeout, "timeout", f.Timeout, "probability, per chance, that a waiting request times out")
	fs.BoolVar(&cfg.Concurrent, "concurrent", false, "copies run on their own, racing aborts and deadlines (not replayable)")
	fs.DurationVar(&cfg.Latency, "latency", cfg.Latency, "with -concurrent: most time one block takes to copy")
	fs.IntVar(&cfg.CheckEvery, "check-every", cfg.CheckEvery, "operations between full checks")
	fs.IntVar(&cfg.StopAfter, "stop-after", cfg.StopAfter, "stop after this many violations (0: never)")
	fs.BoolVar(&cfg.Minimise, "minimise", cfg.Minimise, "minimise the trace of the first violation")
	replay := fs.String("replay", "", "replay the trace in this file (as the report prints it) instead of drawing operations")
	traceOut := fs.String("trace-out", "", "write the trace of the first violation to this file, for -replay")
	quiet := fs.Bool("quiet", false, "no progress lines")
	tiersMode := fs.Bool("tiers", false, "run the tiers audit (device, host and disk tiers; -ops requests, -seed)")
	writeThrough := fs.Bool("write-through", false, "with -tiers: the write-through policy (default write-back)")
	onGPU := fs.Bool("gpu", false, "with -tiers: the device mode, on CUDA device 0 (gpu.Open)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvaudit: unexpected arguments %q\n", fs.Args())
		return 2
	}
	if *onGPU && !*tiersMode {
		fmt.Fprintln(stderr, "kvaudit: -gpu needs -tiers")
		return 2
	}
	if *tiersMode {
		return runTiers(fs, cfg.Seed, cfg.Ops, *writeThrough, *onGPU, stdout, stderr)
	}
	if *pools != "" {
		cfg.PoolBlocks = nil
		for _, s := range strings.Split(*pools, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(s))
			if err != nil {
				fmt.Fprintf(stderr, "kvaudit: -pool-blocks: %v\n", err)
				return 2
			}
			cfg.PoolBlocks = append(cfg.PoolBlocks, n)
		}
		cfg.Workers = len(cfg.PoolBlocks)
	}
	if cfg.Duration > 0 && !isSet(fs, "ops") {
		cfg.Ops = 0
	}
	if *verified {
		bt := cfg.BlockTokens
		cfg.PoolOptions = func(int) []kvlease.Option { return []kvlease.Option{kvlease.WithVerifiedPrefix(bt)} }
	}
	if !*quiet {
		cfg.Progress = func(p audit.Progress) {
			fmt.Fprintf(stderr, "kvaudit: %5.1fs  %d ops (%d lifecycle, %.0f/s)  %d live  %d violations\n",
				p.Elapsed.Seconds(), p.Ops, p.Lifecycle, float64(p.Lifecycle)/p.Elapsed.Seconds(), p.Live, p.Violations)
		}
	}

	var rep *audit.Report
	var err error
	if *replay != "" {
		var data []byte
		if data, err = os.ReadFile(*replay); err == nil {
			var ops []audit.Op
			if ops, err = audit.ParseTrace(string(data)); err == nil {
				rep, err = audit.Replay(cfg, ops)
			}
		}
	} else {
		rep, err = audit.Run(cfg)
	}
	if err != nil {
		fmt.Fprintf(stderr, "kvaudit: %v\n", err)
		return 2
	}
	if err := rep.Write(stdout); err != nil {
		fmt.Fprintf(stderr, "kvaudit: %v\n", err)
		return 2
	}
	if *traceOut != "" && rep.Trace != nil {
		if err := os.WriteFile(*traceOut, []byte(audit.FormatTrace(rep.Trace)), 0o644); err != nil {
			fmt.Fprintf(stderr, "kvaudit: %v\n", err)
			return 2
		}
	}
	if !rep.OK() {
		return 1
	}
	return 0
}

// runTiers runs the tiers audit with the default tiers configuration,
// the seed and -ops requests, on CUDA device 0 with onGPU.
func runTiers(fs *flag.FlagSet, seed uint64, ops int, writeThrough, onGPU bool, stdout, stderr io.Writer) int {
	tc := audit.DefaultTiersConfig()
	tc.Seed = seed
	if isSet(fs, "ops") {
		tc.Requests = ops
	}
	if writeThrough {
		tc.Policy = tiers.WriteThrough
	}
	if onGPU {
		d, err := gpu.Open(0)
		if err != nil {
			fmt.Fprintf(stderr, "kvaudit: -gpu: %v\n", err)
			return 2
		}
		// A device left failed (a sticky error) cannot close; the process
		// ends anyway.
		defer d.Close()
		tc.GPU = d
	}
	rep, err := audit.RunTiers(tc)
	if err != nil {
		fmt.Fprintf(stderr, "kvaudit: %v\n", err)
		return 2
	}
	if err := rep.Write(stdout); err != nil {
		fmt.Fprintf(stderr, "kvaudit: %v\n", err)
		return 2
	}
	if !rep.OK() {
		return 1
	}
	return 0
}

func isSet(fs *flag.FlagSet, name string) bool {
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

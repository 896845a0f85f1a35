// Command replay replays a request trace through a kvlease pool as a
// serving engine would, and through the baselines (no prefix cache) on
// the same trace, and prints what each did and how fast.
//
// Usage:
//
//	go run ./bench/cmd/replay [flags]
//
// With -trace FILE it replays a JSON-lines trace (see package
// bench/trace); otherwise it generates one from the generator flags
// (-requests, -seed, ...), which -write-trace saves. -decode-blocks N
// turns on disaggregated handoffs to a second pool of N blocks. Each
// allocator is replayed -runs times, interleaved with the others, and the
// run with the median wall time is printed.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"runtime/pprof"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/bench/replay"
	"github.com/kvlease/kvlease/bench/trace"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "replay:", err)
		os.Exit(1)
	}
}

func run() error {
	g := trace.DefaultGenConfig()
	g.Requests = 5000
	var (
		tracePath  = flag.String("trace", "", "replay this JSON-lines trace instead of generating one")
		mooncake   = flag.String("mooncake", "", "replay this Mooncake trace (JSON lines: timestamp ms, input_length, output_length, hash_ids of 512-token blocks)")
		genMoon    = flag.Int("gen-mooncake", 0, "generate a production-shaped Mooncake trace of this many requests (~12,000-token prompts, half shared) instead")
		writeMoon  = flag.String("write-mooncake", "", "write the generated Mooncake trace to this file")
		msPerStep  = flag.Float64("ms-per-step", 20, "Mooncake traces: milliseconds of trace time per engine step")
		writePath  = flag.String("write-trace", "", "write the trace replayed to this file")
		allocs     = flag.String("alloc", strings.Join(replay.Kinds, ","), "allocators to replay, comma separated")
		runs       = flag.Int("runs", 3, "replays per allocator; the median by wall time is reported")
		jsonOut    = flag.Bool("json", false, "print one JSON result per allocator instead of a table")
		blocks     = flag.Int("blocks", 4096, "blocks in the pool (the prefill pool with -decode-blocks)")
		decode     = flag.Int("decode-blocks", 0, "blocks in a decode pool: > 0 hands every request off after prefill")
		blockTok   = flag.Int("block-tokens", 16, "tokens per block")
		blockBytes = flag.Int("block-bytes", 64, "bytes per block of host memory (handoffs copy them)")
		maxRun     = flag.Int("max-running", 128, "most requests decoding at once")
		seed       = flag.Uint64("hash-seed", 0x6b766c65617365, "namespace seed of the chain hashes")
		timeCalls  = flag.Bool("time-calls", false, "time every allocator call (adds two clock reads per call)")
		cpuProf    = flag.String("cpuprofile", "", "write a CPU profile of the replays to this file")
	)
	flag.Uint64Var(&g.Seed, "seed", g.Seed, "generator: seed")
	flag.IntVar(&g.Requests, "requests", g.Requests, "generator: requests (turns included)")
	flag.IntVar(&g.SystemPrompts, "system-prompts", g.SystemPrompts, "generator: distinct shared system prompts")
	flag.IntVar(&g.SystemLen, "system-len", g.SystemLen, "generator: system prompt tokens")
	flag.Float64Var(&g.SharedFrac, "shared-frac", g.SharedFrac, "generator: fraction of requests starting with a system prompt")
	flag.Float64Var(&g.ConvFrac, "conv-frac", g.ConvFrac, "generator: fraction of sessions that are multi-turn")
	flag.IntVar(&g.Turns, "turns", g.Turns, "generator: most turns per conversation")
	flag.IntVar(&g.UserLen, "user-len", g.UserLen, "generator: mean user message tokens")
	flag.IntVar(&g.MaxNew, "max-new", g.MaxNew, "generator: mean max new tokens")
	flag.Float64Var(&g.LongFrac, "long-frac", g.LongFrac, "generator: fraction of long-context outliers")
	flag.IntVar(&g.LongLen, "long-len", g.LongLen, "generator: mean long-context prompt tokens")
	flag.Float64Var(&g.AbortFrac, "abort-frac", g.AbortFrac, "generator: fraction of requests aborted mid-decode")
	flag.Float64Var(&g.ArrivalsPerStep, "rate", g.ArrivalsPerStep, "generator: session arrivals per engine step")
	flag.Parse()

	var tr *trace.Trace
	source := ""
	if *mooncake != "" || *genMoon > 0 {
		var reqs []trace.MooncakeRequest
		if *mooncake != "" {
			f, err := os.Open(*mooncake)
			if err != nil {
				return err
			}
			reqs, err = trace.ReadMooncake(f)
			f.Close()
			if err != nil {
				return err
			}
			source = "mooncake " + *mooncake
		} else {
			mc := trace.ProductionMooncake()
			mc.Requests = *genMoon
			reqs = trace.GenerateMooncake(mc)
			source = fmt.Sprintf("generated Mooncake, production shape, seed %d", mc.Seed)
		}
		if *writeMoon != "" {
			f, err := os.Create(*writeMoon)
			if err != nil {
				return err
			}
			if err := trace.WriteMooncake(f, reqs); err != nil {
				f.Close()
				return err
			}
			if err := f.Close(); err != nil {
				return err
			}
		}
		tr = trace.FromMooncake(reqs, *msPerStep)
	} else if *tracePath != "" {
		f, err := os.Open(*tracePath)
		if err != nil {
			return err
		}
		tr, err = trace.Read(f)
		f.Close()
		if err != nil {
			return err
		}
		source = *tracePath
	} else {
		tr = trace.Generate(g)
		source = fmt.Sprintf("generated, seed %d", g.Seed)
	}
	if *writePath != "" {
		f, err := os.Create(*writePath)
		if err != nil {
			return err
		}
		if err := trace.Write(f, tr); err != nil {
			f.Close()
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
	}
	cfg := replay.Config{BlockTokens: *blockTok, Blocks: *blocks, DecodeBlocks: *decode, BlockBytes: *blockBytes,
		MaxRunning: *maxRun, Seed: kvlease.BlockHash(*seed), TimeCalls: *timeCalls}

	if *cpuProf != "" {
		f, err := os.Create(*cpuProf)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	// Runs are interleaved (every allocator once, then again) so that a
	// burst of noise on a shared machine hits all of them alike.
	kinds := strings.Split(*allocs, ",")
	all := make([][]*replay.Result, len(kinds))
	for range max(*runs, 1) {
		for i, kind := range kinds {
			res, err := replayOnce(tr, cfg, strings.TrimSpace(kind))
			if err != nil {
				return err
			}
			all[i] = append(all[i], res)
		}
	}
	var results []*replay.Result
	for _, rs := range all {
		sort.Slice(rs, func(i, j int) bool { return rs[i].Wall < rs[j].Wall })
		results = append(results, rs[len(rs)/2])
	}

	if *jsonOut {
		enc := json.NewEncoder(os.Stdout)
		for _, r := range results {
			if err := enc.Encode(r); err != nil {
				return err
			}
		}
		return nil
	}
	printTable(tr, source, cfg, *runs, results)
	return nil
}

// replayOnce replays tr through fresh pools of the given kind.
func replayOnce(tr *trace.Trace, cfg replay.Config, kind string) (*replay.Result, error) {
	var pools []replay.Allocator
	for _, n := range []int{cfg.Blocks, cfg.DecodeBlocks} {
		if n <= 0 {
			continue
		}
		a, err := replay.New(kind, n, cfg.BlockBytes)
		if err != nil {
			return nil, err
		}
		pools = append(pools, a)
	}
	return replay.Run(tr, cfg, pools...)
}

func printTable(tr *trace.Trace, source string, cfg replay.Config, runs int, results []*replay.Result) {
	var promptTok int64
	for _, r := range tr.Requests {
		promptTok += int64(r.Prompt.Len())
	}
	mode := fmt.Sprintf("one pool of %d blocks", cfg.Blocks)
	if cfg.DecodeBlocks > 0 {
		mode = fmt.Sprintf("prefill pool of %d blocks, handoff to a decode pool of %d", cfg.Blocks, cfg.DecodeBlocks)
	}
	fmt.Printf("trace: %d requests (%s), %d prompt tokens\n", len(tr.Requests), source, promptTok)
	fmt.Printf("engine: %s, %d tokens per block, at most %d running; median of %d runs\n\n",
		mode, cfg.BlockTokens, cfg.MaxRunning, max(runs, 1))

	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "alloc\tblock ops\tops/s\tops/cpu-s\tns/op\thit rate\tacq p50\tacq p99\tpreempt\tfinished\taborted\trejected\twall\t")
	for _, r := range results {
		fmt.Fprintf(w, "%s\t%d\t%.3g\t%.3g\t%.1f\t%.1f%%\t%v\t%v\t%d\t%d\t%d\t%d\t%v\t\n",
			r.Allocator, r.BlockOps(), r.OpsPerSec(), r.OpsPerCPUSec(), r.NsPerOp(), 100*r.HitRate(),
			r.AcquireP50, r.AcquireP99, r.Preemptions, r.Finished, r.Aborted, r.Rejected, r.Wall.Round(time.Millisecond))
	}
	w.Flush()

	fmt.Println()
	w = tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "alloc\tpool\tpeak free\tcached\tleased\tdraining\tquarantined\tacquires\texhausted\tseals\thandoffs\tcopied\tsteps\ttokens\t")
	for _, r := range results {
		for _, p := range r.Pools {
			pk := p.Peak
			fmt.Fprintf(w, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t\n",
				r.Allocator, p.Role, pk.Free, pk.Cached, pk.Leased, pk.Draining, pk.Quarantined,
				p.Acquires, r.Exhausted, r.Seals, r.Handoffs, r.CopiedBlocks, r.Steps, r.Tokens)
		}
	}
	w.Flush()

	fmt.Println()
	for _, r := range results {
		fmt.Printf("%s: %d pool block ops (%d out, %d in, %d seals, %d evictions), hit rate %.1f%%",
			r.Allocator, r.PoolOps(), r.BlocksOut, r.BlocksIn, r.Seals, r.Evictions(), 100*r.HitRate())
		if cfg.TimeCalls {
			fmt.Printf(", pool time %v, %.1f ns per pool block op (clock reads included)",
				r.CallTime.Round(time.Microsecond), float64(r.CallTime.Nanoseconds())/float64(r.PoolOps()))
		}
		fmt.Println()
	}
	if len(results) > 1 && results[0].Allocator == "kvlease" {
		fmt.Println()
		k := results[0]
		for _, r := range results[1:] {
			fmt.Printf("kvlease vs %s: %.2fx the wall time, %.2fx the block ops, %.2fx the ns per block op\n",
				r.Allocator, k.Wall.Seconds()/r.Wall.Seconds(), float64(k.BlockOps())/float64(r.BlockOps()), k.NsPerOp()/r.NsPerOp())
		}
	}
}

package replay

import (
	"errors"
	"testing"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/bench/trace"
)

func smallTrace(seed uint64, n int) *trace.Trace {
	cfg := trace.DefaultGenConfig()
	cfg.Seed = seed
	cfg.Requests = n
	cfg.SystemLen = 128
	cfg.UserLen = 40
	cfg.MaxNew = 40
	cfg.LongLen = 600
	cfg.LongFrac = 0.05
	cfg.AbortFrac = 0.1
	cfg.ArrivalsPerStep = 2
	cfg.ThinkSteps = 5
	return trace.Generate(cfg)
}

func run(t *testing.T, tr *trace.Trace, kind string, cfg Config) *Result {
	t.Helper()
	a, err := New(kind, cfg.Blocks, 64)
	if err != nil {
		t.Fatal(err)
	}
	pools := []Allocator{a}
	if cfg.DecodeBlocks > 0 {
		d, err := New(kind, cfg.DecodeBlocks, 64)
		if err != nil {
			t.Fatal(err)
		}
		pools = append(pools, d)
	}
	res, err := Run(tr, cfg, pools...)
	if err != nil {
		t.Fatalf("%s: %v", kind, err)
	}
	return res
}

// checkLedger checks what holds for every allocator after a replay: every
// request accounted for, every block back, the counts consistent.
func checkLedger(t *testing.T, res *Result) {
	t.Helper()
	if got := res.Finished + res.Aborted + res.Rejected; got != res.Requests {
		t.Errorf("%s: finished %d + aborted %d + rejected %d = %d, want %d requests",
			res.Allocator, res.Finished, res.Aborted, res.Rejected, got, res.Requests)
	}
	if res.BlocksOut != res.BlocksIn || res.BlocksOut == 0 {
		t.Errorf("%s: %d blocks out, %d back", res.Allocator, res.BlocksOut, res.BlocksIn)
	}
	for _, p := range res.Pools {
		f := p.Final
		if f.Leased != 0 || f.Draining != 0 || f.Quarantined != 0 || f.OpenLeases != 0 ||
			f.Free+f.Cached != f.Capacity {
			t.Errorf("%s %s: blocks not all back: %+v", res.Allocator, p.Role, f)
		}
		if int64(f.Acquires) != p.Acquires {
			t.Errorf("%s %s: pool counted %d acquires, engine %d", res.Allocator, p.Role, f.Acquires, p.Acquires)
		}
		if p.Peak.Leased == 0 || p.Peak.Leased > f.Capacity {
			t.Errorf("%s %s: peak leased %d of %d", res.Allocator, p.Role, p.Peak.Leased, f.Capacity)
		}
	}
}

func TestReplayKVLease(t *testing.T) {
	tr := smallTrace(1, 300)
	cfg := Config{Blocks: 384, MaxRunning: 32, Seed: 7}
	res := run(t, tr, "kvlease", cfg)
	checkLedger(t, res)
	p := res.Pools[0]
	if p.Hits == 0 || res.HitRate() <= 0 {
		t.Errorf("no prefix hits on a shared-prefix trace: %+v", p)
	}
	if int64(p.Final.PrefixHits) != p.Hits {
		t.Errorf("pool counted %d hits, engine %d", p.Final.PrefixHits, p.Hits)
	}
	if res.Preemptions == 0 || res.Aborted == 0 || res.Seals == 0 {
		t.Errorf("the trace should preempt, abort and seal: %+v", res)
	}
	if p.Peak.Cached == 0 || p.Final.Cached == 0 {
		t.Errorf("nothing cached: peak %d final %d", p.Peak.Cached, p.Final.Cached)
	}
	// Deterministic: the same trace and config give the same schedule.
	again := run(t, tr, "kvlease", cfg)
	if again.Tokens != res.Tokens || again.BlocksOut != res.BlocksOut || again.Preemptions != res.Preemptions ||
		again.Pools[0].Hits != p.Hits || again.Steps != res.Steps {
		t.Errorf("two replays differ:\n%+v\n%+v", res, again)
	}
}

func TestReplayBaselines(t *testing.T) {
	tr := smallTrace(2, 200)
	cfg := Config{Blocks: 384, MaxRunning: 32}
	var ref *Result
	for _, kind := range Kinds {
		res := run(t, tr, kind, cfg)
		checkLedger(t, res)
		if kind == "kvlease" {
			ref = res
			continue
		}
		if res.Pools[0].Hits != 0 {
			t.Errorf("%s: baseline hit %d blocks", kind, res.Pools[0].Hits)
		}
		if res.Finished+res.Aborted != ref.Finished+ref.Aborted {
			t.Errorf("%s served %d requests, kvlease %d", kind, res.Finished+res.Aborted, ref.Finished+ref.Aborted)
		}
	}
}

func TestReplayHandoff(t *testing.T) {
	tr := smallTrace(3, 200)
	cfg := Config{Blocks: 256, DecodeBlocks: 384, MaxRunning: 32, Seed: 7}
	for _, kind := range []string{"kvlease", "bare"} {
		res := run(t, tr, kind, cfg)
		checkLedger(t, res)
		if res.Handoffs == 0 || res.CopiedBlocks == 0 {
			t.Errorf("%s: %d handoffs copying %d blocks", kind, res.Handoffs, res.CopiedBlocks)
		}
		if kind == "kvlease" && (res.Pools[1].Hits == 0 || res.Pools[0].Hits == 0) {
			t.Errorf("kvlease: prefix hits prefill %d decode %d", res.Pools[0].Hits, res.Pools[1].Hits)
		}
	}
}

// A hand-written trace with explicit tokens: three requests with the same
// 40-token prompt; the second and third hit the first's two full blocks,
// the third aborts at step 0 and gives its blocks straight back, and a
// fourth that could never fit the 16-block pool is rejected.
func TestReplayExplicit(t *testing.T) {
	toks := make([]int32, 40)
	for i := range toks {
		toks[i] = int32(i)
	}
	tr := &trace.Trace{Requests: []trace.Request{
		{ID: 1, Arrival: 0, Prompt: trace.Prompt{Tokens: toks}, MaxNew: 8},
		{ID: 2, Arrival: 1, Prompt: trace.Prompt{Tokens: toks}, MaxNew: 8},
		{ID: 3, Arrival: 1, Prompt: trace.Prompt{Tokens: toks}, MaxNew: 8,
			Events: []trace.Event{{Step: 0, Kind: trace.EventAbort}}},
		{ID: 4, Arrival: 2, Prompt: trace.Prompt{SuffixLen: 250}, MaxNew: 7}, // 257 tokens: 17 blocks
	}}
	if err := tr.Validate(); err != nil {
		t.Fatal(err)
	}
	res := run(t, tr, "kvlease", Config{Blocks: 16})
	checkLedger(t, res)
	p := res.Pools[0]
	if p.Queried != 6 || p.Hits != 4 || res.Finished != 2 || res.Aborted != 1 || res.Rejected != 1 || res.Tokens != 16 {
		t.Fatalf("queried %d hits %d finished %d aborted %d rejected %d tokens %d",
			p.Queried, p.Hits, res.Finished, res.Aborted, res.Rejected, res.Tokens)
	}
	// 40 prompt + 8 generated = 48 tokens = 3 full blocks each; both
	// requests seal the same chain, so block 2 is a duplicate seal.
	if p.Final.DuplicateSeals != 1 || p.Final.Cached != 3 {
		t.Fatalf("duplicate seals %d cached %d", p.Final.DuplicateSeals, p.Final.Cached)
	}
}

func TestReplayErrors(t *testing.T) {
	a, _ := New("kvlease", 8, 64)
	if _, err := Run(&trace.Trace{}, Config{Blocks: 8, DecodeBlocks: 8}, a); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Errorf("one allocator for a handoff: %v", err)
	}
	if _, err := New("heap", 8, 64); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Errorf("unknown kind: %v", err)
	}
}

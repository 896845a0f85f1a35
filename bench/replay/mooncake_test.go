package replay

import (
	"os"
	"testing"

	"github.com/kvlease/kvlease/bench/trace"
)

// TestReplayMooncake replays the committed small Mooncake trace through
// kvlease and the bare baseline at two block sizes: every request
// finishes, the pools end whole, and kvlease's hit rate matches the
// sharing the trace describes (the same at both block sizes, since both
// divide 512), with evictions once the pool is full of cached blocks.
func TestReplayMooncake(t *testing.T) {
	f, err := os.Open("../trace/testdata/mooncake_small.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	reqs, err := trace.ReadMooncake(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	tr := trace.FromMooncake(reqs, 20)
	var rates []float64
	for _, bt := range []int{16, 64} {
		cfg := Config{BlockTokens: bt, Blocks: 16384 / bt, MaxRunning: 8}
		for _, kind := range []string{"kvlease", "bare"} {
			a, err := New(kind, cfg.Blocks, 64)
			if err != nil {
				t.Fatal(err)
			}
			res, err := Run(tr, cfg, a)
			if err != nil {
				t.Fatalf("%s, %d-token blocks: %v", kind, bt, err)
			}
			if res.Finished != len(reqs) || res.BlocksOut != res.BlocksIn {
				t.Fatalf("%s, %d-token blocks: finished %d of %d, out %d in %d",
					kind, bt, res.Finished, len(reqs), res.BlocksOut, res.BlocksIn)
			}
			if kind == "kvlease" {
				if res.HitRate() < 0.2 || res.Evictions() == 0 {
					t.Fatalf("%d-token blocks: hit rate %.2f, %d evictions", bt, res.HitRate(), res.Evictions())
				}
				if res.PoolOps() != res.BlockOps()+res.Seals+res.Evictions() {
					t.Fatal("PoolOps")
				}
				rates = append(rates, res.HitRate())
			}
		}
	}
	t.Logf("hit rates at 16 and 64 tokens per block: %.3f %.3f", rates[0], rates[1])
}

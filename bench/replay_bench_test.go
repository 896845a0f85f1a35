package bench_test

import (
	"testing"

	"github.com/kvlease/kvlease/bench/replay"
	"github.com/kvlease/kvlease/bench/trace"
)

// BenchmarkReplay replays a generated chat trace (1000 requests, the
// default mix) through the engine of bench/replay: one op is one whole
// replay. block-ops/s is the engine's throughput in block operations per
// second (target ≥ 10⁶); x-bare is the wall time ratio to the same trace
// replayed with the bare baseline (no prefix cache) in the same run.
// handoff adds a decode pool and a transfer-gated copy per request.
func BenchmarkReplay(b *testing.B) {
	g := trace.DefaultGenConfig()
	g.Requests = 1000
	tr := trace.Generate(g)
	for _, c := range []struct {
		name string
		cfg  replay.Config
	}{
		{"pool", replay.Config{Blocks: 4096, MaxRunning: 128}},
		{"handoff", replay.Config{Blocks: 4096, DecodeBlocks: 4096, MaxRunning: 128}},
	} {
		b.Run(c.name, func(b *testing.B) {
			once := func(kind string) *replay.Result {
				pools := []replay.Allocator{}
				for _, n := range []int{c.cfg.Blocks, c.cfg.DecodeBlocks} {
					if n > 0 {
						a, err := replay.New(kind, n, 64)
						if err != nil {
							b.Fatal(err)
						}
						pools = append(pools, a)
					}
				}
				res, err := replay.Run(tr, c.cfg, pools...)
				if err != nil {
					b.Fatal(err)
				}
				return res
			}
			var ops int64
			paired(b, func(k int) {
				for range k {
					ops += once("kvlease").BlockOps()
				}
			}, base{"x-bare", func(k int) {
				for range k {
					once("bare")
				}
			}})
			b.ReportMetric(float64(ops)/b.Elapsed().Seconds(), "block-ops/s")
		})
	}
}

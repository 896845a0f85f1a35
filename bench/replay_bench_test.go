package bench_test

import (
	"time"

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

// BenchmarkReplayIndex is issue 16's figure for the prefix index: the
// pool time (time inside allocator calls, Config.TimeCalls) of a
// prefix-heavy replay through kvlease, against the same replay through
// kvlease with its prefix index in a Go map as before issue 16
// (replay.KVLeaseMapIndex), interleaved in the same run. One op is one
// whole replay of each. Reported: pool-ns/op and map-pool-ns/op per pool
// block operation (acquire, hit, seal, release and evict each count one),
// speedup = map pool time ÷ flat pool time (target ≥ 2.5), hit% and
// evictions per replay. Both replays schedule alike (the test asserts it):
// the same operations, so the pool times compare like for like.
//
//   - chat: the generated chat mix of BenchmarkReplay (1000 requests,
//     4096 blocks of 16 tokens, 128 running).
//   - mooncake: a generated production-shaped Mooncake trace
//     (trace.ProductionMooncake, 200 requests of about 12,000 tokens) on
//     32,768 blocks, 64 running: the pool is full of cached blocks and
//     nearly every fresh block evicts one.
func BenchmarkReplayIndex(b *testing.B) {
	chat := trace.DefaultGenConfig()
	chat.Requests = 1000
	moon := trace.ProductionMooncake()
	moon.Requests = 200
	for _, c := range []struct {
		name string
		tr   *trace.Trace
		cfg  replay.Config
	}{
		{"chat", trace.Generate(chat), replay.Config{Blocks: 4096, MaxRunning: 128, TimeCalls: true}},
		{"mooncake", trace.FromMooncake(trace.GenerateMooncake(moon), 20),
			replay.Config{Blocks: 32768, MaxRunning: 64, TimeCalls: true}},
	} {
		b.Run(c.name, func(b *testing.B) {
			once := func(kind string) *replay.Result {
				a, err := replay.New(kind, c.cfg.Blocks, 64)
				if err != nil {
					b.Fatal(err)
				}
				res, err := replay.Run(c.tr, c.cfg, a)
				if err != nil {
					b.Fatal(err)
				}
				return res
			}
			var flat, old time.Duration
			var ops, oldOps, evictions int64
			var hits float64
			paired(b, func(k int) {
				for range k {
					r := once("kvlease")
					flat += r.CallTime
					ops += r.PoolOps()
					evictions += r.Evictions()
					hits = r.HitRate()
				}
			}, base{"x-map-index", func(k int) {
				for range k {
					r := once(replay.KVLeaseMapIndex)
					old += r.CallTime
					oldOps += r.PoolOps()
				}
			}})
			if ops != oldOps {
				b.Fatalf("flat index %d pool ops, map index %d", ops, oldOps)
			}
			b.ReportMetric(float64(flat.Nanoseconds())/float64(ops), "pool-ns/op")
			b.ReportMetric(float64(old.Nanoseconds())/float64(ops), "map-pool-ns/op")
			b.ReportMetric(float64(old)/float64(flat), "speedup")
			b.ReportMetric(100*hits, "hit%")
			b.ReportMetric(float64(evictions)/float64(b.N), "evict/op")
		})
	}
}

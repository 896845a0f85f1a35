package bench_test

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"go.uber.org/atomic"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/bench/baseline"
)

// loop runs an operation n times.
type loop func(n int)

// base is a baseline for paired: its loop and the metric its ratio is
// reported as ("x-bare": target ns/op ÷ this baseline's ns/op).
type base struct {
	unit string
	run  loop
}

// paired measures target against each baseline in the same benchmark
// invocation. The b.N iterations of each are interleaved in up to sixteen
// rounds; in each round the benchmark timer is stopped while a chunk of
// each baseline runs under its own stopwatch, then restarted for the same
// number of target iterations. So ns/op, B/op and allocs/op are the
// target's alone, drift on a noisy machine hits target and baselines
// alike, and each ratio compares the same iteration count. The first
// baseline's own ns/op is reported too, as "<name>-ns/op".
func paired(b *testing.B, target loop, bases ...base) {
	b.Helper()
	b.ReportAllocs()
	spent := make([]time.Duration, len(bases))
	rounds := min(16, b.N)
	b.ResetTimer()
	done := 0
	for r := range rounds {
		k := (b.N*(r+1))/rounds - done
		done += k
		b.StopTimer()
		for i, bl := range bases {
			t0 := time.Now()
			bl.run(k)
			spent[i] += time.Since(t0)
		}
		b.StartTimer()
		target(k)
	}
	b.StopTimer()
	tns := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	for i, bl := range bases {
		bns := float64(spent[i].Nanoseconds()) / float64(b.N)
		if i == 0 {
			b.ReportMetric(bns, bl.unit[2:]+"-ns/op")
		}
		b.ReportMetric(tns/bns, bl.unit)
	}
}

const poolBlocks = 1024

func newPool(tb testing.TB, blocks int) *kvlease.Pool[[]byte] {
	tb.Helper()
	mem, err := kvlease.NewHostMemory(blocks, 64)
	if err != nil {
		tb.Fatal(err)
	}
	// The leak check is off, as in production builds, so that a -race
	// run of the benchmarks measures the same work.
	p, err := kvlease.NewPool[[]byte](mem, kvlease.WithLeakCheck(false))
	if err != nil {
		tb.Fatal(err)
	}
	return p
}

// The loops, each one lease cycle of n blocks per iteration.

func kvCycle(b *testing.B, p *kvlease.Pool[[]byte], n int) loop {
	return func(k int) {
		for range k {
			l, err := p.Acquire("bench", n)
			if err != nil {
				b.Fatal(err)
			}
			l.Release()
		}
	}
}

// bareCycle, slotCycle and chanCycle look alike on purpose: each calls its
// baseline's methods directly. A shared interface (or a generic over
// pointer types, which Go compiles to the same dictionary call) would add
// an indirect call to every baseline cycle and flatter kvlease's ratios.
func bareCycle(b *testing.B, bl *baseline.BareList, n int) loop {
	buf := make([]kvlease.BlockID, 0, n)
	return func(k int) {
		for range k {
			ids, ok := bl.Pop(buf[:0], n)
			if !ok {
				b.Fatal("bare: exhausted")
			}
			bl.Push(ids)
		}
	}
}

func slotCycle(b *testing.B, sl *baseline.SlotList, n int) loop {
	buf := make([]kvlease.BlockRef, 0, n)
	return func(k int) {
		for range k {
			refs, ok := sl.Pop(buf[:0], n)
			if !ok || !sl.Push(refs) {
				b.Fatal("slots: exhausted or stale")
			}
		}
	}
}

func slotBase(b *testing.B, n int) base {
	return base{"x-slots", slotCycle(b, baseline.NewSlotList(poolBlocks), n)}
}

func chanCycle(b *testing.B, cp *baseline.ChanPool, n int) loop {
	buf := make([]kvlease.BlockID, 0, n)
	return func(k int) {
		for range k {
			ids, ok := cp.Pop(buf[:0], n)
			if !ok {
				b.Fatal("chan: exhausted")
			}
			cp.Push(ids)
		}
	}
}

func mapCycle(b *testing.B, mp *baseline.MapPool, n int) loop {
	return func(k int) {
		for range k {
			if err := mp.Acquire("bench", n); err != nil {
				b.Fatal(err)
			}
			mp.Release("bench")
		}
	}
}

func bareBase(b *testing.B, n int) base {
	return base{"x-bare", bareCycle(b, baseline.NewBareList(poolBlocks), n)}
}

var cycleSizes = []int{1, 16, 256}

// BenchmarkLeaseCycle is Acquire(n) + Release on an idle pool of 1024
// blocks, against the baselines doing the same. Targets: x-bare
// ≤ 3 at 1 block; x-slots ≤ 2 at 16 blocks and ≤ 1.5 at 256, where slots
// is the per-block floor (a generation bumped and checked per block, see
// baseline.SlotList); at most one allocation per cycle.
func BenchmarkLeaseCycle(b *testing.B) {
	for _, n := range cycleSizes {
		b.Run(fmt.Sprintf("blocks=%d", n), func(b *testing.B) {
			paired(b, kvCycle(b, newPool(b, poolBlocks), n),
				bareBase(b, n),
				slotBase(b, n),
				base{"x-chan", chanCycle(b, baseline.NewChanPool(poolBlocks), n)},
				base{"x-map", mapCycle(b, baseline.NewMapPool(poolBlocks), n)})
		})
	}
}

// BenchmarkBaseline times the baselines alone, for the table.
func BenchmarkBaseline(b *testing.B) {
	for _, n := range cycleSizes {
		b.Run(fmt.Sprintf("bare/blocks=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			bareCycle(b, baseline.NewBareList(poolBlocks), n)(b.N)
		})
		b.Run(fmt.Sprintf("slots/blocks=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			slotCycle(b, baseline.NewSlotList(poolBlocks), n)(b.N)
		})
		b.Run(fmt.Sprintf("chan/blocks=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			chanCycle(b, baseline.NewChanPool(poolBlocks), n)(b.N)
		})
		b.Run(fmt.Sprintf("map/blocks=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			mapCycle(b, baseline.NewMapPool(poolBlocks), n)(b.N)
		})
	}
}

// BenchmarkLeaseCycleTransfer is a lease cycle of 16 blocks with one
// transfer attached over all of them and resolved. Target:
// x-slots ≤ 3 against slots(16), one allocation (the transfer).
//
//   - resolve-release: the copy finishes while the lease is open.
//   - release-resolve: the lease is released first and drains; the
//     Resolve returns its blocks (the abort-mid-copy path).
//   - attach-whole: Attach (every block, including later extensions)
//     instead of AttachRange.
//   - handoff: one transfer gates a Read on a source lease and a Write on
//     a destination lease in a second pool, both released before the
//     Resolve; against two bare cycles.
func BenchmarkLeaseCycleTransfer(b *testing.B) {
	const n = 16
	b.Run("resolve-release", func(b *testing.B) {
		p := newPool(b, poolBlocks)
		paired(b, func(k int) {
			for range k {
				l, _ := p.Acquire("bench", n)
				t := kvlease.NewTransfer(nil)
				if err := l.AttachRange(t, 0, n, kvlease.Write); err != nil {
					b.Fatal(err)
				}
				t.Resolve(nil)
				l.Release()
			}
		}, bareBase(b, n), slotBase(b, n))
	})
	b.Run("release-resolve", func(b *testing.B) {
		p := newPool(b, poolBlocks)
		paired(b, func(k int) {
			for range k {
				l, _ := p.Acquire("bench", n)
				t := kvlease.NewTransfer(nil)
				if err := l.AttachRange(t, 0, n, kvlease.Write); err != nil {
					b.Fatal(err)
				}
				l.Release()
				t.Resolve(nil)
			}
		}, bareBase(b, n), slotBase(b, n))
	})
	b.Run("attach-whole", func(b *testing.B) {
		p := newPool(b, poolBlocks)
		paired(b, func(k int) {
			for range k {
				l, _ := p.Acquire("bench", n)
				t := kvlease.NewTransfer(nil)
				if err := l.Attach(t); err != nil {
					b.Fatal(err)
				}
				l.Release()
				t.Resolve(nil)
			}
		}, bareBase(b, n), slotBase(b, n))
	})
	b.Run("handoff", func(b *testing.B) {
		src, dst := newPool(b, poolBlocks), newPool(b, poolBlocks)
		b1, b2 := bareCycle(b, baseline.NewBareList(poolBlocks), n), bareCycle(b, baseline.NewBareList(poolBlocks), n)
		paired(b, func(k int) {
			for range k {
				s, _ := src.Acquire("bench", n)
				d, _ := dst.Acquire("bench", n)
				t := kvlease.NewTransfer(nil)
				if err := s.AttachRange(t, 0, n, kvlease.Read); err != nil {
					b.Fatal(err)
				}
				if err := d.AttachRange(t, 0, n, kvlease.Write); err != nil {
					b.Fatal(err)
				}
				s.Release()
				d.Release()
				t.Resolve(nil)
			}
		}, base{"x-bare", func(k int) { b1(k); b2(k) }})
	})
}

// BenchmarkAcquireWait runs W goroutines that each loop AcquireWait(4) +
// Release on a nearly full pool: capacity W·4 with three quarters held by
// a background lease, so a quarter of the goroutines hold blocks while the
// rest queue. ns/op is wall time per cycle (all goroutines together).
// x-uncontended compares it with Acquire(4)+Release by one goroutine on an
// idle pool; x-bare with baseline.BareList.PopWait under the same
// contention (a FIFO of channels behind one mutex). Target:
// x-bare ≤ 1.1.
func BenchmarkAcquireWait(b *testing.B) {
	const n = 4
	for _, w := range []int{8, 64} {
		b.Run(fmt.Sprintf("waiters=%d", w), func(b *testing.B) {
			capacity := w * n
			p := newPool(b, capacity)
			hold, err := p.Acquire("background", capacity*3/4)
			if err != nil {
				b.Fatal(err)
			}
			defer hold.Release()
			bl := baseline.NewBareList(capacity)
			bhold, _ := bl.Pop(nil, capacity*3/4)
			defer bl.Push(bhold)
			ctx := context.Background()

			contended := func(k int, cycle func(buf []kvlease.BlockID)) {
				var left atomic.Int64
				left.Store(int64(k))
				var wg sync.WaitGroup
				for range w {
					wg.Add(1)
					go func() {
						defer wg.Done()
						buf := make([]kvlease.BlockID, 0, n)
						for left.Add(-1) >= 0 {
							cycle(buf)
						}
					}()
				}
				wg.Wait()
			}
			paired(b, func(k int) {
				contended(k, func([]kvlease.BlockID) {
					l, err := p.AcquireWait(ctx, "waiter", n)
					if err != nil {
						b.Error(err)
						return
					}
					l.Release()
				})
			},
				base{"x-uncontended", kvCycle(b, newPool(b, capacity), n)},
				base{"x-bare", func(k int) {
					contended(k, func(buf []kvlease.BlockID) {
						ids, err := bl.PopWait(ctx, buf[:0], n)
						if err != nil {
							b.Error(err)
							return
						}
						bl.Push(ids)
					})
				}})
			if st := p.Stats(); st.Waiters != 0 || st.Leased != capacity*3/4 {
				b.Fatalf("after the run: %+v", st)
			}
		})
	}
}

// prefixWorkload is a ring of requests whose chained hashes are
// precomputed: each request is blocks full blocks plus a partial one.
type prefixWorkload struct {
	tokens [][]int32
	hashes [][]kvlease.BlockHash
	n      int // blocks per request, the partial one included
}

const blockTokens = 16

// newPrefixWorkload makes reqs requests. With shared > 0 each starts with
// one of 8 system prompts of shared blocks, then unique blocks of its own.
func newPrefixWorkload(reqs, shared, unique int) *prefixWorkload {
	w := &prefixWorkload{n: shared + unique + 1}
	for r := range reqs {
		toks := make([]int32, 0, (w.n)*blockTokens)
		for i := range shared * blockTokens {
			toks = append(toks, int32(1_000_000*(1+r%8)+i))
		}
		for i := range unique*blockTokens + blockTokens/2 {
			toks = append(toks, int32(100_000_000+r*10_000+i))
		}
		w.tokens = append(w.tokens, toks)
		w.hashes = append(w.hashes, kvlease.ChainHashes(1, toks, blockTokens))
	}
	return w
}

// cycle is one request: AcquirePrefix, seal what missed, release. With
// chain it hashes the prompt first, as an engine does per request.
func (w *prefixWorkload) cycle(b testing.TB, p *kvlease.Pool[[]byte], r int, chain bool) {
	hs := w.hashes[r%len(w.hashes)]
	if chain {
		hs = kvlease.ChainHashes(1, w.tokens[r%len(w.tokens)], blockTokens)
	}
	l, hits, err := p.AcquirePrefix("bench", hs, w.n)
	if err != nil {
		b.Fatal(err)
	}
	for i := hits; i < len(hs); i++ {
		if err := l.Seal(i, hs[i]); err != nil {
			b.Fatal(err)
		}
	}
	l.Release()
}

// BenchmarkPrefix is the prefix cache under load: each op is one request
// (AcquirePrefix of its chained hashes, Seal of the blocks that missed,
// Release), cycling through a ring of distinct requests.
//
//   - hit-heavy: 4096 requests, each one of 8 system prompts of 32 blocks
//     plus 4 unique blocks and a partial one, on a pool of 8192 blocks:
//     the system prompts always hit and the unique blocks evict older
//     ones (hit rate ≈ 86%).
//   - evict-heavy: 4096 requests of 16 unique blocks and a partial one on
//     a pool of 1024: every request misses and evicts all it takes.
//
// hashes=chain computes ChainHashes inside the loop (one allocation),
// hashes=pre uses precomputed ones. x-bare and x-map compare with a
// baseline cycle of the same block count (no prefix cache: what an engine
// without one pays for the same blocks). hit% and evict/op come from
// Stats.
func BenchmarkPrefix(b *testing.B) {
	for _, c := range []struct {
		name                   string
		capacity, shared, uniq int
	}{
		{"hit-heavy", 8192, 32, 4},
		{"evict-heavy", 1024, 0, 16},
	} {
		w := newPrefixWorkload(4096, c.shared, c.uniq)
		for _, chain := range []bool{false, true} {
			name := c.name + "/hashes=pre"
			if chain {
				name = c.name + "/hashes=chain"
			}
			b.Run(name, func(b *testing.B) {
				p := newPool(b, c.capacity)
				for r := range 2 * len(w.hashes) { // warm: the cache in its steady state
					w.cycle(b, p, r, false)
				}
				before := p.Stats()
				next := 0
				paired(b, func(k int) {
					for range k {
						w.cycle(b, p, next, chain)
						next++
					}
				},
					base{"x-bare", bareCycle(b, baseline.NewBareList(c.capacity), w.n)},
					base{"x-map", mapCycle(b, baseline.NewMapPool(c.capacity), w.n)})
				st := p.Stats()
				q := float64(st.PrefixQueries - before.PrefixQueries)
				b.ReportMetric(100*float64(st.PrefixHits-before.PrefixHits)/q, "hit%")
				b.ReportMetric(float64(st.Evictions-before.Evictions)/float64(b.N), "evict/op")
			})
		}
	}
}

// BenchmarkParallel runs lease cycles from every P with RunParallel, for
// GOMAXPROCS 1, 2 and 4 (sub-benchmarks set it with runtime.GOMAXPROCS;
// on a 2-core machine 4 oversubscribes). The bare baseline runs under the
// same parallelism before and after the target; x-bare divides by the
// mean of the two. Target: x-bare ≤ 3 for cycle/blocks=4 on
// all cores.
func BenchmarkParallel(b *testing.B) {
	type op struct {
		name string
		n    int
		kv   func(p *kvlease.Pool[[]byte]) error
	}
	ops := []op{
		{"cycle/blocks=1", 1, func(p *kvlease.Pool[[]byte]) error {
			l, err := p.Acquire("bench", 1)
			if err == nil {
				l.Release()
			}
			return err
		}},
		{"cycle/blocks=4", 4, func(p *kvlease.Pool[[]byte]) error {
			l, err := p.Acquire("bench", 4)
			if err == nil {
				l.Release()
			}
			return err
		}},
		{"cycle/blocks=16", 16, func(p *kvlease.Pool[[]byte]) error {
			l, err := p.Acquire("bench", 16)
			if err == nil {
				l.Release()
			}
			return err
		}},
		{"transfer/blocks=16", 16, func(p *kvlease.Pool[[]byte]) error {
			l, err := p.Acquire("bench", 16)
			if err != nil {
				return err
			}
			t := kvlease.NewTransfer(nil)
			err = l.AttachRange(t, 0, 16, kvlease.Write)
			l.Release()
			t.Resolve(nil)
			return err
		}},
	}
	for _, o := range ops {
		for _, procs := range []int{1, 2, 4} {
			b.Run(fmt.Sprintf("%s/procs=%d", o.name, procs), func(b *testing.B) {
				defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
				p := newPool(b, 4096)
				parallelVsBare(b, 4096, o.n, func(pb *testing.PB) {
					for pb.Next() {
						if err := o.kv(p); err != nil {
							panic(err)
						}
					}
				})
			})
		}
	}
}

// parallelVsBare runs target with RunParallel under the benchmark timer,
// between two RunParallel runs of bare cycles of n ids on a list of
// capacity ids (timer stopped), and reports the ratio to their mean.
func parallelVsBare(b *testing.B, capacity, n int, target func(*testing.PB)) {
	bl := baseline.NewBareList(capacity)
	bare := func(pb *testing.PB) {
		buf := make([]kvlease.BlockID, 0, n)
		for pb.Next() {
			ids, ok := bl.Pop(buf[:0], n)
			if !ok {
				panic("bare: exhausted")
			}
			bl.Push(ids)
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	b.StopTimer()
	t0 := time.Now()
	b.RunParallel(bare)
	spent := time.Since(t0)
	b.StartTimer()
	b.RunParallel(target)
	b.StopTimer()
	t0 = time.Now()
	b.RunParallel(bare)
	spent += time.Since(t0)
	bns := float64(spent.Nanoseconds()) / float64(2*b.N)
	b.ReportMetric(bns, "bare-ns/op")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/bns, "x-bare")
}

// BenchmarkParallelPrefix is hit-heavy prefix traffic (see BenchmarkPrefix)
// from every P, for GOMAXPROCS 1, 2 and 4, against bare cycles of the same
// block count under the same parallelism.
func BenchmarkParallelPrefix(b *testing.B) {
	w := newPrefixWorkload(4096, 32, 4)
	for _, procs := range []int{1, 2, 4} {
		b.Run(fmt.Sprintf("procs=%d", procs), func(b *testing.B) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
			p := newPool(b, 8192)
			for r := range 2 * len(w.hashes) {
				w.cycle(b, p, r, false)
			}
			var next atomic.Int64
			parallelVsBare(b, 8192, w.n, func(pb *testing.PB) {
				r := int(next.Add(1013))
				for pb.Next() {
					w.cycle(b, p, r, false)
					r++
				}
			})
		})
	}
}

// BenchmarkChainHashes is the per-request hashing an engine adds to use
// the prefix cache: ChainHashes of a 36-block (576-token) prompt.
func BenchmarkChainHashes(b *testing.B) {
	toks := make([]int32, 36*blockTokens)
	for i := range toks {
		toks[i] = int32(i)
	}
	b.ReportAllocs()
	for b.Loop() {
		_ = kvlease.ChainHashes(1, toks, blockTokens)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/36, "ns/block")
}

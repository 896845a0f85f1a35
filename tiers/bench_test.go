package tiers

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/gpu"
)

// hitTrace is a trace whose working set is four times the device pool:
// docs documents of docLen blocks, requested uniformly at random.
type hitTrace struct {
	chains [][]kvlease.BlockHash
	order  []int
}

func newHitTrace(docs, docLen, requests int, seed uint64) hitTrace {
	tr := hitTrace{chains: make([][]kvlease.BlockHash, docs)}
	for d := range tr.chains {
		tr.chains[d] = chain(d+1, docLen)
	}
	rng := rand.New(rand.NewPCG(seed, 3))
	for range requests {
		tr.order = append(tr.order, rng.IntN(docs))
	}
	return tr
}

// BenchmarkHitRate runs one trace (working set 4× the device pool, and
// it fits in device + host) through a device-only cache (a plain pool of
// the device's size), the tiered cache (device + host, write-back) and an
// unbounded cache (a set), and reports the three hit rates and the gap
// between tiered and unbounded in percentage points (target ≤ 2). Each
// request waits for its onboard and its offloads to land before the next,
// as an engine's step would. The copies run on the gpu package's CPU
// fallback. The host tier is inclusive (an onboarded block keeps its host
// copy), so the target needs a host pool the size of the working set
// (host-4x: device + host is 5× the device); host-3.5x shows what a host
// smaller than the working set loses.
func BenchmarkHitRate(b *testing.B) {
	const devN, docs, docLen, requests = 64, 32, 8, 3000
	tr := newHitTrace(docs, docLen, requests, 17)
	for _, host := range []struct {
		name string
		n    int
	}{{"host-4x", 4 * devN}, {"host-3.5x", 7 * devN / 2}} {
		b.Run(host.name, func(b *testing.B) {
			var devOnly, tiered, unbounded float64
			for b.Loop() {
				devOnly, tiered, unbounded = runHitRate(b, tr, devN, host.n)
			}
			b.ReportMetric(devOnly, "device-only-hit%")
			b.ReportMetric(tiered, "tiered-hit%")
			b.ReportMetric(unbounded, "unbounded-hit%")
			b.ReportMetric(unbounded-tiered, "gap-pp")
		})
	}
}

func runHitRate(b *testing.B, tr hitTrace, devN, hostN int) (devOnly, tiered, unbounded float64) {
	dev := gpu.OpenHost()
	defer dev.Close()
	devMem, err := dev.AllocDevice(devN, 4096)
	if err != nil {
		b.Fatal(err)
	}
	defer devMem.Close()
	hostMem, err := dev.AllocPinned(hostN, 4096)
	if err != nil {
		b.Fatal(err)
	}
	defer hostMem.Close()
	eng, err := dev.NewCopyEngine()
	if err != nil {
		b.Fatal(err)
	}
	defer eng.Close()
	dp, _ := kvlease.NewPool[gpu.DevicePtr](devMem, kvlease.WithSealRecords())
	hp, _ := kvlease.NewPool[[]byte](hostMem, kvlease.WithSealRecords())
	c, err := New(Config[gpu.DevicePtr]{Device: dp, Host: hp, Offload: eng.DeviceToHost(), Onload: eng.HostToDevice(),
		DeviceReserve: devN / 4})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	pm, _ := kvlease.NewHostMemory(devN, 64)
	plain, _ := kvlease.NewPool[[]byte](pm)
	seen := map[kvlease.BlockHash]bool{}
	var plainHits, unbHits, queried int
	for _, d := range tr.order {
		hashes := tr.chains[d]
		queried += len(hashes)
		k := 0
		for k < len(hashes) && seen[hashes[k]] {
			k++
		}
		unbHits += k
		for _, h := range hashes {
			seen[h] = true
		}
		pl, hits, err := plain.AcquirePrefix("r", hashes, len(hashes))
		if err != nil {
			b.Fatal(err)
		}
		plainHits += hits
		for i := hits; i < len(hashes); i++ {
			_ = pl.Seal(i, hashes[i])
		}
		pl.Release()

		o, err := c.Acquire("r", hashes, len(hashes))
		if err != nil {
			b.Fatal(err)
		}
		valid, err := o.Wait(context.Background())
		if err != nil {
			b.Fatal(err)
		}
		for i := valid; i < len(hashes); i++ {
			var parent kvlease.BlockHash
			if i > 0 {
				parent = hashes[i-1]
			}
			if err := c.Seal(o.Lease, i, parent, hashes[i]); err != nil {
				b.Fatal(err)
			}
		}
		o.Lease.Release()
		for dp.Stats().Draining+hp.Stats().Draining > 0 || dp.Stats().Leased+hp.Stats().Leased > 0 {
			time.Sleep(10 * time.Microsecond)
		}
	}
	st := c.Stats()
	pct := func(n int) float64 { return 100 * float64(n) / float64(queried) }
	return pct(plainHits), pct(int(st.Tiers[TierDevice].Hits + st.Tiers[TierHost].Hits)), pct(unbHits)
}

// latencies reports p50 and p99 of xs, in nanoseconds.
func latencies(b *testing.B, xs []time.Duration, prefix string) {
	slices.Sort(xs)
	q := func(p float64) float64 { return float64(xs[min(int(p*float64(len(xs))), len(xs)-1)].Nanoseconds()) }
	b.ReportMetric(q(0.50), prefix+"p50-ns")
	b.ReportMetric(q(0.99), prefix+"p99-ns")
}

// BenchmarkOnboardLatency measures onboarding a 64-block prefix of 16 KiB
// blocks (1 MiB) on the gpu package's CPU fallback, from the host tier
// and from the disk tier, from Cache.Acquire to Ready, with p50 and p99
// over the run. Its baselines, measured in the same run: the copy engine
// alone copying the same 64 blocks host to device (host), and the disk
// tier's reads alone of the same 64 slots into host memory (disk).
func BenchmarkOnboardLatency(b *testing.B) {
	const blocks, blockBytes = 64, 16 << 10
	for _, from := range []Tier{TierHost, TierDisk} {
		b.Run(from.String(), func(b *testing.B) {
			dev := gpu.OpenHost()
			defer dev.Close()
			devMem, err := dev.AllocDevice(2*blocks, blockBytes)
			if err != nil {
				b.Fatal(err)
			}
			defer devMem.Close()
			hostMem, err := dev.AllocPinned(3*blocks, blockBytes)
			if err != nil {
				b.Fatal(err)
			}
			defer hostMem.Close()
			eng, err := dev.NewCopyEngine()
			if err != nil {
				b.Fatal(err)
			}
			defer eng.Close()
			dp, _ := kvlease.NewPool[gpu.DevicePtr](devMem, kvlease.WithSealRecords())
			hp, _ := kvlease.NewPool[[]byte](hostMem, kvlease.WithSealRecords())
			var disk *Disk
			if from == TierDisk {
				if disk, err = OpenDisk(DiskConfig{Dir: b.TempDir(), Slots: 2 * blocks, BlockBytes: blockBytes, Workers: 4, Direct: true}); err != nil {
					b.Fatal(err)
				}
				defer disk.Close()
			}
			c, err := New(Config[gpu.DevicePtr]{Device: dp, Host: hp, Disk: disk, Offload: eng.DeviceToHost(), Onload: eng.HostToDevice(),
				DeviceReserve: -1, HostReserve: -1})
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			hashes := chain(1, blocks)
			o, err := c.Acquire("fill", hashes, blocks)
			if err != nil {
				b.Fatal(err)
			}
			for i := range hashes {
				p := kvlease.BlockHash(0)
				if i > 0 {
					p = hashes[i-1]
				}
				if err := c.Seal(o.Lease, i, p, hashes[i]); err != nil {
					b.Fatal(err)
				}
			}
			o.Lease.Release()
			settled := func() {
				for dp.Stats().Draining+hp.Stats().Draining+dp.Stats().Leased+hp.Stats().Leased > 0 {
					time.Sleep(5 * time.Microsecond)
				}
			}
			// push moves the chain down to the tier the onboard reads
			// from (the blocks that the tier has already are dropped).
			push := func() {
				dp.OfferCached(dp.Memory().Blocks())
				settled()
				if from == TierDisk {
					hp.OfferCached(hp.Memory().Blocks())
					settled()
					for disk.Pool().Stats().Leased+disk.Pool().Stats().Draining > 0 {
						time.Sleep(5 * time.Microsecond)
					}
				}
			}
			var lat, base []time.Duration
			bufs := make([]byte, blocks*blockBytes)
			for b.Loop() {
				push()
				if dp.CachedPrefix(hashes) != 0 || (from == TierDisk && hp.CachedPrefix(hashes) != 0) {
					b.Fatal("the chain is still above the tier under test")
				}
				t0 := time.Now()
				o, err := c.Acquire("r", hashes, blocks)
				if err != nil {
					b.Fatal(err)
				}
				if n, err := o.Wait(context.Background()); err != nil || n != blocks || o.Hits(from) != blocks {
					b.Fatalf("onboarded %d of %d from %v: %v", n, blocks, from, err)
				}
				lat = append(lat, time.Since(t0))
				o.Lease.Release()
				settled()

				// The baseline: the same bytes through the transport alone.
				if from == TierHost {
					hl, err := hp.AcquireHits("base", hashes)
					if err != nil || hl == nil {
						b.Fatal("host lost the chain", err)
					}
					dl, err := dp.Acquire("base", blocks)
					if err != nil {
						b.Fatal(err)
					}
					pairs := make([]kvlease.CopyPair[[]byte, gpu.DevicePtr], blocks)
					for k := range pairs {
						s, _ := hp.Region(hl.Ref(k))
						d, _ := dp.Region(dl.Ref(k))
						pairs[k] = kvlease.CopyPair[[]byte, gpu.DevicePtr]{Src: s, Dst: d}
					}
					t1 := time.Now()
					t, err := eng.HostToDevice().Start(pairs, func(t *kvlease.Transfer) error { return dl.Attach(t) })
					if err != nil {
						b.Fatal(err)
					}
					<-t.Done()
					base = append(base, time.Since(t1))
					dl.Release()
					hl.Release()
				} else {
					hl := disk.Lookup("base", hashes)
					if hl == nil || hl.Len() != blocks {
						b.Fatal("disk lost the chain")
					}
					reads := make([]SlotRead, blocks)
					for k := range reads {
						reads[k] = SlotRead{Src: disk.Region(hl.Ref(k).ID), Dst: bufs[k*blockBytes : (k+1)*blockBytes], Hash: hashes[k]}
					}
					t1 := time.Now()
					t, err := disk.Read(reads, func(t *kvlease.Transfer) error { return hl.Attach(t) })
					if err != nil {
						b.Fatal(err)
					}
					<-t.Done()
					base = append(base, time.Since(t1))
					if t.Err() != nil {
						b.Fatal(t.Err())
					}
					hl.Release()
				}
				settled()
			}
			latencies(b, lat, "")
			latencies(b, base, "base-")
			b.ReportMetric(float64(len(lat)), "samples")
		})
	}
}

// BenchmarkEvictionPath measures the eviction path: a device pool full
// of cached blocks serves requests of n fresh blocks (8, and 64), which
// are sealed and released, so the pool stays full and every request must
// evict (or, with the hook, take blocks its earlier offers freed). Three
// rigs run the same loop in the same run:
//
//   - base: the pool without a hook (evicted content is lost);
//   - hook: the same pool with the tiered cache's write-back hook
//     installed, driven through the pool's own AcquirePrefix (the
//     evicting acquire offers victims, takes others, and queues the
//     offer; the offload worker copies it to the host tier with MemCopy);
//   - cache: through Cache.Acquire and Cache.Seal, which also look the
//     host tier up and keep the device's free reserve.
//
// thread-ns/block is the CPU time of the acquiring goroutine (locked to
// its thread) per block it acquired, sealed and released: what the
// evicting path itself pays, whatever else the machine runs (target: hook
// ≤ 1.5× base). evict-ns/block is the wall time inside the acquiring call
// alone (on a loaded machine it also counts waiting for a CPU the copies
// hold). loop-ns/block and cpu-ns/block cover everything, the copies and
// their bookkeeping on other goroutines included (each loop ends when its
// copies have landed): what the offload costs in all.
func BenchmarkEvictionPath(b *testing.B) {
	for _, n := range []int{8, 64} {
		b.Run(fmt.Sprintf("blocks=%d", n), func(b *testing.B) { benchEvictionPath(b, n) })
	}
}

type evictRig struct {
	dev, host *kvlease.Pool[[]byte]
	c         *Cache[[]byte]
	viaCache  bool

	acquire, wall, cpu, thread time.Duration
}

func newEvictRig(b *testing.B, hook, viaCache bool) *evictRig {
	const devN, hostN, blockBytes = 1024, 4096, 256
	dm, _ := kvlease.NewHostMemory(devN, blockBytes)
	hm, _ := kvlease.NewHostMemory(hostN, blockBytes)
	r := &evictRig{viaCache: viaCache}
	r.dev, _ = kvlease.NewPool[[]byte](dm, kvlease.WithSealRecords())
	r.host, _ = kvlease.NewPool[[]byte](hm, kvlease.WithSealRecords())
	if hook {
		c, err := New(Config[[]byte]{Device: r.dev, Host: r.host, Offload: MemCopy{}, Onload: MemCopy{}})
		if err != nil {
			b.Fatal(err)
		}
		r.c = c
		b.Cleanup(func() { _ = c.Close() })
	}
	l, err := r.dev.Acquire("fill", devN)
	if err != nil {
		b.Fatal(err)
	}
	for i := range devN {
		_ = l.Seal(i, kvlease.BlockHash(1<<40+i))
	}
	l.Release()
	return r
}

// settle waits, sleeping rather than spinning (a spin would burn the CPU
// time the benchmark measures), until no copy is in flight.
func (r *evictRig) settle() {
	for r.dev.Stats().Draining+r.dev.Stats().Leased+r.host.Stats().Draining+r.host.Stats().Leased > 0 {
		time.Sleep(20 * time.Microsecond)
	}
}

// run serves iters requests of fresh hashes drawn from next.
func (r *evictRig) run(b *testing.B, iters int, hashes []kvlease.BlockHash, next *kvlease.BlockHash) {
	n := len(hashes)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	c0, t0, th0 := cpuTime(), time.Now(), threadTime()
	for range iters {
		for i := range hashes {
			*next++
			hashes[i] = *next
		}
		a0 := time.Now()
		var l *kvlease.Lease[[]byte]
		if r.viaCache {
			o, err := r.c.Acquire("r", hashes, n)
			if err != nil {
				b.Fatal(err)
			}
			l = o.Lease
		} else {
			var err error
			if l, _, err = r.dev.AcquirePrefix("r", hashes, n); err != nil {
				b.Fatal(err)
			}
		}
		r.acquire += time.Since(a0)
		for i := range n {
			if r.viaCache {
				p := kvlease.BlockHash(0)
				if i > 0 {
					p = hashes[i-1]
				}
				_ = r.c.Seal(l, i, p, hashes[i])
			} else {
				_ = l.Seal(i, hashes[i])
			}
		}
		l.Release()
	}
	r.thread += threadTime() - th0
	r.settle()
	r.wall += time.Since(t0)
	r.cpu += cpuTime() - c0
}

func benchEvictionPath(b *testing.B, n int) {
	rigs := []*evictRig{newEvictRig(b, false, false), newEvictRig(b, true, false), newEvictRig(b, true, true)}
	names := []string{"base", "hook", "cache"}
	next := kvlease.BlockHash(1 << 50)
	hashes := make([]kvlease.BlockHash, n)
	for _, r := range rigs { // into the steady state
		r.run(b, 2048/n, hashes, &next)
		r.acquire, r.wall, r.cpu, r.thread = 0, 0, 0, 0
	}
	ev0 := [3]uint64{}
	for k, r := range rigs {
		ev0[k] = r.dev.Stats().Evictions
	}
	const iters = 32
	for b.Loop() {
		for _, r := range rigs {
			r.run(b, iters, hashes, &next)
		}
	}
	blocks := float64(b.N * iters * n)
	per := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / blocks }
	for k, r := range rigs {
		b.ReportMetric(per(r.acquire), names[k]+"-evict-ns/block")
		b.ReportMetric(per(r.wall), names[k]+"-loop-ns/block")
		if r.cpu > 0 {
			b.ReportMetric(per(r.cpu), names[k]+"-cpu-ns/block")
			b.ReportMetric(per(r.thread), names[k]+"-thread-ns/block")
		}
		b.ReportMetric(float64(r.dev.Stats().Evictions-ev0[k])/blocks, names[k]+"-evictions/block")
	}
	b.ReportMetric(per(rigs[1].acquire)/per(rigs[0].acquire), "hook/base-evict")
	b.ReportMetric(per(rigs[2].acquire)/per(rigs[0].acquire), "cache/base-evict")
	b.ReportMetric(per(rigs[1].wall)/per(rigs[0].wall), "hook/base-loop")
	if rigs[0].cpu > 0 {
		b.ReportMetric(per(rigs[1].cpu)/per(rigs[0].cpu), "hook/base-cpu")
		b.ReportMetric(per(rigs[1].thread)/per(rigs[0].thread), "hook/base-thread")
		b.ReportMetric(per(rigs[2].thread)/per(rigs[0].thread), "cache/base-thread")
	}
}

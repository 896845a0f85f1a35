package gpu

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
)

var benchBytes = flag.Int("gpu.benchbytes", 64<<20, "bytes moved by each copy of BenchmarkCopyBandwidth")

// BenchmarkCopyBandwidth measures, in the same run, one copy of N blocks
// laid out contiguously on both sides (the engine merges them into a single
// copy: the bandwidth ceiling) and one copy of the same N blocks scattered
// on both sides (random permutations, nothing merges: what a paged KV cache
// really moves). Each iteration does both and times them separately.
//
// Rows: <device>/<block>/<direction>[/<mode>]. Directions: HtoD, DtoH,
// DtoD (the copy engine, kernel off) and DtoDkernel (scattered copies by
// the gather kernel; its contiguous baseline is the copy engine's single
// copy). On a CUDA device with cuMemcpyBatchAsync, the copy-engine rows
// run both batched and as a loop of cuMemcpyAsync ("/batch", "/loop").
//
// Metrics: wall-clock bandwidth of both and their ratio; the same from
// GPU time (CUDA events around the copies; the worker's time on the
// fallback); the mean time Start took to return for the scattered copy;
// and how the scattered copies were carried (submissions per copy by
// path, from CopyStats), so a "batch" row that ran looped shows it.
// Targets on a GPU at 64 KiB blocks: scattered ≥ 0.80 × contiguous for
// host↔device, the kernel ≥ 0.70 × the contiguous device-to-device copy.
func BenchmarkCopyBandwidth(b *testing.B) {
	for _, k := range deviceKinds {
		if k.name == "fakecuda" {
			continue // memcpy behind a cgo call: nothing to learn
		}
		b.Run(k.name, func(b *testing.B) {
			d := k.open(b)
			for _, bb := range []int{16 << 10, 64 << 10, 256 << 10} {
				// One rig per block size, shared by its sub-benchmarks
				// (this level's body runs once) and freed after them.
				b.Run(fmt.Sprintf("%dKiB", bb>>10), func(b *testing.B) {
					r := newBenchRig(b, d, bb)
					modes := []string{""}
					if _, _, batch, ok := cudaStats(d); ok && batch {
						modes = []string{"/batch", "/loop"}
					}
					for _, dir := range []string{"HtoD", "DtoH", "DtoD", "DtoDkernel"} {
						for _, mode := range modes {
							if dir == "DtoDkernel" {
								if mode == "/loop" {
									continue
								}
								mode = ""
							}
							b.Run(dir+mode, func(b *testing.B) {
								setBatch(d, mode != "/loop")
								setKernel(d, dir == "DtoDkernel")
								defer setBatch(d, true)
								defer setKernel(d, true)
								benchCopy(b, r, dir)
							})
						}
					}
				})
			}
		})
	}
}

// newBenchRig allocates -gpu.benchbytes in each arena and fills the
// sources with random bytes (never zeros).
func newBenchRig(b *testing.B, d *Device, bb int) *rig {
	blocks := *benchBytes / bb
	if blocks < 2 {
		b.Fatalf("-gpu.benchbytes %d holds fewer than 2 blocks of %d", *benchBytes, bb)
	}
	r := newRig(b, d, blocks, bb)
	rng := rand.New(rand.NewPCG(uint64(bb), 1))
	fillRandom(rng, r.pin.a.host)
	total := blocks * bb
	chunk := make([]byte, min(total, 16<<20))
	for off := 0; off < total; off += len(chunk) {
		n := min(len(chunk), total-off)
		fillRandom(rng, chunk[:n])
		if err := d.CopyFromHost(r.dev.Base().Add(off), chunk[:n]); err != nil {
			b.Fatal(err)
		}
	}
	return r
}

// starter returns a function that starts one copy of dir, pairing block
// src[i] with block dst[i].
func starter(r *rig, dir string, src, dst []int) func() (*kvlease.Transfer, error) {
	id := func(i int) kvlease.BlockID { return kvlease.BlockID(i) }
	switch dir {
	case "HtoD":
		pairs := make([]kvlease.CopyPair[[]byte, DevicePtr], len(src))
		for i := range pairs {
			pairs[i] = pair(r.pin.Region(id(src[i])), r.dev.Region(id(dst[i])))
		}
		return func() (*kvlease.Transfer, error) { return r.e.HostToDevice().Start(pairs, noAttach) }
	case "DtoH":
		pairs := make([]kvlease.CopyPair[DevicePtr, []byte], len(src))
		for i := range pairs {
			pairs[i] = pair(r.dev.Region(id(src[i])), r.pin.Region(id(dst[i])))
		}
		return func() (*kvlease.Transfer, error) { return r.e.DeviceToHost().Start(pairs, noAttach) }
	default: // DtoD, DtoDkernel
		pairs := make([]kvlease.CopyPair[DevicePtr, DevicePtr], len(src))
		for i := range pairs {
			pairs[i] = pair(r.dev.Region(id(src[i])), r.dev2.Region(id(dst[i])))
		}
		return func() (*kvlease.Transfer, error) { return r.e.DeviceToDevice().Start(pairs, noAttach) }
	}
}

// timedRun starts one copy and waits for it: wall time, the time Start
// took to return, and the GPU time measured meanwhile.
func timedRun(b *testing.B, d *Device, f func() (*kvlease.Transfer, error)) (wall, start, gpu time.Duration) {
	g0, _ := gpuTime(d)
	t0 := time.Now()
	tr, err := f()
	start = time.Since(t0)
	if err != nil {
		b.Fatal(err)
	}
	<-tr.Done()
	if err := tr.Err(); err != nil {
		b.Fatal(err)
	}
	wall = time.Since(t0)
	g1, _ := gpuTime(d)
	return wall, start, g1 - g0
}

// reportPaths reports how the copies between st0 and now were carried,
// as submissions per copy started (ops of b.N).
func reportPaths(b *testing.B, d *Device, st0 CopyStats, ops int) {
	st := d.CopyStats()
	n := float64(ops)
	b.ReportMetric(float64(st.BatchedSubmits-st0.BatchedSubmits)/n, "batched/op")
	b.ReportMetric(float64(st.LoopedSubmits-st0.LoopedSubmits)/n, "looped/op")
	b.ReportMetric(float64(st.KernelLaunches-st0.KernelLaunches)/n, "kernel/op")
	if st.BatchFailures != st0.BatchFailures || st.KernelFailures != st0.KernelFailures {
		b.Logf("path failures during the row: %v (kernel: %v)", st, st.KernelErr)
	}
}

func benchCopy(b *testing.B, r *rig, dir string) {
	blocks, total := r.blocks, r.blocks*r.bb
	rng := rand.New(rand.NewPCG(uint64(r.bb), 2))
	srcPerm, dstPerm := rng.Perm(blocks), rng.Perm(blocks)
	ident := make([]int, blocks)
	for i := range ident {
		ident[i] = i
	}
	contiguous, scattered := starter(r, dir, ident, ident), starter(r, dir, srcPerm, dstPerm)
	d := r.d
	setTiming(d, true)
	defer setTiming(d, false)
	timedRun(b, d, contiguous) // warm up: first-touch, driver caches, the kernel's JIT
	timedRun(b, d, scattered)
	b.ResetTimer()
	var tc, ts, gc, gs, st time.Duration
	var batched, looped, kernel int64
	for range b.N {
		w, _, g := timedRun(b, d, contiguous)
		tc, gc = tc+w, gc+g
		s0 := d.CopyStats()
		w, s, g := timedRun(b, d, scattered)
		ts, gs, st = ts+w, gs+g, st+s
		s1 := d.CopyStats()
		batched += s1.BatchedSubmits - s0.BatchedSubmits
		looped += s1.LoopedSubmits - s0.LoopedSubmits
		kernel += s1.KernelLaunches - s0.KernelLaunches
	}
	b.StopTimer()
	gbps := func(d time.Duration) float64 { return float64(total) * float64(b.N) / d.Seconds() / 1e9 }
	b.ReportMetric(gbps(tc), "contig-GB/s")
	b.ReportMetric(gbps(ts), "scatter-GB/s")
	b.ReportMetric(gbps(ts)/gbps(tc), "scatter/contig")
	if gc > 0 && gs > 0 {
		b.ReportMetric(gbps(gc), "gpu-contig-GB/s")
		b.ReportMetric(gbps(gs), "gpu-scatter-GB/s")
		b.ReportMetric(gbps(gs)/gbps(gc), "gpu-scatter/contig")
	}
	b.ReportMetric(float64(st.Nanoseconds())/1e3/float64(b.N), "start-µs")
	// How the scattered copies were carried, per copy.
	b.ReportMetric(float64(batched)/float64(b.N), "batched/op")
	b.ReportMetric(float64(looped)/float64(b.N), "looped/op")
	b.ReportMetric(float64(kernel)/float64(b.N), "kernel/op")
}

// BenchmarkCopyLatency measures the latency of small scattered copies
// (Start until the transfer resolves), 8 and 64 blocks per copy, in each
// direction: p50 and p99, the mean time Start took to return, and the
// paths that carried them.
func BenchmarkCopyLatency(b *testing.B) {
	for _, k := range deviceKinds {
		if k.name == "fakecuda" {
			continue
		}
		b.Run(k.name, func(b *testing.B) {
			d := k.open(b)
			for _, bb := range []int{16 << 10, 64 << 10, 256 << 10} {
				b.Run(fmt.Sprintf("%dKiB", bb>>10), func(b *testing.B) {
					r := newRig(b, d, 256, bb)
					for _, dir := range []string{"HtoD", "DtoH", "DtoD", "DtoDkernel"} {
						for _, n := range []int{8, 64} {
							b.Run(fmt.Sprintf("%s/%dblocks", dir, n), func(b *testing.B) {
								setKernel(d, dir == "DtoDkernel")
								defer setKernel(d, true)
								rng := rand.New(rand.NewPCG(uint64(bb), uint64(n)))
								src, dst := rng.Perm(r.blocks)[:n], rng.Perm(r.blocks)[:n]
								f := starter(r, dir, src, dst)
								timedRun(b, d, f)
								st0 := d.CopyStats()
								lat := make([]time.Duration, 0, b.N)
								var starts time.Duration
								b.ResetTimer()
								for range b.N {
									w, s, _ := timedRun(b, d, f)
									lat = append(lat, w)
									starts += s
								}
								b.StopTimer()
								slices.Sort(lat)
								b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50-µs")
								b.ReportMetric(float64(lat[(len(lat)*99)/100].Nanoseconds())/1e3, "p99-µs")
								b.ReportMetric(float64(starts.Nanoseconds())/1e3/float64(b.N), "start-µs")
								reportPaths(b, d, st0, b.N)
							})
						}
					}
				})
			}
		})
	}
}

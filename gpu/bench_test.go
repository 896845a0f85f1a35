package gpu

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/layout"
)

var benchBytes = flag.Int("gpu.benchbytes", 64<<20, "bytes moved by each copy of BenchmarkCopyBandwidth")

// benchPaths are the paths the bandwidth and latency rows run: the
// default (the target rows) and each path forced.
var benchPaths = []Path{PathAuto, PathKernel, PathCopyEngine}

// pathRow names a path in a benchmark row.
func pathRow(p Path) string {
	return map[Path]string{PathAuto: "auto", PathKernel: "kernel", PathCopyEngine: "copyengine"}[p]
}

// benchRig is a rig (its engine on the copy engine: the contiguous
// baselines) with one more engine per path.
type benchRig struct {
	*rig
	eng map[Path]*CopyEngine
}

func newBenchRig(b *testing.B, d *Device, blocks, bb int) *benchRig {
	r := &benchRig{rig: newRig(b, d, blocks, bb, WithPath(PathCopyEngine)), eng: map[Path]*CopyEngine{}}
	for _, p := range benchPaths {
		e, err := d.NewCopyEngine(WithPath(p))
		noErr(b, err)
		r.eng[p] = e
		b.Cleanup(func() { noErr(b, e.Close()) })
	}
	return r
}

// fill writes random bytes (never zeros) into every source.
func (r *benchRig) fill(b *testing.B) {
	rng := rand.New(rand.NewPCG(uint64(r.bb), 1))
	fillRandom(rng, r.pin.a.host)
	total := r.blocks * r.bb
	chunk := make([]byte, min(total, 16<<20))
	for off := 0; off < total; off += len(chunk) {
		n := min(len(chunk), total-off)
		fillRandom(rng, chunk[:n])
		noErr(b, r.d.CopyFromHost(r.dev.Base().Add(off), chunk[:n]))
	}
}

// starter returns a function that starts one copy of dir on e, pairing
// block src[i] with block dst[i].
func starter(r *rig, e *CopyEngine, dir string, src, dst []int) func() (*kvlease.Transfer, error) {
	id := func(i int) kvlease.BlockID { return kvlease.BlockID(i) }
	switch dir {
	case "HtoD":
		pairs := make([]kvlease.CopyPair[[]byte, DevicePtr], len(src))
		for i := range pairs {
			pairs[i] = pair(r.pin.Region(id(src[i])), r.dev.Region(id(dst[i])))
		}
		return func() (*kvlease.Transfer, error) { return e.HostToDevice().Start(pairs, noAttach) }
	case "DtoH":
		pairs := make([]kvlease.CopyPair[DevicePtr, []byte], len(src))
		for i := range pairs {
			pairs[i] = pair(r.dev.Region(id(src[i])), r.pin.Region(id(dst[i])))
		}
		return func() (*kvlease.Transfer, error) { return e.DeviceToHost().Start(pairs, noAttach) }
	default: // DtoD
		pairs := make([]kvlease.CopyPair[DevicePtr, DevicePtr], len(src))
		for i := range pairs {
			pairs[i] = pair(r.dev.Region(id(src[i])), r.dev2.Region(id(dst[i])))
		}
		return func() (*kvlease.Transfer, error) { return e.DeviceToDevice().Start(pairs, noAttach) }
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

// reportPaths reports how the copies between st0 and st were carried, per
// copy started (ops of them): submissions by path, and the mean grid of
// the launches.
func reportPaths(b *testing.B, st0, st CopyStats, ops int) {
	n := float64(ops)
	b.ReportMetric(float64(st.BatchedSubmits-st0.BatchedSubmits)/n, "batched/op")
	b.ReportMetric(float64(st.LoopedSubmits-st0.LoopedSubmits)/n, "looped/op")
	b.ReportMetric(float64(st.KernelLaunches-st0.KernelLaunches)/n, "kernel/op")
	if l := st.KernelLaunches - st0.KernelLaunches; l > 0 {
		b.ReportMetric(float64(st.KernelCTAs-st0.KernelCTAs)/float64(l), "ctas")
	}
	if st.BatchFailures != st0.BatchFailures || st.KernelFailures != st0.KernelFailures || st.RingFull != st0.RingFull {
		b.Logf("path failures during the row: %v (kernel: %v)", st, st.KernelErr)
	}
}

// BenchmarkCopyBandwidth measures, in the same run, one copy of N blocks
// laid out contiguously on both sides (merged into a single copy on the
// copy engine: the link's ceiling) and one copy of the same N blocks
// scattered on both sides (random permutations, nothing merges: what a
// paged KV cache really moves). Each iteration does both and times them
// separately.
//
// Rows: <device>/<block>/<direction>/<path>, blocks of 4, 16, 64 and 256
// KiB, directions HtoD, DtoH and DtoD, paths auto (what an engine does by
// default: the target rows), kernel and copyengine (forced).
//
// Metrics: wall-clock bandwidth of both and their ratio; the same from
// GPU time (CUDA events around the copies; the worker's time on the
// fallback); the mean time Start took to return for the scattered copy;
// how the scattered copies were carried (submissions per copy by path, the
// launches' mean grid). Targets on a GPU (issue 35): scattered ≥ 0.90 ×
// contiguous for HtoD and DtoH (≥ 0.85 at 4 KiB) and ≥ 0.85 for DtoD from
// 16 KiB, on the auto path.
func BenchmarkCopyBandwidth(b *testing.B) {
	for _, k := range deviceKinds {
		if k.name == "fakecuda" {
			continue // memcpy behind a cgo call: nothing to learn
		}
		b.Run(k.name, func(b *testing.B) {
			d := k.open(b)
			for _, bb := range []int{4 << 10, 16 << 10, 64 << 10, 256 << 10} {
				// One rig per block size, shared by its sub-benchmarks
				// (this level's body runs once) and freed after them.
				b.Run(fmt.Sprintf("%dKiB", bb>>10), func(b *testing.B) {
					blocks := *benchBytes / bb
					if blocks < 2 {
						b.Fatalf("-gpu.benchbytes %d holds fewer than 2 blocks of %d", *benchBytes, bb)
					}
					r := newBenchRig(b, d, blocks, bb)
					r.fill(b)
					for _, dir := range []string{"HtoD", "DtoH", "DtoD"} {
						for _, p := range benchPaths {
							b.Run(dir+"/"+pathRow(p), func(b *testing.B) { benchCopy(b, r, dir, p) })
						}
					}
				})
			}
		})
	}
}

func benchCopy(b *testing.B, r *benchRig, dir string, p Path) {
	blocks, total := r.blocks, r.blocks*r.bb
	rng := rand.New(rand.NewPCG(uint64(r.bb), 2))
	srcPerm, dstPerm := rng.Perm(blocks), rng.Perm(blocks)
	ident := make([]int, blocks)
	for i := range ident {
		ident[i] = i
	}
	contiguous, scattered := starter(r.rig, r.e, dir, ident, ident), starter(r.rig, r.eng[p], dir, srcPerm, dstPerm)
	d := r.d
	setTiming(d, true)
	defer setTiming(d, false)
	timedRun(b, d, contiguous) // warm up: first touch, driver caches, the kernel's JIT, the calibration
	timedRun(b, d, scattered)
	st0 := d.CopyStats()
	b.ResetTimer()
	var tc, ts, gc, gs, st time.Duration
	for range b.N {
		w, _, g := timedRun(b, d, contiguous)
		tc, gc = tc+w, gc+g
		w, s, g := timedRun(b, d, scattered)
		ts, gs, st = ts+w, gs+g, st+s
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
	// The contiguous copies are one looped submission each; count the
	// scattered ones only.
	stn := d.CopyStats()
	stn.LoopedSubmits -= int64(b.N)
	reportPaths(b, st0, stn, b.N)
}

// BenchmarkCopyLatency measures the latency of small scattered copies
// (Start until the transfer resolves) of 8 and 64 blocks of 16 KiB, in
// each direction, on the default path and on the copy engine: p50 and
// p99, the mean time Start took to return, and the paths that carried
// them. Targets on a GPU (issue 35), HtoD on the auto path: p50 ≤ 20 µs
// for 8 blocks, ≤ 40 µs for 64.
func BenchmarkCopyLatency(b *testing.B) {
	for _, k := range deviceKinds {
		if k.name == "fakecuda" {
			continue
		}
		b.Run(k.name, func(b *testing.B) {
			d := k.open(b)
			const bb = 16 << 10
			b.Run(fmt.Sprintf("%dKiB", bb>>10), func(b *testing.B) {
				r := newBenchRig(b, d, 256, bb)
				for _, dir := range []string{"HtoD", "DtoH", "DtoD"} {
					for _, n := range []int{8, 64} {
						for _, p := range []Path{PathAuto, PathCopyEngine} {
							b.Run(fmt.Sprintf("%s/%dblocks/%s", dir, n, pathRow(p)), func(b *testing.B) {
								rng := rand.New(rand.NewPCG(uint64(bb), uint64(n)))
								src, dst := rng.Perm(r.blocks)[:n], rng.Perm(r.blocks)[:n]
								f := starter(r.rig, r.eng[p], dir, src, dst)
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
								reportPaths(b, st0, d.CopyStats(), b.N)
							})
						}
					}
				}
			})
		})
	}
}

// BenchmarkLayeredRoundTrip measures per-layer KV at realistic sizes: a
// layer-separated device memory (vLLM's [2, blocks, tokens, heads, dim]
// per layer) and a block-contiguous pinned host memory, 32 layers × K and
// V, offloaded and onloaded (one Start per direction, each one launch or
// one batch), next to the same bytes copied as one contiguous copy each
// way in the same run. Pieces of 32 KiB (Llama-3-8B: 8 KV heads × 128 dims
// × bf16 × 16 tokens) and of 1 KiB. Targets on a GPU (issue 35), auto
// path: ≥ 0.85 of contiguous at 32 KiB, ≥ 0.60 at 1 KiB.
func BenchmarkLayeredRoundTrip(b *testing.B) {
	for _, k := range deviceKinds {
		if k.name == "fakecuda" {
			continue
		}
		b.Run(k.name, func(b *testing.B) {
			d := k.open(b)
			for _, c := range []struct{ piece, blocks int }{{32 << 10, 32}, {1 << 10, 256}} {
				b.Run(fmt.Sprintf("%dKiB", c.piece>>10), func(b *testing.B) { benchLayered(b, d, c.piece, c.blocks) })
			}
		})
	}
}

func benchLayered(b *testing.B, d *Device, piece, blocks int) {
	const layers = 32
	dev, err := d.AllocLayered(layout.LayerSeparated(layers, 2, blocks, piece, "bf16"))
	noErr(b, err)
	host, err := d.AllocLayeredPinned(layout.Contiguous(layers, 2, blocks, piece, "bf16"))
	noErr(b, err)
	auto, err := d.NewCopyEngine()
	noErr(b, err)
	ce, err := d.NewCopyEngine(WithPath(PathCopyEngine))
	noErr(b, err)
	b.Cleanup(func() { noErr(b, auto.Close()); noErr(b, ce.Close()); noErr(b, dev.Close()); noErr(b, host.Close()) })
	fillRandom(rand.New(rand.NewPCG(uint64(piece), 3)), host.arena.a.host)
	off := make([]kvlease.CopyPair[DeviceBlock, HostBlock], blocks)
	on := make([]kvlease.CopyPair[HostBlock, DeviceBlock], blocks)
	for i := range blocks {
		id := kvlease.BlockID(i)
		off[i] = kvlease.CopyPair[DeviceBlock, HostBlock]{Src: dev.Region(id), Dst: host.Region(id)}
		on[i] = kvlease.CopyPair[HostBlock, DeviceBlock]{Src: host.Region(id), Dst: dev.Region(id)}
	}
	// The contiguous baseline: the whole arenas, block i to block i (one
	// merged copy each way).
	n := dev.arena.Blocks()
	cdown := make([]kvlease.CopyPair[DevicePtr, []byte], n)
	cup := make([]kvlease.CopyPair[[]byte, DevicePtr], n)
	for i := range n {
		id := kvlease.BlockID(i)
		cdown[i] = pair(dev.arena.Region(id), host.arena.Region(id))
		cup[i] = pair(host.arena.Region(id), dev.arena.Region(id))
	}
	wait := func(tr *kvlease.Transfer, err error) {
		noErr(b, err)
		<-tr.Done()
		noErr(b, tr.Err())
	}
	layered := func() {
		wait(auto.LayeredHostToDevice().Start(on, noAttach))
		wait(auto.LayeredDeviceToHost().Start(off, noAttach))
	}
	contiguous := func() {
		wait(ce.HostToDevice().Start(cup, noAttach))
		wait(ce.DeviceToHost().Start(cdown, noAttach))
	}
	layered() // warm up, calibrate
	contiguous()
	st0 := d.CopyStats()
	var tl, tc time.Duration
	b.ResetTimer()
	for range b.N {
		t0 := time.Now()
		layered()
		tl += time.Since(t0)
		t0 = time.Now()
		contiguous()
		tc += time.Since(t0)
	}
	b.StopTimer()
	bytes := float64(2*dev.arena.Size()) * float64(b.N)
	b.ReportMetric(bytes/tl.Seconds()/1e9, "layered-GB/s")
	b.ReportMetric(bytes/tc.Seconds()/1e9, "contig-GB/s")
	b.ReportMetric(tc.Seconds()/tl.Seconds(), "layered/contig")
	st := d.CopyStats()
	st.LoopedSubmits -= 2 * int64(b.N) // the contiguous copies
	reportPaths(b, st0, st, 2*b.N)
}

// BenchmarkStart measures the host work of a Start: validating n scattered
// pairs, building the copies, writing the kernel's table or the copy
// engine's arrays, and the driver call that enqueues them, timed from the
// call to its return (the copies themselves run after). ns/piece is the
// number to watch (issue 35: ≤ 50 ns a piece at 1,024 pieces on the
// kernel path; the median Start, mean-ns/piece the mean), with the copy
// engine's in the same run (x-copyengine: the kernel path's time over the
// copy engine's); allocs/start counts the allocations of one Start (the
// transfer it returns is one).
func BenchmarkStart(b *testing.B) {
	for _, k := range deviceKinds {
		b.Run(k.name, func(b *testing.B) {
			d := k.open(b)
			for _, n := range []int{8, 1024} {
				b.Run(fmt.Sprint(n), func(b *testing.B) {
					r := newBenchRig(b, d, n, 4096)
					rng := rand.New(rand.NewPCG(1, 1))
					src, dst := rng.Perm(n), rng.Perm(n)
					var ceNs float64
					for _, p := range []Path{PathCopyEngine, PathKernel} {
						b.Run(pathRow(p), func(b *testing.B) {
							ns, mean, allocs := benchStart(b, r, p, src, dst)
							b.ReportMetric(ns/float64(n), "ns/piece")
							b.ReportMetric(mean/float64(n), "mean-ns/piece")
							b.ReportMetric(allocs, "allocs/start")
							if p == PathCopyEngine {
								ceNs = ns
							} else if ceNs > 0 {
								b.ReportMetric(ns/ceNs, "x-copyengine")
							}
						})
					}
				})
			}
		})
	}
}

// benchStart times b.N Starts of the scattered offload on the engine of
// path p (waiting for each between timings) and counts one Start's
// allocations: the median and the mean ns per Start (the median is what a
// Start costs; the mean adds the preemptions of a loaded machine), and
// allocations per Start.
func benchStart(b *testing.B, r *benchRig, p Path, src, dst []int) (float64, float64, float64) {
	e := r.eng[p]
	pairs := make([]kvlease.CopyPair[DevicePtr, []byte], len(src))
	for i := range pairs {
		pairs[i] = pair(r.dev.Region(kvlease.BlockID(src[i])), r.pin.Region(kvlease.BlockID(dst[i])))
	}
	done := make(chan struct{}, 1)
	signal := func(error) { done <- struct{}{} }
	one := func() time.Duration {
		t0 := time.Now()
		tr, err := e.DeviceToHost().Start(pairs, noAttach)
		el := time.Since(t0)
		if err != nil {
			b.Fatal(err)
		}
		tr.OnResolve(signal)
		<-done
		return el
	}
	one() // warm up: the ring, the job, the kernel
	st0 := r.d.CopyStats()
	var total time.Duration
	times := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for range b.N {
		el := one()
		total += el
		times = append(times, el)
	}
	b.StopTimer()
	reportPaths(b, st0, r.d.CopyStats(), b.N)
	allocs := testing.AllocsPerRun(20, func() { one() })
	slices.Sort(times)
	return float64(times[len(times)/2].Nanoseconds()), float64(total.Nanoseconds()) / float64(b.N), allocs
}

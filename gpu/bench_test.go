package gpu

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
)

var benchBytes = flag.Int("gpu.benchbytes", 64<<20, "bytes moved by each copy of BenchmarkCopyBandwidth")

// BenchmarkCopyBandwidth measures, in the same run, one copy of N blocks
// laid out contiguously on both sides (the engine merges them into a single
// copy: the bandwidth ceiling) and one copy of the same N blocks scattered
// on both sides (random permutations, nothing merges: what a paged KV cache
// really moves). Each iteration does both and times them separately; the
// metrics are the two bandwidths and their ratio. Target on a GPU: a ratio
// of at least 0.80 for blocks of 64 KiB and more.
//
// On a CUDA device with cuMemcpyBatchAsync, the scattered copy runs both
// batched and as a loop of cuMemcpyAsync ("/batch", "/loop").
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
					for _, dir := range []string{"HtoD", "DtoH", "DtoD"} {
						for _, mode := range modes {
							b.Run(dir+mode, func(b *testing.B) {
								setBatch(d, mode != "/loop")
								defer setBatch(d, true)
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

func benchCopy(b *testing.B, r *rig, dir string) {
	blocks, total := r.blocks, r.blocks*r.bb
	rng := rand.New(rand.NewPCG(uint64(r.bb), 2))
	srcPerm, dstPerm := rng.Perm(blocks), rng.Perm(blocks)
	ident := make([]int, blocks)
	for i := range ident {
		ident[i] = i
	}
	id := func(i int) kvlease.BlockID { return kvlease.BlockID(i) }

	// start returns a function that starts one copy of all blocks with the
	// given layout.
	start := func(src, dst []int) func() (*kvlease.Transfer, error) {
		switch dir {
		case "HtoD":
			pairs := make([]kvlease.CopyPair[[]byte, DevicePtr], blocks)
			for i := range pairs {
				pairs[i] = pair(r.pin.Region(id(src[i])), r.dev.Region(id(dst[i])))
			}
			return func() (*kvlease.Transfer, error) { return r.e.HostToDevice().Start(pairs, noAttach) }
		case "DtoH":
			pairs := make([]kvlease.CopyPair[DevicePtr, []byte], blocks)
			for i := range pairs {
				pairs[i] = pair(r.dev.Region(id(src[i])), r.pin.Region(id(dst[i])))
			}
			return func() (*kvlease.Transfer, error) { return r.e.DeviceToHost().Start(pairs, noAttach) }
		default:
			pairs := make([]kvlease.CopyPair[DevicePtr, DevicePtr], blocks)
			for i := range pairs {
				pairs[i] = pair(r.dev.Region(id(src[i])), r.dev2.Region(id(dst[i])))
			}
			return func() (*kvlease.Transfer, error) { return r.e.DeviceToDevice().Start(pairs, noAttach) }
		}
	}
	contiguous, scattered := start(ident, ident), start(srcPerm, dstPerm)
	run := func(f func() (*kvlease.Transfer, error)) time.Duration {
		t0 := time.Now()
		tr, err := f()
		if err != nil {
			b.Fatal(err)
		}
		<-tr.Done()
		if err := tr.Err(); err != nil {
			b.Fatal(err)
		}
		return time.Since(t0)
	}
	run(contiguous) // warm up: first-touch, driver caches
	run(scattered)
	b.ResetTimer()
	var tc, ts time.Duration
	for range b.N {
		tc += run(contiguous)
		ts += run(scattered)
	}
	b.StopTimer()
	gbps := func(d time.Duration) float64 { return float64(total) * float64(b.N) / d.Seconds() / 1e9 }
	b.ReportMetric(gbps(tc), "contig-GB/s")
	b.ReportMetric(gbps(ts), "scatter-GB/s")
	b.ReportMetric(gbps(ts)/gbps(tc), "scatter/contig")
}

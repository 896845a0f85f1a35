package gpu

import (
	"strings"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/layout"
)

// The number: a per-layer copy of 64 blocks × 32 layers (× K and
// V: 4096 pieces) is one submission per direction. layeredRig holds the
// two sides: layer-separated device memory, block-contiguous pinned host
// memory, so no two pieces merge and every piece is its own copy.
type layeredRig struct {
	d    *Device
	e    *CopyEngine
	dev  *LayeredDevice
	host *LayeredPinned
	off  []kvlease.CopyPair[DeviceBlock, HostBlock]
	on   []kvlease.CopyPair[HostBlock, DeviceBlock]
}

const lrBlocks, lrLayers = 64, 32

func newLayeredRig(t testing.TB, d *Device) *layeredRig {
	t.Helper()
	r := &layeredRig{d: d}
	var err error
	r.dev, err = d.AllocLayered(layout.LayerSeparated(lrLayers, 2, lrBlocks, Alignment, "bf16"))
	noErr(t, err)
	r.host, err = d.AllocLayeredPinned(layout.Contiguous(lrLayers, 2, lrBlocks, Alignment, "bf16"))
	noErr(t, err)
	r.e, err = d.NewCopyEngine()
	noErr(t, err)
	t.Cleanup(func() { noErr(t, r.e.Close()); noErr(t, r.dev.Close()); noErr(t, r.host.Close()) })
	for i := range lrBlocks {
		id := kvlease.BlockID(i)
		r.off = append(r.off, kvlease.CopyPair[DeviceBlock, HostBlock]{Src: r.dev.Region(id), Dst: r.host.Region(id)})
		r.on = append(r.on, kvlease.CopyPair[HostBlock, DeviceBlock]{Src: r.host.Region(id), Dst: r.dev.Region(id)})
	}
	return r
}

func submits(d *Device) (subs, copies int64) {
	s := d.CopyStats()
	return s.BatchedSubmits + s.LoopedSubmits + s.KernelLaunches, s.BatchedCopies + s.LoopedCopies + s.KernelCopies
}

// roundTrip offloads and onloads the 64 blocks: one Start per direction.
func (r *layeredRig) roundTrip(t testing.TB) {
	tr, err := r.e.LayeredDeviceToHost().Start(r.off, noAttach)
	noErr(t, err)
	<-tr.Done()
	noErr(t, tr.Err())
	tr, err = r.e.LayeredHostToDevice().Start(r.on, noAttach)
	noErr(t, err)
	<-tr.Done()
	noErr(t, tr.Err())
}

// TestLayered64x32OneDriverCallPerDirection counts what the device's own
// counters say reached the driver: on the fake CUDA driver (the cgo path
// a GPU takes) each direction is one launch of the copy kernel (or, on
// the copy engine, one cuMemcpyBatchAsync) of 4096 copies; on the
// fallback one worker job; on a real GPU, when there is one, the same as
// on the fake driver.
func TestLayered64x32OneDriverCallPerDirection(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		r := newLayeredRig(t, d)
		s0, c0 := submits(d)
		st0 := d.CopyStats()
		tr, err := r.e.LayeredDeviceToHost().Start(r.off, noAttach)
		noErr(t, err)
		<-tr.Done()
		noErr(t, tr.Err())
		s1, c1 := submits(d)
		if s1-s0 != 1 || c1-c0 != lrBlocks*lrLayers*2 {
			t.Fatalf("offload of %d blocks × %d layers: %d submissions of %d copies, want 1 of %d", lrBlocks, lrLayers, s1-s0, c1-c0, lrBlocks*lrLayers*2)
		}
		tr, err = r.e.LayeredHostToDevice().Start(r.on, noAttach)
		noErr(t, err)
		<-tr.Done()
		noErr(t, tr.Err())
		s2, c2 := submits(d)
		if s2-s1 != 1 || c2-c1 != lrBlocks*lrLayers*2 {
			t.Fatalf("onload: %d submissions of %d copies, want 1 of %d", s2-s1, c2-c1, lrBlocks*lrLayers*2)
		}
		st := d.CopyStats()
		if strings.HasSuffix(t.Name(), "/fakecuda") && !st.KernelEnabled {
			t.Fatalf("the fake driver runs the kernel, but it is off: %v", st)
		}
		calls := st.BatchedSubmits + st.KernelLaunches - st0.BatchedSubmits - st0.KernelLaunches
		if !d.IsHost() && (st.BatchEnabled || st.KernelEnabled) && calls != 2 {
			t.Fatalf("%d batch calls and launches for the round trip, want 2 (%v)", calls, st)
		}
	})
}

// BenchmarkLayered64x32 measures the round trip of 64 blocks × 32 layers
// (4096 pieces of 256 B each way) batched into one Start per direction,
// next to its baseline in the same run: the same pieces copied with one
// DeviceToHost/HostToDevice Start per piece, what an engine that knows no
// layout does. submits/op counts submissions (driver calls on a GPU) of
// the batched round trip, base-submits/op the baseline's; x-perpiece is
// the ratio of the batched time to the baseline's.
func BenchmarkLayered64x32(b *testing.B) {
	for _, k := range deviceKinds {
		b.Run(k.name, func(b *testing.B) {
			d := k.open(b)
			r := newLayeredRig(b, d)
			perPiece := func() {
				for l := range lrLayers {
					for kv := range 2 {
						for i := range lrBlocks {
							id := kvlease.BlockID(i)
							tr, err := r.e.DeviceToHost().Start([]kvlease.CopyPair[DevicePtr, []byte]{{Src: r.dev.Piece(id, l, kv), Dst: r.host.Piece(id, l, kv)}}, noAttach)
							noErr(b, err)
							<-tr.Done()
						}
					}
				}
				for l := range lrLayers {
					for kv := range 2 {
						for i := range lrBlocks {
							id := kvlease.BlockID(i)
							tr, err := r.e.HostToDevice().Start([]kvlease.CopyPair[[]byte, DevicePtr]{{Src: r.host.Piece(id, l, kv), Dst: r.dev.Piece(id, l, kv)}}, noAttach)
							noErr(b, err)
							<-tr.Done()
						}
					}
				}
			}
			var base time.Duration
			var baseSubs, subs int64
			b.SetBytes(2 * lrBlocks * lrLayers * 2 * Alignment)
			b.ResetTimer()
			for range b.N {
				b.StopTimer()
				s0, _ := submits(d)
				start := time.Now()
				perPiece()
				base += time.Since(start)
				s1, _ := submits(d)
				baseSubs += s1 - s0
				b.StartTimer()
				r.roundTrip(b)
				b.StopTimer()
				s2, _ := submits(d)
				subs += s2 - s1
				b.StartTimer()
			}
			b.StopTimer()
			baseNs := float64(base.Nanoseconds()) / float64(b.N)
			b.ReportMetric(float64(subs)/float64(b.N), "submits/op")
			b.ReportMetric(float64(baseSubs)/float64(b.N), "base-submits/op")
			b.ReportMetric(baseNs, "base-ns/op")
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/baseNs, "x-perpiece")
		})
	}
}

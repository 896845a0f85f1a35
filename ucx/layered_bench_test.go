package ucx_test

import (
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/layout"
	"github.com/kvlease/kvlease/ucx"
)

// BenchmarkLayeredPull64x32 is one handoff of 64 consecutive blocks
// (the middle half of 128-block pools) of a 32-layer model (K and V
// pieces of 4 KiB: 256 KiB blocks, 16 MiB in all) over UCX_TLS=tcp on
// loopback, from a layer-separated source (64 registrations: one per
// layer and kind) into a block-contiguous destination (one get per
// piece: 4096; also with 128 gets outstanding instead of 16, since small
// gets are bound by the window) and into a layer-separated one (one get
// per layer and kind: 64). Its baseline, measured in the same run,
// interleaved, is the same bytes as 64 plain contiguous blocks (16 gets
// of 1 MiB); ratio is ours over the baseline's MB/s.
func BenchmarkLayeredPull64x32(b *testing.B) {
	const blocks, layers, piece = 64, 32, 4 << 10
	const bb = layers * 2 * piece
	for _, c := range []struct {
		name   string
		dst    func(layers, kvs, blocks, pieceBytes int, tag string) layout.Layout
		window int
	}{
		{"to=contiguous", layout.Contiguous, 16},
		{"to=contiguous,window=128", layout.Contiguous, 128},
		{"to=separated", layout.LayerSeparated, 16},
	} {
		b.Run(c.name, func(b *testing.B) {
			ls, err := ucx.NewSender(ucx.Config{}, ucx.LayeredPieces[layout.Block])
			if err != nil {
				b.Fatal(err)
			}
			defer ls.Close()
			lr, err := ucx.NewReceiver(ucx.Config{Window: c.window}, ucx.LayeredPieces[layout.Block])
			if err != nil {
				b.Fatal(err)
			}
			defer lr.Close()
			s, err := ucx.NewSender(ucx.Config{}, ucx.HostBytes)
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			r, err := ucx.NewReceiver(ucx.Config{}, ucx.HostBytes)
			if err != nil {
				b.Fatal(err)
			}
			defer r.Close()
			srcH, err := layout.NewHost(layout.LayerSeparated(layers, 2, 2*blocks, piece, "b"))
			if err != nil {
				b.Fatal(err)
			}
			dstH, err := layout.NewHost(c.dst(layers, 2, 2*blocks, piece, "b"))
			if err != nil {
				b.Fatal(err)
			}
			var src, dst []layout.Block
			for i := range blocks {
				id := kvlease.BlockID(blocks/2 + i)
				src, dst = append(src, srcH.Region(id)), append(dst, dstH.Region(id))
			}
			psrc, pdst := benchRegions(blocks, bb), benchRegions(blocks, bb)
			b.SetBytes(blocks * bb)
			var base, ours time.Duration
			b.ResetTimer()
			for i := range b.N {
				id := handoff.PlaneID{Session: 1, Handoff: uint64(i)}
				t0 := time.Now()
				moveOnce(b, ls, lr, id, src, dst)
				t1 := time.Now()
				b.StopTimer()
				moveOnce(b, s, r, id, psrc, pdst)
				base += time.Since(t1)
				b.StartTimer()
				ours += t1.Sub(t0)
			}
			b.StopTimer()
			mb := float64(b.N) * blocks * bb / base.Seconds() / 1e6
			mo := float64(b.N) * blocks * bb / ours.Seconds() / 1e6
			b.ReportMetric(mb, "contiguous-MB/s")
			b.ReportMetric(mo, "ours-MB/s")
			b.ReportMetric(mo/mb, "ratio")
			b.ReportMetric(float64(lr.Stats().Gets)/float64(b.N), "gets/op")
			b.ReportMetric(float64(ls.Stats().Registrations)/float64(b.N), "src-regs/op")
		})
	}
}

package tcp

import (
	"net"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// BenchmarkRuns: a handoff of 256 blocks of 4 KiB over loopback (both
// halves in this process, one sender and one receiver for the run),
// with the blocks scattered (every other block of an arena, on both
// sides), contiguous (one run of ids) and as the same bytes in one
// buffer (one 1 MiB block), unkeyed (crc32c) and keyed (AES-GMAC), all in
// the same run, alternating. It prints each layout's MB/s, the
// descriptors per handoff (frames: one header, one gathered write and
// one check each) and the contiguous and scattered figures as a
// percentage of the one-buffer one. Goal: contiguous ≥ 80 % of one
// buffer.
func BenchmarkRuns(b *testing.B) {
	const bb, n = 4 << 10, 256
	for _, mode := range []string{"crc32c", "gmac"} {
		b.Run(mode, func(b *testing.B) {
			srcID, dstID := handoff.PlaneID{Handoff: 1}, handoff.PlaneID{Handoff: 1}
			if mode == "gmac" {
				srcID, dstID = secureID(b, 1)
			}
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			r := NewReceiver(ln, Config{})
			defer r.Close()
			s := NewSender(Config{})
			defer s.Close()
			one := func(seed byte) [][]byte { return [][]byte{layoutRegions(b, "contiguous", 1, n*bb, seed)[0]} }
			layouts := []struct {
				name     string
				src, dst [][]byte
			}{
				{"scattered", layoutRegions(b, "scattered", n, bb, 1), layoutRegions(b, "scattered", n, bb, 2)},
				{"contiguous", layoutRegions(b, "contiguous", n, bb, 1), layoutRegions(b, "contiguous", n, bb, 2)},
				{"one-buffer", one(1), one(2)},
			}
			move := func(src, dst [][]byte) time.Duration {
				start := time.Now()
				accept, err := r.Prepare(dstID, len(dst))
				if err != nil {
					b.Fatal(err)
				}
				var st, rt *kvlease.Transfer
				if _, err := s.Send(srcID, src, accept, func(t *kvlease.Transfer) error { st = t; return nil }); err != nil {
					b.Fatal(err)
				}
				if err := r.Receive(dstID, dst, nil, func(t *kvlease.Transfer) error { rt = t; return nil }); err != nil {
					b.Fatal(err)
				}
				<-st.Done()
				<-rt.Done()
				if st.Err() != nil || rt.Err() != nil {
					b.Fatalf("sender %v, receiver %v", st.Err(), rt.Err())
				}
				return time.Since(start)
			}
			for _, l := range layouts {
				move(l.src, l.dst) // warm
			}
			took := make([]time.Duration, len(layouts))
			b.ReportAllocs()
			b.ResetTimer()
			for k := range b.N {
				for j := range layouts {
					i := (k + j) % len(layouts)
					took[i] += move(layouts[i].src, layouts[i].dst)
				}
			}
			b.StopTimer()
			mb := float64(n*bb) * float64(b.N) / 1e6
			for i, l := range layouts {
				b.ReportMetric(mb/took[i].Seconds(), l.name+"-MB/s")
				b.ReportMetric(float64(len(frames(nil, l.src))), l.name+"-desc/handoff")
				if i < 2 {
					b.ReportMetric(100*took[2].Seconds()/took[i].Seconds(), l.name+"-%-of-one-buffer")
				}
			}
		})
	}
}

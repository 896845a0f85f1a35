package tcp_test

import (
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// BenchmarkStream: how long after the prefill's last write (its last
// WroteLayers) the handoff is Delivered at the source, streaming (the
// handoff proposed when the prefill starts, each layer sent as it is
// marked) against start-after-prefill (proposed once the prefill is
// done: propose, accept, start, the whole copy, done), in the same run,
// both halves in this process over 127.0.0.1.
//
// Sizes: 64 blocks of 64 KiB (4 MiB) written as 32 layers, 1 ms of
// compute per layer: one layer's share is 64 parts of 2 KiB (128 KiB),
// large enough that sending it takes measurable time, small enough that
// it goes out well within the next layer's compute. The baseline "one
// layer" is the time to send one layer's share alone: a handoff
// (propose → Delivered) of 64 blocks of 2 KiB over the same kind of
// halves. Goal: streaming ≤ one layer (stream/layer ≤ 1), where
// start-after-prefill pays the whole copy (after/layer ≫ 1).
//
// layer-plane-us is the floor under "one layer": the same bytes over the
// plane alone (dial, hello, the bytes, both transfers resolved; no
// control messages, unkeyed). Streaming's time still includes the
// destination's Done travelling back, so it is compared with both.
//
// Metrics (means over the iterations): stream-us, after-us, layer-us,
// layer-plane-us and the ratios stream/layer, after/layer, stream/after
// and stream/layer-plane.
//
//	go test -run XXX -bench BenchmarkStream -benchtime 20x ./handoff/tcp/
func BenchmarkStream(b *testing.B) {
	const (
		blocks = 64
		layers = 32
		bb     = 64 << 10
		delay  = time.Millisecond
	)
	for _, auth := range []string{"psk", "none"} {
		b.Run(auth, func(b *testing.B) {
			o := streamOpts{insecure: auth == "none", deadline: time.Minute}
			big := benchEnv(bb, 4*blocks)
			srcPool, dstPool := hostPool2(b, 4*blocks, bb), hostPool2(b, 4*blocks, bb)
			h := newStreamHalves(b, srcPool, dstPool, big, flat, flatRecv, o)
			small := benchEnv(bb/layers, 4*blocks)
			sSrc, sDst := hostPool2(b, 4*blocks, bb/layers), hostPool2(b, 4*blocks, bb/layers)
			hs := newStreamHalves(b, sSrc, sDst, small, flat, flatRecv, o)

			lease, err := srcPool.Acquire("bench", blocks)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(lease.Release)
			one, err := sSrc.Acquire("layer", blocks)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(one.Release)
			var id uint64
			// deliver waits for out to be Delivered on both sides and
			// releases the destination's lease.
			deliver := func(h *streamHalves[[]byte, []byte], out *handoff.Outgoing[[]byte]) {
				select {
				case <-out.Done():
				case <-time.After(bound):
					b.Fatalf("handoff %d still %v", out.ID(), out.State())
				}
				if out.State() != handoff.Delivered {
					b.Fatalf("handoff %d: %v %v", out.ID(), out.State(), out.Err())
				}
				in := <-h.finals
				if in.State() != handoff.Delivered {
					b.Fatalf("destination %v", in.State())
				}
				in.Lease().Release()
			}
			compute := func(p *handoff.Progress) time.Time {
				for l := range layers {
					time.Sleep(delay)
					if p != nil {
						_ = p.WroteLayers(l + 1)
					}
				}
				return time.Now()
			}
			streaming := func() time.Duration {
				id++
				p, _ := handoff.NewProgress(blocks, layers)
				out, err := h.src.Propose(id, "bench", lease, nil, handoff.Streaming(p))
				if err != nil {
					b.Fatal(err)
				}
				last := compute(p)
				deliver(h, out)
				return time.Since(last)
			}
			after := func() time.Duration {
				id++
				last := compute(nil)
				out, err := h.src.Propose(id, "bench", lease, nil)
				if err != nil {
					b.Fatal(err)
				}
				deliver(h, out)
				return time.Since(last)
			}
			layer := func() time.Duration {
				id++
				start := time.Now()
				out, err := hs.src.Propose(id, "layer", one, nil)
				if err != nil {
					b.Fatal(err)
				}
				deliver(hs, out)
				return time.Since(start)
			}
			// plane sends one layer's share over the plane alone (dial,
			// hello, the bytes, the receiver's resolve; no control
			// messages, unkeyed): the floor under layer.
			src, dst := make([][]byte, blocks), make([][]byte, blocks)
			for i := range blocks {
				src[i], dst[i] = make([]byte, bb/layers), make([]byte, bb/layers)
			}
			plane := func() time.Duration {
				id++
				pid := handoff.PlaneID{Session: 1 << 40, Handoff: id}
				start := time.Now()
				accept, err := hs.recv.Prepare(pid, blocks)
				if err != nil {
					b.Fatal(err)
				}
				var st, rt *kvlease.Transfer
				if _, err := hs.sender.Send(pid, src, accept, func(t *kvlease.Transfer) error { st = t; return nil }); err != nil {
					b.Fatal(err)
				}
				if err := hs.recv.Receive(pid, dst, nil, func(t *kvlease.Transfer) error { rt = t; return nil }); err != nil {
					b.Fatal(err)
				}
				<-st.Done()
				<-rt.Done()
				if st.Err() != nil || rt.Err() != nil {
					b.Fatalf("sender %v, receiver %v", st.Err(), rt.Err())
				}
				return time.Since(start)
			}
			streaming()
			after()
			layer()
			plane()
			var st, at, lt, pt time.Duration
			b.ResetTimer()
			for k := range b.N {
				// Alternate the order so neither pays for the other's
				// leftovers.
				if k%2 == 0 {
					st += streaming()
					at += after()
				} else {
					at += after()
					st += streaming()
				}
				lt += layer()
				pt += plane()
			}
			b.StopTimer()
			us := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(b.N) }
			b.ReportMetric(us(st), "stream-us")
			b.ReportMetric(us(at), "after-us")
			b.ReportMetric(us(lt), "layer-us")
			b.ReportMetric(us(pt), "layer-plane-us")
			b.ReportMetric(st.Seconds()/lt.Seconds(), "stream/layer")
			b.ReportMetric(at.Seconds()/lt.Seconds(), "after/layer")
			b.ReportMetric(st.Seconds()/at.Seconds(), "stream/after")
			b.ReportMetric(st.Seconds()/pt.Seconds(), "stream/layer-plane")
			if s := h.sender.Stats(); s.Failed != 0 {
				b.Fatalf("sender %+v", s)
			}
		})
	}
}

// benchEnv is the envelope of BenchmarkStream's halves: blocks of bb
// bytes, a context of up to the whole pool.
func benchEnv(bb, poolBlocks int) handoff.Envelope {
	return handoff.Envelope{BlockTokens: 16, BlockBytes: bb, PoolBlocks: poolBlocks,
		MaxContextTokens: 16 * poolBlocks, MaxPrefillTokens: 16 * poolBlocks, MaxRunningRequests: 4}
}

package ucx_test

import (
	"testing"
	"time"

	"github.com/kvlease/kvlease/handoff"
)

// BenchmarkStream: how long after the prefill's last write (its last
// WroteLayers) the handoff is Delivered at the source, streaming (the
// handoff proposed when the prefill starts, each (run, layer) message
// sent as it is marked) against start-after-prefill (proposed once the
// prefill is done: propose, accept, start, the whole copy, done), in the
// same run, both halves in this process over UCX_TLS=tcp on 127.0.0.1,
// PSK-authenticated (keyed block sums), connections reused.
//
// Sizes: 64 blocks of 64 KiB (4 MiB, one run: 4 messages of 1 MiB)
// written as 32 layers, 1 ms of compute per layer: one layer's share is
// 128 KiB. The baseline "one layer" is the time to send one layer's
// share alone: a handoff (propose → Delivered) of 64 blocks of 2 KiB
// over halves of the same kind. Goal: streaming ≤ one layer
// (stream/layer ≤ 1), where start-after-prefill pays the whole copy
// (after/layer ≫ 1). Streaming's time includes the last layer's
// messages, the block sums' check at the destination and its Done.
//
// Metrics (means over the iterations): stream-us, after-us, layer-us
// and the ratios stream/layer, after/layer, stream/after.
//
//	go test -run XXX -bench BenchmarkStream -benchtime 20x .
func BenchmarkStream(b *testing.B) {
	const (
		blocks = 64
		layers = 32
		bb     = 64 << 10
		delay  = time.Millisecond
	)
	h := newLoop(b, loopConfig{keepLeases: true, blockBytes: bb, poolBlocks: 2 * blocks, deadline: time.Minute})
	hs := newLoop(b, loopConfig{keepLeases: true, blockBytes: bb / layers, poolBlocks: 2 * blocks, deadline: time.Minute})
	lease, err := h.srcPool.Acquire("bench", blocks)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(lease.Release)
	one, err := hs.srcPool.Acquire("layer", blocks)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(one.Release)
	var id uint64
	deliver := func(l *loop, out *handoff.Outgoing[[]byte]) {
		select {
		case <-out.Done():
		case <-time.After(bound):
			b.Fatalf("handoff %d still %v", out.ID(), out.State())
		}
		if out.State() != handoff.Delivered {
			b.Fatalf("handoff %d: %v %v", out.ID(), out.State(), out.Err())
		}
		for range 10000 { // the destination's final comes on its own goroutine
			l.mu.Lock()
			in := l.finals[out.ID()]
			delete(l.finals, out.ID())
			l.mu.Unlock()
			if in != nil {
				if in.State() != handoff.Delivered {
					b.Fatalf("destination %v", in.State())
				}
				in.Lease().Release()
				return
			}
			time.Sleep(100 * time.Microsecond)
		}
		b.Fatalf("destination never finished handoff %d", out.ID())
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
	streaming()
	after()
	layer()
	var st, at, lt time.Duration
	b.ResetTimer()
	for k := range b.N {
		// Alternate the order so neither pays for the other's leftovers.
		if k%2 == 0 {
			st += streaming()
			at += after()
		} else {
			at += after()
			st += streaming()
		}
		lt += layer()
	}
	b.StopTimer()
	us := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(b.N) }
	b.ReportMetric(us(st), "stream-us")
	b.ReportMetric(us(at), "after-us")
	b.ReportMetric(us(lt), "layer-us")
	b.ReportMetric(st.Seconds()/lt.Seconds(), "stream/layer")
	b.ReportMetric(at.Seconds()/lt.Seconds(), "after/layer")
	b.ReportMetric(st.Seconds()/at.Seconds(), "stream/after")
	if s := h.sender.Stats(); s.Revoked != 0 || s.Connects != 1 {
		b.Fatalf("sender %+v: want one connection, nothing revoked", s)
	}
}

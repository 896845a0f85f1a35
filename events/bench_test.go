package events

import (
	"context"
	"encoding/binary"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"go.uber.org/atomic"

	"github.com/kvlease/kvlease"
)

// BenchmarkPublisherThroughput measures what the publisher sustains to
// one local subscriber over TCP loopback. One op is one request: 8 fresh
// blocks sealed with their tokens (8 stored events, merged on the wire
// into one BlockStored) and, once the pool is warm, 8 cached blocks
// evicted to make room (8 removals, one BlockRemoved). The producer
// flushes every 64 requests, so the pools' ring never overflows: the
// rate is the one the publisher and a decoding subscriber keep up with.
// The subscriber decodes every batch; the run ends when it has received
// every batch sent. kv-events/s counts kvlease's per-block events,
// wire-events/s the merged vLLM events; drops (ring + queue) and gaps
// (missing sequence numbers at the subscriber) must be 0.
func BenchmarkPublisherThroughput(b *testing.B) {
	for _, enc := range []Encoding{MapEncoding, ArrayEncoding} {
		b.Run(enc.String(), func(b *testing.B) {
			mem, err := kvlease.NewHostMemory(1024, 16)
			if err != nil {
				b.Fatal(err)
			}
			pool, err := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(16), kvlease.WithKVEvents(1<<16),
				kvlease.WithLeakCheck(false))
			if err != nil {
				b.Fatal(err)
			}
			pub, err := NewPublisher(Config{Endpoint: "tcp://127.0.0.1:0", Bind: true, Encoding: enc,
				Pod: "bench", Model: "m"}, Source{Pool: pool})
			if err != nil {
				b.Fatal(err)
			}
			defer pub.Close()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			sub := zmq4.NewSub(ctx)
			defer sub.Close()
			if err := sub.Dial("tcp://" + pub.Addr().String()); err != nil {
				b.Fatal(err)
			}
			if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
				b.Fatal(err)
			}
			for deadline := time.Now().Add(10 * time.Second); len(pub.Subscriptions()) == 0; {
				if time.Now().After(deadline) {
					b.Fatal("subscriber never joined")
				}
				time.Sleep(time.Millisecond)
			}
			var got, gaps, bad atomic.Uint64
			go func() {
				next := uint64(0)
				for {
					m, err := sub.Recv()
					if err != nil {
						return
					}
					if len(m.Frames) != 3 {
						bad.Inc()
						continue
					}
					if seq := binary.BigEndian.Uint64(m.Frames[1]); seq != next {
						gaps.Add(seq - next)
						next = seq
					}
					next++
					if _, err := DecodeBatch(m.Frames[2]); err != nil {
						bad.Inc()
					}
					got.Inc()
				}
			}()
			toks := make([]int32, 8*16)
			for i := range toks {
				toks[i] = int32(i*7 + 1)
			}
			ev0 := pool.Stats()
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				l, err := pool.Acquire("r", 8)
				if err != nil {
					b.Fatal(err)
				}
				parent := kvlease.BlockHash(i + 1) // a fresh chain each time
				for k := range 8 {
					if parent, err = l.SealTokens(k, parent, toks[16*k:16*k+16]); err != nil {
						b.Fatal(err)
					}
				}
				l.Release()
				if i%64 == 63 {
					if err := pub.Flush(ctx); err != nil {
						b.Fatal(err)
					}
				}
			}
			if err := pub.Flush(ctx); err != nil {
				b.Fatal(err)
			}
			for deadline := time.Now().Add(30 * time.Second); got.Load() < pub.Stats().Batches; {
				if time.Now().After(deadline) {
					b.Fatalf("subscriber got %d of %d batches", got.Load(), pub.Stats().Batches)
				}
				time.Sleep(100 * time.Microsecond)
			}
			b.StopTimer()
			st, ps := pub.Stats(), pool.Stats()
			sec := b.Elapsed().Seconds()
			kvEvents := float64(8*b.N) + float64(ps.Evictions-ev0.Evictions)
			b.ReportMetric(kvEvents/sec, "kv-events/s")
			b.ReportMetric(float64(st.Events)/sec, "wire-events/s")
			b.ReportMetric(float64(st.Batches)/sec, "batches/s")
			b.ReportMetric(float64(st.DroppedBatches+st.DroppedEvents), "drops")
			b.ReportMetric(float64(gaps.Load()+bad.Load()), "gaps")
		})
	}
}

package ucx_test

import (
	"fmt"
	"io"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/ucx"
)

// proposeDelivered proposes lease as handoff id on l and waits for the
// source's Delivered; it returns how long propose → delivered took.
func proposeDelivered(tb testing.TB, l *loop, id uint64, lease *kvlease.Lease[[]byte]) time.Duration {
	tb.Helper()
	start := time.Now()
	o, err := l.src.Propose(id, fmt.Sprintf("r%d", id), lease, nil)
	if err != nil {
		tb.Fatal(err)
	}
	select {
	case <-o.Done():
	case <-time.After(20 * time.Second):
		tb.Fatalf("handoff %d still %v", id, o.State())
	}
	d := time.Since(start)
	if o.State() != handoff.Delivered {
		tb.Fatalf("handoff %d: %v %v", id, o.State(), o.History())
	}
	return d
}

func TestLoopReusesConnections(t *testing.T) {
	// Handoffs one after the other between two halves (an authenticated
	// session): one connection a side, reused by every handoff after the
	// first, every block checked against its session MAC.
	const handoffs = 5
	l := newLoop(t, loopConfig{keepLeases: true})
	lease, err := l.srcPool.Acquire("r", 16)
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Release()
	for i := range handoffs {
		stamp(t, lease, uint32(i+1))
		proposeDelivered(t, l, uint64(i+1), lease)
		in := waitIncoming(t, l, uint64(i+1))
		if err := marked(in.Lease(), uint32(i+1)); err != nil {
			t.Fatalf("handoff %d: %v", i+1, err)
		}
		in.Lease().Release()
	}
	s, r := l.sender.Stats(), l.recv.Stats()
	if s.Connects != 1 || s.Reuses != handoffs-1 || s.Keyed != handoffs || s.Completed != handoffs {
		t.Fatalf("source %+v, want 1 connect, %d reuses", s, handoffs-1)
	}
	if r.Workers != 1 || r.Connects != 1 || r.Reuses != handoffs-1 || r.Completed != handoffs {
		t.Fatalf("destination %+v, want 1 worker, 1 connect, %d reuses", r, handoffs-1)
	}
}

func percentiles(d []time.Duration) (p50, p99 time.Duration) {
	if len(d) == 0 {
		return 0, 0
	}
	d = slices.Clone(d)
	slices.Sort(d)
	return d[len(d)/2], d[min(len(d)-1, len(d)*99/100)]
}

// BenchmarkHandoff16Latency is propose → delivered of a 16-block handoff
// (4 KiB blocks, one run) between the two halves in this process, over
// UCX_TLS=tcp on loopback with a pre-shared key (keyed block sums), p50
// and p99: with reused connections (the default) and with a worker and
// a connect per handoff (MaxIdle -1 on both sides), alternating in the
// same run, next to two small-message round trips measured in the same
// run: a 64-byte tagged message between two UCX workers of the same
// transport (ucx-rtt), and 64 bytes over a held loopback TCP connection
// (tcp-rtt, the control session's transport). The goal is a reused
// handoff's p50 ≤ 3 × the UCX round trip (reuse/ucx-rtt-p50); the
// handoff itself crosses the control session four times (propose,
// accept, start, done) besides the data.
func BenchmarkHandoff16Latency(b *testing.B) {
	reuse := newLoop(b, loopConfig{keepLeases: false})
	fresh := newLoop(b, loopConfig{send: ucx.Config{MaxIdle: -1}, recv: ucx.Config{MaxIdle: -1}})
	loops := []*loop{reuse, fresh}
	leases := make([]*kvlease.Lease[[]byte], len(loops))
	for i, l := range loops {
		lease, err := l.srcPool.Acquire("bench", 16)
		if err != nil {
			b.Fatal(err)
		}
		defer lease.Release()
		stamp(b, lease, 7)
		leases[i] = lease
	}
	ucxRTT, release, err := ucx.TagRoundTrip()
	if err != nil {
		b.Fatal(err)
	}
	defer release()
	tcpRTT := tcpEcho(b)
	next := uint64(0)
	for i, l := range loops { // warm: the reused loop connects here
		next++
		proposeDelivered(b, l, next, leases[i])
	}
	hs := make([][]time.Duration, len(loops))
	var urs, trs []time.Duration
	b.ResetTimer()
	for k := range b.N {
		for j := range loops {
			i := (k + j) % len(loops)
			next++
			hs[i] = append(hs[i], proposeDelivered(b, loops[i], next, leases[i]))
		}
		d, err := ucxRTT()
		if err != nil {
			b.Fatal(err)
		}
		urs = append(urs, d)
		trs = append(trs, tcpRTT())
	}
	b.StopTimer()
	u50, _ := percentiles(urs)
	t50, _ := percentiles(trs)
	r50, r99 := percentiles(hs[0])
	f50, f99 := percentiles(hs[1])
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
	b.ReportMetric(us(r50), "reuse-p50-µs")
	b.ReportMetric(us(r99), "reuse-p99-µs")
	b.ReportMetric(us(f50), "fresh-p50-µs")
	b.ReportMetric(us(f99), "fresh-p99-µs")
	b.ReportMetric(us(u50), "ucx-rtt-p50-µs")
	b.ReportMetric(us(t50), "tcp-rtt-p50-µs")
	b.ReportMetric(float64(r50)/float64(u50), "reuse/ucx-rtt-p50")
	b.ReportMetric(float64(f50)/float64(r50), "fresh/reuse-p50")
	if s := reuse.sender.Stats(); s.Connects != 1 || s.Reuses != b.N {
		b.Fatalf("reused loop: %+v, want 1 connect", s)
	}
	if s := fresh.sender.Stats(); s.Reuses != 0 {
		b.Fatalf("fresh loop reused: %+v", s)
	}
}

// tcpEcho starts a 64-byte echo over a held loopback TCP connection and
// returns a function timing one round trip.
func tcpEcho(b *testing.B) func() time.Duration {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	go func() {
		c, err := ln.Accept()
		_ = ln.Close()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = io.Copy(c, c)
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = c.Close() })
	var msg [64]byte
	return func() time.Duration {
		start := time.Now()
		if _, err := c.Write(msg[:]); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, msg[:]); err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}
}

//go:build unix

package tcp_test

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// benchRig is the source half in this process and the destination in a
// peer process (the test binary re-executed), over 127.0.0.1; the peer
// also serves the raw baselines (a sink and an echo).
type benchRig struct {
	*srcSide
	sink, echo string
	lease      *kvlease.Lease[[]byte]
	next       uint64
}

func newBenchRig(b *testing.B, blockBytes, blocks int) *benchRig {
	b.Helper()
	s := newSrcSide(b, sideOpts{}, peerConfig{HoldAfter: -1, Bench: true, Profile: os.Getenv("KVLEASE_PEER_PROFILE")}, blockBytes, 4*blocks, nil)
	b.Cleanup(s.peer.stop)
	f := fields(s.peer.expect("bench ")[1:])
	r := &benchRig{srcSide: s, sink: f["sink"], echo: f["echo"], next: 1}
	var err error
	if r.lease, err = s.pool.Acquire("bench", blocks); err != nil {
		b.Fatal(err)
	}
	if err := stampLease(r.lease, 1); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(r.lease.Release)
	return r
}

// handoff moves the whole lease to the peer once (no hashes: nothing
// hits in its cache) and returns how long propose → delivered took.
func (r *benchRig) handoff(b *testing.B) time.Duration {
	start := time.Now()
	o, err := r.src.Propose(r.next, "bench", r.lease, nil)
	if err != nil {
		b.Fatal(err)
	}
	r.next++
	select {
	case <-o.Done():
	case <-time.After(bound):
		b.Fatalf("handoff %d still %v", o.ID(), o.State())
	}
	d := time.Since(start)
	if s := o.State(); s != handoff.Delivered {
		b.Fatalf("handoff %d: %v %v", o.ID(), s, o.Err())
	}
	return d
}

// raw copies the lease's blocks to the peer's sink over a fresh
// connection (as the handoff dials its data connection), straight from
// the regions, and waits for the sink's one-byte answer.
func (r *benchRig) raw(b *testing.B) time.Duration {
	start := time.Now()
	c, err := net.Dial("tcp", r.sink)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	var hdr [4]byte
	binary.LittleEndian.PutUint32(hdr[:], uint32(r.lease.Len()*r.pool.BlockBytes()))
	if _, err := c.Write(hdr[:]); err != nil {
		b.Fatal(err)
	}
	for i := range r.lease.Len() {
		reg, _ := r.lease.ReadRegion(i)
		if _, err := c.Write(reg); err != nil {
			b.Fatal(err)
		}
	}
	if _, err := io.ReadFull(c, hdr[:1]); err != nil {
		b.Fatal(err)
	}
	return time.Since(start)
}

// BenchmarkThroughput: a handoff of 256 blocks of 64 KiB from this
// process to the peer process, against a raw TCP copy of the same bytes
// between the same two processes in the same run (alternating, one of
// each per iteration). Target: handoff ≥ 80 % of raw.
func BenchmarkThroughput(b *testing.B) {
	const bb, blocks = 64 << 10, 256
	r := newBenchRig(b, bb, blocks)
	r.handoff(b) // warm: connections, pools
	r.raw(b)
	var th, tr time.Duration
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		th += r.handoff(b)
		tr += r.raw(b)
	}
	b.StopTimer()
	mb := float64(bb*blocks) * float64(b.N) / 1e6
	b.ReportMetric(mb/th.Seconds(), "handoff-MB/s")
	b.ReportMetric(mb/tr.Seconds(), "raw-MB/s")
	b.ReportMetric(100*tr.Seconds()/th.Seconds(), "%-of-raw")
}

// BenchmarkControlLatency: propose → delivered of a 16-block handoff to
// the peer process, p50 and p99, next to the round trip of one 64-byte
// message to the same peer (a ping-pong on a held connection).
func BenchmarkControlLatency(b *testing.B) {
	for _, bb := range []int{4 << 10, 64 << 10} {
		b.Run(fmt.Sprintf("block=%dKiB", bb>>10), func(b *testing.B) {
			r := newBenchRig(b, bb, 16)
			c, err := net.Dial("tcp", r.echo)
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			var msg [64]byte
			rtt := func() time.Duration {
				start := time.Now()
				if _, err := c.Write(msg[:]); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(c, msg[:]); err != nil {
					b.Fatal(err)
				}
				return time.Since(start)
			}
			r.handoff(b)
			rtt()
			hs := make([]time.Duration, 0, b.N)
			rs := make([]time.Duration, 0, b.N)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				hs = append(hs, r.handoff(b))
				rs = append(rs, rtt())
			}
			b.StopTimer()
			hp50, hp99 := percentiles(hs)
			rp50, rp99 := percentiles(rs)
			b.ReportMetric(float64(hp50.Nanoseconds())/1e3, "p50-µs")
			b.ReportMetric(float64(hp99.Nanoseconds())/1e3, "p99-µs")
			b.ReportMetric(float64(rp50.Nanoseconds())/1e3, "rtt-p50-µs")
			b.ReportMetric(float64(rp99.Nanoseconds())/1e3, "rtt-p99-µs")
			b.ReportMetric(float64(hp50)/float64(rp50), "p50/rtt")
		})
	}
}

func percentiles(d []time.Duration) (p50, p99 time.Duration) {
	s := slices.Clone(d)
	slices.Sort(s)
	at := func(q float64) time.Duration { return s[min(len(s)-1, int(q*float64(len(s))))] }
	return at(0.50), at(0.99)
}

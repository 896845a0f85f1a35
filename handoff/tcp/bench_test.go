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
	"github.com/kvlease/kvlease/handoff/tcp"
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

// newBenchRig starts a rig whose halves authenticate as auth says:
// "none" (Insecure), "psk" (the test key) or "tls" (test certificates).
func newBenchRig(b *testing.B, auth string, blockBytes, blocks int) *benchRig {
	b.Helper()
	return newBenchRigWith(b, auth, blockBytes, blocks, tcp.Config{})
}

// newBenchRigWith is newBenchRig with the source's plane configured by
// cfg.
func newBenchRigWith(b *testing.B, auth string, blockBytes, blocks int, cfg tcp.Config) *benchRig {
	b.Helper()
	o := sideOpts{sendCfg: cfg}
	pc := peerConfig{HoldAfter: -1, Bench: true, Profile: os.Getenv("KVLEASE_PEER_PROFILE")}
	switch auth {
	case "none":
		o.insecure, pc.Insecure = true, true
	case "tls":
		pc.TLSDir = writeTLS(b)
		a, err := readTLS(pc.TLSDir, "source")
		if err != nil {
			b.Fatal(err)
		}
		o.auth = a
	}
	s := newSrcSide(b, o, pc, blockBytes, 2*blocks, nil)
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
	return r.handoffWith(b, nil)
}

// handoffWith is handoff with the lease's blocks named by hashes: once
// the peer holds them, every block hits and nothing moves (the control
// messages alone).
func (r *benchRig) handoffWith(b *testing.B, hashes []kvlease.BlockHash) time.Duration {
	start := time.Now()
	o, err := r.src.Propose(r.next, "bench", r.lease, hashes)
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
	binary.LittleEndian.PutUint32(hdr[:], uint32(r.lease.Len()*r.pool.Memory().BlockBytes()))
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

// copyOn copies the lease's blocks to the peer's sink over the held
// connection c with one gathered write (as the plane writes a run) and
// returns how long it took until the sink's answer.
func (r *benchRig) copyOn(b *testing.B, c net.Conn) time.Duration {
	start := time.Now()
	var hdr [4]byte
	binary.LittleEndian.PutUint32(hdr[:], uint32(r.lease.Len()*r.pool.Memory().BlockBytes()))
	bufs := net.Buffers{hdr[:]}
	for i := range r.lease.Len() {
		reg, _ := r.lease.ReadRegion(i)
		bufs = append(bufs, reg)
	}
	if _, err := bufs.WriteTo(c); err != nil {
		b.Fatal(err)
	}
	if _, err := io.ReadFull(c, hdr[:1]); err != nil {
		b.Fatal(err)
	}
	return time.Since(start)
}

var authModes = []string{"none", "psk", "tls"}

// BenchmarkThroughput: a handoff of 256 blocks of 64 KiB from this
// process to a peer process, with the halves unauthenticated ("none": a
// crc32c per block), under a pre-shared key and under mutual TLS (the
// session's key: an HMAC on the data connection's hello and an AES-GMAC
// per block), against a raw TCP copy of the same bytes between the same
// processes, all in the same run (alternating, one of each per
// iteration). Target: authenticated ≥ 75 % of raw.
func BenchmarkThroughput(b *testing.B) {
	const bb, blocks = 64 << 10, 256
	rigs := make([]*benchRig, len(authModes))
	for i, m := range authModes {
		rigs[i] = newBenchRig(b, m, bb, blocks)
		rigs[i].handoff(b) // warm: connections, pools
		rigs[i].raw(b)
	}
	th := make([]time.Duration, len(rigs))
	var tr time.Duration
	b.ReportAllocs()
	b.ResetTimer()
	for k := range b.N {
		// Each iteration starts with another mode: none runs right
		// after another rig's handoff (whose peer may still be busy)
		// more than the others.
		for j := range rigs {
			i := (k + j) % len(rigs)
			th[i] += rigs[i].handoff(b)
		}
		tr += rigs[0].raw(b)
	}
	b.StopTimer()
	mb := float64(bb*blocks) * float64(b.N) / 1e6
	b.ReportMetric(mb/tr.Seconds(), "raw-MB/s")
	for i, m := range authModes {
		b.ReportMetric(mb/th[i].Seconds(), m+"-MB/s")
		b.ReportMetric(100*tr.Seconds()/th[i].Seconds(), m+"-%-of-raw")
	}
}

// BenchmarkControlLatency: propose → delivered of a 16-block handoff to
// the peer process, p50 and p99, unauthenticated, under a pre-shared key
// and under mutual TLS in the same run (alternating), next to the round
// trip of one 64-byte message to the same peer (a ping-pong on a held
// connection). Target: authenticated within 10 % of unauthenticated.
// The data connections are reused (each rig's first handoff, untimed,
// warms its pool): p50/rtt is each mode's p50 over the round trip's,
// dials/op the data connections dialled per timed handoff.
func BenchmarkControlLatency(b *testing.B) {
	for _, bb := range []int{4 << 10, 64 << 10} {
		b.Run(fmt.Sprintf("block=%dKiB", bb>>10), func(b *testing.B) {
			rigs := make([]*benchRig, len(authModes))
			for i, m := range authModes {
				rigs[i] = newBenchRig(b, m, bb, 16)
				rigs[i].handoff(b)
			}
			c, err := net.Dial("tcp", rigs[0].echo)
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
			rtt()
			hs := make([][]time.Duration, len(rigs))
			rs := make([]time.Duration, 0, b.N)
			dials := 0
			for _, r := range rigs {
				dials -= r.sender.Stats().Dials
			}
			b.ReportAllocs()
			b.ResetTimer()
			for k := range b.N {
				for j := range rigs { // each iteration starts with another mode
					i := (k + j) % len(rigs)
					hs[i] = append(hs[i], rigs[i].handoff(b))
				}
				rs = append(rs, rtt())
			}
			b.StopTimer()
			for _, r := range rigs {
				dials += r.sender.Stats().Dials
			}
			rp50, _ := percentiles(rs)
			b.ReportMetric(float64(rp50.Nanoseconds())/1e3, "rtt-p50-µs")
			b.ReportMetric(float64(dials)/float64(len(rigs)*b.N), "dials/op")
			base, _ := percentiles(hs[0])
			for i, m := range authModes {
				p50, p99 := percentiles(hs[i])
				b.ReportMetric(float64(p50.Nanoseconds())/1e3, m+"-p50-µs")
				b.ReportMetric(float64(p99.Nanoseconds())/1e3, m+"-p99-µs")
				b.ReportMetric(float64(p50)/float64(rp50), m+"-p50/rtt")
				if i > 0 {
					b.ReportMetric(float64(p50)/float64(base), m+"/none-p50")
				}
			}
		})
	}
}

// BenchmarkReuseLatency: propose → delivered of a 16-block handoff of
// 4 KiB blocks to the peer process, unauthenticated and under a
// pre-shared key, with the data connections reused (the pool warmed by
// an untimed handoff) next to a dial per handoff (MaxIdleConns < 0) and
// the round trip of one 64-byte message on a held connection, all in the
// same run (alternating): p50, p99, p50 over the round trip's p50, and
// the data connections dialled per timed handoff. Goal: reused p50 ≤ 3 ×
// the round trip's p50. For scale, copy-p50 is the same bytes copied raw
// to the peer over a held connection until its one-byte answer: a
// handoff needs at least a round trip (propose, accept) and that copy;
// ctl-p50 is a handoff of the same blocks that all hit in the peer's
// cache (nothing moves: the control messages alone).
func BenchmarkReuseLatency(b *testing.B) {
	for _, auth := range []string{"none", "psk"} {
		b.Run("auth="+auth, func(b *testing.B) {
			names := []string{"reuse", "dial"}
			rigs := []*benchRig{
				newBenchRigWith(b, auth, 4<<10, 16, tcp.Config{}),
				newBenchRigWith(b, auth, 4<<10, 16, tcp.Config{MaxIdleConns: -1}),
			}
			for _, r := range rigs {
				r.handoff(b)
			}
			c, err := net.Dial("tcp", rigs[0].echo)
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
			rtt()
			sink, err := net.Dial("tcp", rigs[0].sink)
			if err != nil {
				b.Fatal(err)
			}
			defer sink.Close()
			rigs[0].copyOn(b, sink)
			hashes := hashesFor(1, 16)
			rigs[0].handoffWith(b, hashes) // the peer caches them
			if d := rigs[0].handoffWith(b, hashes); d <= 0 {
				b.Fatal(d)
			}
			dials := make([]int, len(rigs))
			for i, r := range rigs {
				dials[i] = -r.sender.Stats().Dials
			}
			hs := make([][]time.Duration, len(rigs))
			rs := make([]time.Duration, 0, b.N)
			cs := make([]time.Duration, 0, b.N)
			ctl := make([]time.Duration, 0, b.N)
			b.ReportAllocs()
			b.ResetTimer()
			for k := range b.N {
				for j := range rigs {
					i := (k + j) % len(rigs)
					hs[i] = append(hs[i], rigs[i].handoff(b))
				}
				rs = append(rs, rtt())
				cs = append(cs, rigs[0].copyOn(b, sink))
				ctl = append(ctl, rigs[0].handoffWith(b, hashes))
			}
			b.StopTimer()
			rp50, _ := percentiles(rs)
			cp50, _ := percentiles(cs)
			b.ReportMetric(float64(rp50.Nanoseconds())/1e3, "rtt-p50-µs")
			b.ReportMetric(float64(cp50.Nanoseconds())/1e3, "copy-p50-µs")
			ctl50, _ := percentiles(ctl)
			b.ReportMetric(float64(ctl50.Nanoseconds())/1e3, "ctl-p50-µs")
			for i, m := range names {
				dials[i] += rigs[i].sender.Stats().Dials
				p50, p99 := percentiles(hs[i])
				b.ReportMetric(float64(p50.Nanoseconds())/1e3, m+"-p50-µs")
				b.ReportMetric(float64(p99.Nanoseconds())/1e3, m+"-p99-µs")
				b.ReportMetric(float64(p50)/float64(rp50), m+"-p50/rtt")
				b.ReportMetric(float64(dials[i])/float64(b.N), m+"-dials/op")
			}
		})
	}
}

// BenchmarkHandshake: the cost of authenticating a control connection
// (NewSource's dial and handshake against a Destination's Listen over
// 127.0.0.1, in this process), p50 and p99 per mode, next to the round
// trip of one 64-byte message over a held loopback connection.
func BenchmarkHandshake(b *testing.B) {
	dir := writeTLS(b)
	srcTLS, err := readTLS(dir, "source")
	if err != nil {
		b.Fatal(err)
	}
	dstTLS, _ := readTLS(dir, "dest")
	env := envFor(4096, 64)
	echo := listen(b)
	defer echo.Close()
	go func() {
		c, err := echo.Accept()
		if err == nil {
			_, _ = io.Copy(c, c)
		}
	}()
	ec, err := net.Dial("tcp", echo.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	defer ec.Close()
	for _, tt := range []struct {
		name     string
		src, dst handoff.Authenticator
	}{{"none", nil, nil}, {"psk", testAuth, testAuth}, {"tls", srcTLS, dstTLS}} {
		b.Run(tt.name, func(b *testing.B) {
			half := func(a handoff.Authenticator) handoff.HalfConfig {
				return handoff.HalfConfig{Envelope: env, Auth: a, Insecure: a == nil, Logf: quiet}
			}
			dst, err := handoff.NewDestination(hostPool2(b, 64, 4096), tcp.NewReceiver(listen(b), tcp.Config{}),
				handoff.DestinationConfig[[]byte]{HalfConfig: half(tt.dst)})
			if err != nil {
				b.Fatal(err)
			}
			ln := listen(b)
			go func() { _ = dst.Listen(ln) }()
			defer ln.Close()
			sender := tcp.NewSender(tcp.Config{})
			var msg [64]byte
			hs := make([]time.Duration, 0, b.N)
			rs := make([]time.Duration, 0, b.N)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				start := time.Now()
				c, err := net.Dial("tcp", ln.Addr().String())
				if err != nil {
					b.Fatal(err)
				}
				src, err := handoff.NewSource(c, sender, half(tt.src))
				if err != nil {
					b.Fatal(err)
				}
				hs = append(hs, time.Since(start))
				_ = src.Close()
				start = time.Now()
				if _, err := ec.Write(msg[:]); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(ec, msg[:]); err != nil {
					b.Fatal(err)
				}
				rs = append(rs, time.Since(start))
			}
			b.StopTimer()
			p50, p99 := percentiles(hs)
			r50, _ := percentiles(rs)
			b.ReportMetric(float64(p50.Nanoseconds())/1e3, "p50-µs")
			b.ReportMetric(float64(p99.Nanoseconds())/1e3, "p99-µs")
			b.ReportMetric(float64(r50.Nanoseconds())/1e3, "rtt-p50-µs")
		})
	}
}

func percentiles(d []time.Duration) (p50, p99 time.Duration) {
	s := slices.Clone(d)
	slices.Sort(s)
	at := func(q float64) time.Duration { return s[min(len(s)-1, int(q*float64(len(s))))] }
	return at(0.50), at(0.99)
}

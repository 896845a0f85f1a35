package tcp_test

import (
	"net"
	"testing"
	"time"

	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
)

// slowConn reads at most 4 KiB per Read, after a pause of 10 ms: a slow
// destination (400 KB/s at most) that keeps making progress.
type slowConn struct{ net.Conn }

func (c slowConn) Read(p []byte) (int, error) {
	time.Sleep(10 * time.Millisecond)
	return c.Conn.Read(p[:min(len(p), 4<<10)])
}

// stallLong is the progress timeout of TestStallTimeoutCountsProgress:
// the slow reader's frame takes twice as long, and the socket wakes its
// writer every ~0.1 s.
const stallLong = 1200 * time.Millisecond

// TestStallTimeoutCountsProgress: the progress timeout bounds the time
// without progress, not the transfer: a destination that reads slowly
// but steadily, so that the sender's one gathered write of a 1 MiB frame
// takes twice StallTimeout or more, is served in full. The writev that
// sends part of a frame before the socket fills gives the deadline anew.
func TestStallTimeoutCountsProgress(t *testing.T) {
	const bb, n = 64 << 10, 16 // one frame of 1 MiB: 256 reads of 4 KiB, 10 ms apart
	small := func(c net.Conn) net.Conn {
		_ = c.(*net.TCPConn).SetWriteBuffer(8 << 10)
		return c
	}
	l := newLoop(t, loopConfig{deadline: -1, wrapSend: small, blockBytes: bb, keepLeases: true,
		sendCfg: tcp.Config{StallTimeout: stallLong},
		recvCfg: tcp.Config{StallTimeout: stallLong, WrapConn: func(c net.Conn) net.Conn { return slowConn{c} }}})
	lease, err := l.srcPool.Acquire("r", n)
	if err != nil {
		t.Fatal(err)
	}
	stamp(t, lease, 4)
	start := time.Now()
	o, err := l.src.Propose(1, "r", lease, nil)
	if err != nil {
		t.Fatal(err)
	}
	waitFinal(t, o)
	if o.State() != handoff.Delivered {
		t.Fatalf("source %v: %v", o.State(), o.History())
	}
	in := waitIncoming(t, l, 1)
	waitFinal(t, in)
	if err := marked(in.Lease(), 4); err != nil {
		t.Fatal(err)
	}
	in.Lease().Release()
	t.Logf("%d KiB delivered in %v at 4 KiB per 10 ms, StallTimeout %v", n*bb>>10, time.Since(start).Round(time.Millisecond), stallLong)
	if s, r := l.sender.Stats(), l.recv.Stats(); s.Stalled+r.Stalled != 0 || s.Completed != 1 || r.Completed != 1 {
		t.Fatalf("sender %+v, receiver %+v", s, r)
	}
	lease.Release()
}

package tcp_test

import (
	"bytes"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
	"github.com/kvlease/kvlease/layout"
)

// deliver runs handoff id of n blocks stamped with seed and checks that
// both sides end Delivered with the markers intact (l keeps its leases).
func deliver(t *testing.T, l *loop, id uint64, n int, seed byte) {
	t.Helper()
	o, in := attempt(t, l, id, n, seed)
	if o.State() != handoff.Delivered || in.State() != handoff.Delivered {
		t.Fatalf("handoff %d: source %v (%v), destination %v (%v)", id, o.State(), o.Err(), in.State(), in.Err())
	}
	if err := marked(in.Lease(), seed); err != nil {
		t.Fatalf("handoff %d: %v", id, err)
	}
	in.Lease().Release()
}

// attempt runs handoff id of n blocks stamped with seed to its end on
// both sides and returns them; the source lease is released.
func attempt(t *testing.T, l *loop, id uint64, n int, seed byte) (*handoff.Outgoing[[]byte], *handoff.Incoming[[]byte]) {
	t.Helper()
	lease, err := l.srcPool.Acquire("r", n)
	if err != nil {
		t.Fatal(err)
	}
	stamp(t, lease, seed)
	o, err := l.src.Propose(id, "r", lease, nil)
	if err != nil {
		t.Fatal(err)
	}
	waitFinal(t, o)
	in := waitIncoming(t, l, id)
	waitFinal(t, in)
	lease.Release()
	return o, in
}

// idleIs waits until the sender holds n idle connections: the
// destination's word reaches the sender's plane (Finish) a moment after
// the handoff is final.
func idleIs(t *testing.T, s *tcp.Sender, n int) handoff.PlaneStats {
	t.Helper()
	return waitStats(t, "sender idle", s.Stats, func(s handoff.PlaneStats) bool { return s.Idle == n })
}

// TestReuseSequential: sequential handoffs, contiguous and layered,
// travel on one data connection, each with its own hello.
func TestReuseSequential(t *testing.T) {
	t.Run("contiguous", func(t *testing.T) {
		l := newLoop(t, loopConfig{keepLeases: true})
		const n = 6
		for id := uint64(1); id <= n; id++ {
			deliver(t, l, id, 4, byte(id))
			idleIs(t, l.sender, 1)
		}
		s := l.sender.Stats()
		if s.Dials != 1 || s.Reuses != n-1 || s.Completed != n || s.Stale != 0 {
			t.Fatalf("sender %+v: want 1 dial, %d reuses", s, n-1)
		}
		r := waitStats(t, "receiver", l.recv.Stats, func(s handoff.PlaneStats) bool { return s.Idle == 1 })
		if r.Dials != 1 || r.Reuses != n-1 || r.Completed != n || r.Refused != 0 {
			t.Fatalf("receiver %+v: want 1 connection, %d reuses", r, n-1)
		}
	})
	t.Run("layered", func(t *testing.T) {
		tag := layeredEnv(64).Layout.Tag
		_, srcPool := hostLayout(t, layout.LayerSeparated(lLayers, 2, 64, lPiece, tag))
		_, dstPool := hostLayout(t, layout.Contiguous(lLayers, 2, 64, lPiece, tag))
		h := newHalves(t, srcPool, dstPool, layeredEnv(64), layered, layeredRecv, nil)
		const n = 3
		for id := uint64(1); id <= n; id++ {
			lease, err := srcPool.Acquire("r", 5)
			if err != nil {
				t.Fatal(err)
			}
			stampPieces(t, lease, byte(id))
			o, err := h.src.Propose(id, "r", lease, nil)
			if err != nil {
				t.Fatal(err)
			}
			waitFinal(t, o)
			in := h.final(t)
			if o.State() != handoff.Delivered || in.State() != handoff.Delivered {
				t.Fatalf("handoff %d: %v %v", id, o.State(), in.State())
			}
			if bad := checkPieces(t, in.Lease(), byte(id)); bad != 0 {
				t.Fatalf("handoff %d: marker mismatches %d", id, bad)
			}
			in.Lease().Release()
			lease.Release()
			<-lease.Settled()
			idleIs(t, h.sender, 1)
		}
		if s := h.sender.Stats(); s.Dials != 1 || s.Reuses != n-1 {
			t.Fatalf("sender %+v: want 1 dial, %d reuses", s, n-1)
		}
	})
}

// gate holds each sender data connection at its first frame (the write
// after its first hello) until release is closed; held receives each
// connection as it is held.
type gate struct {
	held    chan *gateConn
	release chan struct{}
}

func newGate() *gate {
	return &gate{held: make(chan *gateConn, 16), release: make(chan struct{})}
}

func (g *gate) wrap(c net.Conn) net.Conn { return &gateConn{Conn: c, g: g} }

// wait returns the next n held connections.
func (g *gate) wait(t *testing.T, n int) []*gateConn {
	t.Helper()
	var cs []*gateConn
	for range n {
		select {
		case c := <-g.held:
			cs = append(cs, c)
		case <-time.After(bound):
			t.Fatalf("%d of %d connections held", len(cs), n)
		}
	}
	return cs
}

type gateConn struct {
	net.Conn
	g      *gate
	writes int // the writers of successive handoffs are ordered by the pool
}

func (c *gateConn) Write(p []byte) (int, error) {
	if c.writes++; c.writes == 2 {
		c.g.held <- c
		select {
		case <-c.g.release:
		case <-time.After(bound):
		}
	}
	return c.Conn.Write(p)
}

// TestReuseConcurrent: handoffs in flight together use a connection
// each; afterwards the pool keeps MaxIdleConns of them and closes the
// rest, and the next handoffs reuse the kept ones.
func TestReuseConcurrent(t *testing.T) {
	const k, keep = 5, 2
	g := newGate()
	l := newLoop(t, loopConfig{keepLeases: true, sendCfg: tcp.Config{MaxIdleConns: keep}, wrapSend: g.wrap})
	var wg sync.WaitGroup
	errs := make(chan error, k)
	for id := uint64(1); id <= k; id++ {
		lease, err := l.srcPool.Acquire("r", 3)
		if err != nil {
			t.Fatal(err)
		}
		stamp(t, lease, byte(id))
		o, err := l.src.Propose(id, "r", lease, nil)
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer lease.Release()
			if st := o.Wait(bound); st != handoff.Delivered {
				errs <- errors.New(st.String())
			}
		}()
	}
	g.wait(t, k) // all k in flight at once, each on its own connection
	close(g.release)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("a concurrent handoff ended %v", err)
	}
	for id := uint64(1); id <= k; id++ {
		in := waitIncoming(t, l, id)
		if err := marked(in.Lease(), byte(id)); err != nil {
			t.Fatalf("handoff %d: %v", id, err)
		}
		in.Lease().Release()
	}
	s := idleIs(t, l.sender, keep)
	if s.Dials != k || s.Reuses != 0 {
		t.Fatalf("sender %+v: want %d dials", s, k)
	}
	// The receiver sees the other connections closed and drops them.
	waitStats(t, "receiver idle", l.recv.Stats, func(s handoff.PlaneStats) bool { return s.Idle == keep })
	for id := uint64(k + 1); id <= k+3; id++ {
		deliver(t, l, id, 3, byte(id))
		idleIs(t, l.sender, keep)
	}
	if s := l.sender.Stats(); s.Dials != k || s.Reuses != 3 {
		t.Fatalf("sender %+v: want no new dial, 3 reuses", s)
	}
}

// TestReuseIdleExpiry: the sender closes a connection idle for its
// IdleTimeout, before the receiver (which waits twice its own), and the
// next handoff dials. A receiver whose idle wait is shorter than the
// sender's (a misconfiguration) closes first: the sender notices when it
// takes the connection and dials instead.
func TestReuseIdleExpiry(t *testing.T) {
	t.Run("sender first", func(t *testing.T) {
		l := newLoop(t, loopConfig{keepLeases: true, sendCfg: tcp.Config{IdleTimeout: 50 * time.Millisecond},
			recvCfg: tcp.Config{IdleTimeout: 5 * time.Second}})
		deliver(t, l, 1, 2, 1)
		s := waitStats(t, "sender expiry", l.sender.Stats, func(s handoff.PlaneStats) bool { return s.IdleExpired == 1 && s.Idle == 0 })
		if s.Dials != 1 {
			t.Fatalf("sender %+v", s)
		}
		r := waitStats(t, "receiver", l.recv.Stats, func(s handoff.PlaneStats) bool { return s.Idle == 0 })
		if r.IdleExpired != 0 || r.Refused != 0 {
			t.Fatalf("receiver %+v: the sender's close is no refusal, and comes first", r)
		}
		deliver(t, l, 2, 2, 2)
		if s := l.sender.Stats(); s.Dials != 2 || s.Reuses != 0 || s.Stale != 0 {
			t.Fatalf("sender %+v: want a fresh dial", s)
		}
	})
	t.Run("receiver first", func(t *testing.T) {
		var sent connLog
		l := newLoop(t, loopConfig{keepLeases: true, sendCfg: tcp.Config{IdleTimeout: time.Minute},
			recvCfg: tcp.Config{IdleTimeout: 20 * time.Millisecond}, wrapSend: sent.wrap})
		deliver(t, l, 1, 2, 1)
		idleIs(t, l.sender, 1)
		waitStats(t, "receiver expiry", l.recv.Stats, func(s handoff.PlaneStats) bool { return s.IdleExpired == 1 })
		waitEOF(t, sent.get(0))
		deliver(t, l, 2, 2, 2)
		if s := l.sender.Stats(); s.Dials != 2 || s.Stale != 1 || s.Reuses != 0 || s.Failed != 0 {
			t.Fatalf("sender %+v: want the closed connection found and replaced", s)
		}
	})
}

// connLog keeps every data connection a plane wraps.
type connLog struct {
	mu    sync.Mutex
	conns []net.Conn
}

func (c *connLog) wrap(conn net.Conn) net.Conn {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.conns = append(c.conns, conn)
	return conn
}

func (c *connLog) get(i int) net.Conn {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.conns[i]
}

// waitEOF waits until the sender's connection c has the receiver's FIN
// (the close is complete on this side too: what the sender's peek looks
// for; a FIN still on its way is the redial's case, TestReuseHelloRetry).
func waitEOF(t *testing.T, c net.Conn) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(bound))
	if n, err := c.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("the sender's connection read %d bytes, %v; want the receiver's FIN", n, err)
	}
	_ = c.SetReadDeadline(time.Time{})
}

// TestReuseKilledBetween: an idle connection closed by either side
// between handoffs is replaced by a fresh dial, and the next handoff is
// delivered.
func TestReuseKilledBetween(t *testing.T) {
	for _, side := range []string{"sender", "receiver"} {
		t.Run(side, func(t *testing.T) {
			var sent, got connLog
			l := newLoop(t, loopConfig{keepLeases: true, wrapSend: sent.wrap, wrapRecv: got.wrap})
			deliver(t, l, 1, 3, 1)
			idleIs(t, l.sender, 1)
			if side == "sender" {
				_ = sent.get(0).Close()
			} else {
				_ = got.get(0).Close()
				waitEOF(t, sent.get(0))
			}
			waitStats(t, "receiver", l.recv.Stats, func(s handoff.PlaneStats) bool { return s.Idle == 0 })
			deliver(t, l, 2, 3, 2)
			if s := l.sender.Stats(); s.Dials != 2 || s.Stale != 1 || s.Failed != 0 || s.Completed != 2 {
				t.Fatalf("sender %+v", s)
			}
			deliver(t, l, 3, 3, 3) // and the new one is reused
			if s := l.sender.Stats(); s.Dials != 2 || s.Reuses != 1 {
				t.Fatalf("sender %+v", s)
			}
		})
	}
}

// failConn fails its writes, once armed, as a connection whose peer is
// gone fails them (the peek cannot tell: nothing arrived).
type failConn struct {
	net.Conn
	mu    sync.Mutex
	armed bool
}

func (c *failConn) arm() {
	c.mu.Lock()
	c.armed = true
	c.mu.Unlock()
}

func (c *failConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	armed := c.armed
	c.mu.Unlock()
	if armed {
		return 0, net.ErrClosed
	}
	return c.Conn.Write(p)
}

// TestReuseHelloRetry: a reused connection whose hello cannot be written
// is replaced at once (no block byte was written, the regions were not
// read): the handoff dials once more and is delivered.
func TestReuseHelloRetry(t *testing.T) {
	var mu sync.Mutex
	var conns []*failConn
	l := newLoop(t, loopConfig{keepLeases: true, wrapSend: func(c net.Conn) net.Conn {
		f := &failConn{Conn: c}
		mu.Lock()
		conns = append(conns, f)
		mu.Unlock()
		return f
	}})
	deliver(t, l, 1, 3, 1)
	idleIs(t, l.sender, 1)
	mu.Lock()
	conns[0].arm()
	mu.Unlock()
	deliver(t, l, 2, 3, 2)
	if s := l.sender.Stats(); s.Dials != 2 || s.Reuses != 1 || s.Stale != 1 || s.Failed != 0 || s.Completed != 2 {
		t.Fatalf("sender %+v", s)
	}
	if r := l.recv.Stats(); r.Refused != 0 || r.Completed != 2 {
		t.Fatalf("receiver %+v", r)
	}
}

// TestReuseKilledMidTransfer: of two handoffs in flight on two
// connections, the one whose connection dies fails on both sides (every
// block back), the other is delivered, and the next handoff reuses the
// surviving connection.
func TestReuseKilledMidTransfer(t *testing.T) {
	g := newGate()
	l := newLoop(t, loopConfig{keepLeases: true, wrapSend: g.wrap})
	type res struct {
		o  *handoff.Outgoing[[]byte]
		id uint64
	}
	var outs []res
	for id := uint64(1); id <= 2; id++ {
		lease, err := l.srcPool.Acquire("r", 4)
		if err != nil {
			t.Fatal(err)
		}
		stamp(t, lease, byte(id))
		t.Cleanup(lease.Release)
		o, err := l.src.Propose(id, "r", lease, nil)
		if err != nil {
			t.Fatal(err)
		}
		outs = append(outs, res{o, id})
	}
	cs := g.wait(t, 2)
	_ = cs[0].Conn.Close()
	close(g.release)
	var failed, delivered int
	for _, r := range outs {
		waitFinal(t, r.o)
		in := waitIncoming(t, l, r.id)
		waitFinal(t, in)
		switch {
		case r.o.State() == handoff.Delivered && in.State() == handoff.Delivered:
			delivered++
			if err := marked(in.Lease(), byte(r.id)); err != nil {
				t.Fatal(err)
			}
			in.Lease().Release()
		case r.o.State() == handoff.Failed && in.State() == handoff.Failed:
			failed++
		default:
			t.Fatalf("handoff %d: source %v, destination %v", r.id, r.o.State(), in.State())
		}
	}
	if failed != 1 || delivered != 1 {
		t.Fatalf("%d failed, %d delivered: want one of each", failed, delivered)
	}
	idleIs(t, l.sender, 1)
	deliver(t, l, 3, 4, 3)
	if s := l.sender.Stats(); s.Dials != 2 || s.Reuses != 1 || s.Failed != 1 {
		t.Fatalf("sender %+v", s)
	}
	if s := l.dstPool.Stats(); s.Free != 64 || s.Quarantined != 0 {
		t.Fatalf("destination pool %+v: the failed handoff's blocks are not all back", s)
	}
}

// TestReuseCanceled: a transfer cancelled mid-way (an abort by either
// side) closes its connection on both sides: the next handoff dials.
func TestReuseCanceled(t *testing.T) {
	for _, who := range []string{"source", "destination"} {
		t.Run(who, func(t *testing.T) {
			g := newGate()
			l := newLoop(t, loopConfig{keepLeases: true, wrapSend: g.wrap})
			lease, err := l.srcPool.Acquire("r", 4)
			if err != nil {
				t.Fatal(err)
			}
			stamp(t, lease, 1)
			o, err := l.src.Propose(1, "r", lease, nil)
			if err != nil {
				t.Fatal(err)
			}
			g.wait(t, 1)
			l.mu.Lock()
			in := l.accepted[1]
			l.mu.Unlock()
			waitState(t, "destination", in.State, handoff.Transferring)
			other := o.History
			if who == "source" {
				err, other = o.Abort("prefill", nil), in.History
			} else {
				err = in.Abort("decode", nil)
			}
			if err != nil {
				t.Fatal(err)
			}
			waitStep(t, other, handoff.EventAbort) // the abort, not the cut, reaches the other side first
			close(g.release)
			waitFinal(t, o)
			waitFinal(t, in)
			lease.Release()
			if o.State() != handoff.Aborted || in.State() != handoff.Aborted {
				t.Fatalf("source %v, destination %v", o.State(), in.State())
			}
			waitStats(t, "receiver", l.recv.Stats, func(s handoff.PlaneStats) bool { return s.Idle == 0 })
			deliver(t, l, 2, 4, 2)
			if s := l.sender.Stats(); s.Dials != 2 || s.Reuses != 0 {
				t.Fatalf("sender %+v: the cancelled connection was reused", s)
			}
		})
	}
}

// tamper rewrites the second handoff's stream on a sender's data
// connections: "forge" flips a bit of its hello's MAC, "replay" sends
// the first handoff's whole stream (hello and blocks) in its place.
type tamper struct {
	mu     sync.Mutex
	mode   string
	first  []byte // the first handoff's stream
	hellos int
}

type tamperConn struct {
	net.Conn
	t *tamper
}

func (c *tamperConn) Write(p []byte) (int, error) {
	t := c.t
	t.mu.Lock()
	defer t.mu.Unlock()
	hello := len(p) >= 60 && p[0] == 'K' && p[1] == 'D'
	if hello {
		t.hellos++
	}
	switch {
	case t.hellos == 1:
		t.first = append(t.first, p...)
	case t.hellos == 2 && t.mode == "forge" && hello:
		q := bytes.Clone(p)
		q[59] ^= 1
		if _, err := c.Conn.Write(q); err != nil {
			return 0, err
		}
		return len(p), nil
	case t.hellos == 2 && t.mode == "replay":
		if hello {
			if _, err := c.Conn.Write(t.first); err != nil {
				return 0, err
			}
		}
		return len(p), nil // its own bytes never leave
	}
	return c.Conn.Write(p)
}

// TestReuseReplayedHello: on a reused connection, a hello whose MAC does
// not verify, or the replay of the previous handoff's stream, is refused
// like on a fresh one: the connection is closed, that handoff fails
// (nothing written into the destination's blocks), and the next handoff
// is delivered on a fresh connection.
func TestReuseReplayedHello(t *testing.T) {
	for _, mode := range []string{"forge", "replay"} {
		t.Run(mode, func(t *testing.T) {
			tp := &tamper{mode: mode}
			var mu sync.Mutex
			var refusals []error
			l := newLoop(t, loopConfig{keepLeases: true, hello: 300 * time.Millisecond,
				wrapSend: func(c net.Conn) net.Conn { return &tamperConn{Conn: c, t: tp} },
				recvCfg:  tcp.Config{OnError: func(err error) { mu.Lock(); refusals = append(refusals, err); mu.Unlock() }}})
			deliver(t, l, 1, 3, 1)
			idleIs(t, l.sender, 1)
			o, in := attempt(t, l, 2, 3, 2)
			if o.State() == handoff.Delivered || in.State() != handoff.Failed || !errors.Is(in.Err(), tcp.ErrNoData) {
				t.Fatalf("tampered handoff: source %v, destination %v (%v)", o.State(), in.State(), in.Err())
			}
			r := l.recv.Stats()
			mu.Lock()
			defer mu.Unlock()
			if len(refusals) != 1 || r.Refused != 1 {
				t.Fatalf("receiver %+v, refusals %v", r, refusals)
			}
			want := tcp.ErrCorrupt // a used token names no prepared handoff
			if mode == "forge" {
				want = tcp.ErrUnauthenticated
			}
			if !errors.Is(refusals[0], want) || (mode == "forge") != (r.RefusedAuth == 1) {
				t.Fatalf("refusal %v, receiver %+v", refusals[0], r)
			}
			deliver(t, l, 3, 3, 3)
			if s := l.sender.Stats(); s.Dials != 2 || s.Reuses != 1 {
				t.Fatalf("sender %+v", s)
			}
			if s := l.dstPool.Stats(); s.Free != 64 || s.Quarantined != 0 {
				t.Fatalf("destination pool %+v", s)
			}
		})
	}
}

// TestReuseOff: MaxIdleConns < 0 dials a connection per handoff, and a
// Send after Close fails with ErrClosed.
func TestReuseOff(t *testing.T) {
	l := newLoop(t, loopConfig{keepLeases: true, sendCfg: tcp.Config{MaxIdleConns: -1}})
	for id := uint64(1); id <= 3; id++ {
		deliver(t, l, id, 2, byte(id))
	}
	if s := l.sender.Stats(); s.Dials != 3 || s.Reuses != 0 || s.Idle != 0 {
		t.Fatalf("sender %+v", s)
	}
	s := tcp.NewSender(tcp.Config{})
	_ = s.Close()
	accept, err := l.recv.Prepare(handoff.PlaneID{Session: 99, Handoff: 1}, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer l.recv.Forget(handoff.PlaneID{Session: 99, Handoff: 1})
	_, err = s.Send(handoff.PlaneID{Session: 99, Handoff: 1}, [][]byte{make([]byte, 8)}, accept, func(*kvlease.Transfer) error { return nil })
	if !errors.Is(err, tcp.ErrClosed) {
		t.Fatalf("send after close: %v", err)
	}
}

//go:build unix

package tcp_test

// The pinning attacks of the attack suite (issue 30): a peer that holds
// our blocks by freezing, with no malice needed. Each case measures an
// honest request beside it: one that waits for the whole pool, served
// once the quarantine lifts (and how long after the freeze it was).

import (
	"context"
	"errors"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
	"github.com/kvlease/kvlease/layout"
)

// honestWait is an honest request for every block of pool from now on:
// it waits in the pool's queue (AcquireWait) and, refused while
// quarantined blocks leave too few usable (kvlease.ErrQuarantineBound,
// which a wait cannot help), asks again every 5 ms, within bound.
type honestWait[R any] struct {
	since   time.Time
	served  chan error
	after   time.Duration // how long after since it was served
	refused int           // ErrQuarantineBound answers before that
	lease   *kvlease.Lease[R]
}

func waitWhole[R any](pool *kvlease.Pool[R]) *honestWait[R] {
	h := &honestWait[R]{since: time.Now(), served: make(chan error, 1)}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), bound)
		defer cancel()
		for {
			l, err := pool.AcquireWait(ctx, "honest", pool.Memory().Blocks())
			if errors.Is(err, kvlease.ErrQuarantineBound) && ctx.Err() == nil {
				h.refused++
				time.Sleep(5 * time.Millisecond)
				continue
			}
			h.after, h.lease = time.Since(h.since), l
			h.served <- err
			return
		}
	}()
	return h
}

// check asserts the honest request was served, logs how fast, and
// releases what it got.
func (h *honestWait[R]) check(t *testing.T) {
	t.Helper()
	if err := <-h.served; err != nil {
		t.Fatalf("the honest request for the whole pool was not served (refused %d times): %v", h.refused, err)
	}
	t.Logf("honest request for the whole pool served %v after the peer froze or stalled (refused %d times meanwhile)", h.after.Round(time.Millisecond), h.refused)
	h.lease.Release()
}

// liftedBy checks that a quarantine was recorded and then lifted by the
// transport's evidence, and logs how long that took.
func liftedBy(t *testing.T, who string, h []handoff.Step) {
	t.Helper()
	var q *handoff.Step
	for i := range h {
		if h[i].To == handoff.Quarantined {
			q = &h[i]
		}
	}
	last := h[len(h)-1]
	if q == nil || last.From != handoff.Quarantined || last.By != "transport" || last.To != handoff.Aborted {
		t.Fatalf("%s: no quarantine lifted by the transport: %v", who, h)
	}
	t.Logf("%s: the quarantine lifted %v after it was set", who, last.At.Sub(q.At).Round(time.Millisecond))
}

// settledWhileFrozen waits (a liveness bound) for l's blocks to be back
// while the peer is still stopped.
func settledWhileFrozen[R any](t *testing.T, who string, l *kvlease.Lease[R], pool *kvlease.Pool[R]) {
	t.Helper()
	select {
	case <-l.Settled():
	case <-time.After(bound):
		t.Fatalf("%s: the lease's blocks still held %v after the peer froze (lease %v, pool %+v)", who, bound, l.State(), pool.Stats())
	}
}

// TestAttackFrozenDestination is issue 30's item 1 as it was found: a
// prefill source releases its lease once its handoff is under way (rule
// 2 allows it), and the destination freezes (SIGSTOP) with our writer
// blocked in the kernel on its full socket. The source's deadline (300 ms) and
// Outgoing.Abort cancel the transfer itself, not only the (already
// closed) lease: the writer's return is the evidence, and every block
// comes back while the destination is still frozen. Before the fix the
// 64 blocks stayed quarantined until the Sender was closed.
func TestAttackFrozenDestination(t *testing.T) {
	const bb, blocks = 64 << 10, 64
	wrap := func(c net.Conn) net.Conn {
		_ = c.(*net.TCPConn).SetWriteBuffer(16 << 10)
		return c
	}
	for _, tc := range []struct {
		name     string
		deadline time.Duration
		abort    bool
	}{
		{"deadline", 300 * time.Millisecond, false},
		{"abort", 10 * bound, true}, // the deadline cannot be what ends it
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSrcSide(t, sideOpts{deadline: tc.deadline}, peerConfig{HoldAfter: 1, SmallBuffers: true}, bb, blocks, wrap)
			p := s.peer
			o, l := s.propose(1, blocks, 43)
			p.expect("held 1")
			waitState(t, "source", o.State, handoff.Transferring)
			l.Release() // rule 2: the source is done with it
			p.signal(syscall.SIGSTOP)
			honest := waitWhole(s.pool)
			if tc.abort {
				if err := o.Abort("frontend", errors.New("client went away")); err != nil {
					t.Fatal(err)
				}
			}
			settledWhileFrozen(t, "source", l, s.pool)
			if st := waitDone(t, "source", o.Done(), o.State); st != handoff.Aborted {
				t.Fatalf("source %v: %v", st, o.History())
			}
			// The cancel ended the blocked write: not the peer, not a
			// stall timeout.
			if err := o.Transfer().Err(); !errors.Is(err, kvlease.ErrCanceled) {
				t.Fatalf("source transfer resolved with %v, want the cancel's outcome", err)
			}
			if tc.abort {
				for _, st := range o.History() {
					if st.To == handoff.Quarantined {
						t.Fatalf("an abort quarantined: %v", o.History())
					}
				}
			} else {
				liftedBy(t, "source", o.History())
				if st := s.src.Stats(); st.Quarantined != 1 {
					t.Errorf("source stats %+v: want 1 quarantined", st)
				}
			}
			honest.check(t)
			wantStats(t, "source", localStats(s.pool, s.sender.Stats()), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok started=1 completed=0 canceled=1")
			p.signal(syscall.SIGCONT)
			p.do("release")
			p.do("wait 1 aborted")
			if f := p.expect("state 1 "); f[2] != "aborted" && f[2] != "failed" {
				t.Fatalf("peer's handoff: %q", f)
			}
			wantStats(t, "peer destination", p.stats(), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok")
		})
	}
}

// TestAttackFrozenSource: the same on the destination side. The source
// freezes mid-stream (SIGSTOP) with our reader blocked on its socket,
// and the destination's caller has already released the lease it was
// handed (an engine's cleanup of a request that went away): the
// destination's deadline and Incoming.Abort cancel the transfer itself,
// and the reader's return lifts what they quarantined.
func TestAttackFrozenSource(t *testing.T) {
	for _, tc := range []struct {
		name     string
		deadline time.Duration
		abort    bool
	}{
		{"deadline", 300 * time.Millisecond, false},
		{"abort", 10 * bound, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := newDestSide(t, sideOpts{deadline: tc.deadline}, peerConfig{HoldAfter: 2})
			p := d.peer
			p.do("propose 1 8 41")
			p.expect("held 2")
			in := d.in(1)
			waitState(t, "destination", in.State, handoff.Transferring)
			l := in.Lease()
			l.Release()
			p.signal(syscall.SIGSTOP)
			honest := waitWhole(d.pool)
			if tc.abort {
				if err := in.Abort("frontend", errors.New("client went away")); err != nil {
					t.Fatal(err)
				}
			}
			settledWhileFrozen(t, "destination", l, d.pool)
			if st := waitDone(t, "destination", in.Done(), in.State); st != handoff.Aborted {
				t.Fatalf("destination %v: %v", st, in.History())
			}
			if err := in.Transfer().Err(); !errors.Is(err, kvlease.ErrCanceled) {
				t.Fatalf("destination transfer resolved with %v, want the cancel's outcome", err)
			}
			if !tc.abort {
				liftedBy(t, "destination", in.History())
			}
			honest.check(t)
			wantStats(t, "destination", localStats(d.pool, d.recv.Stats()), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok started=1 completed=0 canceled=1")
			p.signal(syscall.SIGCONT)
			p.do("release")
			peerState(p, 1, handoff.Aborted)
			wantStats(t, "peer source", p.stats(), "free=64 leased=0 draining=0 quarantined=0 check=ok")
		})
	}
}

// stallFor is the progress timeout of the stall cases.
const stallFor = 300 * time.Millisecond

// TestAttackStalledPeer is issue 30's item 4 across processes: both
// halves without a deadline (Deadline < 0, which the config allows), and
// the peer stalls: it stops reading (a destination) or writing (a
// source) and stays alive. Our side's StallTimeout ends the transfer
// (ErrStalled): the loop's return is our evidence, and the blocks come
// back (an honest request for the whole pool is served). Before it the
// peer pinned them for as long as it liked.
func TestAttackStalledPeer(t *testing.T) {
	t.Run("destination-stalls", func(t *testing.T) {
		const bb, blocks = 64 << 10, 64
		wrap := func(c net.Conn) net.Conn {
			_ = c.(*net.TCPConn).SetWriteBuffer(16 << 10)
			return c
		}
		s := newSrcSide(t, sideOpts{deadline: -1, sendCfg: tcp.Config{StallTimeout: stallFor}},
			peerConfig{HoldAfter: 1, SmallBuffers: true, Deadline: -1}, bb, blocks, wrap)
		p := s.peer
		o, l := s.propose(1, blocks, 45)
		p.expect("held 1")
		waitState(t, "source", o.State, handoff.Transferring)
		l.Release()
		honest := waitWhole(s.pool)
		settledWhileFrozen(t, "source", l, s.pool)
		if err := o.Transfer().Err(); !errors.Is(err, tcp.ErrStalled) {
			t.Fatalf("source transfer resolved with %v, want ErrStalled", err)
		}
		honest.check(t)
		wantStats(t, "source", localStats(s.pool, s.sender.Stats()), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok started=1 completed=0 failed=1")
		if st := s.sender.Stats(); st.Stalled != 1 {
			t.Errorf("sender stats %+v: want 1 stalled", st)
		}
		// Resumed, the peer finds the connection closed: its reader
		// returns, and it fails; so does our handoff on its word.
		p.do("release")
		p.do("wait 1 failed")
		if f := p.expect("state 1 "); f[2] != "failed" && f[2] != "aborted" {
			t.Fatalf("peer's handoff: %q", f)
		}
		if st := waitDone(t, "source", o.Done(), o.State); st != handoff.Failed {
			t.Fatalf("source %v: %v", st, o.History())
		}
		wantStats(t, "peer destination", p.stats(), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok")
	})
	t.Run("source-stalls", func(t *testing.T) {
		d := newDestSide(t, sideOpts{deadline: -1, recvCfg: tcp.Config{StallTimeout: stallFor}}, peerConfig{HoldAfter: 2, Deadline: -1})
		p := d.peer
		p.do("propose 1 8 46")
		p.expect("held 2")
		in := d.in(1)
		honest := waitWhole(d.pool)
		if st := waitDone(t, "destination", in.Done(), in.State); st != handoff.Failed {
			t.Fatalf("destination %v: %v", st, in.History())
		}
		if err := in.Transfer().Err(); !errors.Is(err, tcp.ErrStalled) {
			t.Fatalf("destination transfer resolved with %v, want ErrStalled", err)
		}
		honest.check(t)
		wantStats(t, "destination", localStats(d.pool, d.recv.Stats()), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok started=1 completed=0 failed=1")
		if st := d.recv.Stats(); st.Stalled != 1 {
			t.Errorf("receiver stats %+v: want 1 stalled", st)
		}
		// The peer heard of the failure (our Done): its writer was
		// cancelled in its hold, and it fails on its own evidence.
		p.do("release")
		peerState(p, 1, handoff.Failed)
		wantStats(t, "peer source", p.stats(), "leased=8 draining=0 quarantined=0 check=ok")
	})
}

// TestAttackStallPaths is item 4 on each path of the plane (plain,
// layered, streaming), in process: both halves without a deadline, one
// side stalled (its connection wrapper holds its reads or writes, or its
// prefill stops marking parts), and the other side's StallTimeout ends
// its transfer with ErrStalled; its blocks come back.
func TestAttackStallPaths(t *testing.T) {
	for _, path := range []string{"plain", "layered", "stream"} {
		for _, who := range []string{"source", "destination"} {
			t.Run(path+"/"+who+"-stalls", func(t *testing.T) {
				if path == "layered" {
					tag := layeredEnv(64).Layout.Tag
					_, srcPool := hostLayout(t, layout.LayerSeparated(lLayers, 2, 64, lPiece, tag))
					_, dstPool := hostLayout(t, layout.Contiguous(lLayers, 2, 64, lPiece, tag))
					stallCase(t, srcPool, dstPool, layeredEnv(64), layered, layeredRecv, who, false)
					return
				}
				stallCase(t, hostPool(t, 64), hostPool(t, 64), env(64), flat, flatRecv, who, path == "stream")
			})
		}
	}
}

// stallCase runs one case of TestAttackStallPaths: a handoff of the
// whole source pool, with who stalling.
func stallCase[S, D any](t *testing.T, srcPool *kvlease.Pool[S], dstPool *kvlease.Pool[D], e handoff.Envelope,
	send func(*tcp.Sender) handoff.SendPlane[S], recv func(*tcp.Receiver) handoff.RecvPlane[D], who string, stream bool) {
	release := make(chan struct{})
	held := make(chan struct{}, 4)
	hold := func(c net.Conn) net.Conn {
		return &holdConn{Conn: c, left: 4 * blockBytes, onHold: func() { held <- struct{}{} }, release: release}
	}
	small := func(c net.Conn) net.Conn {
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetReadBuffer(8 << 10)
			_ = tc.SetWriteBuffer(8 << 10)
		}
		return c
	}
	o := streamOpts{deadline: -1, stall: stallFor}
	switch {
	case who == "destination":
		o.wrapSend, o.wrapRecv = small, func(c net.Conn) net.Conn { return hold(small(c)) }
	case !stream:
		o.wrapSend = hold // a streaming source stalls by its prefill instead
	}
	h := newStreamHalves(t, srcPool, dstPool, e, send, recv, o)
	t.Cleanup(func() { close(release) }) // before the halves' cleanup: the holds let go
	n := srcPool.Memory().Blocks()
	lease, err := srcPool.Acquire("r", n)
	if err != nil {
		t.Fatal(err)
	}
	var opts []handoff.ProposeOption
	var prog *handoff.Progress
	if stream {
		prog, _ = handoff.NewProgress(n, sLayers)
		opts = append(opts, handoff.Streaming(prog))
	}
	out, err := h.src.Propose(1, "r", lease, nil, opts...)
	if err != nil {
		t.Fatal(err)
	}
	in := waitIn(t, h, out)
	if stream {
		upTo := sLayers // the destination stalls: everything to send
		if who == "source" {
			upTo = 2 // the prefill stalls after two layers
		}
		if err := prog.WroteLayers(upTo); err != nil {
			t.Fatal(err)
		}
	}
	if who == "source" {
		// The destination's stall timeout ends its transfer.
		honest := waitWhole(dstPool)
		waitFinal(t, in)
		if in.State() != handoff.Failed || !errors.Is(in.Transfer().Err(), tcp.ErrStalled) {
			t.Fatalf("destination %v, transfer %v: %v", in.State(), in.Transfer().Err(), in.History())
		}
		if st := h.recv.Stats(); st.Stalled != 1 || st.Failed != 1 {
			t.Fatalf("receiver stats %+v", st)
		}
		honest.check(t)
		if stream {
			// The source's writer waited for its prefill, not on the
			// socket: the destination's word cancels it.
			waitFinal(t, out)
			if out.State() != handoff.Failed {
				t.Fatalf("source %v: %v", out.State(), out.History())
			}
		}
		lease.Release()
		return
	}
	// The destination stalls: the source's stall timeout ends its
	// transfer, and the lease it released comes back.
	select {
	case <-held:
	case <-time.After(bound):
		t.Fatal("the destination never stalled")
	}
	lease.Release()
	honest := waitWhole(srcPool)
	settledWhileFrozen(t, "source", lease, srcPool)
	if err := out.Transfer().Err(); !errors.Is(err, tcp.ErrStalled) {
		t.Fatalf("source transfer resolved with %v, want ErrStalled", err)
	}
	if st := h.sender.Stats(); st.Stalled != 1 || st.Failed != 1 {
		t.Fatalf("sender stats %+v", st)
	}
	honest.check(t)
}

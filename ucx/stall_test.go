package ucx_test

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/ucx"
)

// The progress timeout (Config.StallTimeout) with no handoff deadline
// (Deadline < 0): a frozen peer holds our blocks for at most StallTimeout
// past its last progress; a slow but live one is never stalled.

// gate is a fault hook's switch: the hook signals frozen once and blocks
// until release (closed once, by the test or its cleanup).
type gate struct {
	frozen, released chan struct{}
	fOnce, rOnce     sync.Once
}

// newGate returns a gate; the caller registers its release as a cleanup
// after the loop's (cleanups run last first: nothing stays blocked).
func newGate() *gate {
	return &gate{frozen: make(chan struct{}), released: make(chan struct{})}
}

func (g *gate) block() {
	g.fOnce.Do(func() { close(g.frozen) })
	<-g.released
}

func (g *gate) release() { g.rOnce.Do(func() { close(g.released) }) }

func (g *gate) waitFrozen(t *testing.T) {
	t.Helper()
	select {
	case <-g.frozen:
	case <-time.After(30 * time.Second):
		t.Fatal("the hook never ran")
	}
}

// TestStallFrozenDestination: the destination's worker freezes with its
// receives posted (a fault hook blocks it), nobody has a deadline. The
// source's transfer ends ErrStalled by its own revocation, and its blocks
// come back, while the destination is still frozen.
func TestStallFrozenDestination(t *testing.T) {
	for _, pull := range []bool{false, true} {
		name := "push"
		if pull {
			name = "pull"
		}
		// Pushed, the lease is one message (a rendezvous: its send
		// completes only once the destination takes it); pulled, a get
		// per block, the second never posted.
		maxGet := 0
		if pull {
			maxGet = blockBytes
		}
		t.Run(name, func(t *testing.T) {
			g := newGate()
			l := newLoop(t, loopConfig{deadline: -1,
				send: ucx.Config{Pull: pull, StallTimeout: 300 * time.Millisecond},
				recv: ucx.Config{Pull: pull, StallTimeout: time.Hour, MaxGet: maxGet, BeforeGet: func(_ handoff.PlaneID, block int) {
					if block == 1 {
						g.block()
					}
				}}})
			t.Cleanup(g.release)
			lease, err := l.srcPool.Acquire("r", 10)
			if err != nil {
				t.Fatal(err)
			}
			stamp(t, lease, 51)
			o, err := l.src.Propose(1, "r", lease, nil)
			if err != nil {
				t.Fatal(err)
			}
			g.waitFrozen(t)
			// The handoff waits for the destination's word (it has
			// none: no deadline); the transfer, and so the blocks, do
			// not.
			tr := waitTransfer(t, o)
			if err := tr.Err(); !errors.Is(err, ucx.ErrStalled) || !errors.Is(err, ucx.ErrRevoked) || errors.Is(err, kvlease.ErrCanceled) {
				t.Fatalf("source transfer resolved with %v, want a stall's revocation", err)
			}
			if s := l.sender.Stats(); s.Stalled != 1 || s.Revoked != 1 || s.Completed != 0 {
				t.Fatalf("sender %+v", s)
			}
			if err := marked(lease, 51); err != nil {
				t.Fatalf("source blocks changed: %v", err)
			}
			lease.Release()
			allFree(t, "source", l.srcPool) // the destination is still frozen
			if s := l.recv.Stats(); s.Completed != 0 || s.Stalled != 0 {
				t.Fatalf("receiver %+v while frozen", s)
			}
			if st := o.State(); st.Final() {
				t.Fatalf("source %v while the destination is frozen: %v", st, o.History())
			}
			g.release()
			if pull {
				// The revoked source's worker may not have finished its
				// flush (its peer was frozen): it is then abandoned, its
				// sockets open (see Limits in DESIGN.md), and the
				// destination's next get waits until Close revokes it.
				return
			}
			in := waitIncoming(t, l, 1)
			if st := in.State(); st != handoff.Failed && st != handoff.Aborted {
				t.Fatalf("destination %v: %v", st, in.History())
			}
			waitFinal(t, o)
			if st := o.State(); st != handoff.Failed {
				t.Fatalf("source %v: %v", st, o.History())
			}
		})
	}
}

// waitTransfer waits up to 30 s for o's transfer to resolve and returns it.
func waitTransfer(t *testing.T, o *handoff.Outgoing[[]byte]) *kvlease.Transfer {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for o.Transfer() == nil {
		select {
		case <-deadline:
			t.Fatalf("never attached: %v", o.History())
		case <-time.After(5 * time.Millisecond):
		}
	}
	tr := o.Transfer()
	select {
	case <-tr.Done():
	case <-deadline:
		t.Fatalf("the source's transfer still %v after 30 s", tr.State())
	}
	return tr
}

// TestStallSilentSource: the source attaches and never sends (its
// worker blocks before the first message), nobody has a deadline. The
// destination's transfer ends ErrStalled once its receives are
// withdrawn (its evidence: no revocation, nothing counted as a cancel),
// its blocks come back, and a message the source sends after all never
// lands in them.
func TestStallSilentSource(t *testing.T) {
	g := newGate()
	l := newLoop(t, loopConfig{deadline: -1,
		send: ucx.Config{StallTimeout: time.Hour, BeforeSend: func(handoff.PlaneID, int) { g.block() }},
		recv: ucx.Config{StallTimeout: 300 * time.Millisecond}})
	t.Cleanup(g.release)
	lease, err := l.srcPool.Acquire("r", 10)
	if err != nil {
		t.Fatal(err)
	}
	stamp(t, lease, 52)
	o, err := l.src.Propose(1, "r", lease, nil)
	if err != nil {
		t.Fatal(err)
	}
	g.waitFrozen(t)
	in := waitIncoming(t, l, 1)
	if st := in.State(); st != handoff.Failed {
		t.Fatalf("destination %v: %v", st, in.History())
	}
	if err := in.Transfer().Err(); !errors.Is(err, ucx.ErrStalled) || errors.Is(err, ucx.ErrRevoked) || errors.Is(err, kvlease.ErrCanceled) {
		t.Fatalf("destination transfer resolved with %v, want a stall", err)
	}
	if s := l.recv.Stats(); s.Stalled != 1 || s.Revoked != 0 || s.Canceled != 0 || s.Completed != 0 {
		t.Fatalf("receiver %+v", s)
	}
	allFree(t, "destination", l.dstPool)
	// Reuse every block of the destination, then let the source go: none
	// of its messages may land.
	reuse, err := l.dstPool.Acquire("reuse", 64)
	if err != nil {
		t.Fatal(err)
	}
	stamp(t, reuse, 53)
	g.release()
	waitFinal(t, o)
	if st := o.State(); st != handoff.Failed && st != handoff.Aborted {
		t.Fatalf("source %v: %v", st, o.History())
	}
	if err := marked(reuse, 53); err != nil {
		t.Fatalf("a late message landed in a reused block: %v", err)
	}
	reuse.Release()
	lease.Release()
	allFree(t, "source", l.srcPool)
}

// TestStallSlowPeerLive: a peer that progresses every 200 ms, across
// several StallTimeouts of 2 s, is not stalled: a slow source (a block
// per message, 200 ms before each), and a slow destination (a
// rendezvous-size block per message, 200 ms before each receive; the
// source's sends complete only as the destination takes them).
func TestStallSlowPeerLive(t *testing.T) {
	const (
		stall  = 2 * time.Second
		pause  = 200 * time.Millisecond
		blocks = 24 // 4.8 s: more than two StallTimeouts
		bb     = 64 << 10
	)
	slow := func(handoff.PlaneID, int) { time.Sleep(pause) }
	for _, tc := range []struct {
		name       string
		send, recv ucx.Config
	}{
		// Window 1: the source's worker progresses between its pauses
		// (they run on its thread), as a live source's does.
		{"slow-source", ucx.Config{StallTimeout: stall, MaxGet: bb, Window: 1, BeforeSend: slow}, ucx.Config{StallTimeout: stall, MaxGet: bb}},
		{"slow-destination", ucx.Config{StallTimeout: stall, MaxGet: bb}, ucx.Config{StallTimeout: stall, MaxGet: bb, Window: 1, BeforeGet: slow}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newLoop(t, loopConfig{deadline: -1, keepLeases: true, blockBytes: bb, poolBlocks: 2 * blocks, send: tc.send, recv: tc.recv})
			lease, err := l.srcPool.Acquire("r", blocks)
			if err != nil {
				t.Fatal(err)
			}
			stamp(t, lease, 54)
			start := time.Now()
			o, err := l.src.Propose(1, "r", lease, nil)
			if err != nil {
				t.Fatal(err)
			}
			select {
			case <-o.Done():
			case <-time.After(60 * time.Second):
				t.Fatalf("still %v after 60 s", o.State())
			}
			if st := o.State(); st != handoff.Delivered {
				t.Fatalf("source %v after %v: %v", st, time.Since(start), o.History())
			}
			in := waitIncoming(t, l, 1)
			if st := in.State(); st != handoff.Delivered {
				t.Fatalf("destination %v: %v", st, in.History())
			}
			if err := marked(in.Lease(), 54); err != nil {
				t.Fatal(err)
			}
			in.Lease().Release()
			lease.Release()
			if s, r := l.sender.Stats(), l.recv.Stats(); s.Stalled != 0 || r.Stalled != 0 || s.Completed != 1 || r.Completed != 1 {
				t.Fatalf("sender %+v receiver %+v", s, r)
			}
			t.Logf("delivered in %v (StallTimeout %v)", time.Since(start).Round(time.Millisecond), stall)
		})
	}
}

// TestStallStreamPrefillPause: a streaming handoff whose prefill pauses
// between layers. The source's wait for its own prefill, with nothing
// outstanding, is not a stall (source-waits: a pause of more than three
// of its StallTimeouts, delivered); the destination cannot tell a
// computing prefill from a frozen one, so a pause longer than its
// StallTimeout stalls it (destination-gap: ErrStalled, its receives
// withdrawn), as Config.StallTimeout's doc says.
func TestStallStreamPrefillPause(t *testing.T) {
	const short = 300 * time.Millisecond
	t.Run("source-waits", func(t *testing.T) {
		l := newLoop(t, loopConfig{deadline: -1, keepLeases: true,
			send: ucx.Config{StallTimeout: short}, recv: ucx.Config{StallTimeout: time.Hour}})
		out, in, lease, prog, fill := startStream(t, l, 6, 61)
		prefill(t, prog, 0, 0, 3, fill)
		waitFor(t, "the first 3 layers sent", func() bool { return l.sender.Stats().Messages >= 3 })
		time.Sleep(4 * short)
		prefill(t, prog, 0, 3, sLayers, fill)
		waitFinal(t, out)
		waitFinal(t, in)
		if out.State() != handoff.Delivered || in.State() != handoff.Delivered {
			t.Fatalf("source %v, destination %v: %v / %v", out.State(), in.State(), out.History(), in.History())
		}
		if err := checkParts(in.Lease(), 61); err != nil {
			t.Fatal(err)
		}
		in.Lease().Release()
		lease.Release()
		if s := l.sender.Stats(); s.Stalled != 0 || s.Completed != 1 {
			t.Fatalf("sender %+v", s)
		}
	})
	t.Run("destination-gap", func(t *testing.T) {
		l := newLoop(t, loopConfig{deadline: -1, keepLeases: true,
			send: ucx.Config{StallTimeout: time.Hour}, recv: ucx.Config{StallTimeout: short}})
		out, in, lease, prog, fill := startStream(t, l, 6, 62)
		prefill(t, prog, 0, 0, 3, fill)
		waitFinal(t, in) // the prefill pauses until the destination gave up
		if st := in.State(); st != handoff.Failed {
			t.Fatalf("destination %v: %v", st, in.History())
		}
		if err := in.Transfer().Err(); !errors.Is(err, ucx.ErrStalled) {
			t.Fatalf("destination transfer resolved with %v, want a stall", err)
		}
		if r := l.recv.Stats(); r.Stalled != 1 || r.Revoked != 0 || r.Completed != 0 {
			t.Fatalf("receiver %+v", r)
		}
		prefill(t, prog, 0, 3, sLayers, fill)
		waitFinal(t, out)
		if st := out.State(); st != handoff.Failed && st != handoff.Aborted {
			t.Fatalf("source %v: %v", st, out.History())
		}
		lease.Release()
		waitSettled(t, lease)
	})
}

package handoff

import (
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvlease/kvlease"
)

// Tests that an abort and a deadline end the transfer itself (its
// cancel), not only the lease: a lease closed already (rule 2 lets the
// source release right after Propose) cancels nothing when aborted, and
// a plane whose loop waits on a frozen peer would then never return its
// evidence (issue 30, item 1).

// errCanceled is the outcome of a cancelPlane transfer that honoured its
// cancel.
var errCanceled = errors.New("cancelPlane: canceled")

// cancelPlane is a SendPlane and a RecvPlane whose transfers honour a
// cancel: the hook counts the call and resolves the transfer with
// errCanceled, as a plane's loop does when the cancel ends its
// blocked read or write. Nothing else resolves them.
type cancelPlane struct {
	canceled  atomic.Int32
	transfers chan *kvlease.Transfer
}

func newCancelPlane() *cancelPlane { return &cancelPlane{transfers: make(chan *kvlease.Transfer, 8)} }

func (p *cancelPlane) attach(attach func(*kvlease.Transfer) error) error {
	var t *kvlease.Transfer
	t = kvlease.NewTransfer(func() {
		p.canceled.Add(1)
		t.Resolve(errCanceled)
	})
	if err := attach(t); err != nil {
		t.Resolve(err)
		return err
	}
	p.transfers <- t
	return nil
}

func (p *cancelPlane) Send(_ PlaneID, _ [][]byte, _ []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	return nil, p.attach(attach)
}
func (p *cancelPlane) Finish(PlaneID, error)                { /* a push plane: its own evidence */ }
func (p *cancelPlane) Prepare(PlaneID, int) ([]byte, error) { return []byte("cancel"), nil }
func (p *cancelPlane) Receive(_ PlaneID, _ [][]byte, _ []byte, attach func(*kvlease.Transfer) error) error {
	return p.attach(attach)
}
func (p *cancelPlane) Forget(PlaneID) {}

func (p *cancelPlane) next(t *testing.T) *kvlease.Transfer {
	t.Helper()
	select {
	case tr := <-p.transfers:
		return tr
	case <-time.After(10 * time.Second):
		t.Fatal("no transfer attached")
		return nil
	}
}

// cancelHalves is a Source and a Destination over a pipe, each with a
// cancelPlane.
type cancelHalves struct {
	srcPool, dstPool *kvlease.Pool[[]byte]
	src              *Source[[]byte]
	send, recv       *cancelPlane
	incoming         chan *Incoming[[]byte]
}

// newCancelHalves starts both halves with their own deadlines (negative:
// none), so that only one side's can fire.
func newCancelHalves(t *testing.T, srcDeadline, dstDeadline time.Duration) *cancelHalves {
	t.Helper()
	h := &cancelHalves{srcPool: newHostPool(t, 32, hbBytes), dstPool: newHostPool(t, 32, hbBytes),
		send: newCancelPlane(), recv: newCancelPlane(), incoming: make(chan *Incoming[[]byte], 8)}
	a, b := net.Pipe()
	dst, err := NewDestination(h.dstPool, h.recv, DestinationConfig[[]byte]{
		HalfConfig: HalfConfig{Envelope: testEnvelope(), Deadline: dstDeadline, Auth: testPSK},
		OnAccept:   func(in *Incoming[[]byte]) { h.incoming <- in },
	})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() { _ = dst.Serve(b); close(served) }()
	if h.src, err = NewSource(a, h.send, HalfConfig{Envelope: testEnvelope(), Deadline: srcDeadline, Auth: testPSK}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = h.src.Close()
		<-served
		for _, p := range []*kvlease.Pool[[]byte]{h.srcPool, h.dstPool} {
			if err := p.Check(); err != nil {
				t.Error(err)
			}
		}
	})
	return h
}

// start proposes a 3-block lease and returns the handoff on both sides
// once both planes attached their transfers.
func (h *cancelHalves) start(t *testing.T) (*kvlease.Lease[[]byte], *Outgoing[[]byte], *Incoming[[]byte], *kvlease.Transfer, *kvlease.Transfer) {
	t.Helper()
	lease, err := h.srcPool.Acquire("r", 3)
	if err != nil {
		t.Fatal(err)
	}
	o, err := h.src.Propose(1, "r", lease, nil)
	if err != nil {
		t.Fatal(err)
	}
	in := <-h.incoming
	return lease, o, in, h.send.next(t), h.recv.next(t)
}

// settled waits (a liveness bound, not a verdict) for a lease's blocks
// to be back.
func settled(t *testing.T, what string, l *kvlease.Lease[[]byte]) {
	t.Helper()
	select {
	case <-l.Settled():
	case <-time.After(10 * time.Second):
		t.Fatalf("%s lease still %v: its transfer was never cancelled", what, l.State())
	}
}

func finalIn(t *testing.T, what string, done <-chan struct{}) {
	t.Helper()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s never final: its transfer was never cancelled", what)
	}
}

// TestSourceAbortCancelsAfterRelease: the source released its lease
// right after Propose; Outgoing.Abort cancels the transfer itself, whose
// evidence then makes the handoff Aborted and brings the blocks back.
func TestSourceAbortCancelsAfterRelease(t *testing.T) {
	h := newCancelHalves(t, -1, -1)
	lease, o, in, st, _ := h.start(t)
	lease.Release()
	if s := h.srcPool.Stats(); s.Draining != 3 {
		t.Fatalf("source pool after the release: %+v", s)
	}
	if err := o.Abort("frontend", errors.New("client went away")); err != nil {
		t.Fatal(err)
	}
	finalIn(t, "source", o.Done())
	settled(t, "source", lease)
	if s := o.State(); s != Aborted || !errors.Is(st.Err(), errCanceled) || h.send.canceled.Load() != 1 {
		t.Fatalf("source %v, transfer %v, %d cancels: %v", s, st.Err(), h.send.canceled.Load(), o.History())
	}
	if s := h.srcPool.Stats(); s.Free != 32 {
		t.Fatalf("source pool: %+v", s)
	}
	finalIn(t, "destination", in.Done()) // told by the source's Abort; its lease is open
}

// TestSourceDeadlineCancelsAfterRelease: the same with the deadline:
// the transfer is quarantined and cancelled, and its evidence lifts the
// quarantine (Stats counted it).
func TestSourceDeadlineCancelsAfterRelease(t *testing.T) {
	h := newCancelHalves(t, 50*time.Millisecond, -1)
	lease, o, in, st, _ := h.start(t)
	lease.Release()
	finalIn(t, "source", o.Done())
	settled(t, "source", lease)
	if s := o.State(); s != Aborted || !errors.Is(st.Err(), errCanceled) {
		t.Fatalf("source %v, transfer %v: %v", s, st.Err(), o.History())
	}
	if !sawState(o.History(), Quarantined) {
		t.Fatalf("no quarantine: %v", o.History())
	}
	if s := h.src.Stats(); s.Quarantined != 1 {
		t.Fatalf("source stats %+v", s)
	}
	if s := h.srcPool.Stats(); s.Free != 32 || s.Quarantined != 0 {
		t.Fatalf("source pool: %+v", s)
	}
	finalIn(t, "destination", in.Done())
}

// TestDestinationAbortCancelsAfterRelease: a destination whose caller
// released the lease it was handed (an engine's cleanup of a request
// that went away) and then aborts: the transfer is cancelled all the
// same, and so is it at the destination's deadline.
func TestDestinationAbortCancelsAfterRelease(t *testing.T) {
	t.Run("abort", func(t *testing.T) {
		h := newCancelHalves(t, -1, -1)
		lease, o, in, _, dt := h.start(t)
		dl := in.Lease()
		dl.Release()
		if err := in.Abort("decode", errors.New("client went away")); err != nil {
			t.Fatal(err)
		}
		finalIn(t, "destination", in.Done())
		settled(t, "destination", dl)
		if s := in.State(); s != Aborted || !errors.Is(dt.Err(), errCanceled) || h.recv.canceled.Load() != 1 {
			t.Fatalf("destination %v, transfer %v: %v", s, dt.Err(), in.History())
		}
		if s := h.dstPool.Stats(); s.Free != 32 {
			t.Fatalf("destination pool: %+v", s)
		}
		finalIn(t, "source", o.Done()) // its lease is open: the abort cancels
		lease.Release()
	})
	t.Run("deadline", func(t *testing.T) {
		h := newCancelHalves(t, -1, 50*time.Millisecond)
		lease, o, in, _, dt := h.start(t)
		dl := in.Lease()
		dl.Release()
		finalIn(t, "destination", in.Done())
		settled(t, "destination", dl)
		if s := in.State(); s != Aborted || !errors.Is(dt.Err(), errCanceled) || !sawState(in.History(), Quarantined) {
			t.Fatalf("destination %v, transfer %v: %v", s, dt.Err(), in.History())
		}
		finalIn(t, "source", o.Done())
		lease.Release()
	})
}

// TestHandoffAbortCancelsClosedLeases: the in-process Handoff cancels its
// transfer on Abort and on Expire even when both leases were closed
// already (the source's by its owner, as rule 2 allows; the
// destination's against its contract): each lease's Abort is then a
// no-op that cancels nothing.
func TestHandoffAbortCancelsClosedLeases(t *testing.T) {
	for _, expire := range []bool{false, true} {
		synctest.Test(t, func(t *testing.T) {
			f := newFixture(t, 3, time.Second)
			f.tr.onCancel = func(t *kvlease.Transfer) { t.Resolve(errCanceled) }
			f.start(t)
			f.lease.Release()
			f.h.Destination().Release()
			if expire {
				time.Sleep(time.Second) // the deadline's timer
				synctest.Wait()
			} else if err := f.h.Abort("frontend", nil); err != nil {
				t.Fatal(err)
			}
			wantState(t, f.h, Aborted)
			if f.tr.cancels.Load() != 1 {
				t.Fatalf("expire=%v: %d cancels", expire, f.tr.cancels.Load())
			}
			wantStats(t, f, "src free=32 leased=0 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
		})
	}
}

func sawState(h []Step, s State) bool {
	for _, st := range h {
		if st.To == s {
			return true
		}
	}
	return false
}

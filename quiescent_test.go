package kvlease

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvlease/kvlease/internal/invariants"
)

func quiescenceErr(t *testing.T, err error) *QuiescenceError {
	t.Helper()
	var qe *QuiescenceError
	if !errors.As(err, &qe) || !errors.Is(err, ErrNotQuiescent) {
		t.Fatalf("not a quiescence error: %v", err)
	}
	return qe
}

// TestCheckQuiescent: Check passes a pool with a forgotten open lease;
// CheckQuiescent does not: it counts what is held and, in a watched
// pool, names each lease still open, draining or quarantined with its
// owner and blocks; once everything has settled, it is nil.
func TestCheckQuiescent(t *testing.T) {
	for _, watched := range []bool{false, true} {
		var opts []Option
		if watched {
			opts = append(opts, WithObserver(ObserverFunc(func(Event) {})))
		}
		p := hostPool(t, 16, 64, opts...)
		if err := p.CheckQuiescent(); err != nil {
			t.Fatalf("a new pool: %v", err)
		}
		open, _ := p.Acquire("forgotten", 2)
		draining, _ := p.Acquire("sender", 3)
		quar, _ := p.Acquire("lost-peer", 1)
		send, stuck := NewTransfer(nil), NewTransfer(nil)
		if err := draining.Attach(send); err != nil {
			t.Fatal(err)
		}
		if err := quar.Attach(stuck); err != nil {
			t.Fatal(err)
		}
		draining.Release()
		quar.Release()
		stuck.Quarantine(errors.New("peer vanished"))

		if err := p.Check(); err != nil {
			t.Fatalf("Check is a consistency check, not a leak check: %v", err)
		}
		qe := quiescenceErr(t, p.CheckQuiescent())
		if qe.OpenLeases != 1 || qe.Leased != 2 || qe.Draining != 3 || qe.Quarantined != 1 || qe.Waiters != 0 {
			t.Fatalf("watched %v: %+v", watched, qe)
		}
		var want []Holding
		if watched || invariants.Enabled { // a checked build watches every pool
			want = []Holding{
				{Lease: open.ID(), Owner: "forgotten", State: LeaseActive},
				{Lease: draining.ID(), Owner: "sender", State: LeaseDraining, Blocks: 3},
				{Lease: quar.ID(), Owner: "lost-peer", State: LeaseQuarantined, Blocks: 1},
			}
		}
		if len(qe.Holdings) != len(want) {
			t.Fatalf("watched %v: holdings %v, want %v", watched, qe.Holdings, want)
		}
		for i := range want {
			if qe.Holdings[i] != want[i] {
				t.Fatalf("watched %v: holding %d is %+v, want %+v", watched, i, qe.Holdings[i], want[i])
			}
		}
		msg := qe.Error()
		for _, s := range []string{"1 open leases", "(sender) draining, 3 blocks", "(lost-peer) quarantined, 1 blocks"} {
			if !strings.Contains(msg, s) && (len(want) > 0 || s == "1 open leases") {
				t.Fatalf("message %q lacks %q", msg, s)
			}
		}

		send.Resolve(nil)
		stuck.Resolve(nil) // late evidence
		open.Release()
		if err := p.CheckQuiescent(); err != nil {
			t.Fatalf("watched %v, everything settled: %v", watched, err)
		}
		// The table reuses its entries: a cycle of leases leaves it as
		// small as the most held at once.
		for range 100 {
			l, _ := p.Acquire("cycle", 1)
			tr := NewTransfer(nil)
			_ = l.Attach(tr)
			l.Release()
			tr.Resolve(nil)
		}
		if n := len(p.holds.recs); n > 3 {
			t.Fatalf("table of %d entries after settled cycles", n)
		}
		if err := p.CheckQuiescent(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestCheckQuiescentWaiters: a queued AcquireWait caller is not at rest.
func TestCheckQuiescentWaiters(t *testing.T) {
	p := hostPool(t, 2, 64)
	l, _ := p.Acquire("a", 2)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	got := make(chan error, 1)
	go func() {
		w, err := p.AcquireWait(ctx, "waiter", 1)
		if err == nil {
			w.Release()
		}
		got <- err
	}()
	for i := 0; p.Stats().Waiters == 0; i++ {
		if i > 5000 {
			t.Fatal("the waiter never queued")
		}
		time.Sleep(time.Millisecond)
	}
	if qe := quiescenceErr(t, p.CheckQuiescent()); qe.Waiters != 1 || qe.OpenLeases != 1 {
		t.Fatalf("%+v", qe)
	}
	l.Release()
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	if err := p.CheckQuiescent(); err != nil {
		t.Fatal(err)
	}
}

// TestCheckQuiescentLeaked: a lease dropped while open stays a holding,
// marked leaked once the leak check has found it.
func TestCheckQuiescentLeaked(t *testing.T) {
	p, leaked := lkPool(t, 8, WithLeakCheck(true))
	id, _ := lkDrop(t, p, "forgetful", 3, false)
	lkGC(t, leaked, "leak report")
	qe := quiescenceErr(t, p.CheckQuiescent())
	if len(qe.Holdings) != 1 || qe.Holdings[0] != (Holding{Lease: id, Owner: "forgetful", State: LeaseActive, Leaked: true}) || qe.Leased != 3 {
		t.Fatalf("%+v", qe)
	}
	if !strings.Contains(qe.Error(), "(forgetful) leaked while open") {
		t.Fatal(qe.Error())
	}
}

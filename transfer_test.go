package kvlease

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	"go.uber.org/atomic"
)

func coreIsClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

func TestTransferResolve(t *testing.T) {
	tr := NewTransfer(nil)
	if tr.State() != TransferPending || tr.Err() != nil || coreIsClosed(tr.Done()) {
		t.Fatalf("new transfer: %v err=%v", tr.State(), tr.Err())
	}
	outcome := errors.New("copy failed, engine stopped")
	if !tr.Resolve(outcome) {
		t.Fatal("first Resolve lost")
	}
	if tr.Resolve(nil) {
		t.Fatal("second Resolve won")
	}
	if tr.State() != TransferResolved || !errors.Is(tr.Err(), outcome) || !coreIsClosed(tr.Done()) {
		t.Fatalf("resolved: %v err=%v", tr.State(), tr.Err())
	}
	// Quarantine after Resolve is a no-op.
	tr.Quarantine(errors.New("too late"))
	if tr.State() != TransferResolved || !errors.Is(tr.Err(), outcome) {
		t.Fatalf("Quarantine after Resolve changed it: %v err=%v", tr.State(), tr.Err())
	}
}

func TestTransferQuarantine(t *testing.T) {
	tr := NewTransfer(nil)
	done := tr.Done() // asked before: closed only on Resolve
	tr.Quarantine(nil)
	if tr.State() != TransferQuarantined || !errors.Is(tr.Err(), ErrQuarantined) {
		t.Fatalf("Quarantine(nil): %v err=%v", tr.State(), tr.Err())
	}
	if coreIsClosed(done) || coreIsClosed(tr.Done()) {
		t.Fatal("Done closed by Quarantine: it is not evidence")
	}
	// A second Quarantine keeps the first reason.
	tr.Quarantine(errors.New("second"))
	if !errors.Is(tr.Err(), ErrQuarantined) {
		t.Fatalf("second Quarantine replaced the reason: %v", tr.Err())
	}
	// Late evidence wins.
	if !tr.Resolve(nil) {
		t.Fatal("Resolve after Quarantine lost")
	}
	if tr.State() != TransferResolved || tr.Err() != nil || !coreIsClosed(done) {
		t.Fatalf("late Resolve: %v err=%v", tr.State(), tr.Err())
	}
	if tr.Resolve(nil) {
		t.Fatal("Resolve after the late Resolve won")
	}

	reason := errors.New("peer vanished mid-write")
	q := NewTransfer(nil)
	q.Quarantine(reason)
	if !errors.Is(q.Err(), reason) {
		t.Fatalf("reason %v", q.Err())
	}
}

// Cancel runs the hook at most once, never after Resolve, and changes no
// state.
func TestTransferCancel(t *testing.T) {
	var n atomic.Int32
	tr := NewTransfer(func() { n.Add(1) })
	tr.Cancel()
	tr.Cancel()
	if n.Load() != 1 {
		t.Fatalf("hook ran %d times", n.Load())
	}
	if tr.State() != TransferPending {
		t.Fatalf("Cancel changed the state to %v", tr.State())
	}

	var m atomic.Int32
	r := NewTransfer(func() { m.Add(1) })
	r.Resolve(nil)
	r.Cancel()
	if m.Load() != 0 {
		t.Fatal("hook ran after Resolve")
	}

	var q atomic.Int32
	qt := NewTransfer(func() { q.Add(1) })
	qt.Quarantine(nil)
	qt.Cancel()
	if q.Load() != 1 || qt.State() != TransferQuarantined {
		t.Fatalf("Cancel of a quarantined transfer: hook %d, state %v", q.Load(), qt.State())
	}
	qt.Resolve(nil)
	qt.Cancel()
	if q.Load() != 1 {
		t.Fatal("hook ran twice")
	}

	NewTransfer(nil).Cancel() // a nil hook is allowed

	// Many concurrent Cancels: still once.
	var c atomic.Int32
	ct := NewTransfer(func() { c.Add(1) })
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() { defer wg.Done(); ct.Cancel() }()
	}
	wg.Wait()
	if c.Load() != 1 {
		t.Fatalf("hook ran %d times under concurrent Cancel", c.Load())
	}
}

// A cancel hook may resolve its transfer synchronously: no deadlock, and
// the blocks it gated are back when Cancel returns.
func TestCancelHookResolves(t *testing.T) {
	p := corePool(t, 4)
	l := coreAcquire(t, p, "l", 3)
	var tr *Transfer
	tr = NewTransfer(func() { tr.Resolve(errors.New("cancelled, engine fenced")) })
	coreNoErr(t, l.Attach(tr), "Attach")
	l.Release()
	coreWant(t, p, coreCounts{Free: 1, Draining: 3})
	tr.Cancel()
	if tr.State() != TransferResolved || l.State() != LeaseSettled {
		t.Fatalf("after Cancel: %v %v", tr.State(), l.State())
	}
	coreAllFree(t, p)
}

// Resolve and Quarantine take effect on every lease and block they gate
// before they return: a copy gating a source lease and a destination lease
// in two pools of different region types.
func TestTransferGatesTwoPools(t *testing.T) {
	for _, end := range []string{"resolve", "failed", "quarantine-then-resolve"} {
		t.Run(end, func(t *testing.T) {
			srcRec, dstRec := &coreRecorder{}, &coreRecorder{}
			src := corePool(t, 4, WithObserver(srcRec))
			dstPool, err := NewPool[uint64](coreFakeMem{6, 64}, WithObserver(dstRec))
			coreNoErr(t, err, "NewPool")
			sl := coreAcquire(t, src, "prefill", 3)
			dl, err := dstPool.Acquire("decode", 3)
			coreNoErr(t, err, "Acquire dst")

			copyT := NewTransfer(nil)
			coreNoErr(t, sl.AttachRange(copyT, 0, 3, Read), "attach src")
			coreNoErr(t, dl.AttachRange(copyT, 0, 3, Write), "attach dst")
			sl.Release()
			coreWant(t, src, coreCounts{Free: 1, Draining: 3})
			if st := coreConsistent(t, dstPool); st.Leased != 3 {
				t.Fatalf("dst %+v", coreCountsOf(st))
			}
			switch end {
			case "resolve":
				copyT.Resolve(nil)
			case "failed":
				copyT.Resolve(errors.New("copy failed but provably stopped"))
			default:
				copyT.Quarantine(errors.New("peer vanished"))
				coreWant(t, src, coreCounts{Free: 1, Quarantined: 3})
				if st := coreConsistent(t, dstPool); st.Quarantined != 3 || st.Free != 3 {
					t.Fatalf("dst %+v", coreCountsOf(st))
				}
				if sl.State() != LeaseQuarantined || dl.State() != LeaseQuarantined {
					t.Fatalf("states %v %v", sl.State(), dl.State())
				}
				if srcRec.count(EventTransferQuarantined, sl.ID()) != 1 ||
					dstRec.count(EventTransferQuarantined, dl.ID()) != 1 {
					t.Fatal("each pool's observer sees the quarantine of its own lease")
				}
				dl.Release()
				if dl.State() != LeaseQuarantined {
					t.Fatalf("Release while quarantined: %v", dl.State())
				}
				copyT.Resolve(nil)
			}
			// Both sides, before Resolve returned.
			coreWant(t, src, coreCounts{Free: 4})
			if sl.State() != LeaseSettled {
				t.Fatalf("src lease %v", sl.State())
			}
			if end == "quarantine-then-resolve" {
				coreAllFree(t, dstPool)
				if dl.State() != LeaseSettled {
					t.Fatalf("dst lease %v", dl.State())
				}
			} else {
				if dl.State() != LeaseActive {
					t.Fatalf("dst lease %v", dl.State())
				}
				if st := coreConsistent(t, dstPool); st.Leased != 3 || st.Free != 3 {
					t.Fatalf("dst %+v", coreCountsOf(st))
				}
				dl.Release()
				coreAllFree(t, dstPool)
			}
			if srcRec.count(EventTransferResolved, sl.ID()) != 1 {
				t.Fatal("src observer missed the resolve")
			}
			if dstRec.count(EventTransferResolved, 0) != 1 {
				t.Fatal("dst observer missed the resolve")
			}
		})
	}
}

// Aborting one side of a copy cancels the transfer (the transport's hook
// decides what is safe) but leaves the other side gated until evidence.
func TestAbortOneSideOfCopy(t *testing.T) {
	src, dst := corePool(t, 4), corePool(t, 4)
	sl := coreAcquire(t, src, "src", 2)
	dl := coreAcquire(t, dst, "dst", 2)
	var hooks atomic.Int32
	copyT := NewTransfer(func() { hooks.Add(1) })
	coreNoErr(t, sl.AttachRange(copyT, 0, 2, Read), "attach src")
	coreNoErr(t, dl.AttachRange(copyT, 0, 2, Write), "attach dst")
	dl.Abort(errors.New("request rejected"))
	if hooks.Load() != 1 {
		t.Fatalf("hook ran %d times", hooks.Load())
	}
	coreWant(t, dst, coreCounts{Free: 2, Draining: 2})
	coreWant(t, src, coreCounts{Free: 2, Leased: 2})
	sl.Abort(nil) // the hook already ran: at most once
	if hooks.Load() != 1 {
		t.Fatalf("hook ran %d times", hooks.Load())
	}
	coreWant(t, src, coreCounts{Free: 2, Draining: 2})
	copyT.Resolve(nil)
	coreAllFree(t, src)
	coreAllFree(t, dst)
}

// A quarantined Read range keeps serving prefix hits (its content is
// intact); a quarantined Write range is content unknown. All of them are
// quarantined: never reused until late evidence.
func TestQuarantineReadVersusWrite(t *testing.T) {
	p := corePool(t, 6)
	hs := []BlockHash{11, 12}
	l := coreAcquire(t, p, "l", 4)
	coreNoErr(t, l.Seal(0, hs[0]), "Seal 0")
	coreNoErr(t, l.Seal(1, hs[1]), "Seal 1")
	tr := NewTransfer(nil)
	coreNoErr(t, l.AttachRange(tr, 0, 2, Read), "attach read")
	coreNoErr(t, l.AttachRange(tr, 2, 4, Write), "attach write")
	tr.Quarantine(errors.New("peer vanished"))
	coreWant(t, p, coreCounts{Free: 2, Quarantined: 4})
	if l.State() != LeaseQuarantined {
		t.Fatalf("state %v", l.State())
	}
	// Read side: still hits.
	if n := p.CachedPrefix(hs); n != 2 {
		t.Fatalf("CachedPrefix over quarantined reads = %d, want 2", n)
	}
	// Write side: content unknown, no Seal.
	coreErrIs(t, l.Seal(2, 13), ErrInvalidArgument, "Seal of a quarantined write block")
	// The open, quarantined lease still works otherwise.
	_, err := l.Region(3)
	coreNoErr(t, err, "Region of an open quarantined lease")

	l.Release()
	if l.State() != LeaseQuarantined {
		t.Fatalf("Release while quarantined: %v", l.State())
	}
	coreWant(t, p, coreCounts{Free: 2, Quarantined: 4})
	// Never reused: only the 2 free blocks can be had, even with a cache.
	_, err = p.Acquire("x", 3)
	coreErrIs(t, err, ErrExhausted, "Acquire over quarantined blocks")
	hit, hits, err := p.AcquirePrefix("hit", hs, 3)
	coreNoErr(t, err, "AcquirePrefix over quarantined reads")
	if hits != 2 || hit.Ref(0) != l.Ref(0) || hit.Ref(1) != l.Ref(1) {
		t.Fatalf("hits %d refs %v %v", hits, hit.Ref(0), hit.Ref(1))
	}
	coreWant(t, p, coreCounts{Free: 1, Leased: 1, Quarantined: 4})

	// Late evidence lifts it.
	tr.Resolve(nil)
	if l.State() != LeaseSettled {
		t.Fatalf("after late Resolve: %v", l.State())
	}
	coreWant(t, p, coreCounts{Free: 3, Leased: 3})
	hit.Release()
	coreWant(t, p, coreCounts{Free: 4, Cached: 2})
}

// Late Resolve of the last quarantined transfer: Active if open, Draining
// if closed with pending transfers, Settled otherwise.
func TestLateResolveLiftsQuarantine(t *testing.T) {
	rec := &coreRecorder{}
	p := corePool(t, 8, WithObserver(rec))
	l := coreAcquire(t, p, "l", 3)
	q1, q2, pend := NewTransfer(nil), NewTransfer(nil), NewTransfer(nil)
	coreNoErr(t, l.AttachRange(q1, 0, 1, Write), "attach")
	coreNoErr(t, l.AttachRange(q2, 1, 2, Write), "attach")
	coreNoErr(t, l.AttachRange(pend, 2, 3, Read), "attach")
	q1.Quarantine(nil)
	q2.Quarantine(nil)
	if l.State() != LeaseQuarantined || rec.count(EventLeaseQuarantined, l.ID()) != 1 {
		t.Fatalf("state %v", l.State())
	}
	q1.Resolve(nil)
	if l.State() != LeaseQuarantined {
		t.Fatalf("one quarantined transfer left: %v", l.State())
	}
	q2.Resolve(nil)
	if l.State() != LeaseActive || rec.count(EventQuarantineLifted, l.ID()) != 1 {
		t.Fatalf("open lease after the last late Resolve: %v", l.State())
	}
	coreWant(t, p, coreCounts{Free: 5, Leased: 3})

	// Attaching an already quarantined transfer quarantines the lease.
	q3 := NewTransfer(nil)
	q3.Quarantine(nil)
	coreNoErr(t, l.AttachRange(q3, 0, 2, Write), "attach a quarantined transfer")
	if l.State() != LeaseQuarantined {
		t.Fatalf("state %v", l.State())
	}
	coreWant(t, p, coreCounts{Free: 5, Leased: 1, Quarantined: 2})
	l.Release()
	coreWant(t, p, coreCounts{Free: 5, Draining: 1, Quarantined: 2})
	q3.Resolve(nil)
	if l.State() != LeaseDraining {
		t.Fatalf("closed lease with a pending transfer after late Resolve: %v", l.State())
	}
	coreWant(t, p, coreCounts{Free: 7, Draining: 1})
	pend.Resolve(nil)
	if l.State() != LeaseSettled || rec.count(EventSettled, l.ID()) != 1 {
		t.Fatalf("state %v", l.State())
	}
	coreAllFree(t, p)
}

// Done is closed by Resolve, from any goroutine; waiting on it works.
func TestTransferDoneConcurrent(t *testing.T) {
	tr := NewTransfer(nil)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() { defer wg.Done(); <-tr.Done() }()
	}
	var wins atomic.Int32
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if tr.Resolve(nil) {
				wins.Add(1)
			}
		}()
	}
	wg.Wait()
	if wins.Load() != 1 {
		t.Fatalf("%d Resolves won", wins.Load())
	}
}

// One transfer gating many leases in two pools, attached in interleaved
// order (pool A, B, A, B, A): Quarantine and Resolve reach every one of
// them before returning.
func TestTransferGatesManyLeases(t *testing.T) {
	ra, rb := &coreRecorder{}, &coreRecorder{}
	pa, pb := corePool(t, 8, WithObserver(ra)), corePool(t, 8, WithObserver(rb))
	tr := NewTransfer(nil)
	var ls []*Lease[[]byte]
	for i := range 5 {
		p := pa
		if i%2 == 1 {
			p = pb
		}
		l := coreAcquire(t, p, fmt.Sprintf("l%d", i), 2)
		if i%2 == 0 {
			coreNoErr(t, l.Attach(tr), "Attach")
		} else {
			coreNoErr(t, l.AttachRange(tr, 0, 1, Write), "AttachRange")
			coreNoErr(t, l.AttachRange(tr, 1, 2, Read), "AttachRange")
		}
		ls = append(ls, l)
	}
	for i, l := range ls {
		if i < 3 {
			l.Release()
		}
	}
	tr.Quarantine(nil)
	coreWant(t, pa, coreCounts{Free: 2, Quarantined: 6})
	coreWant(t, pb, coreCounts{Free: 4, Quarantined: 4})
	for _, l := range ls {
		if l.State() != LeaseQuarantined {
			t.Fatalf("lease %s: %v", l.Owner(), l.State())
		}
	}
	tr.Resolve(nil)
	coreWant(t, pa, coreCounts{Free: 6, Leased: 2})
	coreWant(t, pb, coreCounts{Free: 6, Leased: 2})
	for i, l := range ls {
		want := LeaseSettled
		if i >= 3 {
			want = LeaseActive
		}
		if l.State() != want {
			t.Fatalf("lease %s: %v, want %v", l.Owner(), l.State(), want)
		}
		l.Abort(nil)
	}
	coreAllFree(t, pa)
	coreAllFree(t, pb)
	// One operation, many events (more than fit inline): each lease sees
	// its own, each pool's observer only its leases'.
	for i, l := range ls {
		rec, other := ra, rb
		if i%2 == 1 {
			rec, other = rb, ra
		}
		for _, k := range []EventKind{EventLeaseQuarantined, EventQuarantineLifted,
			EventSettled} {
			if n := rec.count(k, l.ID()); n != 1 {
				t.Errorf("lease %s: %d %v events", l.Owner(), n, k)
			}
		}
		wantResolved := 1
		if i%2 == 1 {
			wantResolved = 2 // two ranges, two attachments
		}
		for _, k := range []EventKind{EventTransferQuarantined, EventTransferResolved} {
			if n := rec.count(k, l.ID()); n != wantResolved {
				t.Errorf("lease %s: %d %v events, want %d (one per attachment)", l.Owner(), n, k, wantResolved)
			}
		}
		for _, e := range other.events() {
			if e.Owner == l.Owner() {
				t.Errorf("lease %s's event %v went to the other pool's observer", l.Owner(), e.Kind)
			}
		}
	}
}

func TestTransferNextTable(t *testing.T) {
	type key struct {
		s TransferState
		e transferEvent
	}
	want := map[key]struct {
		to TransferState
		ok bool
	}{
		{TransferPending, evResolve}:        {TransferResolved, true},
		{TransferPending, evQuarantine}:     {TransferQuarantined, true},
		{TransferQuarantined, evResolve}:    {TransferResolved, true}, // late evidence
		{TransferQuarantined, evQuarantine}: {TransferQuarantined, false},
		{TransferResolved, evResolve}:       {TransferResolved, false}, // terminal
		{TransferResolved, evQuarantine}:    {TransferResolved, false},
	}
	for k, w := range want {
		to, ok := k.s.next(k.e)
		if to != w.to || ok != w.ok {
			t.Errorf("%v.next(%d) = (%v, %v), want (%v, %v)", k.s, k.e, to, ok, w.to, w.ok)
		}
	}
}

// OnResolve runs each registered callback once, in order, with the
// outcome, after the gated blocks are back and with no lock held; one
// registered after resolution runs at once; Quarantine runs none.
func TestTransferOnResolve(t *testing.T) {
	p := corePool(t, 4)
	l := coreAcquire(t, p, "r", 3)
	tr := NewTransfer(nil)
	coreNoErr(t, l.AttachRange(tr, 0, 3, Read), "attach")
	l.Release()

	var order []string
	outcome := errors.New("copy failed, provably stopped")
	tr.OnResolve(nil) // ignored
	tr.OnResolve(func(err error) {
		// No lock held: every method may be called, and the blocks are
		// back in the pool already.
		if !errors.Is(err, outcome) || !errors.Is(tr.Err(), outcome) || tr.State() != TransferResolved || !coreIsClosed(tr.Done()) {
			t.Errorf("first callback: err %v, transfer %v", err, tr)
		}
		if st := p.Stats(); st.Free != 4 || l.State() != LeaseSettled {
			t.Errorf("first callback: free %d, lease %v", st.Free, l.State())
		}
		tr.Cancel()
		order = append(order, "first")
	})
	tr.OnResolve(func(error) { order = append(order, "second") })
	tr.Quarantine(errors.New("deadline"))
	if len(order) != 0 {
		t.Fatalf("Quarantine ran callbacks: %v", order)
	}
	tr.Resolve(outcome)
	tr.Resolve(nil)
	if fmt.Sprint(order) != "[first second]" {
		t.Fatalf("callbacks ran %v, want [first second]", order)
	}
	var late error
	ran := false
	tr.OnResolve(func(err error) { ran, late = true, err })
	if !ran || !errors.Is(late, outcome) {
		t.Fatalf("callback registered after Resolve: ran %v err %v", ran, late)
	}
	tr.Resolve(nil)
	if len(order) != 2 {
		t.Fatalf("callbacks ran again: %v", order)
	}
	coreAllFree(t, p)
}

// Registrations racing Resolves: every callback runs exactly once,
// whichever side wins.
func TestTransferOnResolveConcurrent(t *testing.T) {
	for range 50 {
		tr := NewTransfer(nil)
		var runs atomic.Int32
		var wg sync.WaitGroup
		for i := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if i%2 == 0 {
					tr.OnResolve(func(err error) {
						if err != nil {
							t.Errorf("outcome %v", err)
						}
						runs.Add(1)
					})
				} else {
					tr.Resolve(nil)
				}
			}()
		}
		wg.Wait()
		if runs.Load() != 4 {
			t.Fatalf("%d callbacks ran, want 4", runs.Load())
		}
	}
}

package kvlease

import (
	"errors"
	"testing"
	"testing/synctest"
	"time"
)

const coreDeadline = time.Second

// coreSleep advances the bubble's fake clock by d and lets every timer
// callback that fired finish.
func coreSleep(d time.Duration) {
	time.Sleep(d)
	synctest.Wait()
}

// A closed lease whose transfer is still pending when the drain deadline
// passes is quarantined and reported, and never freed: time is not
// evidence. A late Resolve lifts it.
func TestDrainDeadlineQuarantines(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := &coreRecorder{}
		p := corePool(t, 4, WithObserver(rec), WithDrainDeadline(coreDeadline))
		l := coreAcquire(t, p, "slow", 2)
		tr := NewTransfer(nil)
		coreNoErr(t, l.AttachRange(tr, 0, 2, Write), "AttachRange")
		coreSleep(5 * coreDeadline) // an open lease has no deadline
		if l.State() != LeaseActive || rec.count(EventDeadline, 0) != 0 {
			t.Fatalf("open lease hit the drain deadline: %v", l.State())
		}

		l.Release()
		coreSleep(coreDeadline - time.Millisecond)
		if l.State() != LeaseDraining || rec.count(EventDeadline, 0) != 0 {
			t.Fatalf("before the deadline: %v, %d reports", l.State(), rec.count(EventDeadline, 0))
		}
		coreWant(t, p, coreCounts{Free: 2, Draining: 2})

		coreSleep(2 * time.Millisecond)
		if n := rec.count(EventDeadline, l.ID()); n != 1 {
			t.Fatalf("deadline reported %d times", n)
		}
		ev, _ := rec.last(EventDeadline)
		if ev.Owner != "slow" || !errors.Is(ev.Err, ErrDrainDeadline) {
			t.Fatalf("EventDeadline %+v", ev)
		}
		if l.State() != LeaseQuarantined || tr.State() != TransferQuarantined {
			t.Fatalf("after the deadline: lease %v, transfer %v", l.State(), tr.State())
		}
		coreErrIs(t, tr.Err(), ErrDrainDeadline, "transfer's reason")
		coreWant(t, p, coreCounts{Free: 2, Quarantined: 2})

		// Time alone never frees it.
		coreSleep(24 * time.Hour)
		coreWant(t, p, coreCounts{Free: 2, Quarantined: 2})
		_, err := p.Acquire("x", 3)
		coreErrIs(t, err, ErrExhausted, "Acquire over quarantined blocks")
		if n := rec.count(EventDeadline, 0); n != 1 {
			t.Fatalf("deadline reported %d times", n)
		}

		if !tr.Resolve(nil) {
			t.Fatal("late Resolve lost")
		}
		<-l.Settled()
		coreAllFree(t, p)
	})
}

// A lease that settles before the deadline is never reported.
func TestDrainDeadlineSettledInTime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := &coreRecorder{}
		p := corePool(t, 4, WithObserver(rec), WithDrainDeadline(coreDeadline))
		l := coreAcquire(t, p, "quick", 2)
		tr := NewTransfer(nil)
		coreNoErr(t, l.AttachRange(tr, 0, 1, Read), "AttachRange")
		l.Release()
		coreSleep(coreDeadline / 2)
		tr.Resolve(nil)
		<-l.Settled()

		// Nothing gated: settled at once, no deadline at all.
		m := coreAcquire(t, p, "plain", 1)
		m.Abort(nil)

		// A failed copy that provably stopped is evidence too.
		n := coreAcquire(t, p, "failed", 1)
		f := NewTransfer(nil)
		coreNoErr(t, n.Attach(f), "Attach")
		n.Abort(nil)
		coreSleep(coreDeadline / 4)
		f.Resolve(errors.New("copy failed, engine fenced"))

		coreSleep(10 * coreDeadline)
		if k := rec.count(EventDeadline, 0); k != 0 {
			t.Fatalf("%d deadline reports for leases that settled in time", k)
		}
		for _, ls := range []*Lease[[]byte]{l, m, n} {
			if ls.State() != LeaseSettled {
				t.Fatalf("lease %s: %v", ls.Owner(), ls.State())
			}
		}
		coreAllFree(t, p)
	})
}

// The deadline quarantines only what is still pending; the transfer's
// quarantine reaches the other lease it gates (the other side of the
// copy), even in a pool with no deadline.
func TestDrainDeadlineQuarantinesOtherSide(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := &coreRecorder{}
		src := corePool(t, 4, WithObserver(rec), WithDrainDeadline(coreDeadline))
		dst := corePool(t, 4)
		sl := coreAcquire(t, src, "src", 3)
		dl := coreAcquire(t, dst, "dst", 2)
		done, stuck := NewTransfer(nil), NewTransfer(nil)
		coreNoErr(t, sl.AttachRange(done, 0, 1, Read), "attach done")
		coreNoErr(t, sl.AttachRange(stuck, 1, 3, Read), "attach stuck (src)")
		coreNoErr(t, dl.AttachRange(stuck, 0, 2, Write), "attach stuck (dst)")
		sl.Release()
		done.Resolve(nil)
		coreWant(t, src, coreCounts{Free: 2, Draining: 2})

		coreSleep(coreDeadline + time.Millisecond)
		if rec.count(EventDeadline, sl.ID()) != 1 {
			t.Fatal("deadline not reported")
		}
		coreWant(t, src, coreCounts{Free: 2, Quarantined: 2})
		coreWant(t, dst, coreCounts{Free: 2, Quarantined: 2})
		if dl.State() != LeaseQuarantined || done.State() != TransferResolved {
			t.Fatalf("dst lease %v, resolved transfer %v", dl.State(), done.State())
		}
		dl.Release()
		coreSleep(time.Hour)
		coreWant(t, dst, coreCounts{Free: 2, Quarantined: 2})

		stuck.Resolve(nil)
		coreAllFree(t, src)
		coreAllFree(t, dst)
		if sl.State() != LeaseSettled || dl.State() != LeaseSettled {
			t.Fatalf("states %v %v", sl.State(), dl.State())
		}
	})
}

// A lease already quarantined when it closes is still unresolved at the
// deadline: it stays quarantined (never freed) until late evidence.
func TestDrainDeadlineAlreadyQuarantined(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		rec := &coreRecorder{}
		p := corePool(t, 4, WithObserver(rec), WithDrainDeadline(coreDeadline))
		l := coreAcquire(t, p, "q", 2)
		q, pend := NewTransfer(nil), NewTransfer(nil)
		coreNoErr(t, l.AttachRange(q, 0, 1, Write), "attach q")
		coreNoErr(t, l.AttachRange(pend, 1, 2, Write), "attach pend")
		reason := errors.New("peer vanished")
		q.Quarantine(reason)
		l.Abort(nil)
		coreSleep(2 * coreDeadline)
		if rec.count(EventDeadline, l.ID()) != 1 {
			t.Fatal("an unsettled closed lease past its deadline was not reported")
		}
		coreWant(t, p, coreCounts{Free: 2, Quarantined: 2})
		// The earlier reason is kept; the pending one got the deadline's.
		if !errors.Is(q.Err(), reason) {
			t.Fatalf("reason replaced: %v", q.Err())
		}
		coreErrIs(t, pend.Err(), ErrDrainDeadline, "pending transfer's reason")
		q.Resolve(nil)
		if l.State() != LeaseQuarantined {
			t.Fatalf("one quarantined transfer left: %v", l.State())
		}
		coreWant(t, p, coreCounts{Free: 3, Quarantined: 1})
		pend.Resolve(nil)
		coreAllFree(t, p)
		coreSleep(time.Hour)
		if rec.count(EventDeadline, l.ID()) != 1 {
			t.Fatal("deadline reported again")
		}
	})
}

// The deadline also cancels what it quarantines: a transport that honours
// its cancel hook returns, and its Resolve (evidence, not time) lifts the
// quarantine. One that ignores the hook keeps its blocks quarantined. The
// other side of a cancelled copy sees the copy end.
func TestDrainDeadlineCancels(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := corePool(t, 6, WithDrainDeadline(coreDeadline))
		other := corePool(t, 4)
		l := coreAcquire(t, p, "early-release", 4)
		dl := coreAcquire(t, other, "copy-dst", 2)

		// An honest transport: its loop returns when asked, and only then
		// does it resolve (here, a goroutine standing in for its loop).
		stop := make(chan struct{})
		honest := NewTransfer(func() { close(stop) })
		returned := make(chan struct{})
		go func() {
			<-stop
			honest.Resolve(ErrCanceled)
			close(returned)
		}()
		deaf := NewTransfer(func() {}) // asked, never returns
		coreNoErr(t, l.AttachRange(honest, 0, 2, Read), "attach honest")
		coreNoErr(t, dl.AttachRange(honest, 0, 2, Write), "attach honest (dst)")
		coreNoErr(t, l.AttachRange(deaf, 2, 4, Read), "attach deaf")
		l.Release()

		coreSleep(coreDeadline - time.Millisecond)
		if honest.CancelRequested() || deaf.CancelRequested() {
			t.Fatal("cancelled before the deadline")
		}
		coreWant(t, p, coreCounts{Free: 2, Draining: 4})

		coreSleep(2 * time.Millisecond)
		<-returned
		if !honest.CancelRequested() || !deaf.CancelRequested() {
			t.Fatalf("deadline did not cancel: honest %v, deaf %v", honest.CancelRequested(), deaf.CancelRequested())
		}
		if honest.State() != TransferResolved || !errors.Is(honest.Err(), ErrCanceled) {
			t.Fatalf("honest transfer %v (%v)", honest.State(), honest.Err())
		}
		coreErrIs(t, deaf.Err(), ErrDrainDeadline, "deaf transfer's reason")
		coreWant(t, p, coreCounts{Free: 4, Quarantined: 2})
		// The copy's other side is no longer gated (the same evidence)
		// and was never quarantined: its owner releases it at once.
		coreWant(t, other, coreCounts{Free: 2, Leased: 2})
		dl.Release()
		coreAllFree(t, other)

		coreSleep(24 * time.Hour) // time alone frees nothing
		coreWant(t, p, coreCounts{Free: 4, Quarantined: 2})
		deaf.Resolve(nil)
		<-l.Settled()
		coreAllFree(t, p)
	})
}

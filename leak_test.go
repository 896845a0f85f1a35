package kvlease

import (
	"runtime"
	"testing"
	"time"

	"github.com/kvlease/kvlease/internal/invariants"
)

// lkPool is a pool whose observer forwards leak reports to a channel (and
// keeps nothing that could keep a lease reachable).
func lkPool(t *testing.T, n int, opts ...Option) (*Pool[[]byte], chan Event) {
	t.Helper()
	leaked := make(chan Event, 64)
	obs := ObserverFunc(func(e Event) {
		if e.Kind == EventLeaked {
			leaked <- e
		}
	})
	mem, err := NewHostMemory(n, 16)
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewPool[[]byte](mem, append([]Option{WithObserver(obs)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return p, leaked
}

// lkDrop acquires a lease and drops it while open; it returns the lease's
// id and a channel closed once the lease has been collected.
//
//go:noinline
func lkDrop(t *testing.T, p *Pool[[]byte], owner string, n int, release bool) (uint64, chan struct{}) {
	l, err := p.Acquire(owner, n)
	if err != nil {
		t.Fatal(err)
	}
	if release {
		l.Release()
	}
	gone := make(chan struct{})
	runtime.AddCleanup(l, func(ch chan struct{}) { close(ch) }, gone)
	return l.ID(), gone
}

// lkGC runs the collector until ch delivers, a bounded number of times.
func lkGC[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	for range 500 {
		runtime.GC()
		select {
		case v := <-ch:
			return v
		case <-time.After(5 * time.Millisecond):
		}
	}
	t.Fatalf("%s: nothing after 500 collections", what)
	panic("unreachable")
}

// A lease dropped while open is reported to the observer and its blocks
// stay leased; a released lease dropped is not reported.
func TestLeakReported(t *testing.T) {
	p, leaked := lkPool(t, 8, WithLeakCheck(true))
	id, gone := lkDrop(t, p, "forgetful", 3, false)
	closedID, closedGone := lkDrop(t, p, "tidy", 2, true)

	ev := lkGC(t, leaked, "leak report")
	if ev.Lease != id || ev.Owner != "forgetful" || ev.Err == nil {
		t.Fatalf("EventLeaked %+v, want lease %d", ev, id)
	}
	lkGC(t, gone, "leaked lease collected")
	lkGC(t, closedGone, "released lease collected")
	for range 3 {
		runtime.GC()
	}
	select {
	case ev := <-leaked:
		t.Fatalf("second leak report %+v (released lease is %d)", ev, closedID)
	case <-time.After(20 * time.Millisecond):
	}

	// Its blocks are not reclaimed behind the owner's back.
	st := p.Stats()
	if st.Leased != 3 || st.Free != 5 || st.OpenLeases != 1 {
		t.Fatalf("after the leak: %+v", st)
	}
	if err := p.Check(); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Acquire("x", 6); err == nil {
		t.Fatal("leaked blocks were handed out again")
	}
}

// With the leak check off nothing is reported; in checked builds it is on
// by default.
func TestLeakCheckDefault(t *testing.T) {
	p, leaked := lkPool(t, 4, WithLeakCheck(false))
	_, gone := lkDrop(t, p, "off", 1, false)
	lkGC(t, gone, "lease collected")
	runtime.GC()
	select {
	case ev := <-leaked:
		t.Fatalf("reported with the leak check off: %+v", ev)
	case <-time.After(20 * time.Millisecond):
	}

	if !invariants.Enabled {
		t.Log("not a checked build: the default is off")
		return
	}
	q, leakedQ := lkPool(t, 4)
	id, _ := lkDrop(t, q, "default", 2, false)
	if ev := lkGC(t, leakedQ, "leak report in a checked build"); ev.Lease != id {
		t.Fatalf("EventLeaked %+v, want lease %d", ev, id)
	}
}

// A leak check with no observer costs nothing and reports nowhere; a
// lease dropped while draining is not a leak.
func TestLeakCheckQuiet(t *testing.T) {
	mem, _ := NewHostMemory(2, 8)
	p, err := NewPool[[]byte](mem, WithLeakCheck(true))
	if err != nil {
		t.Fatal(err)
	}
	func() {
		l, _ := p.Acquire("x", 1)
		_ = l
	}()
	runtime.GC()

	q, leaked := lkPool(t, 4, WithLeakCheck(true))
	tr := NewTransfer(nil)
	_, gone := func() (uint64, chan struct{}) {
		l, _ := q.Acquire("draining", 2)
		if err := l.Attach(tr); err != nil {
			t.Fatal(err)
		}
		l.Release()
		gone := make(chan struct{})
		runtime.AddCleanup(l, func(ch chan struct{}) { close(ch) }, gone)
		return l.ID(), gone
	}()
	tr.Resolve(nil) // drops the transfer's reference to the lease
	lkGC(t, gone, "closed lease collected")
	runtime.GC()
	select {
	case ev := <-leaked:
		t.Fatalf("closed lease reported as leaked: %+v", ev)
	case <-time.After(20 * time.Millisecond):
	}
	if st := q.Stats(); st.Free != 4 {
		t.Fatalf("%+v", st)
	}
}

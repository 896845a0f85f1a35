package kvlease

import (
	"errors"
	"math"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/kvlease/kvlease/internal/invariants"
	"github.com/stretchr/testify/require"
)

// corePanics fails unless f panics.
func corePanics(t *testing.T, what string, f func()) {
	t.Helper()
	defer func() {
		if recover() == nil {
			t.Fatalf("%s did not panic", what)
		}
	}()
	f()
}

func TestLeaseAccessors(t *testing.T) {
	p := corePool(t, 8)
	l := coreAcquire(t, p, "req-1", 3)
	if l.Owner() != "req-1" || l.Len() != 3 || l.State() != LeaseActive {
		t.Fatalf("owner %q len %d state %v", l.Owner(), l.Len(), l.State())
	}
	refs := []BlockRef{l.Ref(0), l.Ref(1), l.Ref(2)}
	for i := range 3 {
		r, err := l.Region(i)
		coreNoErr(t, err, "Region")
		if len(r) != 64 || cap(r) != 64 {
			t.Fatalf("Region(%d): len %d cap %d, want 64", i, len(r), cap(r))
		}
	}
	for _, i := range []int{-1, 3, 100} {
		_, err := l.Region(i)
		coreErrIs(t, err, ErrInvalidArgument, "Region out of range")
		corePanics(t, "Ref out of range", func() { l.Ref(i) })
	}

	// AppendBlockIDs: the tail from `from`, no allocation with room.
	ids := l.AppendBlockIDs(nil, 0)
	if len(ids) != 3 || ids[0] != refs[0].ID || ids[2] != refs[2].ID {
		t.Fatalf("AppendBlockIDs = %v, refs %v", ids, refs)
	}
	dst := []BlockID{99}
	if got := l.AppendBlockIDs(dst, 2); len(got) != 2 || got[0] != 99 || got[1] != refs[2].ID {
		t.Fatalf("AppendBlockIDs(dst, 2) = %v", got)
	}
	if got := l.AppendBlockIDs(dst, 3); len(got) != 1 {
		t.Fatalf("AppendBlockIDs(dst, Len) = %v, want dst unchanged", got)
	}
	for _, from := range []int{-1, 4} {
		corePanics(t, "AppendBlockIDs out of range", func() { l.AppendBlockIDs(nil, from) })
	}
	buf := make([]BlockID, 0, 8)
	if n := testing.AllocsPerRun(100, func() { buf = l.AppendBlockIDs(buf[:0], 0) }); n != 0 {
		t.Fatalf("AppendBlockIDs with room allocates %v times", n)
	}

	l.Release()
	// Refs and Len still answer after close; Region does not.
	if l.Len() != 3 {
		t.Fatalf("Len after Release = %d", l.Len())
	}
	for i, r := range refs {
		if l.Ref(i) != r {
			t.Fatalf("Ref(%d) changed after Release", i)
		}
		_, err := p.Region(r)
		coreErrIs(t, err, ErrStaleRef, "Pool.Region of a released block")
	}
	_, err := l.Region(0)
	coreErrIs(t, err, ErrLeaseClosed, "Region after Release")
	_, err = l.Region(-1)
	if !errors.Is(err, ErrLeaseClosed) && !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("Region(-1) after Release: %v", err)
	}
	coreAllFree(t, p)
}

// Release and Abort are idempotent, in every combination.
func TestReleaseAbortIdempotent(t *testing.T) {
	for _, seq := range [][]string{
		{"release", "release"},
		{"release", "abort"},
		{"abort", "abort"},
		{"abort", "release"},
	} {
		t.Run(seq[0]+"-"+seq[1], func(t *testing.T) {
			rec := &coreRecorder{}
			p := corePool(t, 4, WithObserver(rec))
			l := coreAcquire(t, p, "a", 2)
			hooks := 0
			tr := NewTransfer(func() { hooks++ })
			coreNoErr(t, l.AttachRange(tr, 0, 1, Write), "AttachRange")
			for _, op := range seq {
				if op == "release" {
					l.Release()
				} else {
					l.Abort(nil)
				}
				coreWant(t, p, coreCounts{Free: 3, Draining: 1})
				if l.State() != LeaseDraining {
					t.Fatalf("after %s: %v", op, l.State())
				}
			}
			wantHooks := 0
			if seq[0] == "abort" {
				wantHooks = 1
			}
			if hooks != wantHooks {
				t.Fatalf("cancel hook ran %d times, want %d", hooks, wantHooks)
			}
			if n := rec.count(EventReleased, l.ID()) + rec.count(EventAborted, l.ID()); n != 1 {
				t.Fatalf("%d close events, want 1", n)
			}
			if st := p.Stats(); st.OpenLeases != 0 {
				t.Fatalf("OpenLeases = %d", st.OpenLeases)
			}
			tr.Resolve(nil)
			l.Release()
			l.Abort(errors.New("again"))
			if n := rec.count(EventSettled, l.ID()); n != 1 {
				t.Fatalf("%d settled events, want 1", n)
			}
			coreAllFree(t, p)
		})
	}
}

func TestAbortCause(t *testing.T) {
	rec := &coreRecorder{}
	p := corePool(t, 2, WithObserver(rec))
	l := coreAcquire(t, p, "a", 1)
	l.Abort(nil)
	ev, ok := rec.last(EventAborted)
	if !ok || !errors.Is(ev.Err, ErrAborted) || ev.Lease != l.ID() || ev.Owner != "a" {
		t.Fatalf("Abort(nil) event %+v", ev)
	}
	cause := errors.New("client went away")
	m := coreAcquire(t, p, "b", 1)
	m.Abort(cause)
	ev, _ = rec.last(EventAborted)
	if !errors.Is(ev.Err, cause) {
		t.Fatalf("Abort(cause) event %+v", ev)
	}
	coreAllFree(t, p)
}

func TestExtend(t *testing.T) {
	rec := &coreRecorder{}
	p := corePool(t, 6, WithObserver(rec))
	l := coreAcquire(t, p, "a", 2)
	other := coreAcquire(t, p, "b", 2)

	for _, n := range []int{0, -1, -100} {
		coreErrIs(t, l.Extend(n), ErrInvalidArgument, "Extend(<=0)")
	}
	coreErrIs(t, l.Extend(5), ErrExceedsCapacity, "Extend past the pool's capacity")
	coreErrIs(t, l.Extend(3), ErrExhausted, "Extend with 2 free")
	if l.Len() != 2 {
		t.Fatalf("failed Extends changed Len to %d", l.Len())
	}
	coreWant(t, p, coreCounts{Free: 2, Leased: 4})

	old := l.Ref(1)
	coreNoErr(t, l.Extend(2), "Extend(2)")
	if l.Len() != 4 || l.Ref(1) != old {
		t.Fatalf("Extend: len %d, ref 1 %v (was %v)", l.Len(), l.Ref(1), old)
	}
	if ev, ok := rec.last(EventExtended); !ok || ev.Blocks != 2 || ev.Lease != l.ID() {
		t.Fatalf("EventExtended %+v", ev)
	}
	coreWant(t, p, coreCounts{Leased: 6})
	seen := map[BlockID]bool{}
	for _, ls := range []*Lease[[]byte]{l, other} {
		for i := 0; i < ls.Len(); i++ {
			r := ls.Ref(i)
			if seen[r.ID] || r.Gen == 0 {
				t.Fatalf("block %v handed out twice", r)
			}
			seen[r.ID] = true
			_, err := p.Region(r)
			coreNoErr(t, err, "Pool.Region of an extended block")
		}
	}
	for i := 2; i < 4; i++ {
		_, err := l.Region(i)
		coreNoErr(t, err, "Lease.Region of an extended block")
	}
	coreErrIs(t, l.Extend(1), ErrExhausted, "Extend on a full pool")

	other.Release()
	l.Release()
	coreErrIs(t, l.Extend(1), ErrLeaseClosed, "Extend after Release")
	m := coreAcquire(t, p, "m", 1)
	m.Abort(nil)
	coreErrIs(t, m.Extend(1), ErrLeaseClosed, "Extend after Abort")
	coreAllFree(t, p)

	// Extend evicts cached blocks when nothing is free.
	a := coreAcquire(t, p, "a", 3)
	for i := range 3 {
		coreNoErr(t, a.Seal(i, BlockHash(10+i)), "Seal")
	}
	a.Release()
	g := coreAcquire(t, p, "g", 3)
	coreWant(t, p, coreCounts{Cached: 3, Leased: 3})
	coreNoErr(t, g.Extend(2), "Extend over cached blocks")
	coreWant(t, p, coreCounts{Cached: 1, Leased: 5})
	g.Release()
	coreAllFree(t, p)
}

func TestSettledChannel(t *testing.T) {
	p := corePool(t, 4)
	l := coreAcquire(t, p, "l", 2)
	early := l.Settled()
	tr := NewTransfer(nil)
	coreNoErr(t, l.AttachRange(tr, 0, 1, Read), "AttachRange")
	l.Release()
	select {
	case <-early:
		t.Fatal("Settled closed while a transfer is pending")
	case <-l.Settled():
		t.Fatal("Settled closed while a transfer is pending")
	default:
	}
	tr.Resolve(nil)
	select {
	case <-early:
	default:
		t.Fatal("Settled not closed when Resolve returned")
	}
	<-l.Settled()
	if l.State() != LeaseSettled {
		t.Fatalf("state %v", l.State())
	}
	// Settled with nothing attached: at once.
	m := coreAcquire(t, p, "m", 1)
	m.Release()
	<-m.Settled()
	// An open lease never settles.
	n := coreAcquire(t, p, "n", 1)
	select {
	case <-n.Settled():
		t.Fatal("open lease settled")
	default:
	}
	n.Release()
	coreAllFree(t, p)
}

// Abort calls Cancel on every attached transfer that is not resolved
// (pending or quarantined), and not on resolved ones; Release cancels
// nothing.
func TestAbortCancelsUnresolved(t *testing.T) {
	p := corePool(t, 8)
	l := coreAcquire(t, p, "l", 4)
	var mu sync.Mutex
	calls := map[string]int{}
	hook := func(name string) func() {
		return func() { mu.Lock(); calls[name]++; mu.Unlock() }
	}
	pending := NewTransfer(hook("pending"))
	quar := NewTransfer(hook("quarantined"))
	done := NewTransfer(hook("resolved"))
	twice := NewTransfer(hook("twice"))
	var self *Transfer
	self = NewTransfer(func() { // resolves synchronously from its hook
		hook("self")()
		self.Resolve(nil)
	})
	coreNoErr(t, l.AttachRange(pending, 0, 1, Write), "attach pending")
	coreNoErr(t, l.AttachRange(quar, 1, 2, Write), "attach quarantined")
	coreNoErr(t, l.AttachRange(done, 2, 3, Read), "attach resolved")
	coreNoErr(t, l.AttachRange(twice, 0, 2, Read), "attach twice (1)")
	coreNoErr(t, l.AttachRange(twice, 2, 4, Read), "attach twice (2)")
	coreNoErr(t, l.Attach(self), "attach self-resolving")
	quar.Quarantine(nil)
	done.Resolve(nil)

	l.Abort(nil)
	mu.Lock()
	want := map[string]int{"pending": 1, "quarantined": 1, "twice": 1, "self": 1}
	for k, v := range want {
		if calls[k] != v {
			t.Errorf("cancel hook %q ran %d times, want %d", k, calls[k], v)
		}
	}
	if calls["resolved"] != 0 {
		t.Errorf("cancel hook of a resolved transfer ran")
	}
	mu.Unlock()
	if self.State() != TransferResolved {
		t.Fatalf("self-resolving hook: %v", self.State())
	}
	// Cancel is a request, not evidence: nothing else resolved.
	if pending.State() != TransferPending || quar.State() != TransferQuarantined || twice.State() != TransferPending {
		t.Fatal("Abort changed transfer states")
	}
	if l.State() != LeaseQuarantined {
		t.Fatalf("state %v", l.State())
	}
	coreWant(t, p, coreCounts{Free: 4, Quarantined: 1, Draining: 3})
	quar.Resolve(nil)
	if l.State() != LeaseDraining {
		t.Fatalf("state %v after lifting the quarantine", l.State())
	}
	pending.Resolve(nil)
	twice.Resolve(nil)
	<-l.Settled()
	coreAllFree(t, p)
	// Cancel after resolve runs nothing.
	pending.Cancel()
	mu.Lock()
	if calls["pending"] != 1 {
		t.Fatalf("hook ran after Resolve")
	}
	mu.Unlock()
}

// An Abort (or Release) racing Extend and AttachRange: the loser gets
// ErrLeaseClosed, and whatever was attached before the close is
// cancelled and gates the blocks.
func TestCloseRacesExtendAndAttach(t *testing.T) {
	for round := range 50 {
		p := corePool(t, 64)
		l := coreAcquire(t, p, "l", 1)
		abort := round%2 == 0
		var wg sync.WaitGroup
		var extendErr error
		var attached []*Transfer
		var cancelled sync.Map
		start := make(chan struct{})
		wg.Add(3)
		go func() {
			defer wg.Done()
			<-start
			for {
				if extendErr = l.Extend(1); extendErr != nil {
					return
				}
			}
		}()
		go func() {
			defer wg.Done()
			<-start
			for i := 0; i < 1000; i++ {
				var tr *Transfer
				tr = NewTransfer(func() { cancelled.Store(tr, true) })
				if err := l.AttachRange(tr, 0, 1, Read); err != nil {
					if !errors.Is(err, ErrLeaseClosed) {
						t.Errorf("AttachRange racing close: %v", err)
					}
					return
				}
				attached = append(attached, tr)
			}
		}()
		go func() {
			defer wg.Done()
			<-start
			if abort {
				l.Abort(nil)
			} else {
				l.Release()
			}
		}()
		close(start)
		wg.Wait()
		if !errors.Is(extendErr, ErrLeaseClosed) && !errors.Is(extendErr, ErrExhausted) &&
			!errors.Is(extendErr, ErrExceedsCapacity) {
			t.Fatalf("Extend racing close: %v", extendErr)
		}
		coreConsistent(t, p)
		for _, tr := range attached {
			if _, ok := cancelled.Load(tr); ok != abort {
				t.Fatalf("transfer attached before the close: cancelled=%v, abort=%v", ok, abort)
			}
		}
		if len(attached) > 0 {
			if l.State() != LeaseDraining {
				t.Fatalf("state %v with %d transfers attached", l.State(), len(attached))
			}
			if st := p.Stats(); st.Draining != 1 {
				t.Fatalf("Draining = %d, want the gated block", st.Draining)
			}
		}
		for _, tr := range attached {
			tr.Resolve(nil)
		}
		<-l.Settled()
		coreAllFree(t, p)
	}
}

// No lease can obtain a writable region of a sealed block or of one it
// shares with another lease; ReadRegion serves them.
func TestRegionRefusesSealedAndShared(t *testing.T) {
	p := newTestPool(t, 8)
	a, err := p.Acquire("a", 3)
	require.NoError(t, err)
	for i := range 3 {
		r, err := a.Region(i)
		require.NoError(t, err, "fresh private blocks are writable")
		r[0] = byte(i + 1)
	}
	require.NoError(t, a.Seal(0, 100))
	require.NoError(t, a.Seal(1, 101))
	_, err = a.Region(0)
	require.ErrorIs(t, err, ErrReadOnly, "sealed: immutable even for its sealer")
	r, err := a.ReadRegion(0)
	require.NoError(t, err)
	require.Equal(t, byte(1), r[0])
	_, err = a.AppendRegions(nil, 0, 3)
	require.ErrorIs(t, err, ErrReadOnly)
	_, err = a.AppendRegions(nil, 1, 2)
	require.ErrorIs(t, err, ErrReadOnly, "a sealed block inside the range")
	rs, err := a.AppendRegions(nil, 2, 3)
	require.NoError(t, err, "the unsealed tail is writable")
	require.Len(t, rs, 1)
	rs, err = a.AppendReadRegions(nil, 0, 2)
	require.NoError(t, err)
	require.Len(t, rs, 2, "the range's blocks only")
	rs, err = a.AppendReadRegions(nil, 0, 3)
	require.NoError(t, err)
	require.Len(t, rs, 3)

	// A prefix hit shares the sealed blocks: read-only on both sides.
	b, hits, err := p.AcquirePrefix("b", []BlockHash{100, 101}, 3)
	require.NoError(t, err)
	require.Equal(t, 2, hits)
	for _, l := range []*Lease[[]byte]{a, b} {
		for i := range 2 {
			_, err := l.Region(i)
			require.ErrorIs(t, err, ErrReadOnly)
			_, err = l.ReadRegion(i)
			require.NoError(t, err)
		}
	}
	_, err = b.Region(2)
	require.NoError(t, err, "b's own fresh block")

	// Share: the shared blocks are read-only in both leases.
	s, err := a.Share("s", 2)
	require.NoError(t, err)
	_, err = s.Region(1)
	require.ErrorIs(t, err, ErrReadOnly)
	_, err = s.ReadRegion(1)
	require.NoError(t, err)

	require.False(t, a.Closed())
	a.Release()
	require.True(t, a.Closed())
	_, err = a.ReadRegion(0)
	require.ErrorIs(t, err, ErrLeaseClosed)
	_, err = a.AppendReadRegions(nil, 0, 3)
	require.ErrorIs(t, err, ErrLeaseClosed)
	_, err = b.ReadRegion(3)
	require.ErrorIs(t, err, ErrInvalidArgument)
	b.Release()
	s.Abort(nil)
	require.True(t, s.Closed())
	require.NoError(t, p.Check())
}

// Extend with a huge n can never succeed: ErrExceedsCapacity, not a
// retryable ErrExhausted from a wrapped sum.
func TestExtendHugeNExceedsCapacity(t *testing.T) {
	p := newTestPool(t, 4)
	l, err := p.Acquire("a", 2)
	require.NoError(t, err)
	for _, n := range []int{math.MaxInt, math.MaxInt - 1, math.MaxInt - 2, 3} {
		err := l.Extend(n)
		require.ErrorIs(t, err, ErrExceedsCapacity, "n=%d", n)
		require.NotErrorIs(t, err, ErrExhausted)
	}
	require.NoError(t, l.Extend(2))
	_, err = l.Share("s", math.MaxInt)
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.ErrorIs(t, l.AttachRange(NewTransfer(nil), 0, math.MaxInt, Read), ErrInvalidArgument)
	require.ErrorIs(t, l.AttachRange(NewTransfer(nil), math.MinInt, 1, Read), ErrInvalidArgument)
	_, err = p.Acquire("b", math.MaxInt)
	require.ErrorIs(t, err, ErrExceedsCapacity)
	_, _, err = p.AcquirePrefix("b", []BlockHash{1}, math.MaxInt)
	require.ErrorIs(t, err, ErrExceedsCapacity)
	_, _, err = p.AcquirePrefixTokens("b", 1, prompt(1, 8), math.MaxInt)
	require.ErrorIs(t, err, ErrInvalidArgument, "no block size configured")
	l.Release()
}

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

func TestAppendRegionsAndAvailable(t *testing.T) {
	p := newTestPool(t, 6)
	require.Equal(t, 6, p.Available())
	l, err := p.Acquire("a", 3)
	require.NoError(t, err)
	require.Equal(t, 3, p.Available())
	rs, err := l.AppendRegions(nil, 1, 3)
	require.NoError(t, err)
	require.Len(t, rs, 2)
	for i, r := range rs {
		want, _ := l.Region(i + 1)
		require.Equal(t, &want[0], &r[0], "region %d", i+1)
	}
	rs, err = l.AppendRegions(rs[:0], 1, 2)
	require.NoError(t, err)
	require.Len(t, rs, 1, "to bounds the range")
	rs, err = l.AppendRegions(rs[:0], 3, 3)
	require.NoError(t, err)
	require.Empty(t, rs)
	for _, r := range [][2]int{{0, 4}, {-1, 2}, {2, 1}, {4, 4}} {
		_, err = l.AppendRegions(nil, r[0], r[1])
		require.ErrorIs(t, err, ErrInvalidArgument, "range %v", r)
	}
	buf := make([][]byte, 0, 3)
	allocs := testing.AllocsPerRun(50, func() { buf, _ = l.AppendRegions(buf[:0], 0, 3) })
	require.Zero(t, allocs)
	l.Release()
	_, err = l.AppendRegions(nil, 0, 3)
	require.ErrorIs(t, err, ErrLeaseClosed)
	require.Equal(t, 6, p.Available())
}

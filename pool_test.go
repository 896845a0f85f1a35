package kvlease

import (
	"context"
	"errors"
	"math"
	"sync"
	"testing"
	"time"
)

// The helpers below are shared by the core tests of package kvlease_test
// (pool, lease, transfer, churn, fuzz, deadline, memory). Their names
// start with "core" so they do not collide with other test files.

// coreCounts are the five state counts of rule 7.
type coreCounts struct{ Free, Cached, Leased, Draining, Quarantined int }

func coreCountsOf(st Stats) coreCounts {
	return coreCounts{st.Free, st.Cached, st.Leased, st.Draining, st.Quarantined}
}

// corePool returns a host-memory pool of n blocks of 64 bytes.
func corePool(t testing.TB, n int, opts ...Option) *Pool[[]byte] {
	t.Helper()
	return hostPool(t, n, 64, opts...)
}

// coreConsistent checks rule 7 and the pool's own consistency walk, and
// returns the stats it saw.
func coreConsistent(t testing.TB, p interface {
	Stats() Stats
	Check() error
}) Stats {
	t.Helper()
	st := p.Stats()
	if sum := st.Free + st.Cached + st.Leased + st.Draining + st.Quarantined; sum != st.Capacity {
		t.Fatalf("state counts %+v sum to %d, capacity %d", coreCountsOf(st), sum, st.Capacity)
	}
	if err := p.Check(); err != nil {
		t.Fatalf("Pool.Check: %v", err)
	}
	return st
}

// coreWant checks the five counts exactly (and consistency).
func coreWant(t testing.TB, p *Pool[[]byte], want coreCounts) {
	t.Helper()
	if got := coreCountsOf(coreConsistent(t, p)); got != want {
		t.Fatalf("counts = %+v, want %+v", got, want)
	}
}

// coreAllFree checks that nothing is held: every block free (or cached,
// when the test sealed some) and no lease open.
func coreAllFree(t testing.TB, p interface {
	Stats() Stats
	Check() error
}) {
	t.Helper()
	st := coreConsistent(t, p)
	if st.Free+st.Cached != st.Capacity || st.OpenLeases != 0 {
		t.Fatalf("not everything returned: %+v open=%d", coreCountsOf(st), st.OpenLeases)
	}
}

// coreErrIs fails unless err wraps target.
func coreErrIs(t testing.TB, err, target error, what string) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: got nil error, want %v", what, target)
	}
	if !errors.Is(err, target) {
		t.Fatalf("%s: got %v, want an error wrapping %v", what, err, target)
	}
}

func coreNoErr(t testing.TB, err error, what string) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func coreAcquire(t testing.TB, p *Pool[[]byte], owner string, n int) *Lease[[]byte] {
	t.Helper()
	l, err := p.Acquire(owner, n)
	if err != nil {
		t.Fatalf("Acquire(%q, %d): %v", owner, n, err)
	}
	if l.Len() != n {
		t.Fatalf("Acquire(%q, %d): lease has %d blocks", owner, n, l.Len())
	}
	return l
}

// coreRecorder is an Observer that keeps every event.
type coreRecorder struct {
	mu  sync.Mutex
	evs []Event
}

func (r *coreRecorder) Observe(e Event) {
	r.mu.Lock()
	r.evs = append(r.evs, e)
	r.mu.Unlock()
}

func (r *coreRecorder) events() []Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Event(nil), r.evs...)
}

// count returns how many events of kind k concern lease id (0: any).
func (r *coreRecorder) count(k EventKind, id uint64) int {
	n := 0
	for _, e := range r.events() {
		if e.Kind == k && (id == 0 || e.Lease == id) {
			n++
		}
	}
	return n
}

func (r *coreRecorder) last(k EventKind) (Event, bool) {
	evs := r.events()
	for i := len(evs) - 1; i >= 0; i-- {
		if evs[i].Kind == k {
			return evs[i], true
		}
	}
	return Event{}, false
}

// coreFakeMem is a Memory whose sizes the test chooses and whose regions
// are plain numbers (a stand-in for device pointers).
type coreFakeMem struct{ blocks, bytes int }

func (m coreFakeMem) Blocks() int              { return m.blocks }
func (m coreFakeMem) BlockBytes() int          { return m.bytes }
func (m coreFakeMem) Region(id BlockID) uint64 { return uint64(id) * uint64(m.bytes) }

func TestNewPoolRejectsBadMemory(t *testing.T) {
	_, err := NewPool[[]byte](nil)
	coreErrIs(t, err, ErrInvalidArgument, "NewPool(nil interface)")

	var typedNil *HostMemory
	p, err := NewPool[[]byte](typedNil)
	coreErrIs(t, err, ErrInvalidArgument, "NewPool(typed nil *HostMemory)")
	if p != nil {
		t.Fatal("NewPool returned a pool with an error")
	}

	for _, m := range []coreFakeMem{{0, 64}, {-1, 64}, {4, 0}, {4, -8}, {math.MaxInt32 + 1, 1}} {
		_, err := NewPool[uint64](m)
		coreErrIs(t, err, ErrInvalidArgument, "NewPool over "+
			"a memory with bad sizes")
	}

	mem, _ := NewHostMemory(2, 8)
	for _, d := range []int64{0, -1} {
		_, err := NewPool[[]byte](mem, WithDrainDeadline(time.Duration(d)))
		coreErrIs(t, err, ErrInvalidArgument, "WithDrainDeadline(<=0)")
	}

	// A Memory of another region type works as well as host memory.
	fp, err := NewPool[uint64](coreFakeMem{4, 128})
	coreNoErr(t, err, "NewPool over a fake device memory")
	l, err := fp.Acquire("dev", 2)
	coreNoErr(t, err, "Acquire on the fake device pool")
	r, err := l.Region(1)
	coreNoErr(t, err, "Region")
	if want := uint64(l.Ref(1).ID) * 128; r != want {
		t.Fatalf("Region(1) = %d, want %d", r, want)
	}
	l.Release()
	coreAllFree(t, fp)
}

func TestAcquireBadInput(t *testing.T) {
	rec := &coreRecorder{}
	p := corePool(t, 4, WithObserver(rec))
	cases := []struct {
		owner string
		n     int
		want  error
	}{
		{"", 1, ErrInvalidArgument},
		{"a", 0, ErrInvalidArgument},
		{"a", -1, ErrInvalidArgument},
		{"a", math.MinInt, ErrInvalidArgument},
		{"", 0, ErrInvalidArgument},
		{"", 5, ErrInvalidArgument}, // argument errors come first
		{"a", 5, ErrExceedsCapacity},
		{"a", math.MaxInt, ErrExceedsCapacity},
	}
	for i, c := range cases {
		before := p.Stats().Rejections
		l, err := p.Acquire(c.owner, c.n)
		coreErrIs(t, err, c.want, "Acquire("+c.owner+")")
		if l != nil {
			t.Fatalf("case %d: a failed Acquire returned a lease", i)
		}
		ev, ok := rec.last(EventRejected)
		if !ok || !errors.Is(ev.Err, c.want) {
			t.Fatalf("case %d: rejection not reported with its reason: %+v", i, ev)
		}
		if st := coreConsistent(t, p); st.Free != 4 || st.Rejections != before+1 || st.Acquires != 0 {
			t.Fatalf("case %d: a rejection changed the pool: %+v", i, st)
		}

		l, hits, err := p.AcquirePrefix(c.owner, []BlockHash{1, 2}, c.n)
		coreErrIs(t, err, c.want, "AcquirePrefix")
		if l != nil || hits != 0 {
			t.Fatalf("case %d: a failed AcquirePrefix returned a lease or hits", i)
		}

		l, err = p.AcquireWait(context.Background(), c.owner, c.n)
		coreErrIs(t, err, c.want, "AcquireWait")
		if l != nil {
			t.Fatalf("case %d: a failed AcquireWait returned a lease", i)
		}
		// Argument errors come before the context's.
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_, err = p.AcquireWait(ctx, c.owner, c.n)
		coreErrIs(t, err, c.want, "AcquireWait with a cancelled context")
	}
	coreAllFree(t, p)
}

func TestAcquireAllOrNothing(t *testing.T) {
	p := corePool(t, 4)
	a := coreAcquire(t, p, "a", 3)
	l, err := p.Acquire("b", 2)
	coreErrIs(t, err, ErrExhausted, "Acquire(2) with 1 free")
	if l != nil {
		t.Fatal("exhausted Acquire returned a lease")
	}
	coreWant(t, p, coreCounts{Free: 1, Leased: 3})
	b := coreAcquire(t, p, "b", 1)
	_, err = p.Acquire("c", 1)
	coreErrIs(t, err, ErrExhausted, "Acquire(1) with none free")
	coreWant(t, p, coreCounts{Leased: 4})

	// Distinct blocks, all inside the pool.
	seen := map[BlockID]bool{}
	for _, l := range []*Lease[[]byte]{a, b} {
		for i := 0; i < l.Len(); i++ {
			id := l.Ref(i).ID
			if id < 0 || id >= 4 || seen[id] {
				t.Fatalf("block %d handed out twice or out of range", id)
			}
			seen[id] = true
		}
	}
	a.Release()
	b.Release()
	if st := coreConsistent(t, p); st.Acquires != 2 || st.Rejections != 2 || st.OpenLeases != 0 {
		t.Fatalf("stats %+v", st)
	}
	coreAllFree(t, p)
}

func TestClosedPool(t *testing.T) {
	rec := &coreRecorder{}
	p := corePool(t, 4, WithObserver(rec))
	open := coreAcquire(t, p, "open", 2)
	tr := NewTransfer(nil)
	coreNoErr(t, open.AttachRange(tr, 0, 1, Write), "AttachRange before Close")
	coreNoErr(t, p.Close(), "Close")
	coreNoErr(t, p.Close(), "second Close")

	_, err := p.Acquire("a", 1)
	coreErrIs(t, err, ErrPoolClosed, "Acquire after Close")
	_, err = p.Acquire("", 1)
	coreErrIs(t, err, ErrInvalidArgument, "Acquire with an empty owner after Close")
	_, err = p.Acquire("a", 0)
	coreErrIs(t, err, ErrInvalidArgument, "Acquire(0) after Close")
	_, err = p.Acquire("a", 99)
	coreErrIs(t, err, ErrPoolClosed, "Acquire over capacity after Close (closed comes first)")
	_, _, err = p.AcquirePrefix("a", []BlockHash{7}, 1)
	coreErrIs(t, err, ErrPoolClosed, "AcquirePrefix after Close")
	_, err = p.AcquireWait(context.Background(), "a", 1)
	coreErrIs(t, err, ErrPoolClosed, "AcquireWait after Close")
	_, err = p.AcquireWait(context.Background(), "a", 99)
	coreErrIs(t, err, ErrPoolClosed, "AcquireWait over capacity after Close")
	_, err = p.AcquireWait(context.Background(), "", 1)
	coreErrIs(t, err, ErrInvalidArgument, "AcquireWait with an empty owner after Close")

	// Open leases keep working, except growing.
	coreErrIs(t, open.Extend(1), ErrPoolClosed, "Extend after Close")
	if open.Len() != 2 {
		t.Fatalf("failed Extend changed Len to %d", open.Len())
	}
	coreNoErr(t, open.Seal(1, 42), "Seal after Close")
	open.Release()
	coreWant(t, p, coreCounts{Free: 2, Cached: 1, Draining: 1})
	if !tr.Resolve(nil) {
		t.Fatal("Resolve after Close lost")
	}
	<-open.Settled()
	coreAllFree(t, p)
}

// Region(ref) serves a ref while its slot is at that generation and not
// free; ErrStaleRef afterwards.
func TestPoolRegionRef(t *testing.T) {
	p := corePool(t, 2)
	l := coreAcquire(t, p, "a", 1)
	ref := l.Ref(0)
	if ref.Gen == 0 {
		t.Fatal("generation 0 handed out")
	}
	r, err := p.Region(ref)
	coreNoErr(t, err, "Region of a leased block")
	if len(r) != 64 {
		t.Fatalf("len = %d", len(r))
	}
	lr, _ := l.Region(0)
	if &r[0] != &lr[0] {
		t.Fatal("Pool.Region and Lease.Region name different memory")
	}
	_, err = p.Region(BlockRef{ID: ref.ID, Gen: ref.Gen + 1})
	coreErrIs(t, err, ErrStaleRef, "Region at a future generation")
	_, err = p.Region(BlockRef{ID: ref.ID, Gen: ref.Gen - 1})
	coreErrIs(t, err, ErrStaleRef, "Region at an older generation")
	other := BlockRef{ID: 1 - ref.ID, Gen: 0}
	_, err = p.Region(other)
	coreErrIs(t, err, ErrStaleRef, "Region of a never-used free slot")
	for _, bad := range []BlockID{-1, 2, math.MaxInt32} {
		_, err = p.Region(BlockRef{ID: bad, Gen: 1})
		if err == nil || !(errors.Is(err, ErrInvalidArgument) || errors.Is(err, ErrStaleRef)) {
			t.Fatalf("Region of id %d outside the pool: %v", bad, err)
		}
	}

	// Draining: a transport still needs the region.
	tr := NewTransfer(nil)
	coreNoErr(t, l.Attach(tr), "Attach")
	l.Release()
	_, err = p.Region(ref)
	coreNoErr(t, err, "Region of a draining block")
	// Quarantined.
	tr.Quarantine(nil)
	_, err = p.Region(ref)
	coreNoErr(t, err, "Region of a quarantined block")
	// Free.
	tr.Resolve(nil)
	_, err = p.Region(ref)
	coreErrIs(t, err, ErrStaleRef, "Region of a freed block")

	// Cached: still served at the same generation, until evicted.
	c := coreAcquire(t, p, "c", 2)
	coreNoErr(t, c.Seal(0, 7), "Seal")
	cref := c.Ref(0)
	c.Release()
	coreWant(t, p, coreCounts{Free: 1, Cached: 1})
	_, err = p.Region(cref)
	coreNoErr(t, err, "Region of a cached block")
	d := coreAcquire(t, p, "d", 2) // evicts the cached block: new generation
	coreWant(t, p, coreCounts{Leased: 2})
	_, err = p.Region(cref)
	coreErrIs(t, err, ErrStaleRef, "Region of an evicted block")
	for i := 0; i < d.Len(); i++ {
		if d.Ref(i).ID == cref.ID && d.Ref(i).Gen == cref.Gen {
			t.Fatalf("evicted block handed out at its old generation %v", cref)
		}
	}
	d.Release()
	coreAllFree(t, p)
}

// Every fresh hand-out is a new generation; a prefix hit keeps it.
func TestGenerations(t *testing.T) {
	p := corePool(t, 1)
	seen := map[uint32]bool{}
	var refs []BlockRef
	for range 5 {
		l := coreAcquire(t, p, "a", 1)
		r := l.Ref(0)
		if r.Gen == 0 || seen[r.Gen] {
			t.Fatalf("generation %d reused or zero", r.Gen)
		}
		seen[r.Gen] = true
		refs = append(refs, r)
		l.Release()
		for _, old := range refs {
			_, err := p.Region(old)
			coreErrIs(t, err, ErrStaleRef, "Region of an old generation")
		}
	}
	// Seal, release (cached), hit: same generation.
	a := coreAcquire(t, p, "a", 1)
	coreNoErr(t, a.Seal(0, 5), "Seal")
	ga := a.Ref(0)
	b, hits, err := p.AcquirePrefix("b", []BlockHash{5}, 1)
	coreNoErr(t, err, "AcquirePrefix on a leased sealed block")
	if hits != 1 || b.Ref(0) != ga {
		t.Fatalf("hit %d: ref %v, want %v", hits, b.Ref(0), ga)
	}
	a.Release()
	b.Release()
	c, hits, err := p.AcquirePrefix("c", []BlockHash{5}, 1)
	coreNoErr(t, err, "AcquirePrefix on a cached block")
	if hits != 1 || c.Ref(0) != ga {
		t.Fatalf("hit %d: ref %v, want %v", hits, c.Ref(0), ga)
	}
	c.Release()
	// Evicted: a fresh hand-out, a new generation.
	d := coreAcquire(t, p, "d", 1)
	if d.Ref(0).Gen == ga.Gen {
		t.Fatal("eviction kept the generation")
	}
	d.Release()
	coreAllFree(t, p)
}

// Observers are called with no lock held: one that calls back into the
// library (Stats, Check, Acquire, Release, Resolve) must not deadlock.
func TestObserverReentrant(t *testing.T) {
	var p *Pool[[]byte]
	var mu sync.Mutex
	transfers := map[uint64]*Transfer{}
	kinds := map[EventKind]int{}
	obs := ObserverFunc(func(e Event) {
		mu.Lock()
		kinds[e.Kind]++
		tr := transfers[e.Transfer]
		mu.Unlock()
		st := p.Stats()
		if sum := st.Free + st.Cached + st.Leased + st.Draining + st.Quarantined; sum != st.Capacity {
			t.Errorf("inside observer: counts sum to %d", sum)
		}
		if err := p.Check(); err != nil {
			t.Errorf("inside observer: %v", err)
		}
		switch {
		case e.Kind == EventAcquired && e.Owner == "outer":
			l, err := p.Acquire("inner", 1)
			if err != nil {
				t.Errorf("Acquire inside observer: %v", err)
				return
			}
			l.Release()
		case e.Kind == EventTransferQuarantined && tr != nil:
			tr.Resolve(nil) // late evidence, from inside the observer
		}
	})
	p = corePool(t, 4, WithObserver(obs))
	l := coreAcquire(t, p, "outer", 2)
	tr := NewTransfer(nil)
	mu.Lock()
	transfers[tr.ID()] = tr
	mu.Unlock()
	coreNoErr(t, l.Attach(tr), "Attach")
	coreNoErr(t, l.Extend(1), "Extend")
	tr.Quarantine(errors.New("peer vanished"))
	if tr.State() != TransferResolved || l.State() != LeaseActive {
		t.Fatalf("observer's Resolve: transfer %v lease %v", tr.State(), l.State())
	}
	_, err := p.Acquire("x", 9)
	coreErrIs(t, err, ErrExceedsCapacity, "rejection with an observer")
	l.Abort(nil)
	<-l.Settled()
	coreAllFree(t, p)
	mu.Lock()
	defer mu.Unlock()
	for _, k := range []EventKind{EventAcquired, EventRejected, EventExtended,
		EventAborted, EventReleased, EventSettled, EventAttached,
		EventTransferQuarantined, EventLeaseQuarantined, EventQuarantineLifted,
		EventTransferResolved} {
		if kinds[k] == 0 {
			t.Errorf("no %v event seen", k)
		}
	}
}

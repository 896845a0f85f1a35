package kvlease_test

import (
	"context"
	"errors"
	"math"
	"runtime"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvlease/kvlease"
)

// The helpers below are shared by the core tests of package kvlease_test
// (pool, lease, transfer, churn, fuzz, deadline, memory). Their names
// start with "core" so they do not collide with other test files.

// coreCounts are the five state counts of rule 7.
type coreCounts struct{ Free, Cached, Leased, Draining, Quarantined int }

func coreCountsOf(st kvlease.Stats) coreCounts {
	return coreCounts{st.Free, st.Cached, st.Leased, st.Draining, st.Quarantined}
}

// corePool returns a host-memory pool of n blocks of 64 bytes.
func corePool(t testing.TB, n int, opts ...kvlease.Option) *kvlease.Pool[[]byte] {
	t.Helper()
	mem, err := kvlease.NewHostMemory(n, 64)
	if err != nil {
		t.Fatalf("NewHostMemory(%d, 64): %v", n, err)
	}
	p, err := kvlease.NewPool[[]byte](mem, opts...)
	if err != nil {
		t.Fatalf("NewPool: %v", err)
	}
	return p
}

// coreConsistent checks rule 7 and the pool's own consistency walk, and
// returns the stats it saw.
func coreConsistent(t testing.TB, p interface {
	Stats() kvlease.Stats
	Check() error
}) kvlease.Stats {
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
func coreWant(t testing.TB, p *kvlease.Pool[[]byte], want coreCounts) {
	t.Helper()
	if got := coreCountsOf(coreConsistent(t, p)); got != want {
		t.Fatalf("counts = %+v, want %+v", got, want)
	}
}

// coreAllFree checks that nothing is held: every block free (or cached,
// when the test sealed some) and no lease open.
func coreAllFree(t testing.TB, p interface {
	Stats() kvlease.Stats
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

func coreAcquire(t testing.TB, p *kvlease.Pool[[]byte], owner string, n int) *kvlease.Lease[[]byte] {
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
	evs []kvlease.Event
}

func (r *coreRecorder) Observe(e kvlease.Event) {
	r.mu.Lock()
	r.evs = append(r.evs, e)
	r.mu.Unlock()
}

func (r *coreRecorder) events() []kvlease.Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]kvlease.Event(nil), r.evs...)
}

// count returns how many events of kind k concern lease id (0: any).
func (r *coreRecorder) count(k kvlease.EventKind, id uint64) int {
	n := 0
	for _, e := range r.events() {
		if e.Kind == k && (id == 0 || e.Lease == id) {
			n++
		}
	}
	return n
}

func (r *coreRecorder) last(k kvlease.EventKind) (kvlease.Event, bool) {
	evs := r.events()
	for i := len(evs) - 1; i >= 0; i-- {
		if evs[i].Kind == k {
			return evs[i], true
		}
	}
	return kvlease.Event{}, false
}

// coreFakeMem is a Memory whose sizes the test chooses and whose regions
// are plain numbers (a stand-in for device pointers).
type coreFakeMem struct{ blocks, bytes int }

func (m coreFakeMem) Blocks() int                      { return m.blocks }
func (m coreFakeMem) BlockBytes() int                  { return m.bytes }
func (m coreFakeMem) Region(id kvlease.BlockID) uint64 { return uint64(id) * uint64(m.bytes) }

func TestNewPoolRejectsBadMemory(t *testing.T) {
	_, err := kvlease.NewPool[[]byte](nil)
	coreErrIs(t, err, kvlease.ErrInvalidArgument, "NewPool(nil interface)")

	var typedNil *kvlease.HostMemory
	p, err := kvlease.NewPool[[]byte](typedNil)
	coreErrIs(t, err, kvlease.ErrInvalidArgument, "NewPool(typed nil *HostMemory)")
	if p != nil {
		t.Fatal("NewPool returned a pool with an error")
	}

	for _, m := range []coreFakeMem{{0, 64}, {-1, 64}, {4, 0}, {4, -8}, {math.MaxInt32 + 1, 1}} {
		_, err := kvlease.NewPool[uint64](m)
		coreErrIs(t, err, kvlease.ErrInvalidArgument, "NewPool over "+
			"a memory with bad sizes")
	}

	mem, _ := kvlease.NewHostMemory(2, 8)
	for _, d := range []int64{0, -1} {
		_, err := kvlease.NewPool[[]byte](mem, kvlease.WithDrainDeadline(time.Duration(d)))
		coreErrIs(t, err, kvlease.ErrInvalidArgument, "WithDrainDeadline(<=0)")
	}

	// A Memory of another region type works as well as host memory.
	fp, err := kvlease.NewPool[uint64](coreFakeMem{4, 128})
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
	p := corePool(t, 4, kvlease.WithObserver(rec))
	cases := []struct {
		owner string
		n     int
		want  error
	}{
		{"", 1, kvlease.ErrInvalidArgument},
		{"a", 0, kvlease.ErrInvalidArgument},
		{"a", -1, kvlease.ErrInvalidArgument},
		{"a", math.MinInt, kvlease.ErrInvalidArgument},
		{"", 0, kvlease.ErrInvalidArgument},
		{"", 5, kvlease.ErrInvalidArgument}, // argument errors come first
		{"a", 5, kvlease.ErrExceedsCapacity},
		{"a", math.MaxInt, kvlease.ErrExceedsCapacity},
	}
	for i, c := range cases {
		before := p.Stats().Rejections
		l, err := p.Acquire(c.owner, c.n)
		coreErrIs(t, err, c.want, "Acquire("+c.owner+")")
		if l != nil {
			t.Fatalf("case %d: a failed Acquire returned a lease", i)
		}
		ev, ok := rec.last(kvlease.EventRejected)
		if !ok || !errors.Is(ev.Err, c.want) {
			t.Fatalf("case %d: rejection not reported with its reason: %+v", i, ev)
		}
		if st := coreConsistent(t, p); st.Free != 4 || st.Rejections != before+1 || st.Acquires != 0 {
			t.Fatalf("case %d: a rejection changed the pool: %+v", i, st)
		}

		l, hits, err := p.AcquirePrefix(c.owner, []kvlease.BlockHash{1, 2}, c.n)
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
	coreErrIs(t, err, kvlease.ErrExhausted, "Acquire(2) with 1 free")
	if l != nil {
		t.Fatal("exhausted Acquire returned a lease")
	}
	coreWant(t, p, coreCounts{Free: 1, Leased: 3})
	b := coreAcquire(t, p, "b", 1)
	_, err = p.Acquire("c", 1)
	coreErrIs(t, err, kvlease.ErrExhausted, "Acquire(1) with none free")
	coreWant(t, p, coreCounts{Leased: 4})

	// Distinct blocks, all inside the pool.
	seen := map[kvlease.BlockID]bool{}
	for _, l := range []*kvlease.Lease[[]byte]{a, b} {
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
	p := corePool(t, 4, kvlease.WithObserver(rec))
	open := coreAcquire(t, p, "open", 2)
	tr := kvlease.NewTransfer(nil)
	coreNoErr(t, open.AttachRange(tr, 0, 1, kvlease.Write), "AttachRange before Close")
	coreNoErr(t, p.Close(), "Close")
	coreNoErr(t, p.Close(), "second Close")

	_, err := p.Acquire("a", 1)
	coreErrIs(t, err, kvlease.ErrPoolClosed, "Acquire after Close")
	_, err = p.Acquire("", 1)
	coreErrIs(t, err, kvlease.ErrInvalidArgument, "Acquire with an empty owner after Close")
	_, err = p.Acquire("a", 0)
	coreErrIs(t, err, kvlease.ErrInvalidArgument, "Acquire(0) after Close")
	_, err = p.Acquire("a", 99)
	coreErrIs(t, err, kvlease.ErrPoolClosed, "Acquire over capacity after Close (closed comes first)")
	_, _, err = p.AcquirePrefix("a", []kvlease.BlockHash{7}, 1)
	coreErrIs(t, err, kvlease.ErrPoolClosed, "AcquirePrefix after Close")
	_, err = p.AcquireWait(context.Background(), "a", 1)
	coreErrIs(t, err, kvlease.ErrPoolClosed, "AcquireWait after Close")
	_, err = p.AcquireWait(context.Background(), "a", 99)
	coreErrIs(t, err, kvlease.ErrPoolClosed, "AcquireWait over capacity after Close")
	_, err = p.AcquireWait(context.Background(), "", 1)
	coreErrIs(t, err, kvlease.ErrInvalidArgument, "AcquireWait with an empty owner after Close")

	// Open leases keep working, except growing.
	coreErrIs(t, open.Extend(1), kvlease.ErrPoolClosed, "Extend after Close")
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

// Strict FIFO: a later waiter is never served while an earlier one waits,
// plain acquires never overtake the queue, growth of running work is not
// queued, and each release serves the queue in order.
func TestAcquireWaitFIFO(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := corePool(t, 4)
		h1 := coreAcquire(t, p, "h1", 2)
		h2 := coreAcquire(t, p, "h2", 2)

		type result struct {
			l   *kvlease.Lease[[]byte]
			err error
		}
		wait := func(owner string, n int) chan result {
			ch := make(chan result, 1)
			go func() {
				l, err := p.AcquireWait(context.Background(), owner, n)
				ch <- result{l, err}
			}()
			synctest.Wait() // queued (or served) before the next one arrives
			return ch
		}
		a := wait("a", 3)
		b := wait("b", 2)
		c := wait("c", 1)
		if st := p.Stats(); st.Waiters != 3 {
			t.Fatalf("Waiters = %d, want 3", st.Waiters)
		}

		h1.Release() // 2 free: b and c would fit, but a is first
		synctest.Wait()
		select {
		case r := <-b:
			t.Fatalf("b served while a waits: %+v", r)
		case r := <-c:
			t.Fatalf("c served while a waits: %+v", r)
		default:
		}
		coreWant(t, p, coreCounts{Free: 2, Leased: 2})

		// A plain acquire never overtakes a queued waiter.
		_, err := p.Acquire("x", 1)
		coreErrIs(t, err, kvlease.ErrExhausted, "Acquire while waiters are queued")
		_, _, err = p.AcquirePrefix("x", []kvlease.BlockHash{9}, 1)
		coreErrIs(t, err, kvlease.ErrExhausted, "AcquirePrefix while waiters are queued")
		// Growth of running work is not queued behind them.
		coreNoErr(t, h2.Extend(1), "Extend while waiters are queued")
		coreWant(t, p, coreCounts{Free: 1, Leased: 3})

		h2.Release() // 4 free: a (3) is served, then c (1) would fit but b (2) is next
		synctest.Wait()
		ra := <-a
		coreNoErr(t, ra.err, "a")
		if ra.l.Len() != 3 || ra.l.Owner() != "a" {
			t.Fatalf("a got %d blocks for %q", ra.l.Len(), ra.l.Owner())
		}
		select {
		case r := <-b:
			t.Fatalf("b served with 1 free: %+v", r)
		case r := <-c:
			t.Fatalf("c served while b waits: %+v", r)
		default:
		}
		if st := coreConsistent(t, p); st.Waiters != 2 || st.Leased != 3 || st.Free != 1 {
			t.Fatalf("after serving a: %+v waiters=%d", coreCountsOf(st), st.Waiters)
		}

		ra.l.Release() // b then c
		synctest.Wait()
		rb, rc := <-b, <-c
		coreNoErr(t, rb.err, "b")
		coreNoErr(t, rc.err, "c")
		if rb.l.Len() != 2 || rc.l.Len() != 1 {
			t.Fatalf("b got %d, c got %d", rb.l.Len(), rc.l.Len())
		}
		if st := coreConsistent(t, p); st.Waiters != 0 || st.Leased != 3 || st.OpenLeases != 2 {
			t.Fatalf("after serving b and c: %+v", st)
		}
		rb.l.Release()
		rc.l.Release()
		coreAllFree(t, p)
	})
}

// A cancelled waiter holds nothing, and leaving the head of the queue lets
// the next waiter in.
func TestAcquireWaitCancel(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := corePool(t, 4)
		h := coreAcquire(t, p, "h", 3)

		ctxA, cancelA := context.WithCancel(context.Background())
		errA := make(chan error, 1)
		go func() {
			l, err := p.AcquireWait(ctxA, "a", 2)
			if l != nil {
				err = errors.New("cancelled waiter got a lease")
			}
			errA <- err
		}()
		synctest.Wait()
		bl := make(chan *kvlease.Lease[[]byte], 1)
		go func() {
			l, err := p.AcquireWait(context.Background(), "b", 1)
			if err != nil {
				t.Errorf("b: %v", err)
			}
			bl <- l
		}()
		synctest.Wait()
		if st := p.Stats(); st.Waiters != 2 || st.Free != 1 {
			t.Fatalf("want 2 waiters and 1 free block: %+v", st)
		}

		cancelA()
		synctest.Wait()
		coreErrIs(t, <-errA, context.Canceled, "cancelled AcquireWait")
		b := <-bl // served as soon as a left the head of the queue
		if b == nil || b.Len() != 1 {
			t.Fatal("b not served after the head of the queue left")
		}
		if st := coreConsistent(t, p); st.Waiters != 0 || st.Leased != 4 || st.OpenLeases != 2 {
			t.Fatalf("after cancel: %+v", st)
		}

		// A deadline ends a wait the same way, and the waiter holds nothing
		// even when blocks come back later.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := p.AcquireWait(ctx, "late", 4)
		coreErrIs(t, err, context.DeadlineExceeded, "AcquireWait past its deadline")
		h.Release()
		b.Release()
		coreAllFree(t, p)
		if st := p.Stats(); st.Waiters != 0 {
			t.Fatalf("a cancelled waiter is still queued: %+v", st)
		}
	})
}

func TestAcquireWaitClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := corePool(t, 2)
		h := coreAcquire(t, p, "h", 2)
		errs := make(chan error, 3)
		for _, n := range []int{1, 2, 1} {
			go func() {
				l, err := p.AcquireWait(context.Background(), "w", n)
				if l != nil {
					err = errors.New("woken waiter got a lease")
				}
				errs <- err
			}()
		}
		synctest.Wait()
		if st := p.Stats(); st.Waiters != 3 {
			t.Fatalf("Waiters = %d, want 3", st.Waiters)
		}
		coreNoErr(t, p.Close(), "Close")
		synctest.Wait()
		for range 3 {
			coreErrIs(t, <-errs, kvlease.ErrPoolClosed, "waiter woken by Close")
		}
		st := coreConsistent(t, p)
		if st.Waiters != 0 || st.Leased != 2 {
			t.Fatalf("after Close: %+v", st)
		}
		h.Release()
		coreAllFree(t, p)
	})
}

func TestAcquireWaitImmediate(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := corePool(t, 3)
		// Over capacity fails at once (a blocked call would deadlock the
		// bubble and fail the test).
		_, err := p.AcquireWait(context.Background(), "big", 4)
		coreErrIs(t, err, kvlease.ErrExceedsCapacity, "AcquireWait over capacity")
		// Even while the pool is full.
		h := coreAcquire(t, p, "h", 3)
		_, err = p.AcquireWait(context.Background(), "big", 4)
		coreErrIs(t, err, kvlease.ErrExceedsCapacity, "AcquireWait over capacity on a full pool")
		h.Release()
		// Free blocks and nobody queued: served at once.
		l, err := p.AcquireWait(context.Background(), "a", 3)
		coreNoErr(t, err, "AcquireWait with room")
		if l.Len() != 3 || l.State() != kvlease.LeaseActive {
			t.Fatalf("got %d blocks in state %v", l.Len(), l.State())
		}
		l.Release()
		// An already cancelled context: the context's error, nothing held.
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_, err = p.AcquireWait(ctx, "a", 1)
		coreErrIs(t, err, context.Canceled, "AcquireWait with a cancelled context")
		coreAllFree(t, p)
	})
}

// Stats counts a block shared in several ways once, in the first state that
// applies: Quarantined, Leased, Draining, Cached, Free.
func TestStatsPrecedence(t *testing.T) {
	p := corePool(t, 4)
	a := coreAcquire(t, p, "a", 2)
	coreNoErr(t, a.Seal(0, 100), "Seal")
	b, hits, err := p.AcquirePrefix("b", []kvlease.BlockHash{100}, 1)
	coreNoErr(t, err, "AcquirePrefix")
	if hits != 1 || b.Ref(0) != a.Ref(0) {
		t.Fatalf("want a shared block: hits=%d a=%v b=%v", hits, a.Ref(0), b.Ref(0))
	}
	// One block held by two leases is one leased block.
	coreWant(t, p, coreCounts{Free: 2, Leased: 2})

	send := kvlease.NewTransfer(nil)
	coreNoErr(t, a.AttachRange(send, 0, 1, kvlease.Read), "AttachRange")
	a.Release()
	// Block 0: open lease b + pending transfer of closed a → Leased.
	coreWant(t, p, coreCounts{Free: 3, Leased: 1})
	if a.State() != kvlease.LeaseDraining {
		t.Fatalf("a is %v, want draining", a.State())
	}

	send.Quarantine(nil)
	// Quarantined beats Leased.
	coreWant(t, p, coreCounts{Free: 3, Quarantined: 1})
	b.Release()
	coreWant(t, p, coreCounts{Free: 3, Quarantined: 1})
	if b.State() != kvlease.LeaseSettled {
		t.Fatalf("b is %v, want settled (it holds nothing and nothing gates it)", b.State())
	}

	send.Resolve(nil)
	coreWant(t, p, coreCounts{Free: 3, Cached: 1})

	// Draining beats Cached: a sealed block still being read after release.
	c, hits, err := p.AcquirePrefix("c", []kvlease.BlockHash{100}, 1)
	coreNoErr(t, err, "AcquirePrefix")
	if hits != 1 {
		t.Fatalf("hits = %d", hits)
	}
	coreWant(t, p, coreCounts{Free: 3, Leased: 1})
	rd := kvlease.NewTransfer(nil)
	coreNoErr(t, c.AttachRange(rd, 0, 1, kvlease.Read), "AttachRange")
	c.Release()
	coreWant(t, p, coreCounts{Free: 3, Draining: 1})
	rd.Resolve(nil)
	coreWant(t, p, coreCounts{Free: 3, Cached: 1})
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
	_, err = p.Region(kvlease.BlockRef{ID: ref.ID, Gen: ref.Gen + 1})
	coreErrIs(t, err, kvlease.ErrStaleRef, "Region at a future generation")
	_, err = p.Region(kvlease.BlockRef{ID: ref.ID, Gen: ref.Gen - 1})
	coreErrIs(t, err, kvlease.ErrStaleRef, "Region at an older generation")
	other := kvlease.BlockRef{ID: 1 - ref.ID, Gen: 0}
	_, err = p.Region(other)
	coreErrIs(t, err, kvlease.ErrStaleRef, "Region of a never-used free slot")
	for _, bad := range []kvlease.BlockID{-1, 2, math.MaxInt32} {
		_, err = p.Region(kvlease.BlockRef{ID: bad, Gen: 1})
		if err == nil || !(errors.Is(err, kvlease.ErrInvalidArgument) || errors.Is(err, kvlease.ErrStaleRef)) {
			t.Fatalf("Region of id %d outside the pool: %v", bad, err)
		}
	}

	// Draining: a transport still needs the region.
	tr := kvlease.NewTransfer(nil)
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
	coreErrIs(t, err, kvlease.ErrStaleRef, "Region of a freed block")

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
	coreErrIs(t, err, kvlease.ErrStaleRef, "Region of an evicted block")
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
	var refs []kvlease.BlockRef
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
			coreErrIs(t, err, kvlease.ErrStaleRef, "Region of an old generation")
		}
	}
	// Seal, release (cached), hit: same generation.
	a := coreAcquire(t, p, "a", 1)
	coreNoErr(t, a.Seal(0, 5), "Seal")
	ga := a.Ref(0)
	b, hits, err := p.AcquirePrefix("b", []kvlease.BlockHash{5}, 1)
	coreNoErr(t, err, "AcquirePrefix on a leased sealed block")
	if hits != 1 || b.Ref(0) != ga {
		t.Fatalf("hit %d: ref %v, want %v", hits, b.Ref(0), ga)
	}
	a.Release()
	b.Release()
	c, hits, err := p.AcquirePrefix("c", []kvlease.BlockHash{5}, 1)
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
	var p *kvlease.Pool[[]byte]
	var mu sync.Mutex
	transfers := map[uint64]*kvlease.Transfer{}
	kinds := map[kvlease.EventKind]int{}
	obs := kvlease.ObserverFunc(func(e kvlease.Event) {
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
		case e.Kind == kvlease.EventAcquired && e.Owner == "outer":
			l, err := p.Acquire("inner", 1)
			if err != nil {
				t.Errorf("Acquire inside observer: %v", err)
				return
			}
			l.Release()
		case e.Kind == kvlease.EventTransferQuarantined && tr != nil:
			tr.Resolve(nil) // late evidence, from inside the observer
		}
	})
	p = corePool(t, 4, kvlease.WithObserver(obs))
	l := coreAcquire(t, p, "outer", 2)
	tr := kvlease.NewTransfer(nil)
	mu.Lock()
	transfers[tr.ID()] = tr
	mu.Unlock()
	coreNoErr(t, l.Attach(tr), "Attach")
	coreNoErr(t, l.Extend(1), "Extend")
	tr.Quarantine(errors.New("peer vanished"))
	if tr.State() != kvlease.TransferResolved || l.State() != kvlease.LeaseActive {
		t.Fatalf("observer's Resolve: transfer %v lease %v", tr.State(), l.State())
	}
	_, err := p.Acquire("x", 9)
	coreErrIs(t, err, kvlease.ErrExceedsCapacity, "rejection with an observer")
	l.Abort(nil)
	<-l.Settled()
	coreAllFree(t, p)
	mu.Lock()
	defer mu.Unlock()
	for _, k := range []kvlease.EventKind{kvlease.EventAcquired, kvlease.EventRejected, kvlease.EventExtended,
		kvlease.EventAborted, kvlease.EventReleased, kvlease.EventSettled, kvlease.EventAttached,
		kvlease.EventTransferQuarantined, kvlease.EventLeaseQuarantined, kvlease.EventQuarantineLifted,
		kvlease.EventTransferResolved} {
		if kinds[k] == 0 {
			t.Errorf("no %v event seen", k)
		}
	}
}

// A waiter whose context ends just as it is served either returns the
// lease or holds nothing: a served lease is never dropped on the floor.
// Same for Close racing a release that would serve the waiter.
func TestAcquireWaitServeRaces(t *testing.T) {
	for round := range 300 {
		p := corePool(t, 2)
		h := coreAcquire(t, p, "h", 2)
		ctx, cancel := context.WithCancel(context.Background())
		type result struct {
			l   *kvlease.Lease[[]byte]
			err error
		}
		res := make(chan result, 1)
		go func() {
			l, err := p.AcquireWait(ctx, "w", 2)
			res <- result{l, err}
		}()
		for p.Stats().Waiters == 0 {
			select {
			case r := <-res:
				t.Fatalf("AcquireWait returned before anything was released: %+v", r)
			default:
			}
			runtime.Gosched()
		}
		closing := round%3 == 2
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			if closing {
				p.Close()
			} else {
				cancel()
			}
		}()
		go func() { defer wg.Done(); h.Release() }()
		wg.Wait()
		r := <-res
		cancel()
		switch {
		case r.err == nil:
			if r.l == nil || r.l.Len() != 2 {
				t.Fatalf("round %d: served without a full lease", round)
			}
			coreWant(t, p, coreCounts{Leased: 2})
			r.l.Release()
		case closing:
			coreErrIs(t, r.err, kvlease.ErrPoolClosed, "waiter woken by Close")
		default:
			coreErrIs(t, r.err, context.Canceled, "cancelled waiter")
		}
		if r.err != nil && r.l != nil {
			t.Fatalf("round %d: a lease and an error", round)
		}
		coreAllFree(t, p)
		if st := p.Stats(); st.Waiters != 0 {
			t.Fatalf("round %d: %d waiters left", round, st.Waiters)
		}
	}
}

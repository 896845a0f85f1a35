package kvlease

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"
)

// quarantineN acquires n blocks for owner, attaches a transfer to them and
// quarantines it; the lease stays open when keep is set.
func quarantineN(t *testing.T, p *Pool[[]byte], owner string, n int, keep bool) (*Lease[[]byte], *Transfer) {
	t.Helper()
	l, err := p.Acquire(owner, n)
	require.NoError(t, err)
	tr := NewTransfer(nil)
	require.NoError(t, l.Attach(tr))
	tr.Quarantine(nil)
	if !keep {
		l.Release()
	}
	return l, tr
}

// Stats reports usable capacity and quarantined blocks still in use; a
// request larger than what quarantine leaves usable gets
// ErrQuarantineBound, which wraps ErrExhausted.
func TestQuarantineBoundAndStats(t *testing.T) {
	p := newTestPool(t, 8)
	open, tOpen := quarantineN(t, p, "open", 1, true)
	_, tClosed := quarantineN(t, p, "closed", 1, false)
	st := p.Stats()
	require.Equal(t, 2, st.Quarantined)
	require.Equal(t, 1, st.QuarantinedLeased, "the open lease still uses its block")
	require.Equal(t, 0, st.Leased, "one state per block: it counts as Quarantined")
	require.Equal(t, 6, st.Usable)
	require.Equal(t, 6, p.Stats().Usable)

	_, err := p.Acquire("max", 8)
	require.ErrorIs(t, err, ErrQuarantineBound)
	require.ErrorIs(t, err, ErrExhausted, "old callers still retry")
	_, err = p.Acquire("big", 7)
	require.ErrorIs(t, err, ErrQuarantineBound)
	_, _, err = p.AcquirePrefix("big", []BlockHash{1, 2}, 7)
	require.ErrorIs(t, err, ErrQuarantineBound)
	_, err = p.AcquireWait(context.Background(), "big", 7)
	require.ErrorIs(t, err, ErrQuarantineBound, "waiting could never help: at once")

	// Extend: the lease's own usable blocks cannot be free for it.
	a, err := p.Acquire("a", 2)
	require.NoError(t, err)
	hog, err := p.Acquire("hog", 4)
	require.NoError(t, err)
	err = a.Extend(5)
	require.ErrorIs(t, err, ErrQuarantineBound, "6 usable, a holds 2: 4 at most")
	err = a.Extend(4)
	require.ErrorIs(t, err, ErrExhausted)
	require.NotErrorIs(t, err, ErrQuarantineBound, "4 will be free once the hog leaves")
	hog.Release()
	require.NoError(t, a.Extend(4))
	a.Release()

	// Late evidence lifts the bound.
	tClosed.Resolve(nil)
	st = p.Stats()
	require.Equal(t, 1, st.Quarantined)
	require.Equal(t, 1, st.QuarantinedLeased)
	require.Equal(t, 7, st.Usable)
	l, err := p.Acquire("big", 7)
	require.NoError(t, err)
	l.Release()
	open.Release()
	require.Equal(t, 0, p.Stats().QuarantinedLeased, "closed: still quarantined, no longer used")
	require.Equal(t, 1, p.Stats().Quarantined)
	tOpen.Resolve(nil)
	require.Equal(t, 8, p.Stats().Usable)
}

// A queued waiter that quarantine makes unservable is failed with
// ErrQuarantineBound instead of blocking the FIFO forever; waiters behind
// it are then served.
func TestAcquireWaitFailedByQuarantine(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := newTestPool(t, 8)
		victim, err := p.Acquire("victim", 3)
		require.NoError(t, err)
		tr := NewTransfer(nil)
		require.NoError(t, victim.Attach(tr))
		hold, err := p.Acquire("hold", 2)
		require.NoError(t, err) // 3 free

		type result struct {
			l   *Lease[[]byte]
			err error
		}
		res := make([]result, 3)
		var wg sync.WaitGroup
		wait := func(i int, owner string, n int) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				res[i].l, res[i].err = p.AcquireWait(context.Background(), owner, n)
			}()
			synctest.Wait() // queued, in this order
		}
		wait(0, "head", 6)  // fits 8 usable, not 3 free: queued at the head
		wait(1, "small", 1) // strictly behind the head
		wait(2, "huge", 7)  // behind both
		require.Equal(t, 3, p.Stats().Waiters)

		tr.Quarantine(nil) // 3 blocks: usable 5
		synctest.Wait()
		wg.Wait()
		require.ErrorIs(t, res[0].err, ErrQuarantineBound)
		require.ErrorIs(t, res[0].err, ErrExhausted)
		require.ErrorIs(t, res[2].err, ErrQuarantineBound, "a waiter behind the head is failed too")
		require.NoError(t, res[1].err, "the FIFO moves on")
		require.Equal(t, 0, p.Stats().Waiters)
		res[1].l.Release()
		hold.Release()
		victim.Release()
		tr.Resolve(nil)
		require.Equal(t, 8, p.Stats().Free)
	})
}

// A waiter that still fits the usable capacity keeps waiting through a
// quarantine and is served once blocks return.
func TestAcquireWaitSurvivesQuarantineItFits(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := newTestPool(t, 8)
		hold, err := p.Acquire("hold", 4)
		require.NoError(t, err)
		q, err := p.Acquire("q", 2)
		require.NoError(t, err)
		tr := NewTransfer(nil)
		require.NoError(t, q.Attach(tr))
		var got *Lease[[]byte]
		var gerr error
		done := make(chan struct{})
		go func() {
			got, gerr = p.AcquireWait(context.Background(), "w", 4)
			close(done)
		}()
		synctest.Wait()
		tr.Quarantine(nil) // usable 6 ≥ 4: keep waiting
		q.Release()
		synctest.Wait()
		select {
		case <-done:
			t.Fatalf("waiter finished early: %v", gerr)
		default:
		}
		hold.Release()
		<-done
		require.NoError(t, gerr)
		got.Release()
		tr.Resolve(nil)
	})
}

// The observer is told when quarantined blocks exceed the configured
// share of the pool, once per crossing, and when they recover.
func TestQuarantineAlert(t *testing.T) {
	var mu sync.Mutex
	var alerts []Event
	obs := ObserverFunc(func(e Event) {
		if e.Kind == EventQuarantineAlert || e.Kind == EventQuarantineRecovered {
			mu.Lock()
			alerts = append(alerts, e)
			mu.Unlock()
		}
	})
	p := newTestPool(t, 10, WithObserver(obs), WithQuarantineAlert(0.2)) // above 2 blocks
	_, t1 := quarantineN(t, p, "a", 2, false)
	require.Empty(t, alerts, "2 of 10 is not above 20%")
	_, t2 := quarantineN(t, p, "b", 1, false)
	require.Len(t, alerts, 1)
	require.Equal(t, EventQuarantineAlert, alerts[0].Kind)
	require.Equal(t, 3, alerts[0].Blocks)
	require.Error(t, alerts[0].Err)
	_, t3 := quarantineN(t, p, "c", 1, true)
	require.Len(t, alerts, 1, "told once per crossing")
	t1.Resolve(nil)
	require.Len(t, alerts, 2)
	require.Equal(t, EventQuarantineRecovered, alerts[1].Kind)
	require.Equal(t, 2, alerts[1].Blocks)
	t2.Resolve(nil)
	t3.Resolve(nil)
	require.Len(t, alerts, 2)
	require.Equal(t, "quarantine-alert", EventQuarantineAlert.String())

	// Attaching an already quarantined transfer counts too.
	l, err := p.Acquire("d", 3)
	require.NoError(t, err)
	tq := NewTransfer(nil)
	tq.Quarantine(nil)
	require.NoError(t, l.Attach(tq))
	require.Len(t, alerts, 3)
	require.Equal(t, EventQuarantineAlert, alerts[2].Kind)
	l.Release()
	tq.Resolve(nil)
	require.Len(t, alerts, 4)
	require.True(t, errors.Is(p.Check(), nil))
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
			l   *Lease[[]byte]
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
		coreErrIs(t, err, ErrExhausted, "Acquire while waiters are queued")
		_, _, err = p.AcquirePrefix("x", []BlockHash{9}, 1)
		coreErrIs(t, err, ErrExhausted, "AcquirePrefix while waiters are queued")
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
		bl := make(chan *Lease[[]byte], 1)
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
			coreErrIs(t, <-errs, ErrPoolClosed, "waiter woken by Close")
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
		coreErrIs(t, err, ErrExceedsCapacity, "AcquireWait over capacity")
		// Even while the pool is full.
		h := coreAcquire(t, p, "h", 3)
		_, err = p.AcquireWait(context.Background(), "big", 4)
		coreErrIs(t, err, ErrExceedsCapacity, "AcquireWait over capacity on a full pool")
		h.Release()
		// Free blocks and nobody queued: served at once.
		l, err := p.AcquireWait(context.Background(), "a", 3)
		coreNoErr(t, err, "AcquireWait with room")
		if l.Len() != 3 || l.State() != LeaseActive {
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

// A waiter whose context ends just as it is served either returns the
// lease or holds nothing: a served lease is never dropped on the floor.
// Same for Close racing a release that would serve the waiter.
func TestAcquireWaitServeRaces(t *testing.T) {
	for round := range 300 {
		p := corePool(t, 2)
		h := coreAcquire(t, p, "h", 2)
		ctx, cancel := context.WithCancel(context.Background())
		type result struct {
			l   *Lease[[]byte]
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
			coreErrIs(t, r.err, ErrPoolClosed, "waiter woken by Close")
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

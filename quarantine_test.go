package kvlease

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"

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
// ErrQuarantineBound, which wraps ErrExhausted (issue 11, liveness and
// rough edges).
func TestQuarantineBoundAndStats(t *testing.T) {
	p := newTestPool(t, 8)
	open, tOpen := quarantineN(t, p, "open", 1, true)
	_, tClosed := quarantineN(t, p, "closed", 1, false)
	st := p.Stats()
	require.Equal(t, 2, st.Quarantined)
	require.Equal(t, 1, st.QuarantinedLeased, "the open lease still uses its block")
	require.Equal(t, 0, st.Leased, "one state per block: it counts as Quarantined")
	require.Equal(t, 6, st.Usable)
	require.Equal(t, 6, p.Usable())

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
// it are then served (issue 11, liveness).
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
// quarantine and is served once blocks return (issue 11, liveness).
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
// share of the pool, once per crossing, and when they recover (issue 11,
// liveness).
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

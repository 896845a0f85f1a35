package kvlease

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

// Prefix statistics count queries and hits together, for admitted
// lookups only; refused lookups are counted apart.
func TestPrefixStatsCountAdmittedLookups(t *testing.T) {
	p := newTestPool(t, 4)
	hs := []BlockHash{10, 11, 12}
	a, err := p.Acquire("a", 3)
	require.NoError(t, err)
	for i, h := range hs {
		require.NoError(t, a.Seal(i, h))
	}
	a.Release() // 3 cached, 1 free
	hog, err := p.Acquire("hog", 1)
	require.NoError(t, err)
	// Needs 3 hits + 2 fresh: only 0 free and no other evictable block.
	for range 3 {
		_, _, err := p.AcquirePrefix("r", hs, 5)
		require.ErrorIs(t, err, ErrExceedsCapacity) // 5 > 4: never
	}
	for range 3 {
		_, _, err := p.AcquirePrefix("r", hs, 4)
		require.ErrorIs(t, err, ErrExhausted)
	}
	hog.Release()
	l, hits, err := p.AcquirePrefix("r", hs, 4)
	require.NoError(t, err)
	require.Equal(t, 3, hits)
	st := p.Stats()
	require.EqualValues(t, 3, st.PrefixQueries, "one admitted lookup of 3 blocks")
	require.EqualValues(t, 3, st.PrefixHits)
	require.EqualValues(t, 9, st.PrefixRefused, "three refused lookups of 3 blocks")
	l.Release()
}

// Stats splits Rejections by reason, and counts transfer outcomes,
// quarantines and their lifts (the counters the metrics package exports).
func TestStatsOutcomeCounters(t *testing.T) {
	p := newTestPool(t, 8)

	// Rejections, one of each reason.
	_, err := p.Acquire("", 1)
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = p.Acquire("big", 9)
	require.ErrorIs(t, err, ErrExceedsCapacity)
	hog, err := p.Acquire("hog", 8)
	require.NoError(t, err)
	_, err = p.Acquire("late", 1)
	require.ErrorIs(t, err, ErrExhausted)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = p.AcquireWait(ctx, "patient", 1)
	require.ErrorIs(t, err, context.Canceled)
	hog.Release()

	// Transfers: one resolved, one failed, one quarantined then lifted.
	l, err := p.Acquire("t", 3)
	require.NoError(t, err)
	ok, bad, q := NewTransfer(nil), NewTransfer(nil), NewTransfer(nil)
	require.NoError(t, l.AttachRange(ok, 0, 1, Write))
	require.NoError(t, l.AttachRange(bad, 1, 2, Write))
	require.NoError(t, l.AttachRange(q, 2, 3, Write))
	ok.Resolve(nil)
	bad.Resolve(errors.New("link down"))
	q.Quarantine(nil)
	l.Release()
	_, err = p.Acquire("max", 8)
	require.ErrorIs(t, err, ErrQuarantineBound)
	st := p.Stats()
	require.Equal(t, uint64(1), st.Quarantines)
	require.Equal(t, uint64(0), st.QuarantineLifts)
	q.Resolve(nil) // late evidence
	st = p.Stats()

	require.Equal(t, uint64(5), st.Rejections)
	require.Equal(t, uint64(2), st.RejectedInvalid, "empty owner, more than capacity")
	require.Equal(t, uint64(1), st.RejectedExhausted)
	require.Equal(t, uint64(1), st.RejectedCanceled)
	require.Equal(t, uint64(1), st.RejectedQuarantineBound)
	require.Equal(t, st.Rejections, st.RejectedExhausted+st.RejectedQuarantineBound+st.RejectedCanceled+
		st.RejectedClosed+st.RejectedInvalid+st.RejectedQuota)
	require.Equal(t, uint64(1), st.TransfersResolved)
	require.Equal(t, uint64(1), st.TransfersFailed)
	require.Equal(t, uint64(1), st.TransfersQuarantined, "late evidence does not count a second outcome")
	require.Equal(t, uint64(1), st.Quarantines)
	require.Equal(t, uint64(1), st.QuarantineLifts)
	require.Equal(t, 0, st.Quarantined)

	// Closed pool.
	require.NoError(t, p.Close())
	_, err = p.Acquire("after", 1)
	require.ErrorIs(t, err, ErrPoolClosed)
	require.Equal(t, uint64(1), p.Stats().RejectedClosed)
	require.NoError(t, p.Check())
}

// A leaked lease is counted in Stats.LeakedLeases (the detection needs an
// observer).
func TestStatsLeakedLeases(t *testing.T) {
	p, leaked := lkPool(t, 8, WithLeakCheck(true))
	lkDrop(t, p, "forgetful", 2, false)
	lkGC(t, leaked, "leak report")
	require.Equal(t, uint64(1), p.Stats().LeakedLeases)
}

// Stats counts a block shared in several ways once, in the first state that
// applies: Quarantined, Leased, Draining, Cached, Free.
func TestStatsPrecedence(t *testing.T) {
	p := corePool(t, 4)
	a := coreAcquire(t, p, "a", 2)
	coreNoErr(t, a.Seal(0, 100), "Seal")
	b, hits, err := p.AcquirePrefix("b", []BlockHash{100}, 1)
	coreNoErr(t, err, "AcquirePrefix")
	if hits != 1 || b.Ref(0) != a.Ref(0) {
		t.Fatalf("want a shared block: hits=%d a=%v b=%v", hits, a.Ref(0), b.Ref(0))
	}
	// One block held by two leases is one leased block.
	coreWant(t, p, coreCounts{Free: 2, Leased: 2})

	send := NewTransfer(nil)
	coreNoErr(t, a.AttachRange(send, 0, 1, Read), "AttachRange")
	a.Release()
	// Block 0: open lease b + pending transfer of closed a → Leased.
	coreWant(t, p, coreCounts{Free: 3, Leased: 1})
	if a.State() != LeaseDraining {
		t.Fatalf("a is %v, want draining", a.State())
	}

	send.Quarantine(nil)
	// Quarantined beats Leased.
	coreWant(t, p, coreCounts{Free: 3, Quarantined: 1})
	b.Release()
	coreWant(t, p, coreCounts{Free: 3, Quarantined: 1})
	if b.State() != LeaseSettled {
		t.Fatalf("b is %v, want settled (it holds nothing and nothing gates it)", b.State())
	}

	send.Resolve(nil)
	coreWant(t, p, coreCounts{Free: 3, Cached: 1})

	// Draining beats Cached: a sealed block still being read after release.
	c, hits, err := p.AcquirePrefix("c", []BlockHash{100}, 1)
	coreNoErr(t, err, "AcquirePrefix")
	if hits != 1 {
		t.Fatalf("hits = %d", hits)
	}
	coreWant(t, p, coreCounts{Free: 3, Leased: 1})
	rd := NewTransfer(nil)
	coreNoErr(t, c.AttachRange(rd, 0, 1, Read), "AttachRange")
	c.Release()
	coreWant(t, p, coreCounts{Free: 3, Draining: 1})
	rd.Resolve(nil)
	coreWant(t, p, coreCounts{Free: 3, Cached: 1})
}

// InUse counts the blocks open leases hold, quarantined ones included.
func TestStatsInUse(t *testing.T) {
	mem, _ := NewHostMemory(8, 64)
	p, err := NewPool[[]byte](mem)
	if err != nil {
		t.Fatal(err)
	}
	a, _ := p.Acquire("a", 3)
	b, _ := p.Acquire("b", 2)
	tr := NewTransfer(nil)
	if err := b.AttachRange(tr, 0, 2, Write); err != nil {
		t.Fatal(err)
	}
	tr.Quarantine(nil)
	st := p.Stats()
	if st.Leased != 3 || st.QuarantinedLeased != 2 || st.Leased+st.QuarantinedLeased != 5 {
		t.Fatalf("leased %d quarantined-leased %d in use %d", st.Leased, st.QuarantinedLeased, st.Leased+st.QuarantinedLeased)
	}
	a.Release()
	b.Release()
	if st := p.Stats(); st.Leased+st.QuarantinedLeased != 0 {
		t.Fatalf("in use %d after release", st.Leased+st.QuarantinedLeased)
	}
	tr.Resolve(nil)
}

package kvlease

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

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
		st.RejectedClosed+st.RejectedInvalid)
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

package kvlease

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// A long-lived lease that attaches and resolves a transfer every decode
// step keeps no record of resolved transfers: what it retains is bounded
// by the transfers still live (issue 11, bug 2).
func TestResolvedAttachmentsReclaimed(t *testing.T) {
	p := newTestPool(t, 16, WithLeakCheck(false))
	l, err := p.Acquire("long", 4)
	require.NoError(t, err)
	retained := func() (live int32, capMore int) {
		p.mu.Lock()
		defer p.mu.Unlock()
		if l.ls.extra != nil {
			capMore = cap(l.ls.extra.more)
		}
		return l.ls.natts, capMore
	}
	// One step at a time, with every kind of attachment and outcome.
	for step := range 30000 {
		tr := NewTransfer(nil)
		switch step % 4 {
		case 0:
			require.NoError(t, l.Attach(tr))
		case 1:
			require.NoError(t, l.AttachRange(tr, 1, 3, Write))
		case 2:
			require.NoError(t, l.AttachRange(tr, 0, 4, Read))
			require.NoError(t, l.AttachRange(tr, 2, 3, Read)) // twice on one lease
		case 3:
			require.NoError(t, l.AttachRange(tr, 0, 2, Write))
			tr.Quarantine(nil)
		}
		tr.Resolve(nil)
		live, capMore := retained()
		require.Zero(t, live, "step %d", step)
		require.LessOrEqual(t, capMore, 8, "step %d", step)
	}
	// A burst: many pending at once, then resolved in arrival order.
	var trs []*Transfer
	for i := range 1000 {
		tr := NewTransfer(nil)
		require.NoError(t, l.AttachRange(tr, i%4, i%4+1, Read))
		trs = append(trs, tr)
	}
	live, _ := retained()
	require.EqualValues(t, 1000, live)
	require.NoError(t, l.Extend(1), "O(live) and still correct")
	for i, tr := range trs {
		tr.Resolve(nil)
		if i == 499 {
			live, capMore := retained()
			require.EqualValues(t, 500, live)
			require.Less(t, capMore, 2100)
		}
	}
	live, capMore := retained()
	require.Zero(t, live)
	require.LessOrEqual(t, capMore, 8, "the burst's records are given back")
	// Mixed: a pending whole-lease transfer still gates blocks Extend adds.
	keep := NewTransfer(nil)
	require.NoError(t, l.Attach(keep))
	for range 100 {
		tr := NewTransfer(nil)
		require.NoError(t, l.Attach(tr))
		tr.Resolve(nil)
	}
	require.NoError(t, l.Extend(1))
	live, _ = retained()
	require.EqualValues(t, 1, live)
	l.Release()
	require.Equal(t, LeaseDraining, l.State())
	require.Equal(t, 6, p.Stats().Draining, "keep gates all six blocks, the extended ones too")
	keep.Resolve(nil)
	require.Equal(t, LeaseSettled, l.State())
	require.Equal(t, 16, p.Stats().Free)
}

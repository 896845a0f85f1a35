package kvlease

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// A long-lived lease that attaches and resolves a transfer every decode
// step keeps no record of resolved transfers: what it retains is bounded
// by the transfers still live.
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

// Attach gates every block, including blocks Extend adds later: as a
// Write on unsealed blocks and a Read on sealed ones.
func TestAttachGatesExtendedBlocks(t *testing.T) {
	p := corePool(t, 8)
	a := coreAcquire(t, p, "a", 2)
	coreNoErr(t, a.Seal(0, 1), "Seal")
	a.Release() // block with hash 1 is cached now
	l, hits, err := p.AcquirePrefix("l", []BlockHash{1}, 2)
	coreNoErr(t, err, "AcquirePrefix")
	if hits != 1 {
		t.Fatalf("hits = %d", hits)
	}
	tr := NewTransfer(nil)
	coreNoErr(t, l.Attach(tr), "Attach")
	// Read on the sealed hit: it keeps serving hits.
	if n := p.CachedPrefix([]BlockHash{1}); n != 1 {
		t.Fatalf("CachedPrefix of a block read by a pending transfer = %d, want 1", n)
	}
	// Write on the unsealed block: no Seal while the transfer writes it.
	coreErrIs(t, l.Seal(1, 2), ErrInvalidArgument, "Seal of a block under a pending whole Attach")

	coreNoErr(t, l.Extend(3), "Extend")
	for i := 2; i < 5; i++ {
		coreErrIs(t, l.Seal(i, BlockHash(100+i)), ErrInvalidArgument, "Seal of an extended block under Attach")
	}
	l.Release()
	coreWant(t, p, coreCounts{Free: 3, Draining: 5})
	if l.State() != LeaseDraining {
		t.Fatalf("state %v", l.State())
	}
	select {
	case <-l.Settled():
		t.Fatal("settled while a transfer gates every block")
	default:
	}
	tr.Resolve(nil)
	<-l.Settled()
	coreWant(t, p, coreCounts{Free: 7, Cached: 1})

	// Quarantine reaches extended blocks too.
	m := coreAcquire(t, p, "m", 1)
	q := NewTransfer(nil)
	coreNoErr(t, m.Attach(q), "Attach")
	q.Quarantine(nil)
	coreNoErr(t, m.Extend(2), "Extend while quarantined")
	if m.State() != LeaseQuarantined {
		t.Fatalf("state %v", m.State())
	}
	coreWant(t, p, coreCounts{Free: 4, Cached: 1, Quarantined: 3})
	m.Release()
	coreWant(t, p, coreCounts{Free: 4, Cached: 1, Quarantined: 3})
	q.Resolve(nil)
	coreAllFree(t, p)
}

// AttachRange ranges are fixed: blocks Extend adds are not in them.
func TestAttachRangeFixed(t *testing.T) {
	p := corePool(t, 8)
	l := coreAcquire(t, p, "l", 2)
	tr := NewTransfer(nil)
	coreNoErr(t, l.AttachRange(tr, 0, 2, Write), "AttachRange")
	coreNoErr(t, l.Extend(2), "Extend")
	coreNoErr(t, l.Seal(2, 9), "Seal of an extended block outside the range")
	coreErrIs(t, l.Seal(1, 8), ErrInvalidArgument, "Seal of a block under a pending write")
	l.Release()
	coreWant(t, p, coreCounts{Free: 5, Cached: 1, Draining: 2})
	tr.Resolve(nil)
	coreWant(t, p, coreCounts{Free: 7, Cached: 1})
}

func TestAttachMisuse(t *testing.T) {
	p := corePool(t, 4)
	l := coreAcquire(t, p, "l", 3)
	coreNoErr(t, l.Seal(2, 77), "Seal")
	tr := NewTransfer(nil)
	for _, c := range []struct {
		from, to int
		a        Access
	}{
		{-1, 1, Read}, {0, 4, Read}, {2, 1, Write}, {4, 4, Read},
		{-1, -1, Write}, {0, 1, 0}, {0, 1, 99},
		{0, 3, Write}, {2, 3, Write}, // Write over a sealed block
	} {
		coreErrIs(t, l.AttachRange(tr, c.from, c.to, c.a), ErrInvalidArgument, "bad AttachRange")
	}
	coreErrIs(t, l.AttachRange(nil, 0, 1, Read), ErrInvalidArgument, "AttachRange(nil)")
	coreErrIs(t, l.Attach(nil), ErrInvalidArgument, "Attach(nil)")
	// Nothing was attached: the lease settles at once.
	coreWant(t, p, coreCounts{Free: 1, Leased: 3})
	l.Release()
	if l.State() != LeaseSettled {
		t.Fatalf("refused attachments gate the lease: %v", l.State())
	}
	coreWant(t, p, coreCounts{Free: 3, Cached: 1})
	if tr.State() != TransferPending {
		t.Fatalf("transfer %v", tr.State())
	}
	// Attach after close.
	coreErrIs(t, l.Attach(tr), ErrLeaseClosed, "Attach after Release")
	coreErrIs(t, l.AttachRange(tr, 0, 1, Read), ErrLeaseClosed, "AttachRange after Release")
	m := coreAcquire(t, p, "m", 1)
	m.Abort(nil)
	coreErrIs(t, m.Attach(tr), ErrLeaseClosed, "Attach after Abort")
	coreErrIs(t, m.AttachRange(tr, 0, 1, Write), ErrLeaseClosed, "AttachRange after Abort")
	coreAllFree(t, p)
	tr.Resolve(nil)
	coreAllFree(t, p)
}

// An empty range, and an already resolved transfer, gate nothing.
func TestAttachGatesNothing(t *testing.T) {
	p := corePool(t, 4)
	l := coreAcquire(t, p, "l", 2)
	pending := NewTransfer(nil)
	coreNoErr(t, l.AttachRange(pending, 1, 1, Write), "empty range")
	coreNoErr(t, l.AttachRange(pending, 0, 0, Read), "empty range at 0")
	coreNoErr(t, l.AttachRange(pending, 2, 2, Write), "empty range at Len")
	done := NewTransfer(nil)
	done.Resolve(nil)
	coreNoErr(t, l.Attach(done), "Attach of a resolved transfer")
	coreNoErr(t, l.AttachRange(done, 0, 2, Write), "AttachRange of a resolved transfer")
	coreNoErr(t, l.Seal(0, 5), "Seal: nothing is writing")
	l.Release()
	if l.State() != LeaseSettled {
		t.Fatalf("state %v: something gates the lease", l.State())
	}
	<-l.Settled()
	coreWant(t, p, coreCounts{Free: 3, Cached: 1})
	pending.Resolve(nil)
}

// A Write over a sealed block is refused whatever the transfer's state:
// DESIGN.md says so without exception, and the range and access checks
// already come before the "resolved gates nothing" rule.
func TestAttachResolvedWriteOverSealed(t *testing.T) {
	p := corePool(t, 2)
	l := coreAcquire(t, p, "l", 1)
	coreNoErr(t, l.Seal(0, 1), "Seal")
	done := NewTransfer(nil)
	done.Resolve(nil)
	coreErrIs(t, l.AttachRange(done, 0, 1, Write), ErrInvalidArgument,
		"AttachRange(resolved transfer, Write) over a sealed block")
	q := NewTransfer(nil)
	q.Quarantine(nil)
	coreErrIs(t, l.AttachRange(q, 0, 1, Write), ErrInvalidArgument,
		"AttachRange(quarantined transfer, Write) over a sealed block")
	l.Release()
	q.Resolve(nil)
	coreAllFree(t, p)
}

// A pending Read range on an open lease pins nothing until the lease gives
// its blocks back (release's one pass, or TrimTo), and the counts come out
// as if it had pinned at attach: resolved while open, nothing drains;
// trimmed, the trimmed blocks drain; quarantined while open, the blocks
// are quarantined at once.
func TestReadAttachPinsAtRelease(t *testing.T) {
	p := newTestPool(t, 8)
	counts := func(want string) {
		t.Helper()
		require.NoError(t, p.Check())
		st := p.Stats()
		got := fmt.Sprintf("free %d leased %d draining %d quarantined %d", st.Free, st.Leased, st.Draining, st.Quarantined)
		require.Equal(t, want, got)
	}

	a, err := p.Acquire("a", 4)
	require.NoError(t, err)
	ta := NewTransfer(nil)
	require.NoError(t, a.AttachRange(ta, 0, 4, Read))
	require.True(t, ta.Resolve(nil)) // while open: nothing to unpin
	a.Release()
	counts("free 8 leased 0 draining 0 quarantined 0")
	require.Equal(t, LeaseSettled, a.State())

	b, err := p.Acquire("b", 4)
	require.NoError(t, err)
	tb := NewTransfer(nil)
	require.NoError(t, b.AttachRange(tb, 0, 4, Read))
	require.NoError(t, b.TrimTo(2))
	counts("free 4 leased 2 draining 2 quarantined 0")
	b.Release()
	counts("free 4 leased 0 draining 4 quarantined 0")
	require.True(t, tb.Resolve(nil))
	counts("free 8 leased 0 draining 0 quarantined 0")

	c, err := p.Acquire("c", 2)
	require.NoError(t, err)
	tc := NewTransfer(nil)
	require.NoError(t, c.AttachRange(tc, 0, 2, Read))
	tc.Quarantine(nil)
	counts("free 6 leased 0 draining 0 quarantined 2")
	require.Equal(t, 2, p.Stats().QuarantinedLeased)
	c.Release()
	counts("free 6 leased 0 draining 0 quarantined 2")
	require.True(t, tc.Resolve(nil))
	counts("free 8 leased 0 draining 0 quarantined 0")

	// Two ranges, one of them a write: the read's pins are applied at
	// release beside the write's.
	d, err := p.Acquire("d", 4)
	require.NoError(t, err)
	r, w := NewTransfer(nil), NewTransfer(nil)
	require.NoError(t, d.AttachRange(r, 0, 2, Read))
	require.NoError(t, d.AttachRange(w, 2, 4, Write))
	d.Release()
	counts("free 4 leased 0 draining 4 quarantined 0")
	require.True(t, r.Resolve(nil))
	counts("free 6 leased 0 draining 2 quarantined 0")
	require.True(t, w.Resolve(nil))
	counts("free 8 leased 0 draining 0 quarantined 0")
}

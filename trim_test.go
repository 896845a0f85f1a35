package kvlease

import (
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestTrimIndicesStayAbsolute(t *testing.T) {
	p := corePool(t, 8)
	l := coreAcquire(t, p, "sw", 4)
	refs := []BlockRef{l.Ref(0), l.Ref(1), l.Ref(2), l.Ref(3)}

	require.NoError(t, l.TrimTo(2))
	require.Equal(t, 4, l.Len(), "Len counts trimmed positions")
	require.Equal(t, 2, l.Trimmed())
	for i, r := range refs {
		require.Equal(t, r, l.Ref(i), "Ref(%d) answers after a trim", i)
	}
	coreWant(t, p, coreCounts{Free: 6, Leased: 2})
	_, err := p.Region(refs[0])
	require.ErrorIs(t, err, ErrStaleRef, "a trimmed, unsealed block is free")

	_, err = l.Region(1)
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = l.Region(2)
	require.NoError(t, err)
	_, err = l.AppendRegions(nil, 1, 4)
	require.ErrorIs(t, err, ErrInvalidArgument)
	rs, err := l.AppendRegions(nil, 2, 4)
	require.NoError(t, err)
	require.Len(t, rs, 2)
	require.Equal(t, []BlockID{refs[2].ID, refs[3].ID}, l.AppendBlockIDs(nil, 2))
	require.Empty(t, l.AppendBlockIDs(nil, 4))
	corePanics(t, "AppendBlockIDs below Trimmed", func() { l.AppendBlockIDs(nil, 1) })
	corePanics(t, "AppendBlockIDs past Len", func() { l.AppendBlockIDs(nil, 5) })

	tr := NewTransfer(nil)
	require.ErrorIs(t, l.AttachRange(tr, 1, 3, Read), ErrInvalidArgument)
	require.ErrorIs(t, l.Seal(1, 7), ErrInvalidArgument)
	_, err = l.Share("beam", 3)
	require.ErrorIs(t, err, ErrInvalidArgument, "Share refuses a trimmed lease")

	// No-ops, errors that change nothing.
	require.NoError(t, l.TrimTo(1))
	require.NoError(t, l.TrimTo(2))
	require.ErrorIs(t, l.TrimTo(5), ErrInvalidArgument)
	require.ErrorIs(t, l.TrimTo(-1), ErrInvalidArgument)
	require.Equal(t, 2, l.Trimmed())

	// Extend appends at the absolute end.
	require.NoError(t, l.Extend(1))
	require.Equal(t, 5, l.Len())
	require.Len(t, l.AppendBlockIDs(nil, 2), 3)

	// Trim everything: open, holds nothing, may grow again.
	require.NoError(t, l.TrimTo(5))
	coreWant(t, p, coreCounts{Free: 8})
	require.Equal(t, LeaseActive, l.State())
	require.NoError(t, l.Extend(2))
	coreWant(t, p, coreCounts{Free: 6, Leased: 2})
	l.Release()
	require.ErrorIs(t, l.TrimTo(6), ErrLeaseClosed)
	require.Equal(t, 7, l.Len())
	coreAllFree(t, p)
}

// A long request with a short window never outgrows the pool: Extend
// counts held blocks only.
func TestTrimExtendCountsHeldBlocks(t *testing.T) {
	p := corePool(t, 4)
	l := coreAcquire(t, p, "sw", 4)
	for step := range 20 {
		require.NoError(t, l.TrimTo(l.Len()-2), "step %d", step)
		require.NoError(t, l.Extend(2), "step %d", step)
		coreConsistent(t, p)
	}
	require.Equal(t, 44, l.Len())
	require.ErrorIs(t, l.Extend(3), ErrExceedsCapacity)
	l.Release()
	coreAllFree(t, p)
}

// Trimmed blocks follow the rules of a release: a pending transfer keeps
// them draining, a quarantined one keeps them quarantined until late
// evidence, and Abort cancels transfers that gate only trimmed blocks.
func TestTrimUnderTransfers(t *testing.T) {
	p := corePool(t, 8)
	l := coreAcquire(t, p, "sw", 4)
	send := NewTransfer(nil)
	require.NoError(t, l.AttachRange(send, 0, 2, Read))
	whole := NewTransfer(nil)
	require.NoError(t, l.Attach(whole))

	require.NoError(t, l.TrimTo(3))
	// Blocks 0..2 are gated: they drain. Block 3 is leased.
	coreWant(t, p, coreCounts{Free: 4, Leased: 1, Draining: 3})
	require.Equal(t, LeaseActive, l.State())

	require.True(t, whole.Resolve(nil))
	// Block 2 was gated by whole alone; 0 and 1 still by send.
	coreWant(t, p, coreCounts{Free: 5, Leased: 1, Draining: 2})

	send.Quarantine(nil)
	coreWant(t, p, coreCounts{Free: 5, Leased: 1, Quarantined: 2})
	require.Equal(t, LeaseQuarantined, l.State())
	require.True(t, send.Resolve(nil), "late evidence")
	coreWant(t, p, coreCounts{Free: 7, Leased: 1})
	require.Equal(t, LeaseActive, l.State())

	// A whole attachment made after the trim gates the held blocks only;
	// its resolve must not touch the trimmed ones.
	after := NewTransfer(nil)
	require.NoError(t, l.Attach(after))
	require.NoError(t, l.Extend(1))
	require.NoError(t, l.TrimTo(4))
	coreWant(t, p, coreCounts{Free: 6, Leased: 1, Draining: 1})
	require.True(t, after.Resolve(nil))
	coreWant(t, p, coreCounts{Free: 7, Leased: 1})

	// Abort cancels a transfer that gates only trimmed blocks.
	cancelled := 0
	old := NewTransfer(func() { cancelled++ })
	require.NoError(t, l.AttachRange(old, 4, 5, Read))
	require.NoError(t, l.TrimTo(5))
	coreWant(t, p, coreCounts{Free: 7, Draining: 1})
	l.Abort(nil)
	require.Equal(t, 1, cancelled)
	require.Equal(t, LeaseDraining, l.State())
	require.True(t, old.Resolve(nil))
	require.Equal(t, LeaseSettled, l.State())
	coreAllFree(t, p)
}

// A sealed block given back stays cached and serves prefix hits.
func TestTrimSealedStaysCached(t *testing.T) {
	p := corePool(t, 4)
	l := coreAcquire(t, p, "sw", 3)
	require.NoError(t, l.Seal(0, 11))
	require.NoError(t, l.Seal(1, 12))
	require.NoError(t, l.TrimTo(2))
	coreWant(t, p, coreCounts{Free: 1, Cached: 2, Leased: 1})
	l2, hits, err := p.AcquirePrefix("next", []BlockHash{11, 12}, 2)
	require.NoError(t, err)
	require.Equal(t, 2, hits)
	require.Equal(t, l.Ref(0), l2.Ref(0), "same slot, same generation")
	l.Release()
	l2.Release()
	coreConsistent(t, p)
}

func TestTrimObserved(t *testing.T) {
	var mu sync.Mutex
	var got []Event
	p := corePool(t, 4, WithObserver(ObserverFunc(func(e Event) {
		if e.Kind == EventTrimmed {
			mu.Lock()
			got = append(got, e)
			mu.Unlock()
		}
	})))
	l := coreAcquire(t, p, "sw", 3)
	require.NoError(t, l.TrimTo(2))
	require.NoError(t, l.TrimTo(2)) // no-op: no event
	l.Release()
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, got, 1)
	require.Equal(t, 2, got[0].Blocks)
	require.Equal(t, l.ID(), got[0].Lease)
	require.Equal(t, "trimmed", got[0].Kind.String())
}

// Trim races Abort, Extend and a transfer's resolve; the pool stays
// consistent and every block comes back. Run with -race -count=20.
func TestTrimConcurrent(t *testing.T) {
	p := corePool(t, 64)
	for round := range 50 {
		l := coreAcquire(t, p, "sw", 8)
		tr := NewTransfer(nil)
		require.NoError(t, l.AttachRange(tr, 0, 6, Read))
		var wg sync.WaitGroup
		wg.Add(4)
		go func() {
			defer wg.Done()
			for i := 1; i <= 8; i++ {
				if err := l.TrimTo(i); err != nil && !errors.Is(err, ErrLeaseClosed) {
					t.Errorf("TrimTo: %v", err)
				}
			}
		}()
		go func() {
			defer wg.Done()
			if err := l.Extend(2); err != nil && !errors.Is(err, ErrLeaseClosed) {
				t.Errorf("Extend: %v", err)
			}
		}()
		go func() { defer wg.Done(); tr.Resolve(nil) }()
		go func() {
			defer wg.Done()
			if round%2 == 0 {
				l.Abort(nil)
			} else {
				l.Release()
			}
		}()
		wg.Wait()
		<-l.Settled()
		coreAllFree(t, p)
	}
}

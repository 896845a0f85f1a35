package kvlease

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// SealTokens refuses a partial block in every mode.
func TestSealTokensRefusesPartialBlock(t *testing.T) {
	for _, opts := range [][]Option{{WithBlockTokens(16)}, {WithVerifiedPrefix(16)}, {WithBlockTokens(16), WithKVEvents(8)}, nil} {
		p := newTestPool(t, 2, opts...)
		l, err := p.Acquire("a", 1)
		require.NoError(t, err)
		_, err = l.SealTokens(0, 1, prompt(1, 3))
		require.ErrorIs(t, err, ErrInvalidArgument, "3 tokens of a 16-token block")
		_, err = l.SealTokens(0, 1, prompt(1, 17))
		require.ErrorIs(t, err, ErrInvalidArgument, "more than a block")
		if p.cfg.kvEvents > 0 {
			evs, _ := p.DrainKVEvents(nil)
			require.Empty(t, evs, "nothing published")
		}
		if opts != nil {
			_, err = l.SealTokens(0, 1, prompt(1, 16))
			require.NoError(t, err)
		} else {
			_, err = l.SealTokens(0, 1, prompt(1, 16))
			require.ErrorIs(t, err, ErrInvalidArgument, "no block size: SealTokens cannot tell")
		}
		l.Release()
	}
}

// Seal refuses a block with a pending or quarantined write, and a re-seal
// with a different hash; a pending read is fine.
func TestSealUnderTransfers(t *testing.T) {
	p := corePool(t, 4)
	l := coreAcquire(t, p, "l", 3)
	w := NewTransfer(nil)
	r := NewTransfer(nil)
	coreNoErr(t, l.AttachRange(w, 0, 1, Write), "write")
	coreNoErr(t, l.AttachRange(r, 1, 2, Read), "read")
	coreErrIs(t, l.Seal(0, 1), ErrInvalidArgument, "Seal with a pending write")
	coreNoErr(t, l.Seal(1, 2), "Seal with a pending read")
	coreNoErr(t, l.Seal(1, 2), "Seal again with the same hash")
	coreErrIs(t, l.Seal(1, 3), ErrInvalidArgument, "re-Seal with another hash")
	for _, i := range []int{-1, 3} {
		coreErrIs(t, l.Seal(i, 4), ErrInvalidArgument, "Seal out of range")
	}
	w.Quarantine(nil)
	coreErrIs(t, l.Seal(0, 1), ErrInvalidArgument, "Seal with a quarantined write")
	w.Resolve(nil)
	coreNoErr(t, l.Seal(0, 1), "Seal once the write resolved")
	r.Resolve(nil)
	l.Release()
	coreErrIs(t, l.Seal(2, 9), ErrLeaseClosed, "Seal after Release")
	coreWant(t, p, coreCounts{Free: 2, Cached: 2})
}

func TestSealRules(t *testing.T) {
	var seen []Event
	p := newTestPool(t, 8, WithObserver(ObserverFunc(func(e Event) { seen = append(seen, e) })))
	l, err := p.Acquire("a", 3)
	require.NoError(t, err)
	require.ErrorIs(t, l.Seal(3, 1), ErrInvalidArgument)
	require.ErrorIs(t, l.Seal(-1, 1), ErrInvalidArgument)
	require.NoError(t, l.Seal(0, 7))
	require.NoError(t, l.Seal(0, 7), "same hash again is a no-op")
	require.ErrorIs(t, l.Seal(0, 8), ErrInvalidArgument, "re-sealing with another hash")

	w := NewTransfer(nil)
	require.NoError(t, l.AttachRange(w, 1, 2, Write))
	require.ErrorIs(t, l.Seal(1, 9), ErrInvalidArgument, "a pending write")
	w.Quarantine(nil)
	require.ErrorIs(t, l.Seal(1, 9), ErrInvalidArgument, "a quarantined write: content unknown")
	w.Resolve(nil)
	require.NoError(t, l.Seal(1, 9))
	require.ErrorIs(t, l.AttachRange(NewTransfer(nil), 0, 2, Write), ErrInvalidArgument, "no write over sealed content")

	// A second block with a taken hash is sealed but private.
	b, err := p.Acquire("b", 1)
	require.NoError(t, err)
	require.NoError(t, b.Seal(0, 7))
	require.EqualValues(t, 1, p.Stats().DuplicateSeals)
	require.True(t, slices.ContainsFunc(seen, func(e Event) bool { return e.Kind == EventDuplicateSeal }))
	b.Release()
	require.Equal(t, 0, p.Stats().Cached, "a private sealed block is free once unreferenced")
	l.Release()
	require.Equal(t, 2, p.Stats().Cached)
	require.ErrorIs(t, l.Seal(2, 10), ErrLeaseClosed)
	h, hits, err := p.AcquirePrefix("c", []BlockHash{7, 9}, 2)
	require.NoError(t, err)
	require.Equal(t, 2, hits)
	h.Release()
}

func TestShare(t *testing.T) {
	p := newTestPool(t, 8)
	hs := ChainHashes(1, prompt(1, 32), 16)
	a, err := p.Acquire("a", 3)
	require.NoError(t, err)
	require.NoError(t, a.Seal(0, hs[0]))
	_, err = a.Share("beam", 2)
	require.ErrorIs(t, err, ErrInvalidArgument, "block 1 is not sealed")
	require.NoError(t, a.Seal(1, hs[1]))
	_, err = a.Share("", 2)
	require.ErrorIs(t, err, ErrInvalidArgument)
	_, err = a.Share("beam", 4)
	require.ErrorIs(t, err, ErrInvalidArgument)
	b, err := a.Share("beam", 2)
	require.NoError(t, err)
	require.Equal(t, a.Ref(0), b.Ref(0))
	require.Equal(t, a.Ref(1), b.Ref(1))
	require.NoError(t, b.Extend(1))
	require.Equal(t, 4, p.Stats().Leased)
	a.Release()
	require.Equal(t, 3, p.Stats().Leased)
	_, err = a.Share("late", 1)
	require.ErrorIs(t, err, ErrLeaseClosed)
	b.Release()
	require.Equal(t, 2, p.Stats().Cached)
	require.Equal(t, 6, p.Stats().Free)
}

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

// SealInfo reports the one seal record: parent, chained, tokens, for
// every way of sealing; nothing for a pool without records, a stale ref
// or an unsealed block.
func TestSealInfo(t *testing.T) {
	for _, opts := range [][]Option{{WithBlockTokens(4), WithSealRecords()}, {WithBlockTokens(4), WithKVEvents(16)}, {WithVerifiedPrefix(4)}} {
		p := newTestPool(t, 4, opts...)
		require.True(t, p.Stats().SealRecords)
		l, err := p.Acquire("a", 3)
		require.NoError(t, err)
		toks := prompt(1, 4)
		h0, err := l.SealTokens(0, 7, toks)
		require.NoError(t, err)
		_, ok := p.SealInfo(l.Ref(1), nil)
		require.False(t, ok, "block 1 is not sealed")
		buf := make([]int32, 0, 4)
		info, ok := p.SealInfo(l.Ref(0), buf)
		require.True(t, ok)
		require.Equal(t, SealInfo{Hash: h0, Parent: 7, HasParent: true, Chained: false, Tokens: toks}, info)
		require.Same(t, &buf[:1][0], &info.Tokens[0], "the tokens go into the caller's buffer")
		require.Zero(t, testing.AllocsPerRun(10, func() { p.SealInfo(l.Ref(0), buf) }), "no allocation with room")
		if !p.verified {
			// A plain Seal after a sealed block: the parent is that block.
			require.NoError(t, l.Seal(1, 99))
			info, ok = p.SealInfo(l.Ref(1), nil)
			require.True(t, ok)
			require.Equal(t, SealInfo{Hash: 99, Parent: h0, HasParent: true, Chained: true}, info)
		}
		stale := l.Ref(0)
		l.Release()
		// Evict everything: the slots move on to new generations.
		l2, err := p.Acquire("b", 4)
		require.NoError(t, err)
		_, ok = p.SealInfo(stale, nil)
		require.False(t, ok, "a stale ref")
		_, ok = p.SealInfo(BlockRef{ID: 9}, nil)
		require.False(t, ok, "outside the pool")
		l2.Release()
	}
	p := newTestPool(t, 2, WithBlockTokens(4))
	require.False(t, p.Stats().SealRecords)
	l, err := p.Acquire("a", 1)
	require.NoError(t, err)
	_, err = l.SealTokens(0, 7, prompt(1, 4))
	require.NoError(t, err)
	_, ok := p.SealInfo(l.Ref(0), nil)
	require.False(t, ok, "a pool without records reports none")
	l.Release()
}

// SealAs seals a copy as its original was sealed: the two pools' records
// agree, with or without tokens, and a refused SealInfo is an
// ErrInvalidArgument.
func TestSealAs(t *testing.T) {
	src := newTestPool(t, 4, WithBlockTokens(4), WithSealRecords())
	dst := newTestPool(t, 4, WithBlockTokens(4), WithKVEvents(16))
	sl, err := src.Acquire("a", 2)
	require.NoError(t, err)
	h0, err := sl.SealTokens(0, 7, prompt(1, 4))
	require.NoError(t, err)
	h1, err := sl.SealTokens(1, h0, prompt(5, 4))
	require.NoError(t, err)
	i1, ok := src.SealInfo(sl.Ref(1), nil)
	require.True(t, ok)
	dl, err := dst.Acquire("copy", 3)
	require.NoError(t, err)
	// Block 0 of the copy's lease, yet its record (and event) names its parent.
	require.NoError(t, dl.SealAs(0, i1))
	got, ok := dst.SealInfo(dl.Ref(0), nil)
	require.True(t, ok)
	require.Equal(t, i1, got)
	evs, _ := dst.DrainKVEvents(nil)
	require.Len(t, evs, 1)
	require.True(t, evs[0].HasParent)
	require.Equal(t, h0, evs[0].ParentBlockHash)
	require.Equal(t, h1, evs[0].BlockHash)

	// Known parent, no tokens: the parent is recorded all the same.
	noTok := SealInfo{Hash: 1234, Parent: h1, HasParent: true, Chained: true}
	require.NoError(t, dl.SealAs(1, noTok))
	got, ok = dst.SealInfo(dl.Ref(1), nil)
	require.True(t, ok)
	require.Equal(t, noTok, got)

	bad := i1
	bad.Hash++
	require.ErrorIs(t, dl.SealAs(2, bad), ErrInvalidArgument, "tokens that do not hash to Hash")
	require.ErrorIs(t, dl.SealAs(2, SealInfo{Hash: 5, Tokens: prompt(1, 4)}), ErrInvalidArgument, "tokens without a parent")
	require.ErrorIs(t, dl.SealAs(2, SealInfo{Hash: 5, Parent: 1, HasParent: true, Tokens: prompt(1, 3)}), ErrInvalidArgument, "a partial block")
	require.NoError(t, dl.SealAs(2, SealInfo{Hash: 5}), "no parent: a plain Seal")

	v := newTestPool(t, 2, WithVerifiedPrefix(4))
	vl, err := v.Acquire("v", 1)
	require.NoError(t, err)
	require.ErrorIs(t, vl.SealAs(0, noTok), ErrInvalidArgument, "verified mode needs the tokens")
	require.NoError(t, vl.SealAs(0, i1))
	vl.Release()
	sl.Release()
	dl.Release()
}

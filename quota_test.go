package kvlease

import (
	"context"
	"errors"
	"strings"
	"testing"
	"testing/synctest"

	"github.com/stretchr/testify/require"
)

// tenant registers name on p, with quota q.
func tenant(t testing.TB, p *Pool[[]byte], name string, q Quota) *Tenant[[]byte] {
	t.Helper()
	tn, err := p.Tenant(name)
	require.NoError(t, err)
	require.NoError(t, tn.SetQuota(q))
	return tn
}

// cacheAs acquires n blocks as tenant tn (nil: none), seals each with
// base+k and releases them: n cached blocks charged to tn.
func cacheAs(t testing.TB, p *Pool[[]byte], tn *Tenant[[]byte], n int, base BlockHash) []BlockHash {
	t.Helper()
	var l *Lease[[]byte]
	var err error
	if tn == nil {
		l, err = p.Acquire("none", n)
	} else {
		l, err = tn.Acquire(tn.name, n)
	}
	require.NoError(t, err)
	hs := make([]BlockHash, n)
	for k := range hs {
		hs[k] = base + BlockHash(k)
		require.NoError(t, l.Seal(k, hs[k]))
	}
	l.Release()
	return hs
}

// A cap: a tenant's acquires beyond it are refused with ErrQuota (which
// wraps ErrExhausted and names the cap), holding nothing; a tenant at its
// cap takes its own least recently cached blocks first, even with free
// blocks left, and nobody else's.
func TestQuotaCap(t *testing.T) {
	p := newTestPool(t, 32)
	a := tenant(t, p, "a", Quota{Cap: 8})
	b := tenant(t, p, "b", Quota{})
	bh := cacheAs(t, p, b, 4, 100)

	l, err := a.Acquire("a1", 8)
	require.NoError(t, err)
	before := p.Stats()
	_, err = a.Acquire("a2", 1)
	require.ErrorIs(t, err, ErrQuota)
	require.ErrorIs(t, err, ErrExhausted, "callers that retry on ErrExhausted still do")
	require.Contains(t, err.Error(), `tenant "a": its cap of 8 blocks leaves room for 0`)
	after := p.Stats()
	require.Equal(t, before.Free, after.Free, "a refusal holds nothing")
	require.Equal(t, before.Leased, after.Leased)
	require.Equal(t, uint64(1), after.RejectedQuota)
	require.Equal(t, uint64(1), tenantLine(a).Rejected)
	l.Release() // unsealed: free, uncharged
	require.Equal(t, 0, tenantLine(a).Held)

	ah := cacheAs(t, p, a, 8, 200) // a at its cap, all of it cached
	require.Equal(t, TenantStats{Tenant: "a", Quota: Quota{Cap: 8}, Held: 8, Cached: 8, Rejected: 1}, tenantLine(a))
	_, _ = p.DrainKVEvents(nil)
	l, err = a.Acquire("a3", 3)
	require.NoError(t, err, "its own cached blocks make the room")
	// Its own, least recently cached first (a chain leaves from its end),
	// though 20 blocks are free; b's are untouched.
	require.Equal(t, 3, p.CachedPrefix(bh[:3]))
	require.Equal(t, 4, p.CachedPrefix(bh))
	require.Equal(t, 5, p.CachedPrefix(ah), "a's first five blocks stay cached")
	require.Equal(t, 20, p.Stats().Free)
	st := tenantLine(a)
	require.Equal(t, 8, st.Held)
	require.Equal(t, 5, st.Cached)
	require.Equal(t, uint64(3), st.EvictedOwn)
	require.Equal(t, uint64(0), tenantLine(b).Evicted)
	// Room is what its cached blocks leave: 5 more, not 6.
	_, err = a.Acquire("a4", 6)
	require.ErrorIs(t, err, ErrQuota)
	l2, err := a.Acquire("a4", 5)
	require.NoError(t, err)
	require.Equal(t, 0, p.CachedPrefix(ah))
	l.Release()
	l2.Release()
	checkPool(t, p)
}

// A reservation: another tenant's flood (or an acquire of no tenant)
// never evicts the tenant's newest reserved cached blocks, nor counts
// them available; its own acquires may take them.
func TestQuotaReserve(t *testing.T) {
	p := newTestPool(t, 16)
	a := tenant(t, p, "a", Quota{})
	b := tenant(t, p, "b", Quota{Reserve: 4})
	bh := cacheAs(t, p, b, 6, 100) // reserved: its newest four (a chain is cached from its end: bh[0..3])
	nh := cacheAs(t, p, nil, 4, 200)
	require.Equal(t, 4, tenantLine(b).Reserved)
	require.Equal(t, 12, p.Available(), "16 less b's reservation")

	// a floods: 12 blocks at most, whatever it does. b's reserved blocks
	// are the least recently used, yet the newer ones go first.
	var held []*Lease[[]byte]
	for i := range 3 {
		l, err := a.Acquire("flood", 4)
		require.NoError(t, err, "flood %d", i)
		held = append(held, l)
	}
	_, err := a.Acquire("flood", 1)
	require.ErrorIs(t, err, ErrExhausted)
	require.NotErrorIs(t, err, ErrQuota, "a has no cap: the pool is what is short")
	_, err = p.Acquire("none", 1)
	require.ErrorIs(t, err, ErrExhausted)
	require.Equal(t, 4, p.CachedPrefix(bh), "b's reserved prefix survives the flood")
	require.Equal(t, 0, p.CachedPrefix(nh))
	require.Equal(t, uint64(2), tenantLine(b).Evicted)
	// b's own acquire may take its reserved blocks.
	l, err := b.Acquire("b", 2)
	require.NoError(t, err)
	require.Equal(t, 2, p.CachedPrefix(bh))
	l.Release()
	for _, l := range held {
		l.Release()
	}
	checkPool(t, p)
}

// Hits on a tenant's own cached blocks at its cap take them out of what
// it may evict: room counts them, and the fresh blocks evict its older
// ones. Prefix counts are kept per tenant.
func TestQuotaPrefix(t *testing.T) {
	p := newTestPool(t, 32)
	a := tenant(t, p, "a", Quota{Cap: 6})
	ah := cacheAs(t, p, a, 4, 100) // 4 cached
	// 4 hits (its own) + 3 fresh: held 4 + 3 > 6 and nothing left to evict.
	_, _, err := a.AcquirePrefix("a1", ah, 7)
	require.ErrorIs(t, err, ErrQuota)
	require.Equal(t, 4, p.CachedPrefix(ah), "a refusal changes nothing")
	l, hits, err := a.AcquirePrefix("a2", ah[:3], 5) // 3 hits, 2 fresh: 6 held, 1 cached evicted
	require.NoError(t, err)
	require.Equal(t, 3, hits)
	st := tenantLine(a)
	require.Equal(t, 6, st.Held)
	require.Equal(t, uint64(3), st.PrefixQueries)
	require.Equal(t, uint64(3), st.PrefixHits)
	l.Release()
	other := p.TenantStats(nil)
	require.Len(t, other, 2)
	require.Equal(t, "", other[1].Tenant)
	require.Equal(t, 0, other[1].Held, "everything is a's")
	checkPool(t, p)
}

// Extend and a sequence's growth obey the cap; a sequence admitted with
// SequenceSpec.Tenant is charged to it; a Share's growth too.
func TestQuotaExtendAndSequence(t *testing.T) {
	p := newTestPool(t, 32, WithBlockTokens(4))
	a := tenant(t, p, "a", Quota{Cap: 4})
	s, err := p.Admit(SequenceSpec{Owner: "s", Seed: 1, Prompt: seqTokens(9, 1), Tenant: "a"})
	require.NoError(t, err)
	require.Equal(t, 3, tenantLine(a).Held)
	require.NoError(t, s.Lease().Extend(1))
	err = s.Lease().Extend(1)
	require.ErrorIs(t, err, ErrQuota)
	require.Contains(t, err.Error(), "extend 1 fresh blocks")
	require.NoError(t, s.Commit(8)) // two full blocks sealed
	sh, err := s.Lease().Share("beam", 2)
	require.NoError(t, err)
	require.ErrorIs(t, sh.Extend(1), ErrQuota, "a share is charged as its lease")
	sh.Release()
	s.Lease().Release()
	// An unregistered name charges no one.
	s2, err := p.Admit(SequenceSpec{Owner: "s2", Seed: 2, Prompt: seqTokens(20, 1), Tenant: "nobody"})
	require.NoError(t, err)
	require.Equal(t, 5, p.TenantStats(nil)[1].Held-p.TenantStats(nil)[1].Cached)
	s2.Lease().Release()
	checkPool(t, p)
}

// AcquireWait and a cap: refused at once when the cap leaves no room now
// (it would wait for its own releases at the head of everyone's queue);
// a queued waiter whose tenant's room shrank while it waited is failed
// at the head, and the waiter behind it is served; order stays FIFO.
func TestQuotaWaiters(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		p := newTestPool(t, 8)
		a := tenant(t, p, "a", Quota{Cap: 4})
		b := tenant(t, p, "b", Quota{})
		la, err := a.Acquire("a", 3)
		require.NoError(t, err)
		_, err = a.AcquireWait(context.Background(), "a-big", 2)
		require.ErrorIs(t, err, ErrQuota, "at once: only a's own releases could make room")
		require.Equal(t, 0, p.Stats().Waiters)

		hog, err := b.Acquire("hog", 5) // the pool is full
		require.NoError(t, err)
		type res struct {
			l   *Lease[[]byte]
			err error
		}
		ga, gb := make(chan res, 1), make(chan res, 1)
		go func() { l, err := a.AcquireWait(context.Background(), "a-wait", 1); ga <- res{l, err} }()
		synctest.Wait()
		go func() { l, err := b.AcquireWait(context.Background(), "b-wait", 1); gb <- res{l, err} }()
		synctest.Wait()
		require.Equal(t, 2, p.Stats().Waiters)
		// A plain acquire of a tenant does not overtake the queue either.
		_, err = b.Acquire("b-plain", 1)
		require.ErrorIs(t, err, ErrExhausted)
		// a's room shrinks while a-wait waits.
		require.NoError(t, a.SetQuota(Quota{Cap: 3}))
		hog.Release() // 5 free: a-wait is failed at the head, b-wait served
		synctest.Wait()
		ra, rb := <-ga, <-gb
		require.ErrorIs(t, ra.err, ErrQuota)
		require.Nil(t, ra.l)
		require.NoError(t, rb.err)
		require.Equal(t, 0, p.Stats().Waiters)
		require.Equal(t, 3, tenantLine(a).Held, "the failed waiter holds nothing")
		rb.l.Release()
		la.Release()

		// Another tenant's reservation is not available to a waiter; the
		// reserving tenant's own acquire does not overtake the queue.
		require.NoError(t, a.SetQuota(Quota{}))
		require.NoError(t, b.SetQuota(Quota{Reserve: 2}))
		cacheAs(t, p, b, 2, 500) // b's reservation
		fill, err := a.Acquire("fill", 3)
		require.NoError(t, err)
		rest, err := p.Acquire("rest", 3)
		require.NoError(t, err)
		require.Equal(t, 0, p.Available(), "only b's reserved blocks are left")
		go func() { l, err := a.AcquireWait(context.Background(), "a-wait2", 1); ga <- res{l, err} }()
		synctest.Wait()
		require.Equal(t, 1, p.Stats().Waiters, "a may not take b's reservation: it waits")
		_, err = b.Acquire("b-plain", 1)
		require.ErrorIs(t, err, ErrExhausted, "b could take its own reserved block, but not ahead of a's waiter")
		rest.Release()
		synctest.Wait()
		ra = <-ga
		require.NoError(t, ra.err)
		ra.l.Release()
		fill.Release()
	})
}

// Registration and quota errors.
func TestQuotaErrors(t *testing.T) {
	p := newTestPool(t, 8)
	_, err := p.Tenant("")
	require.ErrorIs(t, err, ErrInvalidArgument)
	a, err := p.Tenant("a")
	require.NoError(t, err)
	a2, err := p.Tenant("a")
	require.NoError(t, err)
	require.Same(t, a, a2)
	for _, q := range []Quota{{Cap: -1}, {Reserve: -1}, {Cap: 2, Reserve: 3}, {Reserve: 9}} {
		require.ErrorIs(t, a.SetQuota(q), ErrInvalidArgument, "%+v", q)
	}
	require.NoError(t, a.SetQuota(Quota{Reserve: 6}))
	b, _ := p.Tenant("b")
	err = b.SetQuota(Quota{Reserve: 3})
	require.ErrorIs(t, err, ErrInvalidArgument, "6 + 3 > 8")
	require.True(t, strings.Contains(err.Error(), "other tenants reserve 6"), err.Error())
	require.NoError(t, b.SetQuota(Quota{Reserve: 2}))
	require.True(t, errors.Is(ErrQuota, ErrExhausted))
}

// A sliding-window sequence of a tenant is charged to it and refused at
// its cap, as a plain one is (the window path acquires on its own).
func TestQuotaWindowSequence(t *testing.T) {
	p := newTestPool(t, 32, WithBlockTokens(4))
	a := tenant(t, p, "a", Quota{Cap: 4})
	s, err := p.Admit(SequenceSpec{Owner: "w", Seed: 1, Prompt: seqTokens(12, 1), Window: 8, Tenant: "a"})
	require.NoError(t, err)
	require.Equal(t, 3, tenantLine(a).Held)
	_, err = p.Admit(SequenceSpec{Owner: "w2", Seed: 2, Prompt: seqTokens(12, 1), Window: 8, Tenant: "a"})
	require.ErrorIs(t, err, ErrQuota)
	require.ErrorIs(t, err, ErrExhausted)
	require.Equal(t, 3, tenantLine(a).Held, "a refused admission holds nothing")
	s.Lease().Release()
	checkPool(t, p)
}

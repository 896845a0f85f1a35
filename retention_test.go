package kvlease

import (
	"errors"
	"slices"
	"testing"
)

// sealAll acquires n blocks for owner, applies set, seals each with a
// hash of its own (base+k) and releases: n cached blocks, in order.
func sealAll(t *testing.T, p *Pool[[]byte], owner string, n int, base BlockHash, set func(*Lease[[]byte])) []BlockHash {
	t.Helper()
	l, err := p.Acquire(owner, n)
	if err != nil {
		t.Fatal(err)
	}
	if set != nil {
		set(l)
	}
	var hs []BlockHash
	for k := range n {
		h := base + BlockHash(k)
		if err := l.Seal(k, h); err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	l.Release()
	return hs
}

// evictedOrder acquires n fresh blocks (evicting n cached ones when none
// is free), holds them in *held, and returns the hashes removed, in order.
func evictedOrder(t *testing.T, p *Pool[[]byte], n int, held *[]*Lease[[]byte]) []BlockHash {
	t.Helper()
	_, _ = p.DrainKVEvents(nil)
	l, err := p.Acquire("fresh", n)
	if err != nil {
		t.Fatal(err)
	}
	*held = append(*held, l)
	evs, _ := p.DrainKVEvents(nil)
	var out []BlockHash
	for _, ev := range evs {
		if ev.Kind == KVBlockRemoved {
			out = append(out, ev.BlockHash)
		}
	}
	return out
}

// The lowest class is evicted first, LRU within a class; a lease's class
// and its adapter's combine to the lower; changing an adapter's class
// re-classes its cached blocks.
func TestRetention(t *testing.T) {
	p := seqPool(t, 12, WithKVEvents(64))
	high := sealAll(t, p, "high", 3, 100, func(l *Lease[[]byte]) { _ = l.SetRetention(RetentionMax) })
	def := sealAll(t, p, "default", 3, 200, nil)
	low := sealAll(t, p, "low", 3, 300, func(l *Lease[[]byte]) { _ = l.SetRetention(RetentionMin) })
	sql := sealAll(t, p, "sql", 3, 400, func(l *Lease[[]byte]) { _ = l.SetAdapter(Adapter{ID: 7, Name: "sql"}) })
	checkPool(t, p)
	if got := p.CachedByRetention(); got[RetentionMin] != 3 || got[RetentionDefault] != 6 || got[RetentionMax] != 3 {
		t.Fatalf("cached by retention %v", got)
	}
	// Released tail first: a lease's chain is evicted from its end.
	rev := func(h []BlockHash) []BlockHash { h = slices.Clone(h); slices.Reverse(h); return h }
	var held []*Lease[[]byte]
	release := func() {
		for _, l := range held {
			l.Release()
		}
		held = held[:0]
	}
	if got := evictedOrder(t, p, 3, &held); !slices.Equal(got, rev(low)) {
		t.Fatalf("evicted %v, want the low class %v", got, rev(low))
	}
	// The adapter is unloaded: its blocks go before the default class.
	if err := p.SetAdapterRetention(7, RetentionMin); err != nil {
		t.Fatal(err)
	}
	checkPool(t, p)
	if got := p.CachedByRetention(); got[RetentionMin] != 3 || got[RetentionDefault] != 3 {
		t.Fatalf("after unloading: %v", got)
	}
	if got := evictedOrder(t, p, 3, &held); !slices.Equal(got, rev(sql)) {
		t.Fatalf("evicted %v, want the unloaded adapter's %v", got, rev(sql))
	}
	// Sealed while unloaded, even by a lease asking for more: the lower.
	release() // 6 free
	sql2 := sealAll(t, p, "sql2", 2, 500, func(l *Lease[[]byte]) {
		_ = l.SetAdapter(Adapter{ID: 7, Name: "sql"})
		_ = l.SetRetention(RetentionMax)
	})
	if got := evictedOrder(t, p, 4, &held); len(got) != 0 { // the 4 free blocks
		t.Fatalf("evicted %v with free blocks", got)
	}
	if got := evictedOrder(t, p, 2, &held); !slices.Equal(got, rev(sql2)) {
		t.Fatalf("evicted %v, want %v", got, rev(sql2))
	}
	// Loaded again: its cached blocks join the top class as its most recent.
	release() // 6 free
	sealAll(t, p, "sql3", 2, 600, func(l *Lease[[]byte]) { _ = l.SetAdapter(Adapter{ID: 7, Name: "sql"}) })
	if err := p.SetAdapterRetention(7, RetentionMax); err != nil {
		t.Fatal(err)
	}
	if got := evictedOrder(t, p, 4, &held); len(got) != 0 {
		t.Fatalf("evicted %v with free blocks", got)
	}
	if got := evictedOrder(t, p, 5, &held); !slices.Equal(got, append(rev(def), rev(high)[:2]...)) {
		t.Fatalf("evicted %v, want default %v then high %v", got, rev(def), rev(high)[:2])
	}
	release()
	checkPool(t, p)
}

// A slot reused after eviction starts again at the default class.
func TestRetentionReset(t *testing.T) {
	p := seqPool(t, 2)
	sealAll(t, p, "low", 2, 1, func(l *Lease[[]byte]) { _ = l.SetRetention(RetentionMin) })
	sealAll(t, p, "next", 2, 10, nil) // evicts both low blocks, reuses their slots
	if got := p.CachedByRetention(); got[RetentionDefault] != 2 || got[RetentionMin] != 0 {
		t.Fatalf("reused slots kept their class: %v", got)
	}
	checkPool(t, p)
}

func TestRetentionErrors(t *testing.T) {
	p := seqPool(t, 2)
	l, _ := p.Acquire("a", 1)
	if err := l.SetRetention(RetentionMax + 1); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("retention above max: %v", err)
	}
	l.Release()
	if err := l.SetRetention(RetentionMin); !errors.Is(err, ErrLeaseClosed) {
		t.Fatalf("closed lease: %v", err)
	}
	if err := p.SetAdapterRetention(1, RetentionMax+1); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("adapter retention above max: %v", err)
	}
}

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
	if err := p.SetAdapterRetention("sql", RetentionMin); err != nil {
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
	if err := p.SetAdapterRetention("sql", RetentionMax); err != nil {
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
	if err := p.SetAdapterRetention("x", RetentionMax+1); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("adapter retention above max: %v", err)
	}
}

// Retention follows the adapter's name: an engine that reuses an id
// (unload A from slot 1, load B into it) moves A's blocks only; blocks an
// adapter seals while unloaded get its class whatever id it declares; a
// name-only adapter is an adapter of its own (not the base model), and
// its events carry its name with lora_id 0.
func TestAdapterRetentionByName(t *testing.T) {
	p := seqPool(t, 12, WithKVEvents(64))
	A, B := Adapter{ID: 1, Name: "A"}, Adapter{ID: 1, Name: "B"}
	tag := func(a Adapter) func(*Lease[[]byte]) {
		return func(l *Lease[[]byte]) {
			if err := l.SetAdapter(a); err != nil {
				t.Fatal(err)
			}
		}
	}
	base := sealAll(t, p, "base", 2, 100, nil)
	a := sealAll(t, p, "a", 2, 200, tag(A))
	// A is unloaded from slot 1, B loaded into it.
	if err := p.SetAdapterRetention("A", RetentionMin); err != nil {
		t.Fatal(err)
	}
	b := sealAll(t, p, "b", 2, 300, tag(B))
	x := sealAll(t, p, "x", 2, 400, tag(Adapter{Name: "x"}))
	a2 := sealAll(t, p, "a2", 2, 500, tag(Adapter{ID: 9, Name: "A"})) // A again, under another id
	checkPool(t, p)
	if got := p.CachedByRetention(); got[RetentionMin] != 4 || got[RetentionDefault] != 6 {
		t.Fatalf("cached by retention %v: want A's 4 blocks first, B, x and the base model's 6 default", got)
	}
	evs, _ := p.DrainKVEvents(nil)
	for _, ev := range evs {
		if ev.BlockHash == x[0] && (ev.LoraName != "x" || ev.LoraID != 0) {
			t.Fatalf("x's event: lora %d %q", ev.LoraID, ev.LoraName)
		}
		if ev.BlockHash == b[0] && (ev.LoraName != "B" || ev.LoraID != 1) {
			t.Fatalf("B's event: lora %d %q", ev.LoraID, ev.LoraName)
		}
	}
	// x is unloaded: its blocks only, not the base model's.
	if err := p.SetAdapterRetention("x", RetentionMin+1); err != nil {
		t.Fatal(err)
	}
	var held []*Lease[[]byte]
	rev := func(h []BlockHash) []BlockHash { h = slices.Clone(h); slices.Reverse(h); return h }
	want := append(append(rev(a), rev(a2)...), rev(x)...)
	if got := evictedOrder(t, p, 8, &held); !slices.Equal(got, want) { // 2 free, then 6 evicted
		t.Fatalf("evicted %v, want A's (both ids) then x's %v", got, want)
	}
	if p.CachedPrefix(base) != 2 || p.CachedPrefix(b) != 2 {
		t.Fatal("the base model's or B's blocks were evicted")
	}
	for _, l := range held {
		l.Release()
	}
	// The base model ("") has a class of its own too.
	if err := p.SetAdapterRetention("", RetentionMin); err != nil {
		t.Fatal(err)
	}
	if got := p.CachedByRetention(); got[RetentionMin] != 2 {
		t.Fatalf("after the base model's: %v", got)
	}
	checkPool(t, p)
}

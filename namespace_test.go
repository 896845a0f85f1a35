package kvlease

import (
	"errors"
	"regexp"
	"slices"
	"strings"
	"testing"
)

func nsPool(t *testing.T, opts ...Option) *Pool[[]byte] {
	t.Helper()
	mem, err := NewHostMemory(16, 8)
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewPool[[]byte](mem, append([]Option{WithBlockTokens(2), WithKVEvents(64)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

var nsKey = []byte("0123456789abcdef0123456789abcdef")

// A tenant's namespace is public: derived from its secret, stable across
// pools sharing the key, apart between tenants and keys, and free of the
// name, the key and the seeds.
func TestTenantNamespace(t *testing.T) {
	p, q := nsPool(t, WithTenantKey(nsKey)), nsPool(t, WithTenantKey(nsKey))
	other := nsPool(t, WithTenantKey([]byte("another key of sixteen bytes or more")))
	ns := func(p *Pool[[]byte], name string) string {
		tn, err := p.Tenant(name)
		if err != nil {
			t.Fatal(err)
		}
		return tn.Namespace()
	}
	a, b := ns(p, "acme"), ns(p, "globex")
	if !regexp.MustCompile(`^ns:[0-9a-f]{32}$`).MatchString(a) {
		t.Fatalf("namespace %q, want ns: and 32 hex digits", a)
	}
	if a == b || a != ns(q, "acme") || a == ns(other, "acme") {
		t.Fatalf("namespaces: acme %q, globex %q, acme in a pool with the same key %q, with another key %q",
			a, b, ns(q, "acme"), ns(other, "acme"))
	}
	seed, err := p.TenantSeed("acme", 0)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(a, "acme") || strings.Contains(a, string(nsKey)) {
		t.Fatalf("namespace %q holds the name or the key", a)
	}
	if strings.Contains(a, hex16(uint64(seed))) || strings.Contains(a, hex16(uint64(seed))[8:]) {
		t.Fatalf("namespace %q holds the seed %016x", a, uint64(seed))
	}
	if got := ns(nsPool(t, WithTenantKey(nsKey), WithPublicTenantNames()), "acme"); got != "acme" {
		t.Fatalf("public names: namespace %q", got)
	}
	if got := ns(nsPool(t), "acme"); got != "" {
		t.Fatalf("no tenant key: namespace %q, want none", got)
	}
}

func hex16(v uint64) string {
	const d = "0123456789abcdef"
	b := make([]byte, 16)
	for i := 15; i >= 0; i-- {
		b[i] = d[v&15]
		v >>= 4
	}
	return string(b)
}

// A tenant's blocks carry its namespace in their events, snapshots and
// seal records; a plain lease's carry none.
func TestNamespaceInEventsAndRecords(t *testing.T) {
	p := nsPool(t, WithTenantKey(nsKey))
	acme, err := p.Tenant("acme")
	if err != nil {
		t.Fatal(err)
	}
	l, err := acme.Acquire("req", 2)
	if err != nil {
		t.Fatal(err)
	}
	seed, _ := p.TenantSeed("acme", 1)
	h0, err := l.SealTokens(0, seed, []int32{1, 2})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.SealTokens(1, h0, []int32{3, 4}, []string{"img:1"}...); err != nil {
		t.Fatal(err)
	}
	plain, err := p.Acquire("plain", 1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := plain.SealTokens(0, 9, []int32{1, 2}); err != nil {
		t.Fatal(err)
	}
	evs, _ := p.DrainKVEvents(nil)
	if len(evs) != 3 || evs[0].Namespace != acme.Namespace() || evs[1].Namespace != acme.Namespace() ||
		!slices.Equal(evs[1].ExtraKeys, []string{"img:1"}) || evs[2].Namespace != "" {
		t.Fatalf("events %+v", evs)
	}
	_, snap := p.SnapshotKVBlocks(nil)
	n := 0
	for _, e := range snap {
		if e.Namespace == acme.Namespace() {
			n++
		}
	}
	if n != 2 {
		t.Fatalf("snapshot: %d blocks of acme's namespace, want 2: %+v", n, snap)
	}
	info, ok := p.SealInfo(l.Ref(1), nil)
	if !ok || info.Namespace != acme.Namespace() || !slices.Equal(info.ExtraKeys, []string{"img:1"}) {
		t.Fatalf("seal info %+v %v", info, ok)
	}
}

// SealAs copies a block's namespace, adapter and extra keys, so a copy
// publishes what its original did; a tenant's lease cannot seal under
// another namespace.
func TestSealAsKeepsNamespace(t *testing.T) {
	src := nsPool(t, WithTenantKey(nsKey))
	acme, _ := src.Tenant("acme")
	l, _ := acme.Acquire("req", 2)
	if err := l.SetAdapter(Adapter{ID: 2, Name: "sql"}); err != nil {
		t.Fatal(err)
	}
	h0, _ := l.SealTokens(0, 5, []int32{1, 2})
	if _, err := l.SealTokens(1, h0, []int32{3, 4}, []string{"img:1"}...); err != nil {
		t.Fatal(err)
	}
	dst := nsPool(t, WithTenantKey(nsKey))
	cp, _ := dst.Acquire("copy", 2)
	for i := range 2 {
		info, ok := src.SealInfo(l.Ref(i), nil)
		if !ok {
			t.Fatal("no seal info")
		}
		if err := cp.SealAs(i, info); err != nil {
			t.Fatal(err)
		}
		got, _ := dst.SealInfo(cp.Ref(i), nil)
		if got.Namespace != acme.Namespace() || got.Adapter != (Adapter{ID: 2, Name: "sql"}) ||
			!slices.Equal(got.ExtraKeys, info.ExtraKeys) || got.Hash != info.Hash {
			t.Fatalf("block %d: copy's record %+v, original's %+v", i, got, info)
		}
	}
	evs, _ := dst.DrainKVEvents(nil)
	if len(evs) != 2 || evs[0].Namespace != acme.Namespace() || evs[1].LoraName != "sql" || !slices.Equal(evs[1].ExtraKeys, []string{"img:1"}) {
		t.Fatalf("copy's events %+v", evs)
	}
	// Extra keys are part of the hash: a copy claiming other keys is refused.
	info, _ := src.SealInfo(l.Ref(1), nil)
	info.ExtraKeys = []string{"img:2"}
	cp2, _ := dst.Acquire("copy2", 1)
	if err := cp2.SealAs(0, info); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("copy with other extra keys: %v", err)
	}
	// A tenant's lease seals only under its own namespace.
	globex, _ := dst.Tenant("globex")
	gl, _ := globex.Acquire("g", 1)
	info, _ = src.SealInfo(l.Ref(0), nil)
	if err := gl.SealAs(0, info); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("globex sealing under acme's namespace: %v", err)
	}
	info.Namespace = globex.Namespace()
	info.Adapter = Adapter{}
	if err := gl.SealAs(0, info); err != nil {
		t.Fatalf("globex sealing under its own namespace: %v", err)
	}
	// A hash-only copy keeps its tags too.
	hc, _ := dst.Acquire("hash-only", 1)
	if err := hc.SealAs(0, SealInfo{Hash: 77, Namespace: "ns:x", Adapter: Adapter{Name: "a"}}); err != nil {
		t.Fatal(err)
	}
	got, ok := dst.SealInfo(hc.Ref(0), nil)
	if !ok || got.Namespace != "ns:x" || got.Adapter.Name != "a" || got.HasParent {
		t.Fatalf("hash-only copy %+v", got)
	}
	if err := hc.SealAs(0, SealInfo{Hash: 78, Adapter: Adapter{ID: 1}}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("adapter id without a name: %v", err)
	}
}

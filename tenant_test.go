package kvlease

import (
	"bytes"
	"errors"
	"testing"
)

var testTenantKey = bytes.Repeat([]byte{0x5a}, 32)

// TestTenantIsolation: a copied public salt gives zero hits across
// tenants; the same tenant shares its blocks.
func TestTenantIsolation(t *testing.T) {
	p := seqPool(t, 64, WithBlockTokens(4), WithTenantKey(testTenantKey))
	const salt = BlockHash(0xca5e) // the public cache_salt both requests carry
	a, err := p.TenantSeed("alice", salt)
	if err != nil {
		t.Fatal(err)
	}
	prompt := seqTokens(21, 1)
	s, err := p.Admit(SequenceSpec{Owner: "a1", Seed: a, Prompt: prompt})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(s.Len()); err != nil {
		t.Fatal(err)
	}
	s.Lease().Release()

	b, err := p.TenantSeed("bob", salt)
	if err != nil {
		t.Fatal(err)
	}
	if b == a || b == salt || a == salt {
		t.Fatalf("seeds alice %x bob %x salt %x", a, b, salt)
	}
	if n := p.CachedPrefixTokens(b, prompt); n != 0 {
		t.Fatalf("bob sees %d of alice's blocks", n)
	}
	if n := p.CachedPrefixTokens(salt, prompt); n != 0 {
		t.Fatalf("the bare salt sees %d blocks", n)
	}
	sb, err := p.Admit(SequenceSpec{Owner: "b1", Seed: b, Prompt: prompt})
	if err != nil {
		t.Fatal(err)
	}
	if sb.Hits() != 0 {
		t.Fatalf("bob hit %d of alice's blocks", sb.Hits())
	}
	sb.Lease().Release()
	a2, _ := p.TenantSeed("alice", salt)
	s2, err := p.Admit(SequenceSpec{Owner: "a2", Seed: a2, Prompt: prompt})
	if err != nil {
		t.Fatal(err)
	}
	if s2.Hits() != 5 {
		t.Fatalf("alice's second request: %d hits, want 5", s2.Hits())
	}
	s2.Lease().Release()

	// Another pool with another key: other seeds for the same tenant.
	q := seqPool(t, 4, WithTenantKey(bytes.Repeat([]byte{1}, 16)))
	if a3, _ := q.TenantSeed("alice", salt); a3 == a {
		t.Fatal("two keys gave alice the same seed")
	}
	checkPool(t, p)
}

func TestTenantErrors(t *testing.T) {
	p := seqPool(t, 4)
	if _, err := p.TenantSeed("alice", 0); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("no key: %v", err)
	}
	q := seqPool(t, 4, WithTenantKey(testTenantKey))
	if _, err := q.TenantSeed("", 0); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("empty tenant: %v", err)
	}
	mem, _ := NewHostMemory(4, 64)
	if _, err := NewPool[[]byte](mem, WithTenantKey(make([]byte, 15))); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("short key: %v", err)
	}
	if _, err := NewPool[[]byte](mem, WithTenantKey(testTenantKey), WithTenantKey(make([]byte, 32))); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("two keys: %v", err)
	}
	if _, err := NewPool[[]byte](mem, WithTenantKey(testTenantKey), WithTenantKey(testTenantKey)); err != nil {
		t.Fatalf("the same key twice: %v", err)
	}
	// The option holds its own copy: changing the caller's slice later
	// changes nothing.
	key := bytes.Clone(testTenantKey)
	opt := WithTenantKey(key)
	key[0] ^= 1
	r, err := NewPool[[]byte](mem, opt)
	if err != nil {
		t.Fatal(err)
	}
	x, _ := r.TenantSeed("t", 1)
	y, _ := q.TenantSeed("t", 1)
	if x != y {
		t.Fatal("the option kept the caller's slice")
	}
	if s := opt.string(); bytes.Contains([]byte(s), []byte{0x5a}) || s != "WithTenantKey(32 bytes)" {
		t.Fatalf("option string %q", s)
	}
}

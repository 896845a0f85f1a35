package handoff

import (
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/internal/wire"
)

var handoffTenantKey = []byte("the handoff tests' tenant key!!!")

// tenantPool is a destination pool that knows tenants acme and globex.
func tenantPool(t *testing.T) (*kvlease.Pool[[]byte], *kvlease.Tenant[[]byte], *kvlease.Tenant[[]byte]) {
	t.Helper()
	mem, err := kvlease.NewHostMemory(32, hbBytes)
	if err != nil {
		t.Fatal(err)
	}
	p, err := kvlease.NewPool[[]byte](mem, kvlease.WithTenantKey(handoffTenantKey), kvlease.WithBlockTokens(testEnvelope().BlockTokens), kvlease.WithSealRecords())
	if err != nil {
		t.Fatal(err)
	}
	acme, _ := p.Tenant("acme")
	globex, _ := p.Tenant("globex")
	return p, acme, globex
}

func tenantTokens(blocks int) []int32 {
	toks := make([]int32, blocks*testEnvelope().BlockTokens)
	for i := range toks {
		toks[i] = int32(500 + i)
	}
	return toks
}

// nsProposal is a Propose of tokens under namespace ns, whose chain is
// rooted at seed.
func nsProposal(id uint64, ns string, salt, seed kvlease.BlockHash, tokens []int32) *ProposeMsg {
	bt := testEnvelope().BlockTokens
	return &ProposeMsg{ID: id, Request: "r", Blocks: uint32(len(tokens) / bt), Envelope: testEnvelope().Fingerprint(),
		Hashes: kvlease.ChainHashes(seed, tokens, bt), Namespace: ns, Salt: salt, Seed: seed, Tokens: tokens}
}

// TestHostileProposerNamespaces: an authenticated proposer allowed one
// tenant's namespace cannot get blocks taken (let alone sealed) under
// another tenant's namespace, under a namespace nobody has, under its
// own namespace but another tenant's root, or under a namespace without
// tokens to check the root by; Authorize and the tenant policy see the
// namespace; what it is allowed is taken by that tenant's lease.
func TestHostileProposerNamespaces(t *testing.T) {
	pool, acme, globex := tenantPool(t)
	var authorized, policed []string
	dst, a, _ := servedDestination(t, pool, DestinationConfig[[]byte]{
		Authorize: func(_ *Peer, m *ProposeMsg) error {
			authorized = append(authorized, m.Namespace)
			return nil
		},
		Tenant: func(p *Peer, m *ProposeMsg) (*kvlease.Tenant[[]byte], error) {
			policed = append(policed, m.Namespace)
			switch {
			case m.Namespace == "":
				return nil, nil
			case p.Identity == "psk:test" && m.Namespace == acme.Namespace():
				return acme, nil
			}
			return nil, errors.New("not this proposer's tenant")
		},
	})
	c := rawSource(t, a, testPSK)
	toks := tenantTokens(2)
	acmeSeed, _ := pool.TenantSeed("acme", 5)
	globexSeed, _ := pool.TenantSeed("globex", 5)
	noTokens := nsProposal(5, acme.Namespace(), 5, acmeSeed, toks)
	noTokens.Tokens = nil
	cases := []struct {
		m      *ProposeMsg
		accept bool
		reason string
	}{
		{nsProposal(1, acme.Namespace(), 5, acmeSeed, toks), true, ""},
		{nsProposal(2, globex.Namespace(), 5, globexSeed, toks), false, "not this proposer's tenant"},
		{nsProposal(3, "ns:00000000000000000000000000000000", 5, acmeSeed, toks), false, "not this proposer's tenant"},
		{nsProposal(4, acme.Namespace(), 5, globexSeed, toks), false, "is not the seed of namespace"},
		{noTokens, false, "without tokens"},
		{nsProposal(7, "", 0, 9, toks), true, ""},
	}
	for _, tc := range cases {
		if err := c.Send(tc.m); err != nil {
			t.Fatal(err)
		}
		m, err := c.Read()
		if err != nil {
			t.Fatal(err)
		}
		switch m := m.(type) {
		case *wire.AcceptMsg:
			if !tc.accept {
				t.Fatalf("proposal %d (namespace %q) accepted", tc.m.ID, tc.m.Namespace)
			}
		case *wire.RejectMsg:
			if tc.accept || m.Code != wire.RejectNamespace || !strings.Contains(m.Reason, tc.reason) || !strings.Contains(m.Reason, ErrNamespace.Error()) {
				t.Fatalf("proposal %d (namespace %q): %+v", tc.m.ID, tc.m.Namespace, m)
			}
		default:
			t.Fatalf("proposal %d: %#v", tc.m.ID, m)
		}
	}
	if got := acme.Stats().Held; got != 2 {
		t.Fatalf("acme holds %d blocks, want the accepted proposal's 2", got)
	}
	if got := globex.Stats().Held; got != 0 {
		t.Fatalf("globex holds %d blocks", got)
	}
	if len(authorized) != len(cases) || authorized[1] != globex.Namespace() || len(policed) != len(cases) {
		t.Fatalf("Authorize saw %q, the policy %q", authorized, policed)
	}
	if st := dst.Stats(); st.Unauthorized != 4 {
		t.Fatalf("stats %+v", st)
	}
}

// A tenant policy that answers with a tenant of another namespace than
// the proposed one is refused too; a destination without a policy
// refuses every namespace and serves the rest as before.
func TestNamespacePolicyMisfitAndNoPolicy(t *testing.T) {
	pool, acme, globex := tenantPool(t)
	_, a, _ := servedDestination(t, pool, DestinationConfig[[]byte]{
		Tenant: func(*Peer, *ProposeMsg) (*kvlease.Tenant[[]byte], error) { return globex, nil },
	})
	c := rawSource(t, a, testPSK)
	seed, _ := pool.TenantSeed("acme", 0)
	if err := c.Send(nsProposal(1, acme.Namespace(), 0, seed, tenantTokens(1))); err != nil {
		t.Fatal(err)
	}
	if m, err := c.Read(); err != nil || m.(*wire.RejectMsg) == nil || !strings.Contains(m.(*wire.RejectMsg).Reason, "the tenant policy gave one of") {
		t.Fatalf("%#v %v", m, err)
	}

	pool2, acme2, _ := tenantPool(t)
	_, b, _ := servedDestination(t, pool2, DestinationConfig[[]byte]{})
	c = rawSource(t, b, testPSK)
	for id, ns := range []string{acme2.Namespace(), ""} {
		if err := c.Send(nsProposal(uint64(id+1), ns, 0, seed, tenantTokens(1))); err != nil {
			t.Fatal(err)
		}
		m, err := c.Read()
		if err != nil {
			t.Fatal(err)
		}
		if _, acc := m.(*wire.AcceptMsg); acc != (ns == "") {
			t.Fatalf("namespace %q without a policy: %#v", ns, m)
		}
	}
}

// The source sends the namespace and salt it is given, or the one its
// lease's blocks were sealed under; one that contradicts them, or one
// too long for a frame, is refused before anything is sent.
func TestSourceSendsNamespace(t *testing.T) {
	pool, acme, _ := tenantPool(t)
	got := make(chan *ProposeMsg, 4)
	d, err := NewDestination(newHostPool(t, 32, hbBytes), newManualPlane(), DestinationConfig[[]byte]{
		HalfConfig: HalfConfig{Envelope: testEnvelope(), Auth: testPSK},
		Authorize:  func(_ *Peer, m *ProposeMsg) error { got <- m; return errors.New("recorded") },
	})
	if err != nil {
		t.Fatal(err)
	}
	a, b := net.Pipe()
	served := make(chan error, 1)
	go func() { served <- d.Serve(b) }()
	s, err := NewSource(a, newManualPlane(), HalfConfig{Envelope: testEnvelope(), Auth: testPSK})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Close(); <-served }()
	toks := tenantTokens(2)
	seed, _ := pool.TenantSeed("acme", 5)
	l, err := acme.Acquire("src", 2)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	// Not sealed yet: the option's namespace goes as it is.
	o, err := s.ProposeTokens(1, "r", l, seed, toks, TenantNamespace(acme.Namespace(), 5))
	if err != nil {
		t.Fatal(err)
	}
	o.Wait(10 * time.Second)
	if m := <-got; m.Namespace != acme.Namespace() || m.Salt != 5 || m.Seed != seed {
		t.Fatalf("proposal %+v", m)
	}
	if _, err := l.SealTokens(0, seed, toks[:testEnvelope().BlockTokens]); err != nil {
		t.Fatal(err)
	}
	// Sealed under acme's namespace: carried without the option, and an
	// option naming another is refused.
	if _, err := s.ProposeTokens(2, "r", l, seed, toks, TenantNamespace("ns:other", 5)); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("a namespace that is not the blocks': %v", err)
	}
	if _, err := s.ProposeTokens(3, "r", l, seed, toks, TenantNamespace(strings.Repeat("n", wire.MaxText+1), 5)); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("a namespace too long: %v", err)
	}
	o, err = s.ProposeTokens(4, "r", l, seed, toks)
	if err != nil {
		t.Fatal(err)
	}
	o.Wait(10 * time.Second)
	if m := <-got; m.Namespace != acme.Namespace() || m.Salt != 0 {
		t.Fatalf("proposal %+v", m)
	}
}

package tcp_test

import (
	"errors"
	"net"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
)

// TestHandoffSealsUnderTenantNamespace: a tenant's blocks handed off
// over TCP arrive in the destination's pool sealed under the tenant's
// namespace (records and KV events), charged to the tenant the policy
// allowed the authenticated proposer.
func TestHandoffSealsUnderTenantNamespace(t *testing.T) {
	key, _ := handoff.GenerateKey()
	auth := &handoff.PSK{ID: "prefill-fleet", Key: key}
	env := handoff.Envelope{BlockTokens: 4, BlockBytes: 256, PoolBlocks: 16,
		MaxContextTokens: 64, MaxPrefillTokens: 64, MaxRunningRequests: 4}
	tenantKey := []byte("a tenant key both pools share!!!")
	newPool := func() (*kvlease.Pool[[]byte], *kvlease.Tenant[[]byte]) {
		mem, _ := kvlease.NewHostMemory(env.PoolBlocks, env.BlockBytes)
		p, err := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(env.BlockTokens), kvlease.WithKVEvents(64),
			kvlease.WithTenantKey(tenantKey))
		if err != nil {
			t.Fatal(err)
		}
		acme, _ := p.Tenant("acme")
		return p, acme
	}
	decode, dacme := newPool()
	dataLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	recv := tcp.NewReceiver(dataLn, tcp.Config{})
	defer recv.Close()
	delivered := make(chan *handoff.Incoming[[]byte], 1)
	dst, _ := handoff.NewDestination(decode, recv, handoff.DestinationConfig[[]byte]{
		HalfConfig:  handoff.HalfConfig{Envelope: env, Name: "decode", Peer: "prefill", Auth: auth},
		OnDelivered: func(in *handoff.Incoming[[]byte]) { delivered <- in },
		Tenant: func(p *handoff.Peer, m *handoff.ProposeMsg) (*kvlease.Tenant[[]byte], error) {
			if p.Identity == "psk:prefill-fleet" && m.Namespace == dacme.Namespace() {
				return dacme, nil
			}
			return nil, handoff.ErrRejected
		},
	})
	ctlLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() {
		c, err := ctlLn.Accept()
		_ = ctlLn.Close()
		if err == nil {
			err = dst.Serve(c)
		}
		served <- err
	}()

	prefill, pacme := newPool()
	conn, err := net.Dial("tcp", ctlLn.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	sender := tcp.NewSender(tcp.Config{})
	defer sender.Close()
	src, err := handoff.NewSource(conn, sender, handoff.HalfConfig{Envelope: env, Name: "prefill", Peer: "decode", Auth: auth})
	if err != nil {
		t.Fatal(err)
	}
	seed, _ := prefill.TenantSeed("acme", 5)
	toks := make([]int32, 3*env.BlockTokens)
	for i := range toks {
		toks[i] = int32(100 + i)
	}
	lease, err := pacme.Acquire("req-1", 3)
	if err != nil {
		t.Fatal(err)
	}
	parent := seed
	for i := range 3 {
		if parent, err = lease.SealTokens(i, parent, toks[i*env.BlockTokens:(i+1)*env.BlockTokens]); err != nil {
			t.Fatal(err)
		}
	}
	o, err := src.ProposeTokens(1, "req-1", lease, seed, toks, handoff.TenantNamespace(pacme.Namespace(), 5))
	if err != nil {
		t.Fatal(err)
	}
	<-o.Done()
	var in *handoff.Incoming[[]byte]
	select {
	case in = <-delivered:
	case <-time.After(10 * time.Second):
		t.Fatalf("not delivered: %v %v", o.State(), o.Err())
	}
	for i := range 3 {
		info, ok := decode.SealInfo(in.Lease().Ref(i), nil)
		if !ok || info.Namespace != pacme.Namespace() {
			t.Fatalf("block %d at the destination: %+v %v", i, info, ok)
		}
	}
	if held := dacme.Stats().Held; held != 3 {
		t.Fatalf("the destination's acme holds %d blocks, want 3", held)
	}
	evs, _ := decode.DrainKVEvents(nil)
	stored := 0
	for _, e := range evs {
		if e.Kind == kvlease.KVBlockStored {
			stored++
			if e.Namespace != pacme.Namespace() {
				t.Fatalf("event %+v", e)
			}
		}
	}
	if stored != 3 {
		t.Fatalf("%d stored events", stored)
	}
	// A proposal whose seed is not the tenant's for the salt it names is
	// refused, and the source learns why: ErrNamespace, not only
	// ErrRejected.
	lease2, err := pacme.Acquire("req-2", 1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err = lease2.SealTokens(0, seed, toks[2*env.BlockTokens:3*env.BlockTokens]); err != nil {
		t.Fatal(err)
	}
	o2, err := src.ProposeTokens(2, "req-2", lease2, seed, toks[2*env.BlockTokens:3*env.BlockTokens], handoff.TenantNamespace(pacme.Namespace(), 6))
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-o2.Done():
	case <-time.After(10 * time.Second):
		t.Fatalf("no answer: %v", o2.State())
	}
	if o2.State() != handoff.Rejected || !errors.Is(o2.Err(), handoff.ErrNamespace) || !errors.Is(o2.Err(), handoff.ErrRejected) {
		t.Fatalf("a wrong salt: %v %v", o2.State(), o2.Err())
	}
	lease2.Release()
	in.Lease().Release()
	lease.Release()
	_ = src.Close()
	<-served
}

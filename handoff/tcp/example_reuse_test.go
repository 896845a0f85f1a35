package tcp_test

import (
	"fmt"
	"net"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
)

// Sequential handoffs to one destination share a data connection: the
// sender keeps up to MaxIdleConns idle connections per destination for
// IdleTimeout, and each handoff still opens with its own authenticated
// hello.
func ExampleConfig_reuse() {
	key, _ := handoff.GenerateKey()
	auth := &handoff.PSK{ID: "prefill-fleet", Key: key}
	env := handoff.Envelope{BlockTokens: 16, BlockBytes: 4096, PoolBlocks: 64,
		MaxContextTokens: 1024, MaxPrefillTokens: 512, MaxRunningRequests: 4}
	newPool := func() *kvlease.Pool[[]byte] {
		mem, _ := kvlease.NewHostMemory(env.PoolBlocks, env.BlockBytes)
		p, _ := kvlease.NewPool[[]byte](mem)
		return p
	}

	dataLn, _ := net.Listen("tcp", "127.0.0.1:0")
	recv := tcp.NewReceiver(dataLn, tcp.Config{IdleTimeout: time.Minute})
	defer recv.Close()
	dst, _ := handoff.NewDestination(newPool(), recv, handoff.DestinationConfig[[]byte]{
		HalfConfig:  handoff.HalfConfig{Envelope: env, Name: "decode", Peer: "prefill", Auth: auth},
		OnDelivered: func(in *handoff.Incoming[[]byte]) { in.Lease().Release() },
	})
	ctlLn, _ := net.Listen("tcp", "127.0.0.1:0")
	go func() {
		c, err := ctlLn.Accept()
		_ = ctlLn.Close()
		if err == nil {
			_ = dst.Serve(c)
		}
	}()

	sender := tcp.NewSender(tcp.Config{MaxIdleConns: 2, IdleTimeout: time.Minute})
	defer sender.Close()
	conn, _ := net.Dial("tcp", ctlLn.Addr().String())
	src, _ := handoff.NewSource(conn, sender, handoff.HalfConfig{Envelope: env, Name: "prefill", Peer: "decode", Auth: auth})
	defer src.Close()
	prefill := newPool()
	for id := uint64(1); id <= 3; id++ {
		lease, _ := prefill.Acquire("req", 4)
		o, _ := src.Propose(id, "req", lease, nil)
		<-o.Done()
		fmt.Println("handoff", id, o.State())
		lease.Release()
		// The destination's word puts the connection back in the pool
		// a moment after the handoff is final.
		for end := time.Now().Add(10 * time.Second); sender.Stats().Idle == 0 && time.Now().Before(end); {
			time.Sleep(time.Millisecond)
		}
	}
	s := sender.Stats()
	fmt.Printf("dials %d, reuses %d, idle %d\n", s.Dials, s.Reuses, s.Idle)
	// Output:
	// handoff 1 delivered
	// handoff 2 delivered
	// handoff 3 delivered
	// dials 1, reuses 2, idle 1
}

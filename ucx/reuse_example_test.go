package ucx_test

import (
	"fmt"
	"net"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/ucx"
)

// Handoffs one after the other in one session reuse one connection a
// side: the first connects, the others cost no worker and no handshake.
// The destination keeps its idle workers longer than the source keeps
// its endpoints to them.
func Example_reusedConnections() {
	envelope := handoff.Envelope{BlockTokens: 16, BlockBytes: 4096, PoolBlocks: 64,
		MaxContextTokens: 1024, MaxPrefillTokens: 512, MaxRunningRequests: 4}
	newPool := func() *kvlease.Pool[[]byte] {
		mem, _ := kvlease.NewHostMemory(64, 4096)
		p, _ := kvlease.NewPool[[]byte](mem)
		return p
	}
	prefill, decode := newPool(), newPool()
	key, _ := handoff.GenerateKey()
	auth := &handoff.PSK{ID: "prefill-fleet", Key: key}

	receiver, err := ucx.NewReceiver(ucx.Config{MaxIdle: 2, IdleTimeout: 2 * time.Minute}, ucx.HostBytes)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer receiver.Close()
	sender, err := ucx.NewSender(ucx.Config{MaxIdle: 2, IdleTimeout: time.Minute}, ucx.HostBytes)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sender.Close()

	dst, _ := handoff.NewDestination(decode, receiver, handoff.DestinationConfig[[]byte]{
		HalfConfig:  handoff.HalfConfig{Envelope: envelope, Auth: auth},
		OnDelivered: func(in *handoff.Incoming[[]byte]) { in.Lease().Release() },
	})
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	go func() {
		c, err := ln.Accept()
		if err == nil {
			_ = dst.Serve(c)
		}
	}()
	conn, _ := net.Dial("tcp", ln.Addr().String())
	src, err := handoff.NewSource(conn, sender, handoff.HalfConfig{Envelope: envelope, Auth: auth})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer src.Close()

	lease, _ := prefill.Acquire("req", 16)
	for id := uint64(1); id <= 3; id++ {
		o, _ := src.Propose(id, fmt.Sprint("req-", id), lease, nil)
		fmt.Println("handoff", id, o.Wait(10*time.Second))
	}
	lease.Release()
	s, r := sender.Stats(), receiver.Stats()
	fmt.Println("source: connects", s.Connects, "reuses", s.Reuses, "idle", s.Idle)
	fmt.Println("destination: workers", r.Workers, "reuses", r.Reuses, "idle", r.Idle)
	// Output:
	// handoff 1 delivered
	// handoff 2 delivered
	// handoff 3 delivered
	// source: connects 1 reuses 2 idle 1
	// destination: workers 1 reuses 2 idle 1
}

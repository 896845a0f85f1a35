package ucx_test

import (
	"fmt"
	"net"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/ucx"
)

// Both halves of a handoff over UCX in one process (in production they
// are two processes on two machines): the decode side reads the prefill
// side's blocks as tagged messages, each block checked against a MAC
// under the authenticated session's key.
func Example() {
	envelope := handoff.Envelope{BlockTokens: 16, BlockBytes: 4096, PoolBlocks: 64,
		MaxContextTokens: 1024, MaxPrefillTokens: 512, MaxRunningRequests: 4}
	newPool := func() *kvlease.Pool[[]byte] {
		mem, _ := kvlease.NewHostMemory(64, 4096)
		p, _ := kvlease.NewPool[[]byte](mem)
		return p
	}
	prefill, decode := newPool(), newPool()
	// Both halves hold the pre-shared key: the control session is
	// authenticated, and every block is bound to it.
	key, _ := handoff.GenerateKey()
	auth := &handoff.PSK{ID: "prefill-fleet", Key: key}

	receiver, err := ucx.NewReceiver(ucx.Config{}, ucx.HostBytes)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer receiver.Close()
	sender, err := ucx.NewSender(ucx.Config{}, ucx.HostBytes)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sender.Close()

	delivered := make(chan string, 1)
	dst, _ := handoff.NewDestination(decode, receiver, handoff.DestinationConfig[[]byte]{
		HalfConfig: handoff.HalfConfig{Envelope: envelope, Auth: auth},
		OnDelivered: func(in *handoff.Incoming[[]byte]) {
			b, _ := in.Lease().Region(3)
			delivered <- string(b[:5])
			in.Lease().Release()
		},
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

	lease, _ := prefill.Acquire("req-1", 8)
	b, _ := lease.Region(3)
	copy(b, "hello")
	o, _ := src.Propose(1, "req-1", lease, nil)
	fmt.Println("source:", o.Wait(10*time.Second), "to", src.Peer().Identity)
	select {
	case got := <-delivered:
		fmt.Println("decode block 3:", got)
	case <-time.After(10 * time.Second):
		fmt.Println("nothing delivered")
	}
	lease.Release()
	// Output:
	// source: delivered to psk:prefill-fleet
	// decode block 3: hello
}

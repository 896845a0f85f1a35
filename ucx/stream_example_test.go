package ucx_test

import (
	"fmt"
	"net"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/ucx"
)

// A streaming handoff over UCX (push model): the prefill side proposes
// the lease before its model has written it and marks each layer as it
// is computed; the Sender (a handoff.StreamSendPlane) sends each layer's
// share of the blocks, one message per run and layer, as soon as it is
// marked, never before. The destination needs nothing for streaming: the
// Start bytes say it.
func ExampleSender_SendStream() {
	key, _ := handoff.GenerateKey()
	auth := &handoff.PSK{ID: "prefill-fleet", Key: key}
	env := handoff.Envelope{BlockTokens: 16, BlockBytes: 4096, PoolBlocks: 64,
		MaxContextTokens: 1024, MaxPrefillTokens: 512, MaxRunningRequests: 4}
	newPool := func() *kvlease.Pool[[]byte] {
		mem, _ := kvlease.NewHostMemory(env.PoolBlocks, env.BlockBytes)
		p, _ := kvlease.NewPool[[]byte](mem)
		return p
	}
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

	decode := newPool()
	dst, _ := handoff.NewDestination(decode, receiver, handoff.DestinationConfig[[]byte]{
		HalfConfig:  handoff.HalfConfig{Envelope: env, Auth: auth},
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
	src, err := handoff.NewSource(conn, sender, handoff.HalfConfig{Envelope: env, Auth: auth})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer src.Close()

	const blocks, layers = 8, 4
	prefill := newPool()
	lease, _ := prefill.Acquire("req", blocks)
	defer lease.Release()
	progress, _ := handoff.NewProgress(blocks, layers)
	out, _ := src.Propose(1, "req", lease, nil, handoff.Streaming(progress))
	// (Here the prefill would take a while; the example waits for the
	// Start, which goes out before any layer is written.)
	for i := 0; i < 10000 && out.State() != handoff.Transferring; i++ {
		time.Sleep(time.Millisecond)
	}
	for layer := range layers {
		// The model computes layer `layer` and writes its share of
		// every block (bytes [layer·1024, (layer+1)·1024) of each), then
		// marks it: from here on the plane may send it.
		for i := range blocks {
			r, _ := lease.Region(i)
			part := r[layer*1024 : (layer+1)*1024]
			for j := range part {
				part[j] = byte(i + layer)
			}
		}
		_ = progress.WroteLayers(layer + 1)
	}
	fmt.Println("handoff", out.Wait(10*time.Second))
	fmt.Println("messages", sender.Stats().Messages) // one run × 4 layers
	// Output:
	// handoff delivered
	// messages 4
}

package tcp_test

import (
	"fmt"
	"net"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
)

// A streaming handoff: the prefill side proposes the lease before its
// model has written it, marks each layer as it is computed, and the
// Sender (a handoff.StreamSendPlane) sends every layer's share of the
// blocks as soon as it is marked, never before.
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

	// The decode side: nothing to configure for streaming (the data
	// connection's hello says it).
	decode := newPool()
	dataLn, _ := net.Listen("tcp", "127.0.0.1:0")
	recv := tcp.NewReceiver(dataLn, tcp.Config{})
	defer recv.Close()
	delivered := make(chan *handoff.Incoming[[]byte], 1)
	dst, _ := handoff.NewDestination(decode, recv, handoff.DestinationConfig[[]byte]{
		HalfConfig:  handoff.HalfConfig{Envelope: env, Name: "decode", Peer: "prefill", Auth: auth},
		OnDelivered: func(in *handoff.Incoming[[]byte]) { delivered <- in },
	})
	ctlLn, _ := net.Listen("tcp", "127.0.0.1:0")
	served := make(chan error, 1)
	go func() {
		c, err := ctlLn.Accept()
		_ = ctlLn.Close()
		if err == nil {
			err = dst.Serve(c)
		}
		served <- err
	}()

	// The prefill side: 4 blocks computed as 8 layers of 512 bytes each.
	prefill := newPool()
	conn, _ := net.Dial("tcp", ctlLn.Addr().String())
	sender := tcp.NewSender(tcp.Config{})
	defer sender.Close()
	src, _ := handoff.NewSource(conn, sender, handoff.HalfConfig{Envelope: env, Name: "prefill", Peer: "decode", Auth: auth})
	const layers = 8
	lease, _ := prefill.Acquire("req-1", 4)
	progress, _ := handoff.NewProgress(lease.Len(), layers)
	o, _ := src.Propose(1, "req-1", lease, nil, handoff.Streaming(progress))
	for l := range layers {
		for i := range lease.Len() { // the model writes layer l of every block
			r, _ := lease.Region(i)
			copy(r[l*512:], fmt.Sprintf("block %d layer %d", i, l))
		}
		_ = progress.WroteLayers(l + 1) // then says so: the plane may send it
	}
	<-o.Done()
	in := <-delivered

	b, _ := in.Lease().ReadRegion(2)
	fmt.Printf("prefill: %v\n", o.State())
	fmt.Printf("decode: %v, block 2 layer 7 holds %q\n", in.State(), b[7*512:7*512+15])
	in.Lease().Release()
	lease.Release()
	_ = src.Close()
	<-served
	// Output:
	// prefill: delivered
	// decode: delivered, block 2 layer 7 holds "block 2 layer 7"
}

package tcp_test

import (
	"fmt"
	"net"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
	"github.com/kvlease/kvlease/layout"
)

// A prefill worker whose KV is per-layer tensors (layer-separated) hands a
// request to a decode worker whose pool is block-contiguous, over
// 127.0.0.1: each block crosses as all its pieces, and the envelope's
// Layout lets the decode side check at propose time that the pieces
// agree.
func ExampleSendLayered() {
	key, _ := handoff.GenerateKey()
	auth := &handoff.PSK{ID: "prefill-fleet", Key: key}
	tag := "bf16 t16 h2 d64" // 16 tokens × 2 heads × 64 dims × 2 bytes = 4 KiB per piece
	prefill, _ := layout.NewHost(layout.LayerSeparated(4, 2, 32, 4096, tag))
	decode, _ := layout.NewHost(layout.Contiguous(4, 2, 32, 4096, tag))
	srcPool, _ := kvlease.NewPool[layout.Block](prefill)
	dstPool, _ := kvlease.NewPool[layout.Block](decode)
	env := handoff.Envelope{BlockTokens: 16, BlockBytes: 4 * 2 * 4096, PoolBlocks: 32,
		MaxContextTokens: 512, MaxPrefillTokens: 256, MaxRunningRequests: 4,
		Layout: layout.Layout{Layers: 4, KVs: 2, PieceBytes: 4096, Tag: tag}}

	ctlLn, _ := net.Listen("tcp", "127.0.0.1:0")
	dataLn, _ := net.Listen("tcp", "127.0.0.1:0")
	recv := tcp.NewReceiver(dataLn, tcp.Config{})
	defer recv.Close()
	got := make(chan *handoff.Incoming[layout.Block], 1)
	dst, _ := handoff.NewDestination(dstPool, tcp.ReceiveLayered[layout.Block](recv), handoff.DestinationConfig[layout.Block]{
		HalfConfig:  handoff.HalfConfig{Envelope: env, Auth: auth},
		OnDelivered: func(in *handoff.Incoming[layout.Block]) { got <- in },
	})
	served := make(chan error, 1)
	go func() {
		c, err := ctlLn.Accept()
		_ = ctlLn.Close()
		if err == nil {
			err = dst.Serve(c)
		}
		served <- err
	}()
	conn, _ := net.Dial("tcp", ctlLn.Addr().String())
	sender := tcp.NewSender(tcp.Config{})
	defer sender.Close()
	src, _ := handoff.NewSource(conn, tcp.SendLayered[layout.Block](sender), handoff.HalfConfig{Envelope: env, Auth: auth})

	lease, _ := srcPool.Acquire("req-1", 3)
	b, _ := lease.Region(2)
	copy(b.Piece(3, 1), "V of layer 3, block 2")
	o, _ := src.Propose(1, "req-1", lease, nil)
	fmt.Println("source:", o.Wait(5*time.Second))
	in := <-got
	r, _ := in.Lease().ReadRegion(2)
	fmt.Printf("destination: %q\n", r.Piece(3, 1)[:21])
	fmt.Println("one transfer per side:", sender.Stats().Completed, recv.Stats().Completed)
	in.Lease().Release()
	lease.Release()
	_ = src.Close()
	<-served
	// Output:
	// source: delivered
	// destination: "V of layer 3, block 2"
	// one transfer per side: 1 1
}

package tcp_test

import (
	"bytes"
	"fmt"
	"net"
	"slices"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
)

// Both halves of a handoff over 127.0.0.1: the decode side serves a
// control connection and a data listener, the prefill side proposes a
// lease and the blocks move over TCP. (In a deployment each half lives
// in its own process; see the package's cross-process tests.)
func Example() {
	// Both halves hold the same pre-shared key (handed over out of band:
	// a file private to the user, an inherited descriptor); it never
	// travels. Every control frame and every block is bound to the
	// session it authenticates.
	key, _ := handoff.GenerateKey()
	auth := &handoff.PSK{ID: "prefill-fleet", Key: key}
	env := handoff.Envelope{BlockTokens: 16, BlockBytes: 4096, PoolBlocks: 64,
		MaxContextTokens: 1024, MaxPrefillTokens: 512, MaxRunningRequests: 4}
	newPool := func() *kvlease.Pool[[]byte] {
		mem, _ := kvlease.NewHostMemory(env.PoolBlocks, env.BlockBytes)
		p, _ := kvlease.NewPool[[]byte](mem)
		return p
	}

	// The decode side.
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

	// The prefill side.
	prefill := newPool()
	conn, _ := net.Dial("tcp", ctlLn.Addr().String())
	sender := tcp.NewSender(tcp.Config{})
	defer sender.Close()
	src, _ := handoff.NewSource(conn, sender, handoff.HalfConfig{Envelope: env, Name: "prefill", Peer: "decode", Auth: auth})
	lease, _ := prefill.Acquire("req-1", 4)
	for i := range lease.Len() {
		r, _ := lease.Region(i)
		copy(r, fmt.Sprintf("KV of block %d", i))
	}
	o, _ := src.Propose(1, "req-1", lease, nil)
	<-o.Done()
	in := <-delivered

	var notes []string
	for _, s := range o.History() {
		if s.From == s.To {
			// A note: the source's own transfer went quiescent, the
			// decode side reported. They arrive in either order.
			notes = append(notes, s.Event.String())
			continue
		}
		fmt.Printf("prefill: %v → %v  %s/%v\n", s.From, s.To, s.By, s.Event)
	}
	slices.Sort(notes)
	fmt.Println("prefill notes:", notes)
	first, _ := in.Lease().ReadRegion(3)
	fmt.Printf("decode: %v, %d blocks, block 3 holds %q\n", in.State(), in.Blocks(), bytes.TrimRight(first[:16], "\x00"))
	in.Lease().Release()
	lease.Release()
	_ = src.Close()
	<-served
	fmt.Println("decode pool:", decode.Stats().Free, "free")
	// Output:
	// prefill: none → proposed  prefill/propose
	// prefill: proposed → accepted  decode/accept
	// prefill: accepted → transferring  transport/attach
	// prefill: transferring → delivered  transport/resolve
	// prefill notes: [peer-outcome quiescent]
	// decode: delivered, 4 blocks, block 3 holds "KV of block 3"
	// decode pool: 64 free
}

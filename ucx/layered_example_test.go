package ucx_test

import (
	"fmt"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/layout"
	"github.com/kvlease/kvlease/ucx"
)

// A block of per-layer KV moves as all its pieces: here from a
// layer-separated source ([layers][K, V][blocks][piece], vLLM's per-layer
// tensors) into a block-contiguous destination, one message per block
// gathered from the source's pieces and scattered into the destination's.
// The plane-level calls are what handoff.Source and handoff.Destination
// make.
func ExampleLayeredPieces() {
	src, _ := layout.NewHost(layout.LayerSeparated(4, 2, 16, 256, "bf16"))
	dst, _ := layout.NewHost(layout.Contiguous(4, 2, 16, 256, "bf16"))
	sender, err := ucx.NewSender(ucx.Config{}, ucx.LayeredPieces[layout.Block])
	if err != nil {
		fmt.Println(err)
		return
	}
	defer sender.Close()
	receiver, err := ucx.NewReceiver(ucx.Config{}, ucx.LayeredPieces[layout.Block])
	if err != nil {
		fmt.Println(err)
		return
	}
	defer receiver.Close()

	from := []layout.Block{src.Region(2), src.Region(3), src.Region(4)}
	to := []layout.Block{dst.Region(0), dst.Region(1), dst.Region(2)}
	for i, b := range from {
		b.Piece(3, 1)[0] = byte(10 + i) // layer 3's V
	}
	id := handoff.PlaneID{Session: 1, Handoff: 1}
	accept, _ := receiver.Prepare(id, len(to))
	var read *kvlease.Transfer
	start, err := sender.Send(id, from, accept, func(*kvlease.Transfer) error { return nil })
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := receiver.Receive(id, to, start, func(t *kvlease.Transfer) error { read = t; return nil }); err != nil {
		fmt.Println(err)
		return
	}
	<-read.Done()
	sender.Finish(id, read.Err()) // the destination's done
	fmt.Println("read:", read.Err())
	fmt.Println("layer 3's V:", to[0].Piece(3, 1)[0], to[1].Piece(3, 1)[0], to[2].Piece(3, 1)[0])
	s, r := sender.Stats(), receiver.Stats()
	fmt.Printf("source: %d messages sent; destination: %d received, %d bytes\n", s.Messages, r.Messages, r.Bytes)
	// Output:
	// read: <nil>
	// layer 3's V: 10 11 12
	// source: 3 messages sent; destination: 3 received, 6144 bytes
}

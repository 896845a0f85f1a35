package layout_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/layout"
)

func TestHostPiecesWhereTheLayoutSays(t *testing.T) {
	l := layout.LayerSeparated(3, 2, 4, 8, "t")
	base := make([]byte, l.Size()+5)
	h, err := layout.NewHostOver(l, base)
	if err != nil {
		t.Fatal(err)
	}
	if h.Blocks() != 4 || h.BlockBytes() != 48 || len(h.Base()) != l.Size() {
		t.Fatalf("blocks %d, block bytes %d, base %d", h.Blocks(), h.BlockBytes(), len(h.Base()))
	}
	p, err := kvlease.NewPool[layout.Block](h)
	if err != nil {
		t.Fatal(err)
	}
	ls, err := p.Acquire("r", 4)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		b, err := ls.Region(i)
		if err != nil {
			t.Fatal(err)
		}
		pieces := b.AppendPieces(nil)
		if len(pieces) != 6 {
			t.Fatalf("%d pieces", len(pieces))
		}
		for k, pc := range pieces {
			if len(pc) != 8 || cap(pc) != 8 {
				t.Fatalf("piece len %d cap %d", len(pc), cap(pc))
			}
			pc[0] = byte(10*int(b.ID) + k)
		}
	}
	// Piece (layer, kv) of block id is at Offset in the base, and
	// AppendPieces lists them in (layer, kv) order.
	for id := range 4 {
		for layer := range 3 {
			for kv := range 2 {
				if got, want := base[l.Offset(layer, kv, id)], byte(10*id+layer*2+kv); got != want {
					t.Fatalf("block %d layer %d kv %d: %d, want %d", id, layer, kv, got, want)
				}
			}
		}
	}
	if (layout.Block{}).Layout() != (layout.Layout{}) {
		t.Fatal("the zero block has a layout")
	}
	if _, err := layout.NewHostOver(l, base[:l.Size()-1]); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("NewHostOver of a short base: %v", err)
	}
	if _, err := layout.NewHost(layout.Layout{}); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("NewHost of the zero layout: %v", err)
	}
}

// Host memory in a per-layer layout: a pool over it hands out whole
// model blocks, and each block's pieces sit where the engine's tensors
// expect them (layer l's K of block b at l·LayerStride + b·BlockStride).
func ExampleHost() {
	h, _ := layout.NewHost(layout.LayerSeparated(2, 2, 8, 64, "bf16 t16 h1 d2"))
	p, _ := kvlease.NewPool[layout.Block](h)
	l, _ := p.Acquire("req", 2)
	fmt.Println("a lease of", l.Len(), "blocks of", p.Memory().BlockBytes(), "bytes")

	b := h.Region(3)
	copy(b.Piece(1, 0), "K of layer 1")
	lay := h.Layout()
	off := 1*lay.LayerStride + 3*lay.BlockStride
	fmt.Printf("%d pieces per block; layer 1's K of block 3 at 1·%d + 3·%d: %q\n",
		len(b.AppendPieces(nil)), lay.LayerStride, lay.BlockStride, h.Base()[off:off+12])
	// Output:
	// a lease of 2 blocks of 256 bytes
	// 4 pieces per block; layer 1's K of block 3 at 1·1024 + 3·64: "K of layer 1"
}

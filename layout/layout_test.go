package layout_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/layout"
)

func TestOffsetsAndSize(t *testing.T) {
	sep := layout.LayerSeparated(3, 2, 5, 64, "x")
	con := layout.Contiguous(3, 2, 5, 64, "x")
	for _, l := range []layout.Layout{sep, con} {
		if err := l.Validate(); err != nil {
			t.Fatal(err)
		}
		if l.Size() != 3*2*5*64 || l.BlockBytes() != 3*2*64 || l.PiecesPerBlock() != 6 {
			t.Fatalf("%v: size %d block %d", l, l.Size(), l.BlockBytes())
		}
		// Every piece of every block is distinct and inside Size.
		seen := map[int]bool{}
		for b := range 5 {
			for _, p := range l.AppendPieces(nil, b) {
				if p.Off < 0 || p.Off+p.Len > l.Size() || seen[p.Off] || p.Off%64 != 0 {
					t.Fatalf("%v: piece %+v", l, p)
				}
				seen[p.Off] = true
			}
		}
		if len(seen) != 30 {
			t.Fatalf("%d pieces", len(seen))
		}
	}
	// Layer-separated: K of block b in layer l at l·(2·5·64) + b·64.
	if got := sep.Offset(2, 1, 3); got != 2*640+1*320+3*64 {
		t.Fatalf("Offset = %d", got)
	}
	// Contiguous: block b is one span; its pieces adjacent.
	if !con.IsContiguous() || sep.IsContiguous() {
		t.Fatal("IsContiguous")
	}
	ps := con.AppendPieces(nil, 4)
	for i, p := range ps {
		if p.Off != 4*con.BlockBytes()+i*64 {
			t.Fatalf("contiguous piece %d at %d", i, p.Off)
		}
	}
	defer func() {
		if recover() == nil {
			t.Fatal("AppendPieces out of range did not panic")
		}
	}()
	con.AppendPieces(nil, 5)
}

func TestValidate(t *testing.T) {
	for _, l := range []layout.Layout{
		{},
		{Layers: 1, KVs: 1, Blocks: 1, PieceBytes: 0},
		{Layers: 2, KVs: 1, Blocks: 1, PieceBytes: 8, LayerStride: 4},              // layers overlap
		{Layers: 1, KVs: 2, Blocks: 2, PieceBytes: 8, KVStride: 8, BlockStride: 8}, // kv vs block overlap
		{Layers: 1, KVs: 1, Blocks: 2, PieceBytes: 8, BlockStride: -8},
	} {
		if err := l.Validate(); !errors.Is(err, kvlease.ErrInvalidArgument) {
			t.Fatalf("Validate(%v) = %v", l, err)
		}
	}
	// A single block needs no block stride.
	if err := (layout.Layout{Layers: 2, KVs: 2, Blocks: 1, PieceBytes: 8, LayerStride: 16, KVStride: 8}).Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestFingerprint(t *testing.T) {
	a := layout.LayerSeparated(32, 2, 100, 4096, "bf16 t16 h8 d128")
	b := layout.Contiguous(32, 2, 7, 4096, "bf16 t16 h8 d128")
	if a.Fingerprint() != b.Fingerprint() || a.Compatible(b) != nil {
		t.Fatal("strides and block counts must not change the fingerprint")
	}
	for _, o := range []layout.Layout{
		layout.LayerSeparated(31, 2, 100, 4096, "bf16 t16 h8 d128"),
		layout.LayerSeparated(32, 1, 100, 4096, "bf16 t16 h8 d128"),
		layout.LayerSeparated(32, 2, 100, 2048, "bf16 t16 h8 d128"),
		layout.LayerSeparated(32, 2, 100, 4096, "fp8 t16 h8 d128"),
	} {
		if o.Fingerprint() == a.Fingerprint() {
			t.Fatalf("%v: same fingerprint as %v", o, a)
		}
		if err := a.Compatible(o); !errors.Is(err, kvlease.ErrInvalidArgument) {
			t.Fatalf("Compatible(%v) = %v", o, err)
		}
	}
}

// The pieces of block 1 of a two-layer model stored per layer.
func ExampleLayerSeparated() {
	l := layout.LayerSeparated(2, 2, 4, 256, "bf16 t16 h1 d8")
	for _, p := range l.AppendPieces(nil, 1) {
		fmt.Printf("layer %d kv %d at %d\n", p.Layer, p.KV, p.Off)
	}
	// Output:
	// layer 0 kv 0 at 256
	// layer 0 kv 1 at 1280
	// layer 1 kv 0 at 2304
	// layer 1 kv 1 at 3328
}

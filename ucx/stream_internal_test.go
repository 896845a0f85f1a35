package ucx

import (
	"errors"
	"testing"

	"github.com/kvlease/kvlease"
)

// TestPlanParts: a part is its layer's share of each block of its
// message, as slices of each side's own pieces in order: a layer that
// straddles two pieces is two entries, adjacent slices are merged (the
// same layer of adjacent single-piece blocks stays apart: their layers
// are not adjacent), and a layer count that does not split the block,
// or too many parts, is refused.
func TestPlanParts(t *testing.T) {
	// Two blocks of pieces 256, 256, 512 bytes (1 KiB), 4 layers of 256:
	// block 0 at 0x1000 (pieces adjacent), block 1 scattered.
	g := &geometry{sizes: []int{256, 256, 512}, bb: 1024, spans: []Span{
		{Addr: 0x1000, Len: 256}, {Addr: 0x1100, Len: 256}, {Addr: 0x1200, Len: 512},
		{Addr: 0x9000, Len: 256}, {Addr: 0x5000, Len: 256}, {Addr: 0x7000, Len: 512},
	}}
	msgs := []message{{first: 0, count: 2}}
	parts, spans, err := planParts(g, msgs, 4)
	if err != nil {
		t.Fatal(err)
	}
	want := [][]Span{
		{{Addr: 0x1000, Len: 256}, {Addr: 0x9000, Len: 256}},
		{{Addr: 0x1100, Len: 256}, {Addr: 0x5000, Len: 256}},
		{{Addr: 0x1200, Len: 256}, {Addr: 0x7000, Len: 256}},
		{{Addr: 0x1300, Len: 256}, {Addr: 0x7100, Len: 256}},
	}
	if len(parts) != 4 {
		t.Fatalf("%d parts", len(parts))
	}
	for l, pt := range parts {
		got := spans[pt.iov : pt.iov+pt.niov]
		if pt.layer != l || pt.n != 512 || pt.tag != uint32(l) || pt.contig || len(got) != len(want[l]) {
			t.Fatalf("part %d: %+v %v", l, pt, got)
		}
		for k := range got {
			if got[k].Addr != want[l][k].Addr || got[k].Len != want[l][k].Len {
				t.Fatalf("part %d entry %d: %+v, want %+v", l, k, got[k], want[l][k])
			}
		}
	}
	// 2 layers of 512: layer 0 of block 0 is pieces 0 and 1, adjacent:
	// merged into one entry; one block per message: contiguous parts.
	parts, spans, err = planParts(g, []message{{first: 0, count: 1}, {first: 1, count: 1}}, 2)
	if err != nil {
		t.Fatal(err)
	}
	if pt := parts[0]; !pt.contig || pt.addr != 0x1000 || pt.n != 512 || spans[pt.iov].Len != 512 {
		t.Fatalf("layer 0 of block 0: %+v", pt)
	}
	if pt := parts[1]; pt.contig || pt.niov != 2 || pt.tag != 2 || pt.first != 1 || pt.layer != 0 {
		t.Fatalf("layer 0 of block 1 (layer-major: second): %+v", pt)
	}
	if _, _, err := planParts(g, msgs, 3); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("3 layers of 1024 bytes: %v", err)
	}
	many := make([]message, maxStreamParts/64+1)
	if _, _, err := planParts(g, many, 64); !errors.Is(err, kvlease.ErrExceedsCapacity) {
		t.Fatalf("too many parts: %v", err)
	}
}

// TestStreamUnitTagsFold: a keyed stream's sum folded from its layers'
// GMACs, computed one layer at a time over pieces that do not line up
// with the layers, is the sum computed over the whole block at once, and
// it binds the block index.
func TestStreamUnitTagsFold(t *testing.T) {
	key := make([]byte, 32)
	key[0] = 7
	const layers = 4
	mem := make([]byte, 2048)
	for i := range mem {
		mem[i] = byte(i*13 + i/7)
	}
	// One block of pieces 300, 700, 1048 bytes: layers of 512 straddle them.
	pieces := []Span{hostSpan(mem[:300]), hostSpan(mem[300:1000]), hostSpan(mem[1000:])}
	s, err := newSummer(integrityMAC, key, layerUnits(2048, layers))
	if err != nil {
		t.Fatal(err)
	}
	whole := make([]byte, macLen)
	s.sum(whole, 5, pieces)
	tags := make([]byte, layers*macLen)
	for l := range layers {
		s.unit(tags[l*macLen:l*macLen], 5, l, pieces, l*512, 512)
	}
	folded := make([]byte, macLen)
	s.fold(folded, tags, 5)
	if string(folded) != string(whole) {
		t.Fatalf("folded %x, whole %x", folded, whole)
	}
	s.fold(folded, tags, 6)
	if string(folded) == string(whole) {
		t.Fatal("the fold does not bind the block index")
	}
}

package kvlease

import (
	"math"
	"testing"
)

func TestNewHostMemoryBadSizes(t *testing.T) {
	for _, c := range []struct{ blocks, bytes int }{
		{0, 64}, {-1, 64}, {4, 0}, {4, -1}, {0, 0}, {-4, -4}, {math.MinInt, 64},
		{2, math.MaxInt},       // product overflows
		{math.MaxInt / 2, 3},   // product overflows
		{math.MaxInt32 + 1, 1}, // more blocks than a BlockID can name
	} {
		m, err := NewHostMemory(c.blocks, c.bytes)
		coreErrIs(t, err, ErrInvalidArgument, "NewHostMemory with bad sizes")
		if m != nil {
			t.Fatalf("NewHostMemory(%d, %d) returned memory with an error", c.blocks, c.bytes)
		}
	}
}

// Each region has len == cap == BlockBytes: an append can never reach the
// neighbour, and regions never overlap.
func TestHostMemoryRegions(t *testing.T) {
	const blocks, size = 5, 48
	m, err := NewHostMemory(blocks, size)
	coreNoErr(t, err, "NewHostMemory")
	var mem Memory[[]byte] = m
	if mem.Blocks() != blocks || mem.BlockBytes() != size {
		t.Fatalf("sizes %d × %d", mem.Blocks(), mem.BlockBytes())
	}
	for i := range blocks {
		r := mem.Region(BlockID(i))
		if len(r) != size || cap(r) != size {
			t.Fatalf("region %d: len %d cap %d, want %d", i, len(r), cap(r), size)
		}
		for j := range r {
			r[j] = byte(i + 1)
		}
	}
	for i := range blocks {
		for j, b := range mem.Region(BlockID(i)) {
			if b != byte(i+1) {
				t.Fatalf("region %d byte %d = %d: regions overlap", i, j, b)
			}
		}
	}
	// Appending to a region reallocates; the neighbour is untouched.
	for i := range blocks - 1 {
		r := mem.Region(BlockID(i))
		grown := append(r, 0xEE, 0xEE, 0xEE)
		if &grown[0] == &r[0] {
			t.Fatalf("append to region %d grew in place", i)
		}
		next := mem.Region(BlockID(i + 1))
		for j, b := range next {
			if b != byte(i+2) {
				t.Fatalf("append to region %d reached region %d byte %d", i, i+1, j)
			}
		}
	}
	// The same through a pool's leases.
	p, err := NewPool[[]byte](m)
	coreNoErr(t, err, "NewPool")
	l := coreAcquire(t, p, "l", blocks)
	for i := range blocks {
		r, err := l.Region(i)
		coreNoErr(t, err, "Region")
		if len(r) != size || cap(r) != size {
			t.Fatalf("lease region %d: len %d cap %d", i, len(r), cap(r))
		}
		_ = append(r, 0xFF)
	}
	for i := range blocks {
		for _, b := range mem.Region(BlockID(i)) {
			if b == 0xFF || b == 0xEE {
				t.Fatal("an append reached another block")
			}
		}
	}
	l.Release()
	coreAllFree(t, p)
}

func TestHostMemoryRegionOutOfRangePanics(t *testing.T) {
	m, _ := NewHostMemory(2, 8)
	for _, id := range []BlockID{-1, 2} {
		func() {
			defer func() {
				if recover() == nil {
					t.Fatalf("Region(%d) did not panic", id)
				}
			}()
			m.Region(id)
		}()
	}
}

package kvlease_test

import (
	"testing"

	"github.com/kvlease/kvlease"
)

// AppendRuns splits where ids stop ascending by one, reports from a
// given block, and allocates nothing when dst has room.
func TestAppendRuns(t *testing.T) {
	refs := func(ids ...kvlease.BlockID) []kvlease.BlockRef {
		out := make([]kvlease.BlockRef, len(ids))
		for i, id := range ids {
			out[i] = kvlease.BlockRef{ID: id, Gen: 1}
		}
		return out
	}
	cases := []struct {
		ids  []kvlease.BlockRef
		want []kvlease.Run
	}{
		{nil, nil},
		{refs(5), []kvlease.Run{{Start: 5, Len: 1}}},
		{refs(1, 2, 3, 7, 8, 4), []kvlease.Run{{Start: 1, Len: 3}, {Start: 7, Len: 2}, {Start: 4, Len: 1}}},
		{refs(3, 2, 1), []kvlease.Run{{Start: 3, Len: 1}, {Start: 2, Len: 1}, {Start: 1, Len: 1}}},
		{refs(4, 4), []kvlease.Run{{Start: 4, Len: 1}, {Start: 4, Len: 1}}},
	}
	for _, c := range cases {
		got := kvlease.AppendRunsForTest(nil, c.ids)
		if len(got) != len(c.want) {
			t.Fatalf("%v: runs %v, want %v", c.ids, got, c.want)
		}
		for i := range got {
			if got[i] != c.want[i] {
				t.Fatalf("%v: runs %v, want %v", c.ids, got, c.want)
			}
		}
	}

	mem, _ := kvlease.NewHostMemory(64, 64)
	pool, _ := kvlease.NewPool[[]byte](mem)
	l, err := pool.Acquire("a", 40)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	dst := make([]kvlease.Run, 0, 8)
	if n := testing.AllocsPerRun(100, func() { dst = l.AppendRuns(dst[:0], 3) }); n != 0 {
		t.Fatalf("AppendRuns with room allocated %.0f times", n)
	}
	if len(dst) != 1 || dst[0] != (kvlease.Run{Start: 3, Len: 37}) || dst[0].Start+kvlease.BlockID(dst[0].Len) != 40 {
		t.Fatalf("runs from block 3: %v", dst)
	}
	if got := mem.Span(dst[0]); len(got) != 37*64 || cap(got) != 37*64 || &got[0] != &mem.Region(3)[0] {
		t.Fatalf("Span(%v): %d bytes, cap %d", dst[0], len(got), cap(got))
	}
}

// An extend's fresh blocks come as a run when the free space holds one:
// a released lease's blocks go back as a run, and the next extend takes
// them in order, continuing the extended lease's own run.
func TestExtendKeepsRuns(t *testing.T) {
	mem, _ := kvlease.NewHostMemory(64, 64)
	pool, _ := kvlease.NewPool[[]byte](mem)
	a, err := pool.Acquire("a", 10)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Release()
	b, err := pool.Acquire("b", 20)
	if err != nil {
		t.Fatal(err)
	}
	first := b.AppendRuns(nil, 0)
	b.Release()
	if err := a.Extend(8); err != nil {
		t.Fatal(err)
	}
	got := a.AppendRuns(nil, 0)
	if len(first) != 1 || len(got) != 1 || got[0].Len != 18 || got[0].Start+kvlease.BlockID(got[0].Len) != first[0].Start+8 {
		t.Fatalf("b's runs %v; a's runs after Extend(8): %v, want one run of 18 ending 8 blocks into b's", first, got)
	}
}

package ucx

import (
	"errors"
	"testing"
)

func TestParseTable(t *testing.T) {
	// 3 blocks of two 256-byte pieces: blocks 0 and 1 in one
	// registration, block 2 in another.
	sizes := []int{256, 256}
	regs := []run{{addr: 0x1000, n: 1024}, {addr: 0x3000, n: 512}}
	keys := [][]byte{{1}, {2}}
	good := appendTable(nil, regs, keys, regs, false)
	gotRegs, pieces, err := parseTable(good, 3, sizes)
	if err != nil {
		t.Fatal(err)
	}
	if len(gotRegs) != 2 || string(gotRegs[1].key) != "\x02" {
		t.Fatalf("registrations %+v", gotRegs)
	}
	want := []remotePiece{{0x1000, 0}, {0x1100, 0}, {0x1200, 0}, {0x1300, 0}, {0x3000, 1}, {0x3100, 1}}
	for k, p := range pieces {
		if p != want[k] {
			t.Fatalf("piece %d: %+v, want %+v", k, p, want[k])
		}
	}
	// Piece-major: piece 0 of every block, then piece 1.
	pm := appendTable(nil, []run{{addr: 0x1000, n: 1536}}, keys[:1], []run{{addr: 0x1000, n: 768}, {addr: 0x1300, n: 768}}, true)
	if _, pieces, err = parseTable(pm, 3, sizes); err != nil {
		t.Fatal(err)
	}
	for k, want := range []uint64{0x1000, 0x1300, 0x1100, 0x1400, 0x1200, 0x1500} {
		if pieces[k].addr != want {
			t.Fatalf("piece-major piece %d at %#x, want %#x", k, pieces[k].addr, want)
		}
	}
	bad := map[string][]byte{
		"registrations out of order": appendTable(nil, []run{regs[1], regs[0]}, keys, regs, false),
		"overlapping registrations":  appendTable(nil, []run{{addr: 0x1000, n: 1024}, {addr: 0x1200, n: 512}}, keys, regs, false),
		"piece outside registrations": appendTable(nil, regs, keys,
			[]run{{addr: 0x1000, n: 1024}, {addr: 0x2000, n: 512}}, false),
		"piece across registrations": appendTable(nil, []run{{addr: 0x1000, n: 1152}, {addr: 0x1480, n: 512}}, keys,
			[]run{{addr: 0x1000, n: 1536}}, false),
		"segments too long": appendTable(nil, regs, keys,
			[]run{{addr: 0x1000, n: 1024}, {addr: 0x3000, n: 512}, {addr: 0x1000, n: 256}}, false),
		"segments too short": appendTable(nil, regs, keys, []run{{addr: 0x1000, n: 1024}}, false),
		"piece across segments": appendTable(nil, regs, keys,
			[]run{{addr: 0x1000, n: 128}, {addr: 0x1080, n: 896}, {addr: 0x3000, n: 512}}, false),
		"trailing byte": append(append([]byte(nil), good...), 0),
		"unknown order": append(append([]byte(nil), good[:len(good)-1]...), 0x80|orderSegsAreRegs),
	}
	for n := range len(good) {
		bad["truncated"+string(rune('a'+n))] = good[:n]
	}
	for name, b := range bad {
		if _, _, err := parseTable(b, 3, sizes); !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: %v", name, err)
		}
	}
	// Piece-major order for one-piece blocks is not something a source
	// sends.
	if _, _, err := parseTable(appendTable(nil, regs[:1], keys[:1], regs[:1], true), 4, []int{256}); !errors.Is(err, ErrCorrupt) {
		t.Errorf("piece-major one-piece blocks: %v", err)
	}
}

func TestMatchPieces(t *testing.T) {
	for _, tc := range []struct {
		src, dst []int
		ok       bool
	}{
		{[]int{256, 256}, []int{256, 256}, true},
		{[]int{512}, []int{256, 256}, true}, // a plain block holds the pieces in order
		{[]int{256, 256}, []int{512}, true},
		{[]int{256, 256}, []int{128, 128, 128, 128}, false},
		{[]int{256, 256}, []int{256, 128}, false},
		{[]int{512}, []int{256}, false},
		{[]int{256, 256}, []int{1024}, false},
	} {
		if err := matchPieces(tc.src, tc.dst); (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrCorrupt)) {
			t.Errorf("%v into %v: %v", tc.src, tc.dst, err)
		}
	}
}

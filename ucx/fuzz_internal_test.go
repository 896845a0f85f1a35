package ucx

import (
	"encoding/binary"
	"errors"
	"runtime"
	"testing"
)

// The plane bytes come from the peer: every parser refuses what it
// cannot use with ErrCorrupt, never panics, and allocates only after a
// length check.

func FuzzParsePushAccept(f *testing.F) {
	f.Add(appendPushAccept(nil, 2, 7, 1<<20, []byte{1, 2, 3}))
	f.Add(append([]byte{'K', 'U', 3, 2, 0, 0, 0, 7, 0, 0, 0, 3, 0}, 1, 2, 3)) // version 3
	f.Add([]byte{'K', 'U', version, 2, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		a, err := parsePushAccept(b)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		if a.blocks <= 0 || len(a.addr) == 0 || a.maxMsg <= 0 {
			t.Fatalf("accepted %d blocks, messages of %d bytes, address of %d bytes", a.blocks, a.maxMsg, len(a.addr))
		}
		if again := appendPushAccept(nil, a.blocks, a.salt, a.maxMsg, a.addr); string(again) != string(b) {
			t.Fatalf("parsed accept does not round-trip")
		}
	})
}

func FuzzParsePushStart(f *testing.F) {
	nonce := make([]byte, nonceLen)
	f.Add(appendPushStart(nil, &pushStart{sizes: []int{4096}, blocks: 3, mode: integrityMAC, nonce: nonce, addr: []byte{1, 2, 3}, per: 1}))
	f.Add(appendPushStart(nil, &pushStart{sizes: []int{256, 256, 512}, blocks: 1, mode: integrityCRC, nonce: nonce, addr: make([]byte, 60), per: 256}))
	f.Add(appendPushStart(nil, &pushStart{sizes: []int{4096}, blocks: 10, mode: integrityCRC, nonce: nonce, addr: []byte{1}, per: 3,
		runs: []blockRun{{first: 1, count: 4}, {first: 5, count: 2}, {first: 8, count: 2}}}))
	// Streaming (pushStreamVersion: the layer count after per).
	f.Add(appendPushStart(nil, &pushStart{sizes: []int{4096}, blocks: 12, mode: integrityMAC, nonce: nonce, addr: []byte{1, 2}, per: 256, layers: 8,
		runs: []blockRun{{first: 0, count: 12}}}))
	f.Add(appendPushStart(nil, &pushStart{sizes: []int{256, 256, 512}, blocks: 3, mode: integrityCRC, nonce: nonce, addr: []byte{9}, per: 1, layers: 4}))
	f.Fuzz(func(t *testing.T, b []byte) {
		st, err := parsePushStart(b)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		if again := appendPushStart(nil, st); string(again) != string(b) {
			t.Fatalf("parsed start does not round-trip")
		}
		if st.blocks*len(st.sizes) > 1<<16 {
			return
		}
		// The messages the destination would post cover every block
		// once, in order, none longer than per blocks.
		g := &geometry{sizes: st.sizes, bb: 1}
		for range st.blocks * len(st.sizes) {
			g.spans = append(g.spans, Span{Addr: 0x1000, Len: 1})
		}
		next := 0
		for _, m := range messagesOf(g, st.runs, st.per) {
			if m.first != next || m.count < 1 || m.count > st.per {
				t.Fatalf("message of %d blocks at %d after block %d (per %d)", m.count, m.first, next, st.per)
			}
			next += m.count
		}
		if next != st.blocks {
			t.Fatalf("messages cover %d of %d blocks", next, st.blocks)
		}
		if st.layers == 0 {
			return
		}
		// Streaming: the parts the destination would post cut each
		// message into its layers, each the layer's share of its blocks.
		g = &geometry{sizes: st.sizes}
		for _, n := range st.sizes {
			g.bb += n
		}
		if st.blocks*st.layers > 1<<12 || g.bb > 1<<20 {
			return
		}
		addr := uintptr(0x1000)
		for range st.blocks {
			for _, n := range st.sizes {
				g.spans = append(g.spans, Span{Addr: addr, Len: n})
				addr += uintptr(n) + 64 // never adjacent: every piece its own entry
			}
		}
		msgs := messagesOf(g, st.runs, st.per)
		parts, spans, err := planParts(g, msgs, st.layers)
		if err != nil {
			t.Fatalf("layers %d accepted by the parser, refused by the plan: %v", st.layers, err)
		}
		if len(parts) != len(msgs)*st.layers {
			t.Fatalf("%d parts of %d messages × %d layers", len(parts), len(msgs), st.layers)
		}
		for i, pt := range parts {
			m := msgs[i%len(msgs)] // layer-major
			got := 0
			for _, sp := range spans[pt.iov : pt.iov+pt.niov] {
				got += sp.Len
			}
			if pt.first != m.first || pt.layer != i/len(msgs) || pt.n != m.count*g.bb/st.layers || got != pt.n {
				t.Fatalf("part %d: %+v of message %+v, spans of %d bytes", i, pt, m, got)
			}
		}
	})
}

func FuzzParseStart(f *testing.F) {
	regs := []run{{addr: 0x1000, n: 4096}, {addr: 0x3000, n: 8192}}
	keys := [][]byte{{1, 2}, {3}}
	table := appendTable(nil, regs, keys, regs, false)
	good := []byte{'K', 'U', version, 1, 0, 0, 16, 0, 0, 3, 0, 0, 0, 2, 0, 9, 9, tableInline}
	f.Add(append(good, table...))
	f.Fuzz(func(t *testing.T, b []byte) {
		st, err := parseStart(b)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		if st.table != nil {
			if _, _, err := parseTable(st.table, st.blocks, st.sizes); err != nil && !errors.Is(err, ErrCorrupt) {
				t.Fatalf("table error %v does not wrap ErrCorrupt", err)
			}
		}
	})
}

// FuzzParseAccept: the pull model's Accept bytes parse only when whole,
// of this version, and the block count is what they say; anything else,
// the push model's accept included, is refused with ErrCorrupt.
func FuzzParseAccept(f *testing.F) {
	good := []byte{'K', 'U', version, 5, 0, 0, 0}
	f.Add(good)
	f.Add([]byte{'K', 'U', pushVersion, 5, 0, 0, 0})
	f.Add([]byte{'K', 'U'})
	f.Fuzz(func(t *testing.T, b []byte) {
		blocks, err := parseAccept(b)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		if len(b) != acceptLength || b[0] != 'K' || b[1] != 'U' || b[2] != version ||
			uint64(blocks) != uint64(b[3])|uint64(b[4])<<8|uint64(b[5])<<16|uint64(b[6])<<24 {
			t.Fatalf("accepted %x as %d blocks", b, blocks)
		}
	})
}

// A run table whose counts promise more registrations or segments than
// its bytes hold is refused before anything is allocated for them: a
// peer cannot make the destination allocate by count.
func TestParseTableCountsBoundedByBytes(t *testing.T) {
	const blocks = 1 << 16
	sizes := make([]int, maxPieces)
	for i := range sizes {
		sizes[i] = 1
	}
	pieces := blocks * maxPieces
	regsClaim := binary.LittleEndian.AppendUint32(nil, uint32(pieces))
	regsClaim = append(regsClaim, make([]byte, 64)...)
	one := appendTable(nil, []run{{addr: 0x1000, n: 4096}}, [][]byte{{1}}, nil, false)
	segsClaim := append(one[:len(one)-4:len(one)-4], binary.LittleEndian.AppendUint32(nil, uint32(pieces))...)
	segsClaim = append(segsClaim, make([]byte, 64)...)
	for name, b := range map[string][]byte{"registrations": regsClaim, "segments": segsClaim} {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		_, _, err := parseTable(b, blocks, sizes)
		runtime.ReadMemStats(&after)
		if !errors.Is(err, ErrCorrupt) {
			t.Fatalf("%s: a count of %d in %d bytes: %v, want ErrCorrupt", name, pieces, len(b), err)
		}
		if got := after.TotalAlloc - before.TotalAlloc; got > 1<<20 {
			t.Fatalf("%s: a table of %d bytes allocated %d bytes", name, len(b), got)
		}
	}
}

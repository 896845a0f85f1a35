package ucx

import (
	"encoding/binary"
	"fmt"
	"runtime"
	"slices"
	"unsafe"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/layout"
)

// Blocks as pieces. Every region (a block) is a list of pieces, each a
// Span, in a fixed order: a plain block is the one-piece case, a block of
// per-layer KV (layout.Block, gpu.HostBlock) is its Layers·KVs pieces in
// (layer, kv) order. Pushed, a block is one message, gathered from the
// source's pieces and scattered into the destination's by UCX's iov
// datatype, its sum taken over the source's pieces (push.go); a run of
// blocks each one stretch of the source's memory, one after the other,
// is one message. Pulled, the
// plane works on pieces throughout:
//
//   - the source registers, for the handoff alone, one ucp_mem_map per
//     contiguous run of the handoff's pieces (sorted by address; in a
//     layer-separated layout the pieces of consecutive blocks in one
//     layer and kind are adjacent and merge), and describes its pieces
//     as segments: maximal stretches, in block-major or piece-major
//     order (whichever gives fewer), that are contiguous in its memory;
//   - the destination maps each of its pieces, by its offset in the
//     block's bytes in piece order (the block in the contiguous layout),
//     to the source bytes at the same offset, and reads them with gets
//     that merge what is contiguous on both sides.
//
// The two sides' pieces must agree: the same number of pieces of the
// same sizes, or one side a single piece of the whole block (a plain
// contiguous block, which holds the other side's pieces one after the
// other). Anything else is refused with ErrCorrupt before the destination
// connects or attaches. Which geometry the pieces have (layers, kinds,
// element type) is the handoff's business: the envelope's Layout,
// compared at propose time.

// LayeredRegion is a block in a layout, seen piece by piece: the region
// type of a layered pool (layout.Block; gpu.HostBlock).
type LayeredRegion interface {
	// Layout returns the layout of the block's memory; the zero Layout
	// for a zero region.
	Layout() layout.Layout
	// Piece returns piece (layer, kv) of the block.
	Piece(layer, kv int) []byte
}

// LayeredPieces locates a LayeredRegion's pieces in host memory, in
// (layer, kv) order: the pieces function of NewLayeredSender and
// NewLayeredReceiver. A zero region has none.
func LayeredPieces[R LayeredRegion](r R, dst []Span) []Span {
	lay := r.Layout()
	if lay == (layout.Layout{}) {
		return dst
	}
	for l := range lay.Layers {
		for kv := range lay.KVs {
			dst = append(dst, HostBytes(r.Piece(l, kv)))
		}
	}
	return dst
}

// NewLayeredSender returns a sender plane for blocks of per-layer KV in
// host memory (layout.Block, gpu.HostBlock): each block moves as all its
// pieces, with one registration per contiguous run of the handoff's
// pieces and one Transfer per handoff.
func NewLayeredSender[R LayeredRegion](cfg Config) (*Sender[R], error) {
	return NewSenderOfPieces(cfg, LayeredPieces[R])
}

// NewLayeredReceiver returns a receiver plane for blocks of per-layer KV
// in host memory: each of a block's pieces is read from the matching
// piece of the source's block (see the package doc for which sides
// match).
func NewLayeredReceiver[R LayeredRegion](cfg Config) (*Receiver[R], error) {
	return NewReceiverOfPieces(cfg, LayeredPieces[R])
}

// NewSenderOfPieces returns a sender plane for regions of any type whose
// blocks are several pieces: pieces appends a region's pieces, in the
// order both sides agree on ((layer, kv) for per-layer KV), to dst and
// returns it. Every region of a handoff must have the same number of
// pieces of the same sizes.
func NewSenderOfPieces[R any](cfg Config, pieces func(r R, dst []Span) []Span) (*Sender[R], error) {
	if pieces == nil {
		return nil, fmt.Errorf("ucx: nil pieces function: %w", kvlease.ErrInvalidArgument)
	}
	return newSender(cfg, pieces)
}

// NewReceiverOfPieces returns a receiver plane for regions of any type
// whose blocks are several pieces (see NewSenderOfPieces).
func NewReceiverOfPieces[R any](cfg Config, pieces func(r R, dst []Span) []Span) (*Receiver[R], error) {
	if pieces == nil {
		return nil, fmt.Errorf("ucx: nil pieces function: %w", kvlease.ErrInvalidArgument)
	}
	return newReceiver(cfg, pieces)
}

// onePiece turns a locator into a pieces function.
func onePiece[R any](loc func(R) Span) func(R, []Span) []Span {
	return func(r R, dst []Span) []Span { return append(dst, loc(r)) }
}

// geometry is a handoff's regions as pieces: spans holds every block's
// pieces, block by block; sizes the piece sizes every block shares.
type geometry struct {
	spans []Span
	sizes []int
	bb    int // bytes of one block: the sum of sizes
}

func (g *geometry) blocks() int { return len(g.spans) / len(g.sizes) }

// locate turns regions into pieces, checks that every region has the
// same pieces, and pins Go memory. Errors wrap
// kvlease.ErrInvalidArgument.
func locate[R any](pieces func(R, []Span) []Span, regions []R, pin *runtime.Pinner) (*geometry, error) {
	if len(regions) == 0 {
		return nil, fmt.Errorf("ucx: no regions: %w", kvlease.ErrInvalidArgument)
	}
	g := &geometry{}
	for i, r := range regions {
		n := len(g.spans)
		g.spans = pieces(r, g.spans)
		got := g.spans[n:]
		if i == 0 {
			for _, sp := range got {
				g.sizes = append(g.sizes, sp.Len)
				g.bb += sp.Len
			}
			if len(got) == 0 || len(got) > maxPieces {
				return nil, fmt.Errorf("ucx: region 0 has %d pieces, want 1 to %d: %w", len(got), maxPieces, kvlease.ErrInvalidArgument)
			}
		}
		if len(got) != len(g.sizes) {
			return nil, fmt.Errorf("ucx: region %d has %d pieces, region 0 %d: %w", i, len(got), len(g.sizes), kvlease.ErrInvalidArgument)
		}
		for p, sp := range got {
			if sp.Len != g.sizes[p] || sp.Len <= 0 || sp.Addr == 0 || (sp.Memory != Host && sp.Memory != CUDA) {
				if len(got) == 1 {
					return nil, fmt.Errorf("ucx: region %d at %#x of %d bytes (memory %d), want %d bytes: %w", i, sp.Addr, sp.Len, sp.Memory, g.sizes[p], kvlease.ErrInvalidArgument)
				}
				return nil, fmt.Errorf("ucx: region %d, piece %d at %#x of %d bytes (memory %d), want %d bytes: %w", i, p, sp.Addr, sp.Len, sp.Memory, g.sizes[p], kvlease.ErrInvalidArgument)
			}
		}
	}
	var last unsafe.Pointer
	for _, sp := range g.spans {
		if sp.pin != nil && sp.pin != last {
			pin.Pin(sp.pin)
			last = sp.pin
		}
	}
	return g, nil
}

// maxPieces bounds the pieces of one block (their sizes travel in the
// Start bytes).
const maxPieces = 512

// run is a stretch of contiguous memory of one memory type: a
// registration (of a run of pieces) or a segment.
type run struct {
	addr uintptr
	n    int
	mem  MemoryType
}

// registrations sorts spans by address and merges adjacent ones into
// runs: one ucp_mem_map each, covering the spans and nothing else.
// Overlapping spans are refused with kvlease.ErrInvalidArgument.
func registrations(spans []Span) ([]run, error) {
	sorted := slices.Clone(spans)
	slices.SortFunc(sorted, func(a, b Span) int {
		switch {
		case a.Addr < b.Addr:
			return -1
		case a.Addr > b.Addr:
			return 1
		}
		return 0
	})
	var out []run
	for _, sp := range sorted {
		if n := len(out); n > 0 {
			last := &out[n-1]
			end := last.addr + uintptr(last.n)
			if sp.Addr < end {
				return nil, fmt.Errorf("ucx: pieces at %#x and %#x overlap: %w", last.addr, sp.Addr, kvlease.ErrInvalidArgument)
			}
			if sp.Addr == end && sp.Memory == last.mem {
				last.n += sp.Len
				continue
			}
		}
		out = append(out, run{addr: sp.Addr, n: sp.Len, mem: sp.Memory})
	}
	return out, nil
}

// Segment orders: which order the pieces are listed in (block by block,
// or piece index by piece index), and whether the segments are the
// registrations themselves (then the table omits them).
const (
	orderPieceMajor  = 1 << 0
	orderSegsAreRegs = 1 << 1
)

// pieceOrder visits the flat index (block·P + piece) of every piece of
// blocks blocks of P pieces, block-major or piece-major.
func pieceOrder(blocks, p int, pieceMajor bool, f func(k int) bool) bool {
	if !pieceMajor {
		for k := range blocks * p {
			if !f(k) {
				return false
			}
		}
		return true
	}
	for i := range p {
		for b := range blocks {
			if !f(b*p + i) {
				return false
			}
		}
	}
	return true
}

// segmentsOf lists the pieces as maximal contiguous stretches, in the
// order (block- or piece-major) that gives fewer.
func segmentsOf(g *geometry) ([]run, bool) {
	build := func(pieceMajor bool) []run {
		var out []run
		pieceOrder(g.blocks(), len(g.sizes), pieceMajor, func(k int) bool {
			sp := g.spans[k]
			if n := len(out); n > 0 && out[n-1].mem == sp.Memory && out[n-1].addr+uintptr(out[n-1].n) == sp.Addr {
				out[n-1].n += sp.Len
				return true
			}
			out = append(out, run{addr: sp.Addr, n: sp.Len, mem: sp.Memory})
			return true
		})
		return out
	}
	bm := build(false)
	if len(g.sizes) == 1 {
		return bm, false
	}
	if pm := build(true); len(pm) < len(bm) {
		return pm, true
	}
	return bm, false
}

// appendTable appends the run table: the registrations with their keys,
// the segment order and, unless they are the registrations, the
// segments.
func appendTable(b []byte, regs []run, keys [][]byte, segs []run, pieceMajor bool) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(len(regs)))
	for i, r := range regs {
		b = binary.LittleEndian.AppendUint64(b, uint64(r.addr))
		b = binary.LittleEndian.AppendUint64(b, uint64(r.n))
		b = binary.LittleEndian.AppendUint16(b, uint16(len(keys[i])))
		b = append(b, keys[i]...)
	}
	order := byte(0)
	if pieceMajor {
		order |= orderPieceMajor
	}
	same := len(segs) == len(regs)
	for i := 0; same && i < len(segs); i++ {
		same = segs[i].addr == regs[i].addr && segs[i].n == regs[i].n
	}
	if same {
		return append(b, order|orderSegsAreRegs)
	}
	b = append(b, order)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(segs)))
	for _, s := range segs {
		b = binary.LittleEndian.AppendUint64(b, uint64(s.addr))
		b = binary.LittleEndian.AppendUint64(b, uint64(s.n))
	}
	return b
}

// remoteRun is a registration of the source: its address, length and
// packed key.
type remoteRun struct {
	addr, n uint64
	key     []byte
}

// remotePiece is where one source piece lives: its address and the
// registration (index into the run table) that holds it.
type remotePiece struct {
	addr uint64
	reg  int
}

// The least bytes a registration takes in a run table (address, length,
// key length), and the bytes of a segment.
const (
	regMin   = 8 + 8 + 2
	segBytes = 8 + 8
)

// maxTable bounds a run table for pieces pieces: one registration and
// one segment per piece, each key at most 1 KiB.
func maxTable(pieces int) int { return 4 + 1 + 4 + pieces*(8+8+2+1024+16) }

// parseTable parses a run table for blocks blocks of the given piece
// sizes and returns the registrations and where each source piece lives
// (block by block). The registrations must be sorted and disjoint, the
// segments must hold exactly the pieces, and every piece must lie inside
// one registration; anything else wraps ErrCorrupt.
func parseTable(b []byte, blocks int, sizes []int) ([]remoteRun, []remotePiece, error) {
	r := &reader{b: b}
	pieces := blocks * len(sizes)
	n := r.u32()
	// Each registration takes at least regMin bytes of the table, each
	// segment segBytes: counts the bytes cannot hold are refused before
	// anything is allocated for them.
	if r.err != nil || n <= 0 || n > pieces || n > len(r.b)/regMin {
		return nil, nil, fmt.Errorf("ucx: run table: %d registrations for %d pieces: %w", n, pieces, ErrCorrupt)
	}
	regs := make([]remoteRun, 0, n)
	for range n {
		var rr remoteRun
		rr.addr = r.u64()
		rr.n = r.u64()
		rr.key = append([]byte(nil), r.take(r.u16())...)
		if r.err != nil {
			return nil, nil, r.err
		}
		if k := len(regs); rr.n == 0 || rr.addr+rr.n < rr.addr || (k > 0 && rr.addr < regs[k-1].addr+regs[k-1].n) {
			return nil, nil, fmt.Errorf("ucx: run table: registration %d at %#x of %d bytes out of order: %w", len(regs), rr.addr, rr.n, ErrCorrupt)
		}
		regs = append(regs, rr)
	}
	order := r.take(1)
	if r.err != nil {
		return nil, nil, r.err
	}
	var segs []remoteRun
	if order[0]&orderSegsAreRegs != 0 {
		segs = regs
	} else {
		m := r.u32()
		if r.err != nil || m <= 0 || m > pieces || m > len(r.b)/segBytes {
			return nil, nil, fmt.Errorf("ucx: run table: %d segments for %d pieces: %w", m, pieces, ErrCorrupt)
		}
		segs = make([]remoteRun, 0, m)
		for range m {
			s := remoteRun{addr: r.u64(), n: r.u64()}
			if r.err != nil {
				return nil, nil, r.err
			}
			if s.n == 0 {
				return nil, nil, fmt.Errorf("ucx: run table: empty segment: %w", ErrCorrupt)
			}
			segs = append(segs, s)
		}
	}
	if len(r.b) != 0 || order[0]&^(orderPieceMajor|orderSegsAreRegs) != 0 {
		return nil, nil, fmt.Errorf("ucx: run table: %d trailing bytes, order %#x: %w", len(r.b), order[0], ErrCorrupt)
	}
	if order[0]&orderPieceMajor != 0 && len(sizes) == 1 {
		return nil, nil, fmt.Errorf("ucx: run table: piece-major order of one-piece blocks: %w", ErrCorrupt)
	}
	out := make([]remotePiece, pieces)
	si, soff := 0, uint64(0)
	var bad error
	pieceOrder(blocks, len(sizes), order[0]&orderPieceMajor != 0, func(k int) bool {
		size := uint64(sizes[k%len(sizes)])
		if si == len(segs) || segs[si].n-soff < size {
			bad = fmt.Errorf("ucx: run table: piece %d of block %d outside the segments: %w", k%len(sizes), k/len(sizes), ErrCorrupt)
			return false
		}
		a := segs[si].addr + soff
		reg, _ := slices.BinarySearchFunc(regs, a, func(rr remoteRun, a uint64) int {
			if rr.addr+rr.n <= a {
				return -1
			}
			if rr.addr > a {
				return 1
			}
			return 0
		})
		if reg == len(regs) || regs[reg].addr > a || a+size > regs[reg].addr+regs[reg].n {
			bad = fmt.Errorf("ucx: run table: piece %d of block %d at %#x outside the registrations: %w", k%len(sizes), k/len(sizes), a, ErrCorrupt)
			return false
		}
		out[k] = remotePiece{addr: a, reg: reg}
		if soff += size; soff == segs[si].n {
			si, soff = si+1, 0
		}
		return true
	})
	if bad != nil {
		return nil, nil, bad
	}
	if si != len(segs) {
		return nil, nil, fmt.Errorf("ucx: run table: segments hold more than %d pieces: %w", pieces, ErrCorrupt)
	}
	return regs, out, nil
}

// matchPieces checks that a source block of pieces src can be read into
// a destination block of pieces dst: the same sizes, or one side a
// single piece of the whole block.
func matchPieces(src, dst []int) error {
	sum := func(s []int) (n int) {
		for _, v := range s {
			n += v
		}
		return n
	}
	if slices.Equal(src, dst) || ((len(src) == 1 || len(dst) == 1) && sum(src) == sum(dst)) {
		return nil
	}
	return fmt.Errorf("ucx: receive: source blocks are %d pieces of %d bytes (%v), destination blocks %d of %d (%v): %w",
		len(src), sum(src), clip(src), len(dst), sum(dst), clip(dst), ErrCorrupt)
}

func clip(s []int) []int { return s[:min(len(s), 4)] }

// regIndex returns the run of regs (sorted) holding [addr, addr+n).
func regIndex(regs []run, addr uintptr, n int) int {
	i, _ := slices.BinarySearchFunc(regs, addr, func(r run, a uintptr) int {
		if r.addr+uintptr(r.n) <= a {
			return -1
		}
		if r.addr > a {
			return 1
		}
		return 0
	})
	if i == len(regs) || regs[i].addr > addr || addr+uintptr(n) > regs[i].addr+uintptr(regs[i].n) {
		return -1
	}
	return i
}

// planGets splits the handoff into gets. Each destination piece reads
// the source bytes at the same offset of the block (in piece order): a
// copy per overlap of a source and a destination piece. Copies adjacent
// on both sides (within one registration each) share a get, up to
// maxGet bytes, taken block by block or copy index by copy index,
// whichever gives fewer gets.
func planGets(src []int, remote []remotePiece, local *geometry, lregs []run, maxGet int) []getOp {
	blocks, lp, rp := local.blocks(), len(local.sizes), len(src)
	var copies []getOp
	for b := range blocks {
		i, j, ioff, joff := 0, 0, 0, 0 // local piece, remote piece, offsets in them
		for i < lp && j < rp {
			l, r := local.spans[b*lp+i], remote[b*rp+j]
			n := min(l.Len-ioff, src[j]-joff)
			addr := l.Addr + uintptr(ioff)
			copies = append(copies, getOp{block: b, local: addr, n: n, m: regIndex(lregs, addr, n),
				raddr: r.addr + uint64(joff), key: r.reg})
			if ioff += n; ioff == l.Len {
				i, ioff = i+1, 0
			}
			if joff += n; joff == src[j] {
				j, joff = j+1, 0
			}
		}
	}
	per := len(copies) / blocks
	build := func(copyMajor bool) []getOp {
		var out []getOp
		pieceOrder(blocks, per, copyMajor, func(k int) bool {
			c := copies[k]
			if n := len(out); n > 0 {
				g := &out[n-1]
				if g.m == c.m && g.key == c.key && g.local+uintptr(g.n) == c.local && g.raddr+uint64(g.n) == c.raddr && g.n+c.n <= maxGet {
					g.n += c.n
					return true
				}
			}
			out = append(out, c)
			return true
		})
		return out
	}
	bm := build(false)
	if per == 1 {
		return bm
	}
	if cm := build(true); len(cm) < len(bm) {
		return cm
	}
	return bm
}

func (r *reader) u64() uint64 {
	if b := r.take(8); b != nil {
		return binary.LittleEndian.Uint64(b)
	}
	return 0
}

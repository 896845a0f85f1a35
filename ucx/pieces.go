package ucx

import (
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
// datatype, its sum taken over the source's pieces (integrity.go); a
// run of blocks each one stretch of the source's memory, one after the
// other, is one message. Pulled, the plane works on pieces throughout:
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

// MemoryType says where a region's memory lives, as UCX registers it
// (ucp_mem_map's memory_type).
type MemoryType int

const (
	// Host is CPU memory: Go memory (kvlease.HostMemory) or pinned host
	// memory (a gpu.PinnedArena).
	Host MemoryType = iota
	// CUDA is device memory (a gpu.DeviceArena): registered as
	// UCS_MEMORY_TYPE_CUDA, which needs a UCX built with CUDA support.
	CUDA
)

// Span is a region as the plane registers it: its address, its length
// and its memory type.
type Span struct {
	Addr   uintptr
	Len    int
	Memory MemoryType
	pin    unsafe.Pointer // Go memory to pin while registered
}

// HostBytes is the pieces function of []byte regions (Go or pinned host
// memory): it appends b to dst as one piece. A pieces function of the
// caller's appends each of a region's pieces in host memory with it. Go
// memory stays pinned (runtime.Pinner) while a handoff has it registered.
func HostBytes(b []byte, dst []Span) []Span { return append(dst, hostSpan(b)) }

// hostSpan is b as one Span (Go memory pinned while registered).
func hostSpan(b []byte) Span {
	p := unsafe.Pointer(unsafe.SliceData(b))
	return Span{Addr: uintptr(p), Len: len(b), Memory: Host, pin: p}
}

// message is one tagged message of the push model: count blocks from
// first (its tag's index), in one buffer of count·bb bytes at addr when
// contig, else gathered or scattered with the iov entries of its pieces.
type message struct {
	first, count int
	addr         uintptr
	contig       bool
}

// adjacentSpans reports whether spans lie one after the other in memory
// of one type.
func adjacentSpans(spans []Span) bool {
	for i := 1; i < len(spans); i++ {
		if spans[i].Addr != spans[i-1].Addr+uintptr(spans[i-1].Len) || spans[i].Memory != spans[i-1].Memory {
			return false
		}
	}
	return true
}

// blockRuns returns g's runs of two blocks or more: consecutive blocks
// whose pieces, block by block, lie one after the other in memory.
func blockRuns(g *geometry) []blockRun {
	np := len(g.sizes)
	var out []blockRun
	for b := 0; b < g.blocks(); {
		n := 1
		for b+n < g.blocks() && adjacentSpans(g.spans[(b+n-1)*np:(b+n+1)*np]) {
			n++
		}
		if n >= 2 {
			out = append(out, blockRun{first: b, count: n})
		}
		b += n
	}
	return out
}

// fitRuns keeps the longest of runs that fit in room bytes of a run list
// (the Start bytes are bounded), in block order; the blocks of the runs
// left out move one message each.
func fitRuns(runs []blockRun, room int) []blockRun {
	k := max(0, room/runBytes)
	if len(runs) <= k {
		return runs
	}
	kept := slices.Clone(runs)
	slices.SortStableFunc(kept, func(a, b blockRun) int { return b.count - a.count })
	kept = kept[:k]
	slices.SortFunc(kept, func(a, b blockRun) int { return a.first - b.first })
	return kept
}

// messagesOf cuts the handoff's blocks into messages: each run into
// messages of at most per blocks, every other block one message; each
// is one buffer where its pieces in g (this side's memory) are adjacent.
func messagesOf(g *geometry, runs []blockRun, per int) []message {
	np := len(g.sizes)
	out := make([]message, 0, g.blocks()-len(runs))
	add := func(first, count int) {
		spans := g.spans[first*np : (first+count)*np]
		out = append(out, message{first: first, count: count, addr: spans[0].Addr, contig: adjacentSpans(spans)})
	}
	b := 0
	for _, r := range runs {
		for ; b < r.first; b++ {
			add(b, 1)
		}
		for ; b < r.first+r.count; b += min(per, r.first+r.count-b) {
			add(b, min(per, r.first+r.count-b))
		}
	}
	for ; b < g.blocks(); b++ {
		add(b, 1)
	}
	return out
}

// needIov reports whether a message of msgs is not one buffer.
func needIov(msgs []message) bool {
	return slices.ContainsFunc(msgs, func(m message) bool { return !m.contig })
}

// LayeredRegion is a block in a layout, seen piece by piece: the region
// type of a layered pool (layout.Block; gpu.HostBlock).
type LayeredRegion interface {
	// Layout returns the layout of the block's memory; the zero Layout
	// for a zero region.
	Layout() layout.Layout
	// Piece returns piece (layer, kv) of the block.
	Piece(layer, kv int) []byte
}

// LayeredPieces is the pieces function of LayeredRegion blocks: it
// appends a block's pieces in host memory to dst, in (layer, kv) order.
// A zero region has none.
func LayeredPieces[R LayeredRegion](r R, dst []Span) []Span {
	lay := r.Layout()
	if lay == (layout.Layout{}) {
		return dst
	}
	for l := range lay.Layers {
		for kv := range lay.KVs {
			dst = HostBytes(r.Piece(l, kv), dst)
		}
	}
	return dst
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

package ucx

// Plane bytes: every parse and append of what the planes put in a
// handoff's Accept and Start messages (handoff's plane bytes), the pull
// model's run table, and the push model's message tags. Both models'
// bytes begin "KU" and a version byte: version (pull), pushVersion,
// pushStreamVersion. Parsers check every count against the bytes left
// before they allocate, and wrap ErrCorrupt.

import (
	"encoding/binary"
	"fmt"
	"slices"

	"github.com/kvlease/kvlease/handoff"
)

const (
	// version is the version byte of the pull model's plane bytes.
	version = 2
	// How the Start bytes carry the run table: inline, or as the
	// address, length and key of a registered copy the destination reads.
	tableInline, tableRemote = 0, 1
	// acceptLength is "KU", version, block count.
	acceptLength = 2 + 1 + 4
)

// appendAccept appends the pull model's Accept bytes (read by
// parseAccept): "KU", version, the block count.
func appendAccept(b []byte, blocks int) []byte {
	return binary.LittleEndian.AppendUint32(append(b, 'K', 'U', version), uint32(blocks))
}

// parseAccept parses the pull model's Accept bytes and returns the
// block count; the push model's are refused (ErrCorrupt).
func parseAccept(b []byte) (int, error) {
	if len(b) > 2 && b[0] == 'K' && b[1] == 'U' && b[2] == pushVersion {
		return 0, fmt.Errorf("ucx: the destination expects the push model, this sender pulls (Config.Pull): %w", ErrCorrupt)
	}
	if len(b) != acceptLength || b[0] != 'K' || b[1] != 'U' || b[2] != version {
		return 0, fmt.Errorf("ucx: accept bytes of %d: %w", len(b), ErrCorrupt)
	}
	return int(binary.LittleEndian.Uint32(b[3:])), nil
}

// start is the parsed Start bytes.
type start struct {
	sizes  []int // the source's piece sizes, one block's
	blocks int
	addr   []byte
	table  []byte     // the run table, when inline
	remote *remoteRun // the run table to read (n is its length), or nil
	regs   []remoteRun
	pieces []remotePiece
}

type reader struct {
	b   []byte
	err error
}

func (r *reader) take(n int) []byte {
	if r.err != nil || n > len(r.b) {
		r.err = fmt.Errorf("ucx: start bytes end early: %w", ErrCorrupt)
		return nil
	}
	out := r.b[:n]
	r.b = r.b[n:]
	return out
}

func (r *reader) u16() int {
	if b := r.take(2); b != nil {
		return int(binary.LittleEndian.Uint16(b))
	}
	return 0
}

func (r *reader) u32() int {
	if b := r.take(4); b != nil {
		return int(binary.LittleEndian.Uint32(b))
	}
	return 0
}

func (r *reader) u64() uint64 {
	if b := r.take(8); b != nil {
		return binary.LittleEndian.Uint64(b)
	}
	return 0
}

// appendStartHead appends what both models' Start bytes begin with
// (read by startHead), then the block count.
func appendStartHead(b []byte, ver byte, sizes []int, blocks int) []byte {
	b = append(b, 'K', 'U', ver)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(sizes)))
	for _, n := range sizes {
		b = binary.LittleEndian.AppendUint32(b, uint32(n))
	}
	return binary.LittleEndian.AppendUint32(b, uint32(blocks))
}

// startHead reads what both models' Start bytes begin with (written by
// appendStartHead): "KU", the model's version ver, a block's piece count
// and sizes, and the block count, which the caller checks.
func (r *reader) startHead(ver byte) (sizes []int, blocks int, err error) {
	if h := r.take(3); h == nil || h[0] != 'K' || h[1] != 'U' || h[2] != ver {
		return nil, 0, fmt.Errorf("ucx: start bytes: bad header: %w", ErrCorrupt)
	}
	np := r.u16()
	if r.err == nil && (np == 0 || np > maxPieces) {
		return nil, 0, fmt.Errorf("ucx: start bytes: blocks of %d pieces: %w", np, ErrCorrupt)
	}
	sizes = make([]int, np)
	for i := range sizes {
		if sizes[i] = r.u32(); r.err == nil && sizes[i] <= 0 {
			return nil, 0, fmt.Errorf("ucx: start bytes: piece %d of %d bytes: %w", i, sizes[i], ErrCorrupt)
		}
	}
	return sizes, r.u32(), nil
}

// appendPullStart appends the pull model's Start bytes up to their run
// table (read by parseStart): the head and the source worker's address.
// appendInlineTable or appendRemoteTable completes them.
func appendPullStart(b []byte, sizes []int, blocks int, addr []byte) []byte {
	b = appendStartHead(b, version, sizes, blocks)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(addr)))
	return append(b, addr...)
}

// appendInlineTable appends the run table itself (tableInline).
func appendInlineTable(b, table []byte) []byte { return append(append(b, tableInline), table...) }

// appendRemoteTable appends where the destination reads the run table
// (tableRemote): the address, length and key of its registered copy.
func appendRemoteTable(b []byte, addr uintptr, n int, key []byte) []byte {
	b = append(b, tableRemote)
	b = binary.LittleEndian.AppendUint64(b, uint64(addr))
	b = binary.LittleEndian.AppendUint32(b, uint32(n))
	b = binary.LittleEndian.AppendUint16(b, uint16(len(key)))
	return append(b, key...)
}

// parseStart parses the pull model's Start bytes (appendPullStart and a
// table's append); anything malformed wraps ErrCorrupt.
func parseStart(b []byte) (*start, error) {
	r := &reader{b: b}
	sizes, blocks, err := r.startHead(version)
	if err != nil {
		return nil, err
	}
	s := &start{sizes: sizes, blocks: blocks}
	s.addr = append([]byte(nil), r.take(r.u16())...)
	mode := r.take(1)
	if r.err != nil {
		return nil, r.err
	}
	if len(s.addr) == 0 || len(s.sizes) == 0 || len(s.sizes) > maxPieces || s.blocks <= 0 || s.blocks > handoff.MaxBlocks {
		return nil, fmt.Errorf("ucx: start bytes: %d blocks of %d pieces, address of %d bytes: %w", s.blocks, len(s.sizes), len(s.addr), ErrCorrupt)
	}
	switch mode[0] {
	case tableInline:
		if len(r.b) == 0 {
			return nil, fmt.Errorf("ucx: start bytes: no run table: %w", ErrCorrupt)
		}
		s.table = r.b
		return s, nil
	case tableRemote:
		t := &remoteRun{addr: r.u64(), n: uint64(r.u32())}
		t.key = append([]byte(nil), r.take(r.u16())...)
		if r.err != nil {
			return nil, r.err
		}
		if len(r.b) != 0 || t.n < 4 || t.n > uint64(maxTable(s.blocks*len(s.sizes))) || len(t.key) == 0 {
			return nil, fmt.Errorf("ucx: start bytes: run table of %d bytes for %d blocks: %w", t.n, s.blocks, ErrCorrupt)
		}
		s.remote = t
		return s, nil
	}
	return nil, fmt.Errorf("ucx: start bytes: table mode %d: %w", mode[0], ErrCorrupt)
}

const (
	// pushVersion is the version byte of the push model's plane bytes
	// (4: the destination's message bound in Accept, the run list in
	// Start).
	pushVersion = 4
	// pushStreamVersion is the version byte of a streaming handoff's
	// Start bytes (pushVersion's, plus the layer count; see stream.go).
	pushStreamVersion = 5
	// pushAcceptMin is "KU", version, blocks, salt, the destination's
	// message bound, address length.
	pushAcceptMin = 2 + 1 + 4 + 4 + 4 + 2
	// runBytes is the bytes of a run in the Start bytes' run list: its
	// first block and its block count.
	runBytes = 4 + 4
	// tableIndex is the low half of the integrity table's tag.
	tableIndex = 0xFFFF_FFFF
	// macLen is the bytes of a block's keyed sum (a GMAC tag).
	macLen = 16
	// nonceLen is the bytes of the source's random nonce in Start.
	nonceLen = 16
)

func tagOf(salt uint32, i uint32) uint64 { return uint64(salt)<<32 | uint64(i) }

// appendPushAccept appends the push model's Accept bytes (read by
// parsePushAccept).
func appendPushAccept(b []byte, blocks int, salt uint32, maxMsg int, addr []byte) []byte {
	b = append(b, 'K', 'U', pushVersion)
	b = binary.LittleEndian.AppendUint32(b, uint32(blocks))
	b = binary.LittleEndian.AppendUint32(b, salt)
	b = binary.LittleEndian.AppendUint32(b, uint32(maxMsg))
	b = binary.LittleEndian.AppendUint16(b, uint16(len(addr)))
	return append(b, addr...)
}

// pushAccept is the push model's parsed Accept bytes.
type pushAccept struct {
	blocks int
	salt   uint32
	maxMsg int // the most bytes the destination takes in one message
	addr   []byte
}

// parsePushAccept parses the push model's Accept bytes.
func parsePushAccept(b []byte) (*pushAccept, error) {
	if len(b) >= 3 && b[0] == 'K' && b[1] == 'U' && b[2] == version {
		return nil, fmt.Errorf("ucx: the destination asks to read this source's memory (the pull model); this sender pushes (set Config.Pull on both sides to trust the destination with it): %w", ErrCorrupt)
	}
	if len(b) < pushAcceptMin || b[0] != 'K' || b[1] != 'U' || b[2] != pushVersion {
		return nil, fmt.Errorf("ucx: accept bytes of %d: %w", len(b), ErrCorrupt)
	}
	a := &pushAccept{
		blocks: int(binary.LittleEndian.Uint32(b[3:])),
		salt:   binary.LittleEndian.Uint32(b[7:]),
		maxMsg: int(binary.LittleEndian.Uint32(b[11:])),
	}
	n := int(binary.LittleEndian.Uint16(b[15:]))
	if n == 0 || len(b) != pushAcceptMin+n || a.blocks <= 0 || a.blocks > handoff.MaxBlocks || a.maxMsg <= 0 {
		return nil, fmt.Errorf("ucx: accept bytes: %d blocks, messages of %d bytes, address of %d bytes in %d: %w", a.blocks, a.maxMsg, n, len(b), ErrCorrupt)
	}
	a.addr = b[pushAcceptMin:]
	return a, nil
}

// pushStart is the push model's parsed Start bytes: "KU", pushVersion,
// the piece count and sizes of a block, the block count, the integrity
// mode, a random nonce of the source's, the source worker's address (the
// destination connects to it to learn of the source's failure; it reads
// nothing there), the most blocks of one message, and the runs.
type pushStart struct {
	sizes  []int
	blocks int
	mode   integrityMode
	nonce  []byte // the source's, for the handoff's MAC key
	addr   []byte
	per    int        // the most blocks of one message
	layers int        // streaming: the layers of each block (0: not streaming)
	runs   []blockRun // runs of two blocks or more, in block order
}

// blockRun is a run of count consecutive blocks from first that lie one
// after the other in the source's memory.
type blockRun struct{ first, count int }

func appendPushStart(b []byte, st *pushStart) []byte {
	ver := byte(pushVersion)
	if st.layers > 0 {
		ver = pushStreamVersion
	}
	b = appendStartHead(b, ver, st.sizes, st.blocks)
	b = append(b, byte(st.mode))
	b = append(b, st.nonce...)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(st.addr)))
	b = append(b, st.addr...)
	b = binary.LittleEndian.AppendUint32(b, uint32(st.per))
	if st.layers > 0 {
		b = binary.LittleEndian.AppendUint16(b, uint16(st.layers))
	}
	b = binary.LittleEndian.AppendUint32(b, uint32(len(st.runs)))
	for _, r := range st.runs {
		b = binary.LittleEndian.AppendUint32(b, uint32(r.first))
		b = binary.LittleEndian.AppendUint32(b, uint32(r.count))
	}
	return b
}

// parsePushStart parses the push model's Start bytes. The runs must be
// in block order, disjoint, of two blocks or more, inside the handoff,
// and their count must fit the bytes left (checked before anything is
// allocated for them); a streaming handoff's (pushStreamVersion) layer
// count must be 1 to handoff.MaxLayers and split the block; anything
// else wraps ErrCorrupt.
func parsePushStart(b []byte) (*pushStart, error) {
	r := &reader{b: b}
	ver := byte(pushVersion)
	if len(b) > 2 && b[2] == pushStreamVersion {
		ver = pushStreamVersion
	}
	sizes, blocks, err := r.startHead(ver)
	if err != nil {
		return nil, err
	}
	s := &pushStart{sizes: sizes, blocks: blocks}
	mode := r.take(1)
	s.nonce = r.take(nonceLen)
	s.addr = r.take(r.u16())
	s.per = r.u32()
	if ver == pushStreamVersion {
		s.layers = r.u16()
	}
	nr := r.u32()
	if r.err != nil {
		return nil, r.err
	}
	if ver == pushStreamVersion {
		bb := 0
		for _, n := range s.sizes {
			bb += n
		}
		if s.layers < 1 || s.layers > handoff.MaxLayers || bb%s.layers != 0 {
			return nil, fmt.Errorf("ucx: start bytes: a stream of %d layers over blocks of %d bytes: %w", s.layers, bb, ErrCorrupt)
		}
	}
	s.mode = integrityMode(mode[0])
	if len(s.addr) == 0 || s.blocks <= 0 || s.blocks > handoff.MaxBlocks || s.mode > integrityMAC || s.per <= 0 || s.per > handoff.MaxBlocks {
		return nil, fmt.Errorf("ucx: start bytes: %d blocks, integrity %d, address of %d bytes, messages of %d blocks: %w", s.blocks, mode[0], len(s.addr), s.per, ErrCorrupt)
	}
	if nr > len(r.b)/runBytes || len(r.b) != nr*runBytes {
		return nil, fmt.Errorf("ucx: start bytes: %d runs in %d bytes: %w", nr, len(r.b), ErrCorrupt)
	}
	if nr > 0 {
		s.runs = make([]blockRun, 0, nr)
	}
	end := 0
	for range nr {
		run := blockRun{first: r.u32(), count: r.u32()}
		if run.first < end || run.count < 2 || run.count > s.blocks-run.first {
			return nil, fmt.Errorf("ucx: start bytes: a run of %d blocks at block %d (after block %d, of %d): %w", run.count, run.first, end, s.blocks, ErrCorrupt)
		}
		end = run.first + run.count
		s.runs = append(s.runs, run)
	}
	return s, nil
}

// Segment orders: which order the pieces are listed in (block by block,
// or piece index by piece index), and whether the segments are the
// registrations themselves (then the table omits them).
const (
	orderPieceMajor  = 1 << 0
	orderSegsAreRegs = 1 << 1
)

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

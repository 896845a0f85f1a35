package tcp

import (
	"encoding/binary"
	"fmt"
	"io"
	"unsafe"
)

// Runs on the wire. The sender merges consecutive regions that are
// adjacent in its memory (a run of block ids in a HostMemory or an arena)
// into one frame: one header, the run's bytes, one check. Right after the
// hello it sends the frame layout — the number of frames (4 bytes LE),
// then each frame's block count (4 bytes LE each) — so that the receiver
// knows every frame's boundaries before the first byte of a block and
// reads several frames per system call, whatever its own layout. A
// frame's header names its first block and its length in bytes; its
// check is, unkeyed, one crc32c over the whole run and, keyed, one
// AES-GMAC tag per block of the run with the block's index as nonce
// (so a block can be neither moved inside its run nor spliced into
// another run: its tag binds its index, the key binds the handoff). On
// Linux the system calls gather: adjacent buffers of one writev or readv
// become one iovec, so a run costs one descriptor on each side where its
// memory is one span.

// maxRunBytes bounds a frame's bytes (and maxRunBlocks its blocks): a
// cancel is honoured at a frame boundary, and a receiver's trailer
// buffers grow with the longest frame.
const (
	maxRunBytes  = 1 << 20
	maxRunBlocks = 512
)

// runCap is the most blocks of bb bytes one frame carries.
func runCap(bb int) int {
	return max(1, min(maxRunBlocks, maxRunBytes/max(bb, 1)))
}

// adjacent reports whether b starts in memory where a ends. It only
// compares addresses: no pointer or slice spanning both is ever made (two
// adjacent regions may be two Go allocations).
func adjacent(a, b []byte) bool {
	return len(a) > 0 && len(b) > 0 &&
		uintptr(unsafe.Pointer(unsafe.SliceData(a)))+uintptr(len(a)) == uintptr(unsafe.Pointer(unsafe.SliceData(b)))
}

// frames appends to dst the block counts of the frames that carry
// regions: consecutive adjacent regions share a frame, up to runCap.
func frames(dst []int, regions [][]byte) []int {
	if len(regions) == 0 {
		return dst
	}
	limit := runCap(len(regions[0]))
	for i := 0; i < len(regions); {
		n := 1
		for i+n < len(regions) && n < limit && adjacent(regions[i+n-1], regions[i+n]) {
			n++
		}
		dst = append(dst, n)
		i += n
	}
	return dst
}

// appendLayout appends the wire form of a frame layout.
func appendLayout(b []byte, fr []int) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(len(fr)))
	for _, n := range fr {
		b = binary.LittleEndian.AppendUint32(b, uint32(n))
	}
	return b
}

// parseLayout checks the frame counts of a layout (raw: 4 bytes LE per
// frame) for blocks blocks of bb bytes: every frame carries at least one
// block and at most runCap(bb), and the frames carry exactly blocks
// blocks. A bad layout wraps ErrCorrupt.
func parseLayout(raw []byte, blocks, bb int) ([]int, error) {
	if len(raw)%4 != 0 || len(raw)/4 > blocks || (blocks > 0 && len(raw) == 0) {
		return nil, fmt.Errorf("tcp: a frame layout of %d bytes for %d blocks: %w", len(raw), blocks, ErrCorrupt)
	}
	fr := make([]int, len(raw)/4)
	total, limit := 0, runCap(bb)
	for f := range fr {
		n := binary.LittleEndian.Uint32(raw[4*f:])
		if n == 0 || uint64(n) > uint64(limit) {
			return nil, fmt.Errorf("tcp: frame %d of %d blocks (1 to %d allowed): %w", f, n, limit, ErrCorrupt)
		}
		fr[f] = int(n)
		total += int(n)
	}
	if total != blocks {
		return nil, fmt.Errorf("tcp: frame layout carries %d blocks, want %d: %w", total, blocks, ErrCorrupt)
	}
	return fr, nil
}

// readLayout reads and checks the frame layout that follows the hello,
// for blocks (> 0) blocks of bb bytes: its length is checked before
// anything is allocated (at most 4 bytes per block).
func readLayout(c io.Reader, blocks, bb int) ([]int, error) {
	var cnt [4]byte
	if _, err := io.ReadFull(c, cnt[:]); err != nil {
		return nil, fmt.Errorf("tcp: frame layout: %w", err)
	}
	nf := binary.LittleEndian.Uint32(cnt[:])
	if nf == 0 || uint64(nf) > uint64(blocks) {
		return nil, fmt.Errorf("tcp: a layout of %d frames for %d blocks: %w", nf, blocks, ErrCorrupt)
	}
	raw := make([]byte, 4*int(nf))
	if _, err := io.ReadFull(c, raw); err != nil {
		return nil, fmt.Errorf("tcp: frame layout: %w", err)
	}
	return parseLayout(raw, blocks, bb)
}

package tcp

import (
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

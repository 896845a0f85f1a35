package tcp

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"

	"github.com/kvlease/kvlease/handoff"
)

// The data plane's wire, every byte of it: what is appended and parsed
// here is all that crosses a data connection (DESIGN.md tells the story).
//
//	Accept's plane bytes   address length (2 LE) | address | token (16)
//	hello                  "KD" | version | flags | token (16) | blocks (4 LE) | block bytes (4 LE) | MAC (32)
//	frame layout           frames (4 LE) | blocks of each frame (4 LE each)
//	frame                  first block (4 LE) | length (4 LE) | the run's bytes | check
//	stream layer count     layers (4 LE), after a stream hello instead of a layout
//	stream frame           first block (4 LE) | blocks (4 LE) | first layer (2 LE) | layers (2 LE) | length (4 LE) | body | check
//	stop frame             a stream frame header of first block 0xFFFFFFFF, every other field zero
//
// A frame's check is a crc32c over its bytes (unkeyed) or one AES-GMAC
// tag per block (keyed, seal.go); the MAC of a hello is an HMAC-SHA256
// (keyed) or zero. Every parse checks lengths before it allocates, and a
// bad field wraps ErrCorrupt.

const (
	version     = 3 // 3: frames carry runs, a frame layout follows the hello
	frameHeader = 8 // index, length
)

// castagnoli is the crc32c table of the unkeyed checks.
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// putCRC writes an unkeyed check (crcLength bytes: a crc32c, LE).
func putCRC(dst []byte, sum uint32) { binary.LittleEndian.PutUint32(dst, sum) }

// crcOf reads an unkeyed check.
func crcOf(check []byte) uint32 { return binary.LittleEndian.Uint32(check) }

// appendAccept appends an Accept's plane bytes: the data listener's
// address and the handoff's token.
func appendAccept(b []byte, addr string, tok [16]byte) []byte {
	b = binary.LittleEndian.AppendUint16(b, uint16(len(addr)))
	b = append(b, addr...)
	return append(b, tok[:]...)
}

// parseAccept splits an Accept's plane bytes into address and token.
func parseAccept(b []byte) (string, [16]byte, error) {
	var tok [16]byte
	if len(b) < 2 {
		return "", tok, fmt.Errorf("tcp: accept bytes of %d: %w", len(b), ErrCorrupt)
	}
	n := int(binary.LittleEndian.Uint16(b))
	if len(b) != 2+n+16 {
		return "", tok, fmt.Errorf("tcp: accept bytes of %d for an address of %d: %w", len(b), n, ErrCorrupt)
	}
	copy(tok[:], b[2+n:])
	return string(b[2 : 2+n]), tok, nil
}

// The hello: "KD" | version | flags (bit 0: keyed) | token (16) | blocks
// (4 LE) | block bytes (4 LE) | HMAC-SHA256 of what precedes (32; zero
// when not keyed). Flag bit 1 (flagStream, stream.go) says stream mode.
const (
	helloBody   = 2 + 1 + 1 + 16 + 4 + 4
	helloLength = helloBody + sha256.Size
	flagKeyed   = 1
	flagStream  = 2
)

// appendHello appends a hello's body (helloBody bytes: everything but
// the MAC, which the seal appends).
func appendHello(b []byte, flags byte, tok [16]byte, blocks, bb int) []byte {
	b = append(b, 'K', 'D', version, flags)
	b = append(b, tok[:]...)
	b = binary.LittleEndian.AppendUint32(b, uint32(blocks))
	return binary.LittleEndian.AppendUint32(b, uint32(bb))
}

// hello is a parsed hello (its MAC is the seal's to check).
type hello struct {
	flags      byte
	tok        [16]byte
	blocks, bb int
}

// parseHello parses a hello, refusing one that does not start "KD" and
// this version (ErrCorrupt).
func parseHello(h *[helloLength]byte) (hello, error) {
	if h[0] != 'K' || h[1] != 'D' || h[2] != version {
		return hello{}, fmt.Errorf("hello starts %q, want \"KD\" version %d: %w", h[:3], version, ErrCorrupt)
	}
	p := hello{flags: h[3], blocks: int(binary.LittleEndian.Uint32(h[20:])), bb: int(binary.LittleEndian.Uint32(h[24:]))}
	copy(p.tok[:], h[4:20])
	return p, nil
}

// appendLayout appends the wire form of a frame layout.
func appendLayout(b []byte, fr []int) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(len(fr)))
	for _, n := range fr {
		b = binary.LittleEndian.AppendUint32(b, uint32(n))
	}
	return b
}

// appendUnitLayout appends the wire form of a layout of n frames of one
// block each (the layered sender's: a block's pieces are scattered).
func appendUnitLayout(b []byte, n int) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(n))
	for range n {
		b = binary.LittleEndian.AppendUint32(b, 1)
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

// putFrameHeader writes a frame's header (frameHeader bytes): its first
// block and its length in bytes.
func putFrameHeader(h []byte, first, length int) {
	binary.LittleEndian.PutUint32(h[0:], uint32(first))
	binary.LittleEndian.PutUint32(h[4:], uint32(length))
}

// checkFrameHeader checks a data frame's header (block index, body
// length; frameHeader bytes) against what the receiver expects: block i
// of blocks, of size bytes. A mismatch wraps ErrCorrupt: the sender is
// out of step, and the transfer fails.
func checkFrameHeader(h []byte, i, blocks, size int) error {
	if len(h) < frameHeader {
		return fmt.Errorf("tcp: block %d of %d: frame header of %d bytes: %w", i, blocks, len(h), ErrCorrupt)
	}
	if idx, ln := binary.LittleEndian.Uint32(h[0:]), binary.LittleEndian.Uint32(h[4:]); uint64(idx) != uint64(i) || uint64(ln) != uint64(size) {
		return fmt.Errorf("tcp: block %d of %d: frame says block %d of %d bytes, want %d: %w", i, blocks, idx, ln, size, ErrCorrupt)
	}
	return nil
}

// streamHeader is a stream frame's header length.
const streamHeader = 16

// stopBlock is the first-block field of a stop frame.
const stopBlock = 0xFFFFFFFF

// appendStreamLayers appends the layer count that follows a stream
// hello.
func appendStreamLayers(b []byte, layers int) []byte {
	return binary.LittleEndian.AppendUint32(b, uint32(layers))
}

// putStreamHeader writes a stream frame's header (streamHeader bytes):
// blocks [b, b+nb), layers [l0, l0+nl), length body bytes.
func putStreamHeader(h []byte, b, nb, l0, nl, length int) {
	binary.LittleEndian.PutUint32(h[0:], uint32(b))
	binary.LittleEndian.PutUint32(h[4:], uint32(nb))
	binary.LittleEndian.PutUint16(h[8:], uint16(l0))
	binary.LittleEndian.PutUint16(h[10:], uint16(nl))
	binary.LittleEndian.PutUint32(h[12:], uint32(length))
}

// putStopFrame writes a stop frame (streamHeader bytes).
func putStopFrame(h []byte) {
	clear(h)
	binary.LittleEndian.PutUint32(h, stopBlock)
}

// streamFrame is a parsed stream frame header.
type streamFrame struct {
	block, blocks, layer, layers int
	length                       int
}

// parseStreamLayers checks the layer count that follows a stream hello
// (4 bytes LE) against blocks of bb bytes: 1 to handoff.MaxLayers, and
// splitting the block. A bad count wraps ErrCorrupt.
func parseStreamLayers(b []byte, bb int) (int, error) {
	if len(b) < 4 {
		return 0, fmt.Errorf("tcp: stream layer count of %d bytes: %w", len(b), ErrCorrupt)
	}
	l := binary.LittleEndian.Uint32(b)
	if l < 1 || l > handoff.MaxLayers || bb%int(l) != 0 {
		return 0, fmt.Errorf("tcp: a stream of %d layers over blocks of %d bytes: %w", l, bb, ErrCorrupt)
	}
	return int(l), nil
}

// parseStreamHeader checks a stream frame's header (streamHeader bytes)
// for a stream of blocks blocks of layers layers, layer bytes each: at
// least one block (at most maxRunBlocks) and one layer, inside the
// stream, and a length that is exactly its parts'. It allocates nothing;
// a bad header wraps ErrCorrupt.
func parseStreamHeader(h []byte, blocks, layers, layerBytes int) (streamFrame, error) {
	if len(h) < streamHeader {
		return streamFrame{}, fmt.Errorf("tcp: stream frame header of %d bytes: %w", len(h), ErrCorrupt)
	}
	b0, nb := binary.LittleEndian.Uint32(h[0:]), binary.LittleEndian.Uint32(h[4:])
	l0, nl := binary.LittleEndian.Uint16(h[8:]), binary.LittleEndian.Uint16(h[10:])
	ln := binary.LittleEndian.Uint32(h[12:])
	switch {
	case b0 == stopBlock && nb == 0 && l0 == 0 && nl == 0 && ln == 0:
		return streamFrame{}, errStreamStopped
	case nb == 0 || nb > maxRunBlocks || nl == 0:
		return streamFrame{}, fmt.Errorf("tcp: stream frame of %d blocks (1 to %d) and %d layers: %w", nb, maxRunBlocks, nl, ErrCorrupt)
	case uint64(b0)+uint64(nb) > uint64(blocks) || int(l0)+int(nl) > layers:
		return streamFrame{}, fmt.Errorf("tcp: stream frame of blocks %d+%d, layers %d+%d, outside %d blocks of %d layers: %w", b0, nb, l0, nl, blocks, layers, ErrCorrupt)
	case uint64(nb)*uint64(nl)*uint64(layerBytes) != uint64(ln):
		return streamFrame{}, fmt.Errorf("tcp: stream frame of %d blocks × %d layers says %d bytes, want %d: %w", nb, nl, ln, uint64(nb)*uint64(nl)*uint64(layerBytes), ErrCorrupt)
	}
	return streamFrame{block: int(b0), blocks: int(nb), layer: int(l0), layers: int(nl), length: int(ln)}, nil
}

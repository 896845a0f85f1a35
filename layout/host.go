package layout

import (
	"fmt"

	"github.com/kvlease/kvlease"
)

// Host is ordinary memory in a layout: one byte slice (the base) whose
// pieces the layout places. It is a kvlease.Memory[Block] whose block b is
// all its pieces, so a pool over it hands out whole model blocks while
// the bytes stay where the engine's per-layer tensors expect them. The
// network transports move its blocks piece by piece (handoff/tcp's
// layered plane); a handoff whose pool is a Host compares its geometry
// (the envelope's Layout).
type Host struct {
	lay  Layout
	base []byte
}

// Block is block ID of a Host: the region a pool over it hands out.
type Block struct {
	H  *Host
	ID kvlease.BlockID
}

var _ kvlease.Memory[Block] = (*Host)(nil)

// NewHost allocates zeroed memory for l (l.Size() bytes). Errors wrap
// kvlease.ErrInvalidArgument for an invalid layout.
func NewHost(l Layout) (*Host, error) {
	if err := l.Validate(); err != nil {
		return nil, err
	}
	return &Host{lay: l, base: make([]byte, l.Size())}, nil
}

// NewHostOver lays l over base (memory the caller owns: an mmap, a
// pinned buffer); base must hold l.Size() bytes. Errors wrap
// kvlease.ErrInvalidArgument.
func NewHostOver(l Layout, base []byte) (*Host, error) {
	if err := l.Validate(); err != nil {
		return nil, err
	}
	if len(base) < l.Size() {
		return nil, fmt.Errorf("layout: base of %d bytes for a layout spanning %d: %w", len(base), l.Size(), kvlease.ErrInvalidArgument)
	}
	return &Host{lay: l, base: base[:l.Size():l.Size()]}, nil
}

// Blocks returns the layout's block count.
func (h *Host) Blocks() int { return h.lay.Blocks }

// BlockBytes returns the bytes of one block: all its pieces.
func (h *Host) BlockBytes() int { return h.lay.BlockBytes() }

// Region returns block id. It panics for an id outside the layout, like
// a slice index.
func (h *Host) Region(id kvlease.BlockID) Block {
	if id < 0 || int(id) >= h.lay.Blocks {
		panic(fmt.Sprintf("layout: block %d outside a layout of %d blocks", id, h.lay.Blocks))
	}
	return Block{h, id}
}

// Layout returns the memory's layout.
func (h *Host) Layout() Layout { return h.lay }

// Base returns the memory itself (Size bytes): what a kernel indexes.
func (h *Host) Base() []byte { return h.base }

// Piece returns piece (layer, kv) of block id, with len and cap
// PieceBytes (an append never reaches a neighbour).
func (h *Host) Piece(id kvlease.BlockID, layer, kv int) []byte {
	off := h.lay.Offset(layer, kv, int(id))
	return h.base[off : off+h.lay.PieceBytes : off+h.lay.PieceBytes]
}

// Layout returns the layout of the block's memory (the zero Layout for
// the zero Block).
func (b Block) Layout() Layout {
	if b.H == nil {
		return Layout{}
	}
	return b.H.lay
}

// Piece returns piece (layer, kv) of the block.
func (b Block) Piece(layer, kv int) []byte { return b.H.Piece(b.ID, layer, kv) }

// AppendPieces appends the block's pieces in (layer, kv) order (the order
// of the contiguous layout: a transport that writes them one after the
// other produces a block-contiguous copy) and returns dst.
func (b Block) AppendPieces(dst [][]byte) [][]byte {
	for l := range b.H.lay.Layers {
		for kv := range b.H.lay.KVs {
			dst = append(dst, b.H.Piece(b.ID, l, kv))
		}
	}
	return dst
}

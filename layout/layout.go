// Package layout describes where the KV of one block lives when a model
// stores it per layer: piece (layer l, kind kv, block b) — K or V of block
// b in layer l — is PieceBytes bytes at
//
//	Base + l·LayerStride + kv·KVStride + b·BlockStride
//
// vLLM's per-layer tensors [2, blocks, block_tokens, heads, dim] are
// LayerSeparated; a pool whose block is one contiguous span holding every
// layer's K and V is Contiguous, the special case where a block's pieces
// are adjacent (a copy of it merges into one span).
//
// A transport moves a block as all its pieces (AppendPieces), so the two sides
// of a copy may arrange memory differently as long as their pieces agree:
// the same number of layers and kinds, the same piece size, the same
// element geometry (Tag). Fingerprint covers exactly that; a handoff
// compares it at propose time and refuses a mismatch.
package layout

import (
	"encoding/binary"
	"fmt"

	"github.com/cespare/xxhash/v2"

	"github.com/kvlease/kvlease"
)

// Layout is a memory description of Blocks blocks of per-layer KV.
// Offsets are relative to the start of the memory it describes (its
// base).
type Layout struct {
	Layers     int // layers of the model (of this group)
	KVs        int // pieces per layer: 2 (K and V), or 1 (MLA latent, state)
	Blocks     int
	PieceBytes int // bytes of one piece: block_tokens · heads · head_dim · element size

	LayerStride, KVStride, BlockStride int

	// Tag names the element geometry both sides must agree on (dtype,
	// heads, head dim, block tokens; e.g. "bf16 t16 h8 d128"). Free text,
	// part of the fingerprint.
	Tag string
}

// LayerSeparated returns the layout of per-layer tensors
// [layers][kvs][blocks][piece]: each layer's K of every block, then its V,
// then the next layer.
func LayerSeparated(layers, kvs, blocks, pieceBytes int, tag string) Layout {
	return Layout{Layers: layers, KVs: kvs, Blocks: blocks, PieceBytes: pieceBytes,
		BlockStride: pieceBytes, KVStride: blocks * pieceBytes, LayerStride: kvs * blocks * pieceBytes, Tag: tag}
}

// Contiguous returns the layout where block b is one span of
// layers·kvs·pieceBytes bytes holding its pieces layer by layer ([blocks]
// [layers][kvs][piece]): the plain block of a kvlease.Memory.
func Contiguous(layers, kvs, blocks, pieceBytes int, tag string) Layout {
	return Layout{Layers: layers, KVs: kvs, Blocks: blocks, PieceBytes: pieceBytes,
		KVStride: pieceBytes, LayerStride: kvs * pieceBytes, BlockStride: layers * kvs * pieceBytes, Tag: tag}
}

// BlockBytes returns the bytes of one block: all its pieces.
func (l Layout) BlockBytes() int { return l.Layers * l.KVs * l.PieceBytes }

// PiecesPerBlock returns Layers·KVs.
func (l Layout) PiecesPerBlock() int { return l.Layers * l.KVs }

// Offset returns the offset of piece (layer, kv, block).
func (l Layout) Offset(layer, kv, block int) int {
	return layer*l.LayerStride + kv*l.KVStride + block*l.BlockStride
}

// Size returns the bytes the layout spans: one past its last piece's end.
func (l Layout) Size() int {
	return l.Offset(l.Layers-1, l.KVs-1, l.Blocks-1) + l.PieceBytes
}

// IsContiguous reports whether each block's pieces are adjacent in
// (layer, kv) order, so a block is one span of BlockBytes.
func (l Layout) IsContiguous() bool {
	return l.KVStride == l.PieceBytes && l.LayerStride == l.KVs*l.PieceBytes
}

// Validate checks the layout: positive counts and piece size, non-negative
// strides, and no two pieces overlapping. Errors wrap
// kvlease.ErrInvalidArgument.
func (l Layout) Validate() error {
	if l.Layers <= 0 || l.KVs <= 0 || l.Blocks <= 0 || l.PieceBytes <= 0 {
		return fmt.Errorf("layout: %d layers, %d kvs, %d blocks of %d-byte pieces: all must be positive: %w",
			l.Layers, l.KVs, l.Blocks, l.PieceBytes, kvlease.ErrInvalidArgument)
	}
	if l.LayerStride < 0 || l.KVStride < 0 || l.BlockStride < 0 {
		return fmt.Errorf("layout: negative stride: %w", kvlease.ErrInvalidArgument)
	}
	// Pieces do not overlap when the three strides, sorted, each step past
	// everything the smaller ones span (a mixed-radix numbering).
	type dim struct{ stride, count int }
	ds := []dim{{l.LayerStride, l.Layers}, {l.KVStride, l.KVs}, {l.BlockStride, l.Blocks}}
	for i := range ds { // sort by stride, ignoring dimensions of one
		for j := i + 1; j < len(ds); j++ {
			if ds[j].stride < ds[i].stride {
				ds[i], ds[j] = ds[j], ds[i]
			}
		}
	}
	span := l.PieceBytes
	for _, d := range ds {
		if d.count == 1 {
			continue
		}
		if d.stride < span {
			return fmt.Errorf("layout: stride %d is less than the %d bytes it must step over: pieces overlap: %w",
				d.stride, span, kvlease.ErrInvalidArgument)
		}
		span = d.stride*(d.count-1) + span
	}
	return nil
}

// Fingerprint returns a hash of what the two sides of a copy must agree
// on: layers, kinds, piece size and Tag. Block counts and strides are each
// side's own business (every transport moves a block piece by piece), so
// they are left out.
func (l Layout) Fingerprint() uint64 {
	var b [24]byte
	binary.LittleEndian.PutUint64(b[0:], uint64(l.Layers))
	binary.LittleEndian.PutUint64(b[8:], uint64(l.KVs))
	binary.LittleEndian.PutUint64(b[16:], uint64(l.PieceBytes))
	d := xxhash.New()
	_, _ = d.Write([]byte("kvlease/layout/v1\x00"))
	_, _ = d.Write(b[:])
	_, _ = d.WriteString(l.Tag)
	return d.Sum64()
}

// Piece is one piece of a block: its offset and length.
type Piece struct {
	Layer, KV int
	Off, Len  int
}

// AppendPieces appends block's pieces in (layer, kv) order and returns
// dst. A block outside [0, Blocks) panics like a slice index.
func (l Layout) AppendPieces(dst []Piece, block int) []Piece {
	if block < 0 || block >= l.Blocks {
		panic(fmt.Sprintf("layout: block %d outside [0, %d)", block, l.Blocks))
	}
	for layer := range l.Layers {
		for kv := range l.KVs {
			dst = append(dst, Piece{Layer: layer, KV: kv, Off: l.Offset(layer, kv, block), Len: l.PieceBytes})
		}
	}
	return dst
}

// Compatible returns nil when a block can be copied piece by piece between
// l and o (their fingerprints agree), else an error naming the first
// difference, wrapping kvlease.ErrInvalidArgument.
func (l Layout) Compatible(o Layout) error {
	switch {
	case l.Layers != o.Layers:
		return fmt.Errorf("layout: %d layers vs %d: %w", l.Layers, o.Layers, kvlease.ErrInvalidArgument)
	case l.KVs != o.KVs:
		return fmt.Errorf("layout: %d pieces per layer vs %d: %w", l.KVs, o.KVs, kvlease.ErrInvalidArgument)
	case l.PieceBytes != o.PieceBytes:
		return fmt.Errorf("layout: %d-byte pieces vs %d: %w", l.PieceBytes, o.PieceBytes, kvlease.ErrInvalidArgument)
	case l.Tag != o.Tag:
		return fmt.Errorf("layout: tag %q vs %q: %w", l.Tag, o.Tag, kvlease.ErrInvalidArgument)
	}
	return nil
}

// String describes the layout.
func (l Layout) String() string {
	return fmt.Sprintf("%d layers × %d × %d blocks of %d B (strides layer %d, kv %d, block %d) %q",
		l.Layers, l.KVs, l.Blocks, l.PieceBytes, l.LayerStride, l.KVStride, l.BlockStride, l.Tag)
}

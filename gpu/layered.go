package gpu

import (
	"fmt"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/layout"
)

// Per-layer KV: a model that stores its KV as one tensor per layer
// ([2, blocks, block_tokens, heads, dim] in vLLM) keeps block b's K and V
// in 2·layers separate pieces. LayeredDevice and LayeredPinned lay a
// layout.Layout over one arena whose arena blocks are the pieces, and are
// kvlease.Memory whose block b is all its pieces (l, kv, b), so a pool
// hands out whole model blocks. The layered transports move a block as all
// its pieces: every piece of every pair of one Start goes to the copy
// engine as one batch (one submission: one cuMemcpyBatchAsync, or one run
// of the fallback's worker), ordered layer by layer so that pieces of
// adjacent blocks merge into one span, and the Start returns one Transfer
// for the whole lease range, as a plain copy does.

// LayeredDevice is device memory in a layout: one DeviceArena whose
// blocks are the layout's pieces. It is a kvlease.Memory[DeviceBlock].
type LayeredDevice struct {
	arena *DeviceArena
	lay   layout.Layout
}

// LayeredPinned is pinned host memory in a layout: one PinnedArena whose
// blocks are the layout's pieces. It is a kvlease.Memory[HostBlock].
type LayeredPinned struct {
	arena *PinnedArena
	lay   layout.Layout
}

// DeviceBlock is block ID of a LayeredDevice: the region a pool over it
// hands out.
type DeviceBlock struct {
	M  *LayeredDevice
	ID kvlease.BlockID
}

// HostBlock is block ID of a LayeredPinned.
type HostBlock struct {
	M  *LayeredPinned
	ID kvlease.BlockID
}

var (
	_ kvlease.Memory[DeviceBlock] = (*LayeredDevice)(nil)
	_ kvlease.Memory[HostBlock]   = (*LayeredPinned)(nil)
)

// pieceGeometry checks that lay can be cut into arena blocks of its piece
// size and returns how many arena blocks it spans.
func pieceGeometry(lay layout.Layout) (int, error) {
	if err := lay.Validate(); err != nil {
		return 0, err
	}
	p := lay.PieceBytes
	if lay.LayerStride%p != 0 || lay.KVStride%p != 0 || lay.BlockStride%p != 0 {
		return 0, fmt.Errorf("gpu: layout %v: strides must be multiples of the piece size: %w", lay, kvlease.ErrInvalidArgument)
	}
	return lay.Size() / p, nil
}

// AllocLayered allocates device memory in layout lay: one arena of
// lay.Size() bytes cut into pieces. The piece size must be a multiple of
// Alignment and the strides multiples of the piece size; errors wrap
// kvlease.ErrInvalidArgument.
func (d *Device) AllocLayered(lay layout.Layout) (*LayeredDevice, error) {
	n, err := pieceGeometry(lay)
	if err != nil {
		return nil, err
	}
	a, err := d.AllocDevice(n, lay.PieceBytes)
	if err != nil {
		return nil, err
	}
	return &LayeredDevice{arena: a, lay: lay}, nil
}

// AllocLayeredPinned allocates pinned host memory in layout lay, as
// AllocLayered does on the device.
func (d *Device) AllocLayeredPinned(lay layout.Layout) (*LayeredPinned, error) {
	n, err := pieceGeometry(lay)
	if err != nil {
		return nil, err
	}
	a, err := d.AllocPinned(n, lay.PieceBytes)
	if err != nil {
		return nil, err
	}
	return &LayeredPinned{arena: a, lay: lay}, nil
}

// Blocks returns the layout's block count.
func (m *LayeredDevice) Blocks() int { return m.lay.Blocks }

// BlockBytes returns the bytes of one block: all its pieces.
func (m *LayeredDevice) BlockBytes() int { return m.lay.BlockBytes() }

// Region returns block id. It panics for an id outside the layout.
func (m *LayeredDevice) Region(id kvlease.BlockID) DeviceBlock {
	if id < 0 || int(id) >= m.lay.Blocks {
		panic(fmt.Sprintf("gpu: block %d outside a layout of %d blocks", id, m.lay.Blocks))
	}
	return DeviceBlock{m, id}
}

// Layout returns the memory's layout.
func (m *LayeredDevice) Layout() layout.Layout { return m.lay }

// Arena returns the arena of pieces.
func (m *LayeredDevice) Arena() *DeviceArena { return m.arena }

// Piece returns the device address of piece (layer, kv) of block id.
func (m *LayeredDevice) Piece(id kvlease.BlockID, layer, kv int) DevicePtr {
	return m.arena.Base().Add(m.lay.Offset(layer, kv, int(id)))
}

// Close frees the memory, as DeviceArena.Close.
func (m *LayeredDevice) Close() error { return m.arena.Close() }

// Blocks returns the layout's block count.
func (m *LayeredPinned) Blocks() int { return m.lay.Blocks }

// BlockBytes returns the bytes of one block: all its pieces.
func (m *LayeredPinned) BlockBytes() int { return m.lay.BlockBytes() }

// Region returns block id. It panics for an id outside the layout.
func (m *LayeredPinned) Region(id kvlease.BlockID) HostBlock {
	if id < 0 || int(id) >= m.lay.Blocks {
		panic(fmt.Sprintf("gpu: block %d outside a layout of %d blocks", id, m.lay.Blocks))
	}
	return HostBlock{m, id}
}

// Layout returns the memory's layout.
func (m *LayeredPinned) Layout() layout.Layout { return m.lay }

// Arena returns the arena of pieces.
func (m *LayeredPinned) Arena() *PinnedArena { return m.arena }

// Piece returns piece (layer, kv) of block id: a whole arena block, nil
// once the arena is closed.
func (m *LayeredPinned) Piece(id kvlease.BlockID, layer, kv int) []byte {
	return m.arena.Region(kvlease.BlockID(m.lay.Offset(layer, kv, int(id)) / m.lay.PieceBytes))
}

// Close frees the memory, as PinnedArena.Close.
func (m *LayeredPinned) Close() error { return m.arena.Close() }

// LayeredDeviceToHost copies device blocks in a layout to pinned host
// blocks in a compatible layout, piece by piece, one submission per Start.
// Make it with CopyEngine.LayeredDeviceToHost.
type LayeredDeviceToHost struct{ e *CopyEngine }

// LayeredHostToDevice copies pinned host blocks to device blocks, piece by
// piece, one submission per Start. Make it with
// CopyEngine.LayeredHostToDevice.
type LayeredHostToDevice struct{ e *CopyEngine }

var (
	_ kvlease.Transport[DeviceBlock, HostBlock] = LayeredDeviceToHost{}
	_ kvlease.Transport[HostBlock, DeviceBlock] = LayeredHostToDevice{}
)

// LayeredDeviceToHost returns the engine's per-layer offload transport.
func (e *CopyEngine) LayeredDeviceToHost() LayeredDeviceToHost { return LayeredDeviceToHost{e} }

// LayeredHostToDevice returns the engine's per-layer onload transport.
func (e *CopyEngine) LayeredHostToDevice() LayeredHostToDevice { return LayeredHostToDevice{e} }

// Start copies every piece of each pair's device block to the same piece
// of its host block: all pieces of all pairs in one DeviceToHost.Start
// (one submission, one Transfer), ordered layer by layer, then kind, then
// pair. Errors as DeviceToHost.Start; pairs whose layouts are not
// compatible (layout.Layout.Compatible), or a zero block, are refused with
// kvlease.ErrInvalidArgument before anything is attached.
func (t LayeredDeviceToHost) Start(pairs []kvlease.CopyPair[DeviceBlock, HostBlock], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	pieces, err := expand(pairs, "layered device-to-host copy",
		func(b DeviceBlock) (*layout.Layout, bool) { return layoutOf(b.M) },
		func(b HostBlock) (*layout.Layout, bool) { return layoutOf(b.M) },
		func(p kvlease.CopyPair[DeviceBlock, HostBlock], l, kv int) kvlease.CopyPair[DevicePtr, []byte] {
			return kvlease.CopyPair[DevicePtr, []byte]{Src: p.Src.M.Piece(p.Src.ID, l, kv), Dst: p.Dst.M.Piece(p.Dst.ID, l, kv)}
		})
	if err != nil {
		return nil, err
	}
	return t.e.DeviceToHost().Start(pieces, attach)
}

// Start copies every piece of each pair's host block to its device block,
// as LayeredDeviceToHost.Start does in the other direction.
func (t LayeredHostToDevice) Start(pairs []kvlease.CopyPair[HostBlock, DeviceBlock], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	pieces, err := expand(pairs, "layered host-to-device copy",
		func(b HostBlock) (*layout.Layout, bool) { return layoutOf(b.M) },
		func(b DeviceBlock) (*layout.Layout, bool) { return layoutOf(b.M) },
		func(p kvlease.CopyPair[HostBlock, DeviceBlock], l, kv int) kvlease.CopyPair[[]byte, DevicePtr] {
			return kvlease.CopyPair[[]byte, DevicePtr]{Src: p.Src.M.Piece(p.Src.ID, l, kv), Dst: p.Dst.M.Piece(p.Dst.ID, l, kv)}
		})
	if err != nil {
		return nil, err
	}
	return t.e.HostToDevice().Start(pieces, attach)
}

// layouted is a layered memory of either kind.
type layouted interface {
	*LayeredDevice | *LayeredPinned
	Layout() layout.Layout
}

func layoutOf[M layouted](m M) (*layout.Layout, bool) {
	if m == nil {
		return nil, false
	}
	l := m.Layout()
	return &l, true
}

// expand turns block pairs into piece pairs, layer-major, after checking
// every pair's layouts agree with the first pair's.
func expand[S, D, PS, PD any](pairs []kvlease.CopyPair[S, D], dir string,
	srcLay func(S) (*layout.Layout, bool), dstLay func(D) (*layout.Layout, bool),
	piece func(kvlease.CopyPair[S, D], int, int) kvlease.CopyPair[PS, PD]) ([]kvlease.CopyPair[PS, PD], error) {
	if len(pairs) == 0 {
		return nil, fmt.Errorf("gpu: %s: no pairs: %w", dir, kvlease.ErrInvalidArgument)
	}
	var ref *layout.Layout
	for i, p := range pairs {
		s, ok1 := srcLay(p.Src)
		d, ok2 := dstLay(p.Dst)
		if !ok1 || !ok2 {
			return nil, fmt.Errorf("gpu: %s, pair %d: a zero block (no layered memory): %w", dir, i, kvlease.ErrInvalidArgument)
		}
		if ref == nil {
			ref = s
		}
		if err := ref.Compatible(*s); err != nil {
			return nil, fmt.Errorf("gpu: %s, pair %d, src: %w", dir, i, err)
		}
		if err := ref.Compatible(*d); err != nil {
			return nil, fmt.Errorf("gpu: %s, pair %d, dst: %w", dir, i, err)
		}
	}
	out := make([]kvlease.CopyPair[PS, PD], 0, len(pairs)*ref.PiecesPerBlock())
	for l := range ref.Layers {
		for kv := range ref.KVs {
			for _, p := range pairs {
				out = append(out, piece(p, l, kv))
			}
		}
	}
	return out, nil
}

// Layout returns the layout of the block's memory (the zero Layout for
// the zero block), so a HostBlock is a tcp.LayeredRegion: pinned host
// blocks in a layout can cross a TCP handoff piece by piece.
func (b HostBlock) Layout() layout.Layout {
	if b.M == nil {
		return layout.Layout{}
	}
	return b.M.lay
}

// Piece returns piece (layer, kv) of the block, as LayeredPinned.Piece.
func (b HostBlock) Piece(layer, kv int) []byte { return b.M.Piece(b.ID, layer, kv) }

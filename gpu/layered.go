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
// its pieces: every piece of every pair of one Start is one submission
// (one launch of the copy kernel, one cuMemcpyBatchAsync, or one job of
// the fallback's worker), ordered layer by layer so that pieces of
// adjacent blocks merge into one span, and the Start returns one Transfer
// for the whole lease range, as a plain copy does. The pieces are found
// from the layouts directly: no lookup, no allocation.

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
// of its host block: all pieces of all pairs in one submission (one
// launch of the copy kernel, or one batch of the copy engine), one
// Transfer, ordered layer by layer, then kind, then pair, so that pieces
// of adjacent blocks merge. Errors as DeviceToHost.Start; pairs whose
// layouts are not compatible (layout.Layout.Compatible), a zero block or a
// block outside its memory are refused with kvlease.ErrInvalidArgument
// before anything is attached.
func (t LayeredDeviceToHost) Start(pairs []kvlease.CopyPair[DeviceBlock, HostBlock], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	return startLayered(t.e, deviceToHost, pairs, attach, DeviceBlock.pieces, HostBlock.pieces)
}

// Start copies every piece of each pair's host block to its device block,
// as LayeredDeviceToHost.Start does in the other direction.
func (t LayeredHostToDevice) Start(pairs []kvlease.CopyPair[HostBlock, DeviceBlock], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	return startLayered(t.e, hostToDevice, pairs, attach, HostBlock.pieces, DeviceBlock.pieces)
}

// pieces returns the block's layout, the arena of its pieces, its id and
// whether it is a block of a layered memory at all.
func (b DeviceBlock) pieces() (*layout.Layout, *arena, kvlease.BlockID, bool) {
	if b.M == nil {
		return nil, nil, 0, false
	}
	return &b.M.lay, b.M.arena.a, b.ID, true
}

func (b HostBlock) pieces() (*layout.Layout, *arena, kvlease.BlockID, bool) {
	if b.M == nil {
		return nil, nil, 0, false
	}
	return &b.M.lay, b.M.arena.a, b.ID, true
}

// layeredDirNames names each direction of the layered transports in errors.
var layeredDirNames = [...]string{
	hostToDevice:   "layered host-to-device copy",
	deviceToHost:   "layered device-to-host copy",
	deviceToDevice: "layered device-to-device copy",
}

// startLayered turns block pairs into piece copies straight from the
// layouts (each piece is a whole arena block at a known offset: no lookup)
// after checking every pair's layouts agree with the first pair's, then
// runs them as one Start.
func startLayered[S, D any](e *CopyEngine, kind copyKind, pairs []kvlease.CopyPair[S, D], attach func(*kvlease.Transfer) error,
	srcOf func(S) (*layout.Layout, *arena, kvlease.BlockID, bool), dstOf func(D) (*layout.Layout, *arena, kvlease.BlockID, bool)) (*kvlease.Transfer, error) {
	dir := layeredDirNames[kind]
	switch {
	case e == nil:
		return nil, fmt.Errorf("gpu: %s: zero transport; make it with a CopyEngine: %w", dir, kvlease.ErrInvalidArgument)
	case attach == nil:
		return nil, fmt.Errorf("gpu: %s: nil attach: a copy no lease knows about could land in reused memory: %w", dir, kvlease.ErrInvalidArgument)
	case len(pairs) == 0:
		return nil, fmt.Errorf("gpu: %s: no pairs: %w", dir, kvlease.ErrInvalidArgument)
	}
	var ref *layout.Layout
	for i, p := range pairs {
		s, _, sid, ok1 := srcOf(p.Src)
		d, _, did, ok2 := dstOf(p.Dst)
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
		if sid < 0 || int(sid) >= s.Blocks {
			return nil, fmt.Errorf("gpu: %s, pair %d, src: block %d outside a layout of %d blocks: %w", dir, i, sid, s.Blocks, kvlease.ErrInvalidArgument)
		}
		if did < 0 || int(did) >= d.Blocks {
			return nil, fmt.Errorf("gpu: %s, pair %d, dst: block %d outside a layout of %d blocks: %w", dir, i, did, d.Blocks, kvlease.ErrInvalidArgument)
		}
	}
	j, err := e.reserve(kind, len(pairs)*ref.PiecesPerBlock())
	if err != nil {
		return nil, err
	}
	for l := range ref.Layers {
		for kv := range ref.KVs {
			for i := range pairs {
				p := &pairs[i]
				sl, sa, sid, _ := srcOf(p.Src)
				dl, da, did, _ := dstOf(p.Dst)
				src := span{sa, sl.Offset(l, kv, int(sid))}
				dst := span{da, dl.Offset(l, kv, int(did))}
				if err := j.add(src, dst); err != nil {
					e.unreserve(j)
					return nil, fmt.Errorf("gpu: %s, pair %d, layer %d, kv %d: %w", dir, i, l, kv, err)
				}
			}
		}
	}
	return e.run(j, attach)
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

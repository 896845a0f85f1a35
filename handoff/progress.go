package handoff

import (
	"fmt"
	"sync"

	"github.com/kvlease/kvlease"
)

// Progress is how far a prefill has written the blocks of a lease that a
// streaming handoff sends (Streaming): the source may propose, and the
// plane start sending, before the model has written every block. The
// model marks what it wrote, in either or both of two orders:
//
//   - WroteLayers(l): layers 0..l-1 of every block are written (a prefill
//     that computes the whole prompt layer by layer);
//   - WroteBlocks(b): blocks 0..b-1 are written whole, every layer (a
//     chunked prefill that finishes blocks front to back).
//
// Part (block i, layer j) is written once j < layers or i < blocks. A
// block's layer j is the j-th of Layers equal slices of the block in its
// contiguous form (a layout's pieces of layer j, in kv order). Marks only
// move forward; a smaller mark than the current one changes nothing.
// When every part is written the progress is complete.
//
// The evidence rules do not change: a plane reads a part only after it
// is marked, and its transfer resolves as any other. A Progress is safe
// for concurrent use: the model marks from its goroutine while the plane
// waits on another.
type Progress struct {
	blocks, layers int

	mu      sync.Mutex
	layer   int           // layers [0, layer) of every block are written
	block   int           // blocks [0, block) are written whole
	changed chan struct{} // closed (and replaced) when a mark moves
}

// NewProgress returns the progress of a prefill writing blocks blocks of
// layers layers each, nothing written yet. Errors wrap
// kvlease.ErrInvalidArgument: blocks or layers below 1, layers above
// MaxLayers.
func NewProgress(blocks, layers int) (*Progress, error) {
	if blocks < 1 || layers < 1 || layers > MaxLayers {
		return nil, fmt.Errorf("kvlease: handoff progress of %d blocks × %d layers (1 to %d layers): %w", blocks, layers, MaxLayers, kvlease.ErrInvalidArgument)
	}
	return &Progress{blocks: blocks, layers: layers, changed: make(chan struct{})}, nil
}

// MaxLayers is the most layers a Progress counts.
const MaxLayers = 1 << 12

// Blocks returns the blocks the progress counts.
func (p *Progress) Blocks() int { return p.blocks }

// Layers returns the layers of each block.
func (p *Progress) Layers() int { return p.layers }

// WroteLayers marks layers 0..layers-1 of every block written. Errors
// wrap kvlease.ErrInvalidArgument for layers outside [0, Layers].
func (p *Progress) WroteLayers(layers int) error {
	if layers < 0 || layers > p.layers {
		return fmt.Errorf("kvlease: handoff progress: %d layers written of %d: %w", layers, p.layers, kvlease.ErrInvalidArgument)
	}
	p.mark(layers, 0)
	return nil
}

// WroteBlocks marks blocks 0..blocks-1 written whole. Errors wrap
// kvlease.ErrInvalidArgument for blocks outside [0, Blocks].
func (p *Progress) WroteBlocks(blocks int) error {
	if blocks < 0 || blocks > p.blocks {
		return fmt.Errorf("kvlease: handoff progress: %d blocks written of %d: %w", blocks, p.blocks, kvlease.ErrInvalidArgument)
	}
	p.mark(0, blocks)
	return nil
}

// WroteAll marks every part written.
func (p *Progress) WroteAll() { p.mark(p.layers, p.blocks) }

func (p *Progress) mark(layers, blocks int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if layers <= p.layer && blocks <= p.block {
		return
	}
	p.layer, p.block = max(p.layer, layers), max(p.block, blocks)
	if p.layer == p.layers {
		p.block = p.blocks
	}
	if p.block == p.blocks {
		p.layer = p.layers
	}
	close(p.changed)
	p.changed = make(chan struct{})
}

// Written returns the marks: layers 0..layers-1 of every block and
// blocks 0..blocks-1 whole are written.
func (p *Progress) Written() (layers, blocks int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.layer, p.block
}

// Complete reports whether every part is written.
func (p *Progress) Complete() bool {
	l, _ := p.Written()
	return l == p.layers
}

// Ready returns what a plane that sends blocks from..Blocks-1 (a
// handoff's blocks past the destination's hits) sees of p. Errors wrap
// kvlease.ErrInvalidArgument for from outside [0, Blocks].
func (p *Progress) Ready(from int) (Ready, error) {
	if from < 0 || from > p.blocks {
		return Ready{}, fmt.Errorf("kvlease: handoff progress: ready from block %d of %d: %w", from, p.blocks, kvlease.ErrInvalidArgument)
	}
	return Ready{p: p, from: from}, nil
}

// Ready is a streaming plane's view of a Progress: the parts of its
// regions (region i is the progress's block from+i) that the model has
// written. The zero Ready is complete: every part is ready at once (a
// handoff that does not stream).
type Ready struct {
	p    *Progress
	from int
}

// Streaming reports whether r follows a progress (false for the zero
// Ready, whose parts are all written).
func (r Ready) Streaming() bool { return r.p != nil }

// Layers returns the layers each block is split into (1 for the zero
// Ready).
func (r Ready) Layers() int {
	if r.p == nil {
		return 1
	}
	return r.p.layers
}

// Written returns what is written, relative to the plane's regions:
// layers 0..layers-1 of every region and regions 0..blocks-1 whole. Once
// complete it returns (Layers, the region count).
func (r Ready) Written() (layers, blocks int) {
	if r.p == nil {
		return 1, 1 << 30
	}
	l, b := r.p.Written()
	return l, min(max(b-r.from, 0), r.p.blocks-r.from)
}

// Complete reports whether every part of the regions is written.
func (r Ready) Complete() bool {
	if r.p == nil {
		return true
	}
	l, b := r.Written()
	return l == r.p.layers || b == r.p.blocks-r.from
}

// Wait blocks until the regions' written parts go past (layers, blocks)
// — what the caller has already seen — or stop is closed, and returns
// Written; ok is false when stop ended the wait first. A complete Ready
// returns at once.
func (r Ready) Wait(layers, blocks int, stop <-chan struct{}) (l, b int, ok bool) {
	for {
		if r.p == nil {
			l, b := r.Written()
			return l, b, true
		}
		r.p.mu.Lock()
		ch := r.p.changed
		r.p.mu.Unlock()
		if l, b := r.Written(); l > layers || b > blocks || r.Complete() {
			return l, b, true
		}
		select {
		case <-ch:
		case <-stop:
			l, b := r.Written()
			return l, b, false
		}
	}
}

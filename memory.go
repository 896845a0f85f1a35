package kvlease

import (
	"fmt"
	"math"
)

// Memory is the storage a Pool hands out: Blocks() equal-sized regions of
// BlockBytes() bytes each, addressed by BlockID. R is how a region is
// named: a []byte for host memory, a device pointer for GPU memory.
//
// Region must be safe for concurrent use and must not retain or free the
// region: the pool owns who may touch it and when. Region is called only
// with ids in [0, Blocks()).
type Memory[R any] interface {
	Blocks() int
	BlockBytes() int
	Region(BlockID) R
}

// HostMemory is the embedded default Memory: one contiguous arena of Go
// memory, cut into blocks. Each region has len and cap equal to
// BlockBytes(), so an append to a region can never reach its neighbour.
type HostMemory struct {
	arena      []byte
	blocks     int
	blockBytes int
}

var _ Memory[[]byte] = (*HostMemory)(nil)

// NewHostMemory allocates blocks×blockBytes bytes of host memory. Both
// sizes must be positive, blocks must fit a BlockID and the product must
// not overflow; otherwise the error wraps ErrInvalidArgument.
func NewHostMemory(blocks, blockBytes int) (*HostMemory, error) {
	if blocks <= 0 || blockBytes <= 0 {
		return nil, fmt.Errorf("kvlease: host memory of %d blocks × %d bytes: sizes must be positive: %w",
			blocks, blockBytes, ErrInvalidArgument)
	}
	if blocks > math.MaxInt32 {
		return nil, fmt.Errorf("kvlease: host memory of %d blocks: more than a BlockID can address: %w",
			blocks, ErrInvalidArgument)
	}
	if blockBytes > math.MaxInt/blocks {
		return nil, fmt.Errorf("kvlease: host memory of %d blocks × %d bytes overflows int: %w",
			blocks, blockBytes, ErrInvalidArgument)
	}
	return &HostMemory{arena: make([]byte, blocks*blockBytes), blocks: blocks, blockBytes: blockBytes}, nil
}

// Blocks returns the number of blocks.
func (m *HostMemory) Blocks() int { return m.blocks }

// BlockBytes returns the size of one block in bytes.
func (m *HostMemory) BlockBytes() int { return m.blockBytes }

// Span returns the bytes of run r's blocks, one slice (len == cap ==
// r.Len×BlockBytes()): blocks are laid out by id, so a run of ids is one
// span of memory, which a copy moves at once (see Lease.AppendRuns). It
// panics like a slice expression when r is outside the memory.
func (m *HostMemory) Span(r Run) []byte {
	off, end := int(r.Start)*m.blockBytes, int(r.end())*m.blockBytes
	return m.arena[off:end:end]
}

// Region returns block id's bytes (len == cap == BlockBytes()). It panics
// like a slice index when id is out of range.
func (m *HostMemory) Region(id BlockID) []byte {
	off := int(id) * m.blockBytes
	return m.arena[off : off+m.blockBytes : off+m.blockBytes]
}

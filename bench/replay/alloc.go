package replay

import (
	"fmt"

	"go.uber.org/atomic"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/bench/baseline"
)

// Allocator is what the replayed engine allocates through: a kvlease pool
// (NewKVLease) or a baseline without prefix caching (NewBaseline).
// *kvlease.Pool's methods have these shapes; baselines adapt to them.
type Allocator interface {
	// Name says which allocator this is: "kvlease", "bare", "chan", "map".
	Name() string
	// AcquirePrefix is kvlease's: n blocks, the first hits of them the
	// cached prefix of hashes. Baselines never hit. A refusal for lack of
	// blocks wraps kvlease.ErrExhausted.
	AcquirePrefix(owner string, hashes []kvlease.BlockHash, n int) (Lease, int, error)
	// Region returns block id's memory, unchecked: the caller holds a
	// lease on it (kvlease: Pool.Memory().Region).
	Region(id kvlease.BlockID) []byte
	// Stats fills at least Capacity, Free, Leased and Acquires.
	Stats() kvlease.Stats
	// Check reports any inconsistency found at the end of a replay.
	Check() error
}

// Lease is one request's blocks in one allocator. *kvlease.Lease[[]byte]
// implements it directly; for baselines Seal is a no-op.
type Lease interface {
	Extend(n int) error
	Seal(i int, h kvlease.BlockHash) error
	AppendBlockIDs(dst []kvlease.BlockID, from int) []kvlease.BlockID
	Release()
	Abort(cause error)
}

// Kinds lists the allocators New knows, kvlease first.
var Kinds = []string{"kvlease", "bare", "chan", "map"}

// New returns the allocator of the given kind over blocks blocks of
// blockBytes bytes each.
func New(kind string, blocks, blockBytes int) (Allocator, error) {
	switch kind {
	case "kvlease":
		return NewKVLease(blocks, blockBytes)
	}
	return NewBaseline(kind, blocks, blockBytes)
}

// KVLease is a kvlease pool over host memory, as an Allocator.
type KVLease struct {
	Pool *kvlease.Pool[[]byte]
	mem  kvlease.Memory[[]byte]
	name string
}

// NewKVLease makes a pool of blocks blocks of blockBytes bytes. The leak
// check is off (as in production builds) so that -race runs time the
// same work; everything else is the pool's defaults.
func NewKVLease(blocks, blockBytes int) (*KVLease, error) {
	mem, err := kvlease.NewHostMemory(blocks, blockBytes)
	if err != nil {
		return nil, err
	}
	p, err := kvlease.NewPool[[]byte](mem, kvlease.WithLeakCheck(false))
	if err != nil {
		return nil, err
	}
	return &KVLease{Pool: p, mem: mem, name: "kvlease"}, nil
}

// Name returns "kvlease".
func (a *KVLease) Name() string { return a.name }

// AcquirePrefix is Pool.AcquirePrefix.
func (a *KVLease) AcquirePrefix(owner string, hashes []kvlease.BlockHash, n int) (Lease, int, error) {
	l, hits, err := a.Pool.AcquirePrefix(owner, hashes, n)
	if err != nil {
		return nil, 0, err
	}
	return l, hits, nil
}

// Region is the pool's Memory().Region: no lock, no check.
func (a *KVLease) Region(id kvlease.BlockID) []byte { return a.mem.Region(id) }

// Stats is Pool.Stats.
func (a *KVLease) Stats() kvlease.Stats { return a.Pool.Stats() }

// Check is Pool.Check.
func (a *KVLease) Check() error { return a.Pool.Check() }

// idSource is the part the baselines differ in: where ids come from.
type idSource interface {
	pop(dst []kvlease.BlockID, owner string, n int) ([]kvlease.BlockID, bool)
	push(owner string, ids []kvlease.BlockID)
	free() int
}

type bareSource struct{ *baseline.BareList }

func (s bareSource) pop(dst []kvlease.BlockID, _ string, n int) ([]kvlease.BlockID, bool) {
	return s.Pop(dst, n)
}
func (s bareSource) push(_ string, ids []kvlease.BlockID) { s.Push(ids) }
func (s bareSource) free() int                            { return s.Free() }

type chanSource struct{ *baseline.ChanPool }

func (s chanSource) pop(dst []kvlease.BlockID, _ string, n int) ([]kvlease.BlockID, bool) {
	return s.Pop(dst, n)
}
func (s chanSource) push(_ string, ids []kvlease.BlockID) { s.Push(ids) }
func (s chanSource) free() int                            { return s.Free() }

// mapSource keeps the block table in the MapPool, keyed by owner, as a
// hand-written scheduler does; the lease aliases that table (read only).
type mapSource struct{ *baseline.MapPool }

func (s mapSource) pop(dst []kvlease.BlockID, owner string, n int) ([]kvlease.BlockID, bool) {
	var err error
	if len(dst) == 0 {
		err = s.Acquire(owner, n)
	} else {
		err = s.Extend(owner, n)
	}
	if err != nil {
		return dst, false
	}
	return s.Table(owner), true
}
func (s mapSource) push(owner string, _ []kvlease.BlockID) { s.Release(owner) }
func (s mapSource) free() int                              { return s.Free() }

// Baseline is a baseline allocator with host memory, as an Allocator:
// no prefix cache, no transfers, no generations.
type Baseline struct {
	kind     string
	src      idSource
	blocks   int
	bb       int
	arena    []byte
	acquires atomic.Uint64
	open     atomic.Int64
}

// NewBaseline returns the baseline of the given kind ("bare", "chan" or
// "map"; see package baseline).
func NewBaseline(kind string, blocks, blockBytes int) (*Baseline, error) {
	if blocks <= 0 || blockBytes <= 0 {
		return nil, fmt.Errorf("replay: %s baseline of %d×%d bytes: %w", kind, blocks, blockBytes, kvlease.ErrInvalidArgument)
	}
	b := &Baseline{kind: kind, blocks: blocks, bb: blockBytes, arena: make([]byte, blocks*blockBytes)}
	switch kind {
	case "bare":
		b.src = bareSource{baseline.NewBareList(blocks)}
	case "chan":
		b.src = chanSource{baseline.NewChanPool(blocks)}
	case "map":
		b.src = mapSource{baseline.NewMapPool(blocks)}
	default:
		return nil, fmt.Errorf("replay: unknown allocator %q (want one of %v): %w", kind, Kinds, kvlease.ErrInvalidArgument)
	}
	return b, nil
}

// Name returns the baseline's kind.
func (b *Baseline) Name() string { return b.kind }

// AcquirePrefix hands out n fresh blocks; it never hits.
func (b *Baseline) AcquirePrefix(owner string, _ []kvlease.BlockHash, n int) (Lease, int, error) {
	ids, ok := b.src.pop(nil, owner, n)
	if !ok {
		return nil, 0, errBaseExhausted
	}
	b.acquires.Add(1)
	b.open.Add(1)
	return &baseLease{b: b, owner: owner, ids: ids}, 0, nil
}

// Region returns block id's bytes from the baseline's arena.
func (b *Baseline) Region(id kvlease.BlockID) []byte {
	off := int(id) * b.bb
	return b.arena[off : off+b.bb : off+b.bb]
}

// Stats reports Capacity, Free, Leased, OpenLeases and Acquires.
func (b *Baseline) Stats() kvlease.Stats {
	f := b.src.free()
	return kvlease.Stats{Capacity: b.blocks, Free: f, Leased: b.blocks - f,
		OpenLeases: int(b.open.Load()), Acquires: b.acquires.Load()}
}

// Check reports blocks still out when no lease is open.
func (b *Baseline) Check() error {
	if f := b.src.free(); b.open.Load() == 0 && f != b.blocks {
		return fmt.Errorf("replay: %s: %d of %d blocks free with no lease open", b.kind, f, b.blocks)
	}
	return nil
}

// errBaseExhausted is a baseline's refusal: one static error, as a
// hand-written allocator returns a bool, so that baselines pay nothing to
// say no.
var errBaseExhausted = fmt.Errorf("replay: baseline: not enough free blocks: %w", kvlease.ErrExhausted)

type baseLease struct {
	b      *Baseline
	owner  string
	ids    []kvlease.BlockID
	closed bool
}

func (l *baseLease) Extend(n int) error {
	if l.closed {
		return fmt.Errorf("replay: %s: extend %q: %w", l.b.kind, l.owner, kvlease.ErrLeaseClosed)
	}
	ids, ok := l.b.src.pop(l.ids, l.owner, n)
	if !ok {
		return errBaseExhausted
	}
	l.ids = ids
	return nil
}

func (l *baseLease) Seal(int, kvlease.BlockHash) error { return nil }

func (l *baseLease) AppendBlockIDs(dst []kvlease.BlockID, from int) []kvlease.BlockID {
	return append(dst, l.ids[from:]...)
}

func (l *baseLease) Release() {
	if l.closed {
		return
	}
	l.closed = true
	l.b.src.push(l.owner, l.ids)
	l.b.open.Add(-1)
}

func (l *baseLease) Abort(error) { l.Release() }

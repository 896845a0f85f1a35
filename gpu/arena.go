package gpu

import (
	"fmt"
	"math"
	"slices"
	"sort"
	"unsafe"

	"github.com/kvlease/kvlease"
	"go.uber.org/atomic"
)

// Alignment is the alignment, in bytes, of every block of every arena, and
// BlockBytes must be a multiple of it. cuMemAlloc returns memory aligned to
// at least 256 bytes (the CUDA programming guide's guarantee) and
// cuMemHostAlloc returns page-aligned memory, so with a block size that is a
// multiple of 256 every block starts 256-byte aligned: the copy engines and
// vectorized kernels get full-width transactions, and no block shares a
// 256-byte segment with its neighbour. The CPU fallback aligns its arenas
// the same way.
const Alignment = 256

// DevicePtr is an address in a device's memory (a CUdeviceptr). It is a
// number, never a Go pointer: on the CPU fallback it is an address in the
// fallback's own address space, which only the fallback resolves. The copy
// engine and Device.CopyToHost accept a DevicePtr only inside a live
// DeviceArena of their own device.
type DevicePtr uint64

// Add returns p advanced by n bytes.
func (p DevicePtr) Add(n int) DevicePtr { return p + DevicePtr(n) }

// String formats p in hexadecimal.
func (p DevicePtr) String() string { return fmt.Sprintf("0x%x", uint64(p)) }

type memKind uint8

const (
	deviceMem memKind = iota
	pinnedMem
)

func (k memKind) String() string {
	if k == deviceMem {
		return "device arena"
	}
	return "pinned arena"
}

// arena is the shared core of DeviceArena and PinnedArena.
type arena struct {
	dev        *Device
	kind       memKind
	addr       uint64 // device address, or the address of host[0]
	dptr       uint64 // the address the copy kernel uses: addr for device memory, the mapped address of pinned memory (0: not mapped)
	host       []byte // pinned memory; on the fallback also device memory
	blocks     int
	blockBytes int
	freed      atomic.Bool // set once Close freed the memory

	// Guarded by dev.mu.
	pending     int // copies in flight touching this arena (transfers, sync copies)
	quarantined int // of those, the ones that can never be proven finished
	closed      bool
}

func (a *arena) size() int { return a.blocks * a.blockBytes }

// contains reports whether [addr, addr+n) lies in a.
func (a *arena) contains(addr uint64, n int) bool {
	return addr >= a.addr && n >= 0 && addr-a.addr <= uint64(a.size()) && uint64(n) <= uint64(a.size())-(addr-a.addr)
}

func (a *arena) regionOffset(id kvlease.BlockID) int {
	if id < 0 || int(id) >= a.blocks {
		panic(fmt.Sprintf("gpu: block %d out of range [0, %d) of %s", id, a.blocks, a.kind))
	}
	return int(id) * a.blockBytes
}

// busyLocked describes what keeps a from being freed, or "" if nothing.
func (a *arena) busyLocked() string {
	switch {
	case a.quarantined > 0:
		return fmt.Sprintf("%d copies in flight, %d of them quarantined (the device never proved they stopped; the memory stays allocated for the life of the process)", a.pending, a.quarantined)
	case a.pending > 0:
		return fmt.Sprintf("%d copies in flight", a.pending)
	}
	return ""
}

// close frees a unless copies still reference it.
func (a *arena) close() error {
	d := a.dev
	d.mu.Lock()
	if a.closed {
		d.mu.Unlock()
		return nil
	}
	if busy := a.busyLocked(); busy != "" {
		d.mu.Unlock()
		return fmt.Errorf("gpu: closing %s at 0x%x (%d blocks of %d bytes): %s: %w", a.kind, a.addr, a.blocks, a.blockBytes, busy, ErrBusy)
	}
	a.closed = true
	d.removeArenaLocked(a)
	d.mu.Unlock()
	// No copy can reach a from here on: lookups no longer find it.
	a.freed.Store(true)
	if a.kind == deviceMem {
		return d.b.freeDevice(a.addr, a.size())
	}
	return d.b.freePinned(a.host)
}

// closeWithPool closes pool p over arena a, then frees a if nothing in
// the pool can still reference it.
func closeWithPool[R any](a *arena, m kvlease.Memory[R], p *kvlease.Pool[R]) error {
	if p == nil || p.Memory() != m {
		return fmt.Errorf("gpu: closing %s at 0x%x: the pool does not manage this arena: %w", a.kind, a.addr, kvlease.ErrInvalidArgument)
	}
	if err := p.Close(); err != nil {
		return err
	}
	st := p.Stats()
	if st.OpenLeases > 0 || st.Leased > 0 || st.Draining > 0 || st.Quarantined > 0 {
		return fmt.Errorf("gpu: closing %s at 0x%x: its pool still has %d open leases, %d leased, %d draining and %d quarantined blocks: %w",
			a.kind, a.addr, st.OpenLeases, st.Leased, st.Draining, st.Quarantined, ErrBusy)
	}
	return a.close()
}

func checkGeometry(blocks, blockBytes int) error {
	switch {
	case blocks <= 0 || blockBytes <= 0:
		return fmt.Errorf("gpu: arena of %d blocks of %d bytes: both must be positive: %w", blocks, blockBytes, kvlease.ErrInvalidArgument)
	case blockBytes%Alignment != 0:
		return fmt.Errorf("gpu: block size %d is not a multiple of %d bytes: %w", blockBytes, Alignment, kvlease.ErrInvalidArgument)
	case blocks > math.MaxInt32:
		return fmt.Errorf("gpu: %d blocks exceed the BlockID range: %w", blocks, kvlease.ErrInvalidArgument)
	case blocks > math.MaxInt/blockBytes:
		return fmt.Errorf("gpu: arena of %d blocks of %d bytes overflows: %w", blocks, blockBytes, kvlease.ErrInvalidArgument)
	}
	return nil
}

// DeviceArena is device memory for one pool: a single allocation (one
// cuMemAlloc) cut into Blocks() blocks of BlockBytes() bytes, block i at
// Base() + i·BlockBytes(). It is a kvlease.Memory[DevicePtr], so
// kvlease.NewPool can manage it directly.
//
// Ownership: the arena owns the allocation until Close frees it. Close
// refuses (ErrBusy) while any copy that touches the arena is in flight,
// including quarantined copies, which pin it for good. The arena cannot see
// leases: close the pool that uses it first, or use CloseWithPool, which
// checks the pool too. A DevicePtr handed out earlier stays a plain number
// after Close (the copy engine refuses it).
type DeviceArena struct {
	a *arena
}

var _ kvlease.Memory[DevicePtr] = (*DeviceArena)(nil)

// Blocks returns the number of blocks.
func (m *DeviceArena) Blocks() int { return m.a.blocks }

// BlockBytes returns the size of one block, a multiple of Alignment.
func (m *DeviceArena) BlockBytes() int { return m.a.blockBytes }

// Region returns the device address of block id. It panics if id is out of
// range, like a slice index.
func (m *DeviceArena) Region(id kvlease.BlockID) DevicePtr {
	return DevicePtr(m.a.addr + uint64(m.a.regionOffset(id)))
}

// Base returns the address of block 0.
func (m *DeviceArena) Base() DevicePtr { return DevicePtr(m.a.addr) }

// Size returns Blocks()·BlockBytes().
func (m *DeviceArena) Size() int { return m.a.size() }

// Pending returns how many copies touching the arena are in flight
// (quarantined ones included).
func (m *DeviceArena) Pending() int {
	m.a.dev.mu.Lock()
	defer m.a.dev.mu.Unlock()
	return m.a.pending
}

// Close frees the device memory. It returns an error wrapping ErrBusy, and
// frees nothing, while copies touching the arena are in flight; the error
// says how many and whether any are quarantined. A second Close returns nil.
func (m *DeviceArena) Close() error { return m.a.close() }

// CloseWithPool closes p, the pool over this arena (no new acquires), and
// then frees the arena if nothing can still reference it: no open lease,
// no leased, draining or quarantined block in p, and no copy in flight.
// Otherwise it returns an error wrapping ErrBusy that says what is alive,
// and frees nothing; call it again once the leases have settled.
func (m *DeviceArena) CloseWithPool(p *kvlease.Pool[DevicePtr]) error {
	return closeWithPool[DevicePtr](m.a, m, p)
}

// PinnedArena is page-locked host memory (cuMemHostAlloc) for a host tier:
// the other end of offload and onload copies. It is a
// kvlease.Memory[[]byte] whose regions have len and cap equal to
// BlockBytes(), so an append can never reach a neighbour. Because the
// memory belongs to the driver, not to the Go heap, the device may copy to
// and from it asynchronously while Go code runs.
//
// Ownership is as for DeviceArena. After Close, Region returns nil: the
// memory is gone.
type PinnedArena struct {
	a *arena
}

var _ kvlease.Memory[[]byte] = (*PinnedArena)(nil)

// Blocks returns the number of blocks.
func (m *PinnedArena) Blocks() int { return m.a.blocks }

// BlockBytes returns the size of one block, a multiple of Alignment.
func (m *PinnedArena) BlockBytes() int { return m.a.blockBytes }

// Region returns block id as a slice with len and cap BlockBytes(), or nil
// once the arena is closed. It panics if id is out of range.
func (m *PinnedArena) Region(id kvlease.BlockID) []byte {
	off := m.a.regionOffset(id)
	if m.a.freed.Load() {
		return nil
	}
	end := off + m.a.blockBytes
	return m.a.host[off:end:end]
}

// Size returns Blocks()·BlockBytes().
func (m *PinnedArena) Size() int { return m.a.size() }

// Pending returns how many copies touching the arena are in flight
// (quarantined ones included).
func (m *PinnedArena) Pending() int {
	m.a.dev.mu.Lock()
	defer m.a.dev.mu.Unlock()
	return m.a.pending
}

// Close frees the pinned memory, under the same rule as DeviceArena.Close.
func (m *PinnedArena) Close() error { return m.a.close() }

// addrOf returns the address of b's first byte, for comparisons only: the
// number is never turned back into a pointer.
func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// CloseWithPool closes p and then the arena, as DeviceArena.CloseWithPool.
func (m *PinnedArena) CloseWithPool(p *kvlease.Pool[[]byte]) error {
	return closeWithPool[[]byte](m.a, m, p)
}

// span is a resolved block: an arena and a byte offset in it.
type span struct {
	a   *arena
	off int
}

// key orders spans of one memory kind; distinct blocks have distinct keys.
func (s span) key() uint64 { return s.a.addr + uint64(s.off) }

// insertArena and removeArena return a new list (copy on write): the old
// one may still be read by lock-free lookups.
func insertArena(list []*arena, a *arena) []*arena {
	i := sort.Search(len(list), func(i int) bool { return list[i].addr > a.addr })
	return slices.Insert(slices.Clone(list), i, a)
}

func removeArena(list []*arena, a *arena) []*arena {
	if i := slices.Index(list, a); i >= 0 {
		return slices.Delete(slices.Clone(list), i, i+1)
	}
	return list
}

// findArena returns the arena of list holding [addr, addr+n), or nil.
func findArena(list []*arena, addr uint64, n int) *arena {
	i := sort.Search(len(list), func(i int) bool { return list[i].addr > addr })
	if i == 0 {
		return nil
	}
	if a := list[i-1]; a.contains(addr, n) {
		return a
	}
	return nil
}

// resolver finds the blocks of one Start's pairs in a device's published
// arena list (no lock; the caller re-checks a.closed under d.mu before
// pinning), remembering the last arena found: a Start's blocks mostly lie
// in one or two arenas, so most lookups are one comparison.
type resolver struct {
	d    *Device
	list []*arena
	last *arena
}

func deviceResolver(d *Device) resolver { return resolver{d: d, list: *d.devSnap.Load()} }
func pinnedResolver(d *Device) resolver { return resolver{d: d, list: *d.pinSnap.Load()} }

func (r *resolver) find(addr uint64) *arena {
	if a := r.last; a != nil && addr-a.addr < uint64(a.size()) {
		return a
	}
	a := findArena(r.list, addr, 1)
	if a != nil {
		r.last = a
	}
	return a
}

// device resolves p as the start of a block of a live device arena. Its
// errors are phrased to follow "pair i, src: ".
func (r *resolver) device(p DevicePtr) (span, error) {
	a := r.find(uint64(p))
	if a == nil {
		return span{}, fmt.Errorf("%v is not in a live device arena of %s: %w", p, r.d.name, kvlease.ErrInvalidArgument)
	}
	off := int(uint64(p) - a.addr)
	if off%a.blockBytes != 0 {
		return span{}, fmt.Errorf("%v is %d bytes into a block of %d bytes, not at its start: %w", p, off%a.blockBytes, a.blockBytes, kvlease.ErrInvalidArgument)
	}
	return span{a, off}, nil
}

// pinned resolves b as a whole block of a live pinned arena, as device
// does. Go memory (a kvlease.HostMemory region, a make([]byte)) is
// refused: the device must never copy asynchronously from the Go heap.
func (r *resolver) pinned(b []byte) (span, error) {
	if len(b) == 0 {
		return span{}, fmt.Errorf("empty region: %w", kvlease.ErrInvalidArgument)
	}
	addr := uint64(addrOf(b))
	a := r.find(addr)
	if a == nil {
		return span{}, fmt.Errorf("region of %d bytes at 0x%x is not in a live pinned arena of %s (Go or foreign memory cannot take part in an async copy): %w", len(b), addr, r.d.name, kvlease.ErrInvalidArgument)
	}
	off := int(addr - a.addr)
	if off%a.blockBytes != 0 || len(b) != a.blockBytes {
		return span{}, fmt.Errorf("region of %d bytes at offset %d of a pinned arena is not one whole block of %d bytes: %w", len(b), off, a.blockBytes, kvlease.ErrInvalidArgument)
	}
	return span{a, off}, nil
}

package gpu

import (
	"fmt"
	"os"
	"strings"
	"sync"

	"github.com/kvlease/kvlease"
	"go.uber.org/atomic"
)

// DriverLibraryEnv names the environment variable that overrides the
// library Open loads ("libcuda.so.1" when unset): a path for a driver
// installed outside the loader's search path, or a test double.
const DriverLibraryEnv = "KVLEASE_LIBCUDA"

// defaultDriverLibrary is what Open loads when DriverLibraryEnv is unset.
const defaultDriverLibrary = "libcuda.so.1"

// Device is one CUDA device with its primary context retained, or the CPU
// fallback (OpenHost). Both offer the same arenas, copy engine and
// synchronous helpers, with the same asynchronous completion.
//
// A Device is safe for concurrent use. Close it after every arena and copy
// engine made from it is closed; until then Close refuses.
type Device struct {
	b       backend
	ordinal int
	name    string
	total   int64
	host    bool

	mu        sync.Mutex
	devArenas []*arena // live device arenas, by address
	pinArenas []*arena // live pinned arenas, by address

	// The two lists as published for lock-free lookups by Start; replaced
	// (never modified) under mu.
	devSnap, pinSnap atomic.Pointer[[]*arena]
	engines          int // open copy engines
	closed           bool

	// Path choice: the calibration (nil until measured) and what measures
	// it (tests inject one). See calibrate.go.
	calMu      sync.Mutex
	cal        atomic.Pointer[calTable]
	calMeasure measureFunc
}

// Open opens CUDA device ordinal through the driver loaded at run time
// (libcuda.so.1, or the library named by DriverLibraryEnv) and retains its
// primary context. Errors: ErrNoDriver when the driver cannot be loaded or
// the package was built without cgo; ErrNoDevice when the driver sees no
// device with that ordinal; a *DriverError for other driver failures.
func Open(ordinal int) (*Device, error) {
	path := os.Getenv(DriverLibraryEnv)
	if path == "" {
		path = defaultDriverLibrary
	}
	return openPath(path, ordinal)
}

func openPath(path string, ordinal int) (*Device, error) {
	b, err := openCUDA(path, ordinal)
	if err != nil {
		return nil, err
	}
	total, err := b.totalMemory()
	if err != nil {
		_ = b.close()
		return nil, err
	}
	d := &Device{b: b, ordinal: ordinal, name: b.name(), total: total}
	d.publishLocked()
	return d, nil
}

// HostOption configures OpenHost.
type HostOption func(*hostConfig)

// WithHostCapacity sets how much "device" memory the fallback offers
// (default 16 GiB): allocations beyond it fail with CUDA_ERROR_OUT_OF_MEMORY
// as on a real device, and TotalMemory and FreeMemory report it.
func WithHostCapacity(bytes int64) HostOption {
	return func(c *hostConfig) { c.capacity = bytes }
}

// OpenHost returns the CPU fallback: a Device whose device memory and
// pinned memory are ordinary host memory and whose copy engine runs copies
// on a worker goroutine per engine, completing them later exactly as a
// CUDA stream would. It needs neither cgo nor a driver, so code and tests
// written against Device run on any machine; DevicePtr values it hands out
// are addresses in its own address space, not host pointers.
func OpenHost(opts ...HostOption) *Device {
	cfg := hostConfig{capacity: 16 << 30}
	for _, o := range opts {
		o(&cfg)
	}
	b := newHostBackend(cfg)
	d := &Device{b: b, ordinal: -1, name: b.name(), total: cfg.capacity, host: true}
	d.publishLocked()
	return d
}

// Name returns the device's name as the driver reports it, or
// "CPU fallback" for OpenHost.
func (d *Device) Name() string { return d.name }

// Ordinal returns the CUDA ordinal passed to Open, or -1 for the fallback.
func (d *Device) Ordinal() int { return d.ordinal }

// IsHost reports whether d is the CPU fallback.
func (d *Device) IsHost() bool { return d.host }

// DriverVersion returns the driver's CUDA version (12080 for 12.8), or 0
// on the fallback.
func (d *Device) DriverVersion() int { return d.b.driverVersion() }

// TotalMemory returns the device's memory in bytes.
func (d *Device) TotalMemory() int64 { return d.total }

// FreeMemory returns the device memory free now, in bytes.
func (d *Device) FreeMemory() (int64, error) { return d.b.freeMemory() }

// AllocDevice allocates a device arena of blocks blocks of blockBytes
// bytes each, in one allocation. blockBytes must be a positive multiple of
// Alignment (errors wrap kvlease.ErrInvalidArgument); a failed allocation
// returns a *DriverError (CUDA_ERROR_OUT_OF_MEMORY).
func (d *Device) AllocDevice(blocks, blockBytes int) (*DeviceArena, error) {
	if err := checkGeometry(blocks, blockBytes); err != nil {
		return nil, err
	}
	if err := d.checkOpen(); err != nil {
		return nil, err
	}
	n := blocks * blockBytes
	addr, host, err := d.b.allocDevice(n)
	if err != nil {
		return nil, err
	}
	if addr%Alignment != 0 {
		_ = d.b.freeDevice(addr, n)
		return nil, fmt.Errorf("gpu: device allocation at 0x%x is not %d-byte aligned", addr, Alignment)
	}
	a := &arena{dev: d, kind: deviceMem, addr: addr, dptr: addr, host: host, blocks: blocks, blockBytes: blockBytes}
	if err := d.addArena(a); err != nil {
		_ = d.b.freeDevice(addr, n)
		return nil, err
	}
	return &DeviceArena{a}, nil
}

// AllocPinned allocates a pinned host arena of blocks blocks of blockBytes
// bytes each (cuMemHostAlloc, portable to every context and mapped into
// the device's address space, so the copy kernel reaches it directly).
// blockBytes must be a positive multiple of Alignment.
func (d *Device) AllocPinned(blocks, blockBytes int) (*PinnedArena, error) {
	if err := checkGeometry(blocks, blockBytes); err != nil {
		return nil, err
	}
	if err := d.checkOpen(); err != nil {
		return nil, err
	}
	host, dptr, err := d.b.allocPinned(blocks * blockBytes)
	if err != nil {
		return nil, err
	}
	a := &arena{dev: d, kind: pinnedMem, addr: uint64(addrOf(host)), dptr: dptr, host: host, blocks: blocks, blockBytes: blockBytes}
	if err := d.addArena(a); err != nil {
		_ = d.b.freePinned(host)
		return nil, err
	}
	return &PinnedArena{a}, nil
}

func (d *Device) checkOpen() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return fmt.Errorf("gpu: %s: %w", d.name, ErrClosed)
	}
	return nil
}

func (d *Device) addArena(a *arena) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return fmt.Errorf("gpu: %s: %w", d.name, ErrClosed)
	}
	if a.kind == deviceMem {
		d.devArenas = insertArena(d.devArenas, a)
	} else {
		d.pinArenas = insertArena(d.pinArenas, a)
	}
	d.publishLocked()
	return nil
}

func (d *Device) removeArenaLocked(a *arena) {
	if a.kind == deviceMem {
		d.devArenas = removeArena(d.devArenas, a)
	} else {
		d.pinArenas = removeArena(d.pinArenas, a)
	}
	d.publishLocked()
}

func (d *Device) publishLocked() {
	dev, pin := d.devArenas, d.pinArenas
	d.devSnap.Store(&dev)
	d.pinSnap.Store(&pin)
}

// CopyToHost copies len(dst) bytes of device memory starting at src into
// dst, synchronously. dst may be any memory, Go memory included; src..src+len(dst)
// must lie in one live device arena of d. It is not ordered with copies in
// flight on a CopyEngine: wait for their transfers first. Meant for tests,
// checks and initialization, not for the hot path.
func (d *Device) CopyToHost(dst []byte, src DevicePtr) error {
	if len(dst) == 0 {
		return nil
	}
	a, off, err := d.pinForSync(src, len(dst))
	if err != nil {
		return err
	}
	defer d.unpinSync(a)
	return d.b.readDevice(dst, a, off)
}

// CopyFromHost copies src into device memory starting at dst,
// synchronously, under the same rules as CopyToHost.
func (d *Device) CopyFromHost(dst DevicePtr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	a, off, err := d.pinForSync(dst, len(src))
	if err != nil {
		return err
	}
	defer d.unpinSync(a)
	return d.b.writeDevice(a, off, src)
}

// pinForSync finds the arena holding [p, p+n) and counts the synchronous
// copy as pending, so the arena cannot be freed under it.
func (d *Device) pinForSync(p DevicePtr, n int) (*arena, int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, 0, fmt.Errorf("gpu: %s: %w", d.name, ErrClosed)
	}
	a := findArena(d.devArenas, uint64(p), n)
	if a == nil {
		return nil, 0, fmt.Errorf("gpu: %d bytes at %v are not inside one live device arena of %s: %w", n, p, d.name, kvlease.ErrInvalidArgument)
	}
	a.pending++
	return a, int(uint64(p) - a.addr), nil
}

func (d *Device) unpinSync(a *arena) {
	d.mu.Lock()
	a.pending--
	d.mu.Unlock()
}

// Close releases the device (its primary context, or the fallback's
// resources). It refuses with an error wrapping ErrBusy, naming what is
// still open, while arenas or copy engines made from d are open. A second
// Close returns nil.
func (d *Device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	var alive []string
	if n := len(d.devArenas); n > 0 {
		alive = append(alive, fmt.Sprintf("%d device arenas", n))
	}
	if n := len(d.pinArenas); n > 0 {
		alive = append(alive, fmt.Sprintf("%d pinned arenas", n))
	}
	if d.engines > 0 {
		alive = append(alive, fmt.Sprintf("%d copy engines", d.engines))
	}
	if len(alive) > 0 {
		d.mu.Unlock()
		return fmt.Errorf("gpu: closing %s: %s still open: %w", d.name, strings.Join(alive, ", "), ErrBusy)
	}
	d.closed = true
	d.mu.Unlock()
	return d.b.close()
}

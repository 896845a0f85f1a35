package gpu

import (
	"errors"
	"fmt"
	"testing"

	"github.com/kvlease/kvlease"
)

func TestOpenWithoutDriver(t *testing.T) {
	t.Setenv(DriverLibraryEnv, "/nonexistent/libcuda.so.1")
	d, err := Open(0)
	isErr(t, err, ErrNoDriver)
	isNil(t, d)
}

func TestHostDeviceInfo(t *testing.T) {
	d := OpenHost(WithHostCapacity(1 << 20))
	eq(t, "CPU fallback", d.Name())
	eq(t, true, d.IsHost())
	eq(t, -1, d.Ordinal())
	eq(t, 0, d.DriverVersion())
	eq(t, int64(1<<20), d.TotalMemory())
	a, err := d.AllocDevice(16, 4096)
	noErr(t, err)
	free, err := d.FreeMemory()
	noErr(t, err)
	eq(t, int64(1<<20-16*4096), free)

	_, err = d.AllocDevice(256, 4096) // 1 MiB more than is left
	var de *DriverError
	asErr(t, err, &de)
	eq(t, ErrorOutOfMemory, de.Code)
	eq(t, "gpu: cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory", err.Error())

	noErr(t, a.Close())
	free, err = d.FreeMemory()
	noErr(t, err)
	eq(t, int64(1<<20), free)
	noErr(t, d.Close())
	noErr(t, d.Close(), "second Close")
	_, err = d.AllocDevice(1, 256)
	isErr(t, err, ErrClosed)
	_, err = d.NewCopyEngine()
	isErr(t, err, ErrClosed)
}

func TestArenaGeometry(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		for _, c := range []struct{ blocks, bb int }{{0, 256}, {4, 0}, {-1, 256}, {4, 100}, {4, 384 + 1}, {1 << 40, 1 << 40}} {
			_, err := d.AllocDevice(c.blocks, c.bb)
			isErr(t, err, kvlease.ErrInvalidArgument, "device %d×%d", c.blocks, c.bb)
			_, err = d.AllocPinned(c.blocks, c.bb)
			isErr(t, err, kvlease.ErrInvalidArgument, "pinned %d×%d", c.blocks, c.bb)
		}
		dev, err := d.AllocDevice(5, 768)
		noErr(t, err)
		defer func() { noErr(t, dev.Close()) }()
		pin, err := d.AllocPinned(5, 768)
		noErr(t, err)
		defer func() { noErr(t, pin.Close()) }()
		eq(t, 5, dev.Blocks())
		eq(t, 768, dev.BlockBytes())
		eq(t, 5*768, dev.Size())
		eq(t, 5*768, pin.Size())
		for i := range 5 {
			p := dev.Region(kvlease.BlockID(i))
			eq(t, dev.Base().Add(i*768), p)
			eq(t, uint64(0), uint64(p)%Alignment, "device block %d alignment", i)
			r := pin.Region(kvlease.BlockID(i))
			eq(t, 768, len(r))
			eq(t, 768, cap(r), "region cap: an append must not reach the neighbour")
			eq(t, uintptr(0), addrOf(r)%Alignment, "pinned block %d alignment", i)
		}
		mustPanic(t, func() { dev.Region(5) })
		mustPanic(t, func() { pin.Region(-1) })
	})
}

func mustPanic(t *testing.T, f func()) {
	t.Helper()
	defer func() {
		if recover() == nil {
			t.Fatal("no panic")
		}
	}()
	f()
}

func TestSyncCopies(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		dev, err := d.AllocDevice(4, 256)
		noErr(t, err)
		defer func() { noErr(t, dev.Close()) }()
		data := make([]byte, 300)
		for i := range data {
			data[i] = byte(i%200 + 7)
		}
		// Unaligned offsets and lengths are fine for the helpers.
		noErr(t, d.CopyFromHost(dev.Base().Add(100), data))
		got := make([]byte, 300)
		noErr(t, d.CopyToHost(got, dev.Base().Add(100)))
		eq(t, data, got)
		noErr(t, d.CopyToHost(nil, 0), "empty copy")

		isErr(t, d.CopyToHost(make([]byte, 1024), dev.Base().Add(1)), kvlease.ErrInvalidArgument, "past the end")
		isErr(t, d.CopyFromHost(DevicePtr(1), data), kvlease.ErrInvalidArgument, "outside")
		isErr(t, d.CopyToHost(got, pastEveryArena(d)), kvlease.ErrInvalidArgument, "past every arena")
	})
}

func TestDriverErrors(t *testing.T) {
	e := newDriverError("cuMemcpyDtoHAsync", ErrorIllegalAddress)
	eq(t, "gpu: cuMemcpyDtoHAsync: CUDA_ERROR_ILLEGAL_ADDRESS (700): an illegal memory access was encountered", e.Error())
	var err error = fmt.Errorf("copy: %w", e)
	isErr(t, err, ErrDeviceFailed)
	isFalse(t, errors.Is(err, ErrNoDevice))
	eq(t, true, isSticky(err))

	for code, want := range map[Result]error{
		ErrorNoDevice:         ErrNoDevice,
		ErrorInvalidDevice:    ErrNoDevice,
		ErrorStubLibrary:      ErrNoDriver,
		ErrorContextDestroyed: ErrDeviceFailed,
		ErrorInvalidContext:   ErrDeviceFailed,
		ErrorLaunchFailed:     ErrDeviceFailed,
	} {
		isErr(t, newDriverError("op", code), want, "code %d", code)
	}
	for _, code := range []Result{ErrorOutOfMemory, ErrorInvalidValue, ErrorNotReady, ErrorNotSupported} {
		isFalse(t, code.Sticky(), "code %d sticky", code)
	}
	// Every result the driver API documents as requiring a process
	// restart, by number, so a renamed constant cannot hide one.
	for _, code := range []Result{226, 700, 702, 710, 714, 715, 716, 717, 718, 719, 721, 810, 911} {
		eq(t, true, code.Sticky(), "code %d sticky", code)
		isErr(t, newDriverError("cuEventSynchronize", code), ErrDeviceFailed, "code %d", code)
		isFalse(t, newDriverError("op", code).Name == fmt.Sprintf("CUDA_ERROR_%d", int(code)), "code %d named", code)
	}
	// Recoverable results next to them are not sticky.
	for _, code := range []Result{701, 720, 909, 912, 999 - 1} {
		isFalse(t, code.Sticky(), "code %d sticky", code)
	}
	u := newDriverError("cuX", Result(12345))
	eq(t, "CUDA_ERROR_12345", u.Name)
}

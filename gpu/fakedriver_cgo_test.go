//go:build cgo && linux

package gpu

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvlease/kvlease"
)

// The fake driver (testdata/fakecuda.c) is built with the C compiler into a
// shared library and loaded through the same dlopen path as libcuda.so.1,
// so the cgo layer (symbol resolution, ABI, context push/pop, error naming,
// batched and looped submission) runs on machines without a GPU. It needs
// gcc (or $CC) at test time and skips without one.

func init() {
	deviceKinds = append(deviceKinds, deviceKind{"fakecuda", func(t testing.TB) *Device {
		return openFake(t, "default")
	}})
	fakeHold = func(t *testing.T, sticky bool) (*Device, func(bool)) {
		variant := fmt.Sprintf("hold#%d", holdRuns.Add(1))
		path := fakeLib(t, variant)
		file := holdFile(variant)
		hold := func(on bool) {
			if on {
				noErr(t, os.WriteFile(file, nil, 0o600))
			} else if err := os.Remove(file); err != nil && !os.IsNotExist(err) {
				t.Fatal(err)
			}
		}
		hold(true)
		t.Cleanup(func() { hold(false) })
		d, err := openPath(path, 0)
		noErr(t, err)
		fixedCalibration(d)
		if !sticky {
			t.Cleanup(func() { noErr(t, d.Close()) })
		}
		return d, hold
	}
}

// openFake opens the fake driver built as variant, with the fixed
// calibration, closed at cleanup.
func openFake(t testing.TB, variant string) *Device {
	t.Helper()
	d, err := openPath(fakeLib(t, variant), 0)
	noErr(t, err)
	fixedCalibration(d)
	t.Cleanup(func() { noErr(t, d.Close()) })
	return d
}

var fakeVariants = map[string][]string{
	"default":  nil,
	"noproc":   {"-DFAKE_NO_PROC_ADDRESS"},
	"nobatch":  {"-DFAKE_NO_BATCH"},
	"nodevice": {"-DFAKE_NO_DEVICE"},
	"noalloc":  {"-DFAKE_MISSING_ALLOC"},
	"badptx":   {"-DFAKE_REJECT_PTX"},
	"nomap":    {"-DFAKE_NO_MAP"},
	"sticky":   nil, // a fresh copy per run (see stickyRuns): its sticky state is its own
	"hold":     nil, // -DFAKE_HOLD_FILE=holdFile(variant), a fresh copy per run
}

// stickyRuns numbers the sticky driver's copies: a sticky error lasts as
// long as the library is loaded, so each run (-count) needs a new one.
var stickyRuns atomic.Int32

var fakeBuilt struct {
	sync.Mutex
	libs map[string]string
}

// fakeLib returns the path of the fake driver built with variant's flags,
// building it once per test process.
func fakeLib(t testing.TB, variant string) string {
	t.Helper()
	fakeBuilt.Lock()
	defer fakeBuilt.Unlock()
	if p, ok := fakeBuilt.libs[variant]; ok {
		return p
	}
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "gcc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("SKIP: no C compiler (%s) to build the fake driver: %v", cc, err)
	}
	src, err := filepath.Abs(filepath.Join("testdata", "fakecuda.c"))
	noErr(t, err)
	if _, err := os.Stat(src); err != nil {
		t.Skipf("SKIP: fake driver source not found (run from the package directory): %v", err)
	}
	if fakeDir == "" {
		fakeDir, err = os.MkdirTemp("", "kvlease-fakecuda-")
		noErr(t, err)
	}
	out := filepath.Join(fakeDir, fmt.Sprintf("libfakecuda-%s.so", strings.ReplaceAll(variant, "#", "-")))
	base, _, _ := strings.Cut(variant, "#")
	args := append([]string{"-shared", "-fPIC", "-O1", "-pthread", "-o", out, src}, fakeVariants[base]...)
	if base == "hold" {
		args = append(args, fmt.Sprintf("-DFAKE_HOLD_FILE=%q", holdFile(variant)))
	}
	if msg, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
		t.Fatalf("building the fake driver: %v\n%s", err, msg)
	}
	if fakeBuilt.libs == nil {
		fakeBuilt.libs = map[string]string{}
	}
	fakeBuilt.libs[variant] = out
	return out
}

// holdFile is the file whose existence holds every stream of the fake
// driver built as variant ("hold#N").
func holdFile(variant string) string {
	return filepath.Join(fakeDir, "hold-"+strings.ReplaceAll(variant, "#", "-"))
}

// holdRuns numbers the hold driver's copies, like stickyRuns.
var holdRuns atomic.Int32

func TestFakeDriverResolution(t *testing.T) {
	for _, c := range []struct {
		variant  string
		resolver int
		batch    bool
	}{
		{"default", 2, true},
		{"noproc", 0, true},
		{"nobatch", 2, false},
	} {
		t.Run(c.variant, func(t *testing.T) {
			path := fakeLib(t, c.variant)
			d, err := openPath(path, 0)
			noErr(t, err)
			t.Cleanup(func() { noErr(t, d.Close()) })
			eq(t, "Fake CUDA Device", d.Name())
			eq(t, int64(4<<30), d.TotalMemory())
			eq(t, 12080, d.DriverVersion())
			drv, err := loadDriver(path)
			noErr(t, err)
			eq(t, c.resolver, drv.resolver, "resolver")
			_, _, batch, ok := cudaStats(d)
			eq(t, true, ok)
			eq(t, c.batch, batch, "batch available")

			// One scattered copy (three separate runs) on the copy engine,
			// batched when the driver can.
			r := newRig(t, d, 8, 256, WithPath(PathCopyEngine))
			src := make([]byte, 256)
			for i := range src {
				src[i] = byte(i%251 + 1)
			}
			noErr(t, d.CopyFromHost(r.dev.Region(5), src))
			tr, err := r.e.DeviceToHost().Start([]cp[DevicePtr, []byte]{
				pair(r.dev.Region(5), r.pin.Region(0)), pair(r.dev.Region(1), r.pin.Region(4)), pair(r.dev.Region(7), r.pin.Region(2)),
			}, noAttach)
			noErr(t, err)
			waitDone(t, tr)
			noErr(t, tr.Err())
			eq(t, src, r.pin.Region(0))
			batched, looped, _, _ := cudaStats(d)
			if c.batch {
				eq(t, [2]int64{1, 0}, [2]int64{batched, looped}, "batched, looped")
			} else {
				eq(t, [2]int64{0, 1}, [2]int64{batched, looped}, "batched, looped")
			}
			setBatch(d, false)
			tr, err = r.e.DeviceToHost().Start([]cp[DevicePtr, []byte]{pair(r.dev.Region(5), r.pin.Region(1)), pair(r.dev.Region(0), r.pin.Region(3))}, noAttach)
			noErr(t, err)
			waitDone(t, tr)
			eq(t, src, r.pin.Region(1))
			_, looped2, _, _ := cudaStats(d)
			eq(t, looped+1, looped2, "looped after setBatch(false)")

			free, err := d.FreeMemory()
			noErr(t, err)
			eq(t, int64(4<<30)-2*8*256, free, "free memory with two device arenas")
			eq(t, int64(0), d.CopyStats().KernelLaunches, "a copy-engine engine launched the kernel")
		})
	}
}

func TestFakeDriverOpenErrors(t *testing.T) {
	_, err := openPath(fakeLib(t, "nodevice"), 0)
	isErr(t, err, ErrNoDevice)
	var de *DriverError
	asErr(t, err, &de)
	eq(t, "cuInit", de.Op)
	eq(t, "CUDA_ERROR_NO_DEVICE", de.Name)
	eq(t, "no CUDA-capable device is detected (fake)", de.Text, "the driver's own string")

	_, err = openPath(fakeLib(t, "noalloc"), 0)
	isErr(t, err, ErrNoDriver)
	contains(t, err, "cuMemAlloc_v2")

	_, err = openPath(fakeLib(t, "default"), 1)
	isErr(t, err, ErrNoDevice)
	contains(t, err, "sees 1 devices")

	t.Setenv(DriverLibraryEnv, fakeLib(t, "default"))
	d, err := Open(0)
	noErr(t, err)
	eq(t, "Fake CUDA Device", d.Name())
	_, err = d.AllocDevice(1, 8<<30)
	var oom *DriverError
	asErr(t, err, &oom)
	eq(t, ErrorOutOfMemory, oom.Code)
	eq(t, "out of memory (fake)", oom.Text)
	noErr(t, d.Close())
}

// TestFakeDriverStickyError: a sticky error from cuEventSynchronize
// quarantines the transfer and stops the engine, through the cgo path.
func TestFakeDriverStickyError(t *testing.T) {
	d, err := openPath(fakeLib(t, fmt.Sprintf("sticky#%d", stickyRuns.Add(1))), 0)
	noErr(t, err)
	e, err := d.NewCopyEngine()
	noErr(t, err)
	dev, err := d.AllocDevice(2, 256)
	noErr(t, err)
	pin, err := d.AllocPinned(2, 256)
	noErr(t, err)
	t.Setenv("FAKECUDA_STICKY", "700")
	tr, err := e.DeviceToHost().Start([]cp[DevicePtr, []byte]{pair(dev.Region(0), pin.Region(1))}, noAttach)
	noErr(t, err)
	waitState(t, tr, kvlease.TransferQuarantined)
	isErr(t, tr.Err(), ErrDeviceFailed)
	var de *DriverError
	asErr(t, tr.Err(), &de)
	eq(t, "cuEventSynchronize", de.Op)
	eq(t, "an illegal memory access was encountered (fake)", de.Text)
	isErr(t, dev.Close(), ErrBusy)
	_, err = e.HostToDevice().Start([]cp[[]byte, DevicePtr]{pair(pin.Region(0), dev.Region(1))}, noAttach)
	isErr(t, err, ErrDeviceFailed)
	if !errors.Is(d.Close(), ErrBusy) {
		t.Fatal("device with a quarantined copy closed")
	}
	// The device stays open for the life of the test process, as a real
	// one would after a sticky error.
}

// TestFakeDriverPacksAllocations: the fake carves device memory like
// cuMemAlloc, so the byte one past an arena is the next arena's first
// block; the engine must tell them apart by arena, never by a gap.
func TestFakeDriverPacksAllocations(t *testing.T) {
	d, err := openPath(fakeLib(t, "default"), 0)
	noErr(t, err)
	t.Cleanup(func() { noErr(t, d.Close()) })
	a, err := d.AllocDevice(4, 256)
	noErr(t, err)
	b, err := d.AllocDevice(4, 256)
	noErr(t, err)
	eq(t, a.Base().Add(a.Size()), b.Base(), "second arena right after the first")

	// One past a is b's block 0: a valid copy source, not an error.
	want := make([]byte, 256)
	for i := range want {
		want[i] = byte(i%13 + 1)
	}
	noErr(t, d.CopyFromHost(b.Base(), want))
	got := make([]byte, 256)
	noErr(t, d.CopyToHost(got, a.Base().Add(a.Size())))
	eq(t, want, got)
	// A span that crosses from a into b is in no single arena.
	isErr(t, d.CopyToHost(make([]byte, 512), a.Region(3)), kvlease.ErrInvalidArgument)

	// A freed arena's range is handed out again.
	base := a.Base()
	noErr(t, a.Close())
	c, err := d.AllocDevice(2, 512)
	noErr(t, err)
	eq(t, base, c.Base(), "first fit reuses the freed range")
	noErr(t, b.Close())
	noErr(t, c.Close())
}

// TestFakeDriverCopyFromHostSynchronizes: the fake's pageable upload lands
// only when the legacy stream is synchronized, as the real one may; a copy
// on the engine's non-blocking stream right after CopyFromHost must see
// the new bytes.
func TestFakeDriverCopyFromHostSynchronizes(t *testing.T) {
	d, err := openPath(fakeLib(t, "default"), 0)
	noErr(t, err)
	t.Cleanup(func() { noErr(t, d.Close()) })
	r := newRig(t, d, 4, 256)
	for round := range 5 {
		want := make([]byte, 256)
		for i := range want {
			want[i] = byte(round*31 + i%7 + 1)
		}
		noErr(t, d.CopyFromHost(r.dev.Region(2), want))
		tr, err := r.e.DeviceToHost().Start([]cp[DevicePtr, []byte]{pair(r.dev.Region(2), r.pin.Region(1))}, noAttach)
		noErr(t, err)
		waitDone(t, tr)
		noErr(t, tr.Err())
		eq(t, want, r.pin.Region(1), "round %d", round)
	}
}

// TestFakeDriverKernelFallbacks: a kernel the JIT refuses, or a launch
// that fails, leaves the copy to the copy engine (the bytes still land),
// turns the kernel off for the device, and says why in CopyStats; a driver
// that cannot map pinned memory keeps host↔device copies on the copy
// engine while device-to-device copies still take the kernel.
func TestFakeDriverKernelFallbacks(t *testing.T) {
	scattered := func(t *testing.T, d *Device) {
		t.Helper()
		r := newRig(t, d, 8, 512)
		want := make([]byte, 512)
		for i := range want {
			want[i] = byte(i%29 + 3)
		}
		noErr(t, d.CopyFromHost(r.dev.Region(6), want))
		tr, err := r.e.DeviceToDevice().Start([]cp[DevicePtr, DevicePtr]{
			pair(r.dev.Region(6), r.dev2.Region(1)), pair(r.dev.Region(2), r.dev2.Region(5)),
		}, noAttach)
		noErr(t, err)
		waitDone(t, tr)
		noErr(t, tr.Err())
		eq(t, want, readDev(t, d, r.dev2.Region(1), 512))
		tr, err = r.e.DeviceToHost().Start([]cp[DevicePtr, []byte]{
			pair(r.dev2.Region(1), r.pin.Region(3)), pair(r.dev2.Region(5), r.pin.Region(0)),
		}, noAttach)
		noErr(t, err)
		waitDone(t, tr)
		noErr(t, tr.Err())
		eq(t, want, r.pin.Region(3))
	}
	t.Run("rejected PTX", func(t *testing.T) {
		d := openFake(t, "badptx")
		scattered(t, d)
		st := d.CopyStats()
		eq(t, int64(0), st.KernelLaunches)
		eq(t, int64(2), st.BatchedSubmits, "the batch carried them: %v", st)
		isFalse(t, st.KernelEnabled)
		var de *DriverError
		asErr(t, st.KernelErr, &de)
		eq(t, Result(218), de.Code)
		contains(t, st.KernelErr, "JIT log: fake ptxas: the PTX was rejected")
		c, err := d.Calibrate()
		isErr(t, err, de)
		eq(t, 0, len(c.Rows), "no rows when the kernel cannot run")
	})
	t.Run("failed launch", func(t *testing.T) {
		d := openFake(t, "default")
		t.Setenv("FAKECUDA_LAUNCH_FAIL", "701") // CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
		scattered(t, d)
		st := d.CopyStats()
		eq(t, [3]int64{0, 1, 2}, [3]int64{st.KernelLaunches, st.KernelFailures, st.BatchedSubmits}, "%v", st)
		isFalse(t, st.KernelEnabled)
		contains(t, st.KernelErr, "cuLaunchKernel")
		t.Setenv("FAKECUDA_LAUNCH_FAIL", "")
		scattered(t, d)
		eq(t, int64(0), d.CopyStats().KernelLaunches, "the kernel stays off")
	})
	t.Run("no batch either", func(t *testing.T) {
		d := openFake(t, "nobatch")
		t.Setenv("FAKECUDA_LAUNCH_FAIL", "1")
		scattered(t, d)
		st := d.CopyStats()
		eq(t, [3]int64{1, 2, 4}, [3]int64{st.KernelFailures, st.LoopedSubmits, st.LoopedCopies}, "%v", st)
	})
	t.Run("no mapped memory", func(t *testing.T) {
		d := openFake(t, "nomap")
		scattered(t, d)
		st := d.CopyStats()
		eq(t, [3]int64{0, 2, 0}, [3]int64{st.KernelLaunches, st.BatchedSubmits, st.RingFull}, "no ring, no kernel: %v", st)
		contains(t, st.KernelErr, "cannot map pinned host memory")
		r := newRig(t, d, 2, 256)
		eq(t, uint64(0), r.pin.a.dptr, "pinned memory mapped without cuMemHostGetDevicePointer")
	})
}

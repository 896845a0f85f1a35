package gpu

import (
	"bytes"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
)

// Tests that need a real CUDA device. They skip, saying why, where there
// is none; gpu/devicecheck.sh runs them on a GPU machine. The shared tests
// (forEachDevice) also run their "cuda" subtests there.

func TestDriverInfo(t *testing.T) {
	d := openRealDevice(t)
	free, err := d.FreeMemory()
	noErr(t, err)
	_, _, batch, _ := cudaStats(d)
	major, minor, sms := deviceAttrs(d)
	t.Logf("device %d: %s, compute capability %d.%d, %d SMs, driver CUDA %d, memory %.1f GiB total, %.1f GiB free, cuMemcpyBatchAsync: %v",
		d.Ordinal(), d.Name(), major, minor, sms, d.DriverVersion(), float64(d.TotalMemory())/(1<<30), float64(free)/(1<<30), batch)
	if d.TotalMemory() <= 0 || free <= 0 || free > d.TotalMemory() {
		t.Fatalf("implausible memory: total %d, free %d", d.TotalMemory(), free)
	}
}

// TestDriverLargeArena allocates a large arena (a quarter of the free
// memory, at most 32 GiB), checks that the blocks at its start, middle and
// end hold what was written, and copies across its whole span.
func TestDriverLargeArena(t *testing.T) {
	d := openRealDevice(t)
	free, err := d.FreeMemory()
	noErr(t, err)
	const bb = 2 << 20
	blocks := int(min(free/4, 32<<30) / bb)
	t0 := time.Now()
	a, err := d.AllocDevice(blocks, bb)
	noErr(t, err)
	t.Logf("allocated %d blocks of %d bytes (%.1f GiB) in %v at %v", blocks, bb, float64(a.Size())/(1<<30), time.Since(t0), a.Base())
	defer func() { noErr(t, a.Close()) }()
	e, err := d.NewCopyEngine()
	noErr(t, err)
	defer func() { noErr(t, e.Close()) }()

	rng := rand.New(rand.NewPCG(21, 22))
	ends := []int{0, blocks / 2, blocks - 1}
	want := map[int][]byte{}
	for _, i := range ends {
		want[i] = make([]byte, bb)
		fillRandom(rng, want[i])
		noErr(t, d.CopyFromHost(a.Region(kvlease.BlockID(i)), want[i]))
	}
	for _, i := range ends {
		eq(t, want[i], readDev(t, d, a.Region(kvlease.BlockID(i)), bb), "block %d", i)
	}
	// First ↔ last across the whole arena, in one transfer.
	tr, err := e.DeviceToDevice().Start([]cp[DevicePtr, DevicePtr]{
		pair(a.Region(0), a.Region(kvlease.BlockID(blocks-2))),
		pair(a.Region(kvlease.BlockID(blocks-1)), a.Region(1)),
	}, noAttach)
	noErr(t, err)
	waitDone(t, tr)
	noErr(t, tr.Err())
	eq(t, want[0], readDev(t, d, a.Region(kvlease.BlockID(blocks-2)), bb))
	eq(t, want[blocks-1], readDev(t, d, a.Region(1), bb))
}

// TestDriverResolvesAfterEvent starts a large scattered offload, checks the
// transfer is still pending when Start returns (the copy is asynchronous)
// and that every byte is in place the moment it resolves.
func TestDriverResolvesAfterEvent(t *testing.T) {
	d := openRealDevice(t)
	const bb, blocks = 64 << 10, 8192 // 512 MiB
	r := newRig(t, d, blocks, bb)
	rng := rand.New(rand.NewPCG(23, 24))
	src := make([]byte, blocks*bb)
	fillRandom(rng, src)
	noErr(t, d.CopyFromHost(r.dev.Base(), src))
	perm := rng.Perm(blocks)
	pairs := make([]cp[DevicePtr, []byte], blocks)
	for i := range pairs {
		pairs[i] = pair(r.dev.Region(kvlease.BlockID(perm[i])), r.pin.Region(kvlease.BlockID(i)))
	}
	t0 := time.Now()
	tr, err := r.e.DeviceToHost().Start(pairs, noAttach)
	started := time.Since(t0)
	noErr(t, err)
	state := tr.State()
	<-tr.Done()
	took := time.Since(t0)
	noErr(t, tr.Err())
	// Check the data first: it is the evidence the resolution was honest.
	for i := range blocks {
		got := r.pin.Region(kvlease.BlockID(i))
		if !bytes.Equal(got, src[perm[i]*bb:(perm[i]+1)*bb]) {
			t.Fatalf("block %d (device block %d) differs after the transfer resolved", i, perm[i])
		}
	}
	batched, looped, _, _ := cudaStats(d)
	t.Logf("512 MiB scattered offload: Start returned after %v with the transfer %v; resolved after %v (%.1f GB/s); submissions batched %d, looped %d",
		started, state, took, float64(blocks*bb)/took.Seconds()/1e9, batched, looped)
	if state != kvlease.TransferPending {
		t.Fatalf("transfer was %v when Start returned: the copy of 512 MiB cannot be done yet, so resolution did not wait for the event", state)
	}
}

// TestDriverKernelLoads: the driver JIT-compiles the embedded PTX for
// this device and the kernel moves scattered copies in every direction,
// through mapped pinned memory; on failure the driver's JIT log is in the
// error.
func TestDriverKernelLoads(t *testing.T) {
	d := openRealDevice(t)
	r := newRig(t, d, 16, 64<<10, WithPath(PathKernel))
	rng := rand.New(rand.NewPCG(25, 26))
	src := make([]byte, 16*64<<10)
	fillRandom(rng, src)
	noErr(t, d.CopyFromHost(r.dev.Base(), src))
	t0 := time.Now()
	tr, err := r.e.DeviceToDevice().Start([]cp[DevicePtr, DevicePtr]{
		pair(r.dev.Region(9), r.dev2.Region(0)), pair(r.dev.Region(2), r.dev2.Region(7)), pair(r.dev.Region(15), r.dev2.Region(3)),
	}, noAttach)
	noErr(t, err)
	waitDone(t, tr)
	noErr(t, tr.Err())
	st := d.CopyStats()
	t.Logf("first kernel copy (JIT included): %v; %v", time.Since(t0), st)
	noErr(t, st.KernelErr, "the copy kernel")
	eq(t, int64(1), st.KernelLaunches)
	eq(t, src[9*64<<10:10*64<<10], readDev(t, d, r.dev2.Region(0), 64<<10))
	eq(t, src[15*64<<10:16*64<<10], readDev(t, d, r.dev2.Region(3), 64<<10))
	if r.pin.a.dptr == 0 {
		t.Fatalf("pinned memory is not mapped on %s", d.Name())
	}
	for kind := range kindNames {
		scatterCase(t, r, copyKind(kind), 12)
	}
	eq(t, int64(4), d.CopyStats().KernelLaunches, "%v", d.CopyStats())
}

// TestDriverCalibrate measures the device and logs the table PathAuto
// chooses from.
func TestDriverCalibrate(t *testing.T) {
	d := openRealDevice(t)
	t0 := time.Now()
	c, err := d.Calibrate()
	noErr(t, err)
	t.Logf("calibration in %v:\n%s", time.Since(t0), c)
	eq(t, 3*len(calSizes), len(c.Rows))
}

package gpu

import (
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
)

// fakeDir holds fake drivers built by the cgo tests; removed after the run.
var fakeDir string

func TestMain(m *testing.M) {
	code := m.Run()
	if fakeDir != "" {
		os.RemoveAll(fakeDir)
	}
	os.Exit(code)
}

// deviceKind opens one kind of device for the shared tests, or skips.
type deviceKind struct {
	name string
	open func(t testing.TB) *Device
}

// deviceKinds lists the devices every shared test runs on: the CPU
// fallback always, a real CUDA device when the driver and a device are
// present, and (in cgo builds with gcc) the fake driver of
// fakedriver_cgo_test.go, which drives the cgo path without a GPU.
var deviceKinds = []deviceKind{
	{"host", func(t testing.TB) *Device {
		d := OpenHost()
		fixedCalibration(d)
		t.Cleanup(func() { noErr(t, d.Close()) })
		return d
	}},
	{"cuda", openRealDevice},
}

// openRealDevice opens CUDA device 0, or skips the test with the reason.
func openRealDevice(t testing.TB) *Device {
	d, err := Open(0)
	if errors.Is(err, ErrNoDriver) || errors.Is(err, ErrNoDevice) {
		t.Skipf("SKIP (no GPU here): %v; the CPU fallback runs the same logic; run gpu/devicecheck.sh on a GPU machine", err)
	}
	noErr(t, err)
	t.Cleanup(func() { noErr(t, d.Close()) })
	return d
}

func forEachDevice(t *testing.T, f func(t *testing.T, d *Device)) {
	for _, k := range deviceKinds {
		t.Run(k.name, func(t *testing.T) { f(t, k.open(t)) })
	}
}

// rig is a device with one engine, two device arenas and two pinned arenas
// of the same geometry, all closed at cleanup (which also checks that
// nothing is left pending).
type rig struct {
	d          *Device
	e          *CopyEngine
	dev, dev2  *DeviceArena
	pin, pin2  *PinnedArena
	blocks, bb int
}

func newRig(t testing.TB, d *Device, blocks, bb int, opts ...EngineOption) *rig {
	t.Helper()
	r := &rig{d: d, blocks: blocks, bb: bb}
	var err error
	r.e, err = d.NewCopyEngine(opts...)
	noErr(t, err)
	r.dev, err = d.AllocDevice(blocks, bb)
	noErr(t, err)
	r.dev2, err = d.AllocDevice(blocks, bb)
	noErr(t, err)
	r.pin, err = d.AllocPinned(blocks, bb)
	noErr(t, err)
	r.pin2, err = d.AllocPinned(blocks, bb)
	noErr(t, err)
	t.Cleanup(func() {
		noErr(t, r.e.Close())
		noErr(t, r.dev.Close())
		noErr(t, r.dev2.Close())
		noErr(t, r.pin.Close())
		noErr(t, r.pin2.Close())
	})
	return r
}

// fillRandom fills b with random bytes, none of them zero, so that a copy
// that did not happen (or a block of zeros) never passes for one that did.
func fillRandom(rng *rand.Rand, b []byte) {
	const ones = 0x0101010101010101 // every byte odd, so never zero
	for len(b) >= 8 {
		binary.LittleEndian.PutUint64(b, rng.Uint64()|ones)
		b = b[8:]
	}
	for i := range b {
		b[i] = byte(rng.IntN(255) + 1)
	}
}

// readDev reads a device block through the synchronous helper.
func readDev(t testing.TB, d *Device, p DevicePtr, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	noErr(t, d.CopyToHost(b, p))
	return b
}

func noAttach(*kvlease.Transfer) error { return nil }

// waitDone waits for tr to resolve, failing the test after a generous
// timeout instead of hanging.
func waitDone(t testing.TB, tr *kvlease.Transfer) {
	t.Helper()
	select {
	case <-tr.Done():
	case <-time.After(20 * time.Second):
		t.Fatalf("transfer %v did not resolve", tr)
	}
}

// waitState polls until tr reaches want (quarantine has no channel).
func waitState(t testing.TB, tr *kvlease.Transfer, want kvlease.TransferState) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for tr.State() != want {
		if time.Now().After(deadline) {
			t.Fatalf("transfer %v: state %v, want %v", tr, tr.State(), want)
		}
		time.Sleep(time.Millisecond)
	}
}

// gatedHost returns a fallback device whose stream workers take a token
// from the returned channel before each job.
func gatedHost(t testing.TB) (*Device, chan struct{}) {
	gate := make(chan struct{})
	d := OpenHost(func(c *hostConfig) { c.gate = gate })
	fixedCalibration(d)
	t.Cleanup(func() { noErr(t, d.Close()) })
	return d, gate
}

// fixedCalibration makes d's PathAuto choice deterministic without
// measuring: the kernel is "faster" for pieces up to 64 KiB in every
// direction, the copy engine above.
func fixedCalibration(d *Device) {
	d.calMeasure = func(_ copyKind, pieceBytes, _ int, path Path) (time.Duration, error) {
		switch {
		case path == PathCopyEngine:
			return 2, nil
		case pieceBytes <= 64<<10:
			return 1, nil
		}
		return 3, nil
	}
}

// pastEveryArena returns a device address beyond the end of every live
// device arena of d: in no arena, whatever the allocator packs next to
// what.
func pastEveryArena(d *Device) DevicePtr {
	d.mu.Lock()
	defer d.mu.Unlock()
	var end uint64
	for _, a := range d.devArenas {
		end = max(end, a.addr+uint64(a.size()))
	}
	return DevicePtr(end + Alignment)
}

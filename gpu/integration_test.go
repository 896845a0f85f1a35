package gpu

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// These tests drive the copy engine through kvlease pools, leases and the
// handoff, on the CPU fallback with its worker held back, so the states in
// between are observable.

type tiers struct {
	d      *Device
	gate   chan struct{}
	e      *CopyEngine
	devMem *DeviceArena
	pinMem *PinnedArena
	dev    *kvlease.Pool[DevicePtr]
	pin    *kvlease.Pool[[]byte]
}

func newTiers(t *testing.T, blocks, bb int, opts ...EngineOption) *tiers {
	t.Helper()
	d, gate := gatedHost(t)
	s := &tiers{d: d, gate: gate}
	var err error
	s.e, err = d.NewCopyEngine(opts...)
	noErr(t, err)
	s.devMem, err = d.AllocDevice(blocks, bb)
	noErr(t, err)
	s.pinMem, err = d.AllocPinned(blocks, bb)
	noErr(t, err)
	s.dev, err = kvlease.NewPool[DevicePtr](s.devMem)
	noErr(t, err)
	s.pin, err = kvlease.NewPool[[]byte](s.pinMem)
	noErr(t, err)
	t.Cleanup(func() {
		// The order a program follows: pools, then engines and arenas
		// (which refuse while copies are in flight), then the device.
		noErr(t, s.dev.Close())
		noErr(t, s.pin.Close())
		noErr(t, s.e.Close())
		noErr(t, s.devMem.Close())
		noErr(t, s.pinMem.Close())
	})
	return s
}

// offloadPairs pairs every block of src with the same index of dst.
func offloadPairs(t *testing.T, src *kvlease.Lease[DevicePtr], dst *kvlease.Lease[[]byte]) []kvlease.CopyPair[DevicePtr, []byte] {
	t.Helper()
	pairs := make([]kvlease.CopyPair[DevicePtr, []byte], src.Len())
	for i := range pairs {
		s, err := src.Region(i)
		noErr(t, err)
		d, err := dst.Region(i)
		noErr(t, err)
		pairs[i] = pair(s, d)
	}
	return pairs
}

func attachBoth(src *kvlease.Lease[DevicePtr], dst *kvlease.Lease[[]byte]) func(*kvlease.Transfer) error {
	return func(t *kvlease.Transfer) error {
		if err := src.AttachRange(t, 0, src.Len(), kvlease.Read); err != nil {
			return err
		}
		return dst.AttachRange(t, 0, dst.Len(), kvlease.Write)
	}
}

// TestOffloadGatesReclamation: a released source lease drains until the
// copy's event, and only then are its blocks free, on both paths.
func TestOffloadGatesReclamation(t *testing.T) {
	for _, p := range []Path{PathCopyEngine, PathKernel} {
		t.Run(pathRow(p), func(t *testing.T) { offloadGatesReclamation(t, p) })
	}
}

func offloadGatesReclamation(t *testing.T, p Path) {
	s := newTiers(t, 8, 1024, WithPath(p))
	st0 := s.d.CopyStats()
	src, err := s.dev.Acquire("req-1", 4)
	noErr(t, err)
	dst, err := s.pin.Acquire("req-1", 4)
	noErr(t, err)
	rng := rand.New(rand.NewPCG(11, 12))
	want := make([][]byte, 4)
	for i := range want {
		want[i] = make([]byte, 1024)
		fillRandom(rng, want[i])
		p, err := src.Region(i)
		noErr(t, err)
		noErr(t, s.d.CopyFromHost(p, want[i]))
	}

	tr, err := s.e.DeviceToHost().Start(offloadPairs(t, src, dst), attachBoth(src, dst))
	noErr(t, err)
	src.Release()
	eq(t, 4, s.dev.Stats().Draining, "released source drains while the copy is pending")
	select {
	case <-src.Settled():
		t.Fatal("source settled before the copy finished")
	default:
	}

	s.gate <- struct{}{}
	waitDone(t, tr)
	noErr(t, tr.Err())
	<-src.Settled()
	eq(t, 8, s.dev.Stats().Free)
	eq(t, int64(map[Path]int{PathKernel: 1}[p]), s.d.CopyStats().KernelLaunches-st0.KernelLaunches, "launches")
	for i := range want {
		r, err := dst.Region(i)
		noErr(t, err)
		eq(t, want[i], r, "offloaded block %d", i)
	}
	dst.Release()
	<-dst.Settled()
}

// TestAttachToClosedLease: attach fails on a closed lease, so nothing is
// enqueued, and the lease attached first is not left gated.
func TestAttachToClosedLease(t *testing.T) {
	s := newTiers(t, 4, 256)
	src, err := s.dev.Acquire("req-2", 2)
	noErr(t, err)
	dst, err := s.pin.Acquire("req-2", 2)
	noErr(t, err)
	before, err := dst.Region(0)
	noErr(t, err)
	old := append([]byte(nil), before...)
	pairs := offloadPairs(t, src, dst)
	dst.Release()

	tr, err := s.e.DeviceToHost().Start(pairs, attachBoth(src, dst))
	isErr(t, err, kvlease.ErrLeaseClosed)
	eq(t, kvlease.TransferResolved, tr.State())
	zero(t, s.e.Pending())
	src.Release()
	<-src.Settled() // not held by the failed transfer
	eq(t, old, before, "nothing was copied")
}

// TestAbortCancelsCopy: aborting a lease cancels the transfer; the copy is
// skipped on the fallback, and the blocks still wait for the worker's
// proof before they are free, on both paths.
func TestAbortCancelsCopy(t *testing.T) {
	for _, p := range []Path{PathCopyEngine, PathKernel} {
		t.Run(pathRow(p), func(t *testing.T) { abortCancelsCopy(t, p) })
	}
}

func abortCancelsCopy(t *testing.T, p Path) {
	s := newTiers(t, 4, 256, WithPath(p))
	src, err := s.dev.Acquire("req-3", 2)
	noErr(t, err)
	dst, err := s.pin.Acquire("req-3", 2)
	noErr(t, err)
	tr, err := s.e.DeviceToHost().Start(offloadPairs(t, src, dst), attachBoth(src, dst))
	noErr(t, err)
	dst.Abort(nil)
	src.Abort(nil)
	eq(t, kvlease.TransferPending, tr.State())
	eq(t, 2, s.pin.Stats().Draining)
	s.gate <- struct{}{}
	waitDone(t, tr)
	isErr(t, tr.Err(), kvlease.ErrCanceled)
	<-dst.Settled()
	<-src.Settled()
	eq(t, 4, s.pin.Stats().Free)
}

// TestQuarantineKeepsBlocks: a sticky device failure quarantines the
// blocks of both leases; they are never handed out again.
func TestQuarantineKeepsBlocks(t *testing.T) {
	gate := make(chan struct{})
	d := OpenHost(func(c *hostConfig) { c.gate = gate })
	e, err := d.NewCopyEngine()
	noErr(t, err)
	devMem, err := d.AllocDevice(4, 256)
	noErr(t, err)
	pinMem, err := d.AllocPinned(4, 256)
	noErr(t, err)
	dev, err := kvlease.NewPool[DevicePtr](devMem)
	noErr(t, err)
	pin, err := kvlease.NewPool[[]byte](pinMem)
	noErr(t, err)
	src, err := dev.Acquire("req-4", 2)
	noErr(t, err)
	dst, err := pin.Acquire("req-4", 2)
	noErr(t, err)
	tr, err := e.DeviceToHost().Start(offloadPairs(t, src, dst), attachBoth(src, dst))
	noErr(t, err)
	d.b.(*hostBackend).injectFault(ErrorLaunchFailed)
	gate <- struct{}{}
	waitState(t, tr, kvlease.TransferQuarantined)
	src.Release()
	dst.Release()
	eq(t, 2, dev.Stats().Quarantined)
	eq(t, 2, pin.Stats().Quarantined)
	_, err = pin.Acquire("next", 3)
	isErr(t, err, kvlease.ErrExhausted)
	isErr(t, pinMem.Close(), ErrBusy)
}

// TestHandoffOverDeviceCopy runs the two-phase handoff between two pools
// on one device with the engine's device-to-device transport.
func TestHandoffOverDeviceCopy(t *testing.T) {
	const blocks, bb = 16, 4096
	d := OpenHost()
	t.Cleanup(func() { noErr(t, d.Close()) })
	r := newRig(t, d, blocks, bb)
	prefill, err := kvlease.NewPool[DevicePtr](r.dev)
	noErr(t, err)
	decode, err := kvlease.NewPool[DevicePtr](r.dev2)
	noErr(t, err)
	env := handoff.Envelope{BlockTokens: 16, BlockBytes: bb, PoolBlocks: blocks, MaxContextTokens: 128, MaxPrefillTokens: 64, MaxRunningRequests: 2}
	noErr(t, env.Validate())

	src, err := prefill.Acquire("req-5", 5)
	noErr(t, err)
	rng := rand.New(rand.NewPCG(13, 14))
	want := make([][]byte, src.Len())
	for i := range want {
		want[i] = make([]byte, bb)
		fillRandom(rng, want[i])
		p, err := src.Region(i)
		noErr(t, err)
		noErr(t, d.CopyFromHost(p, want[i]))
	}
	h, err := handoff.Propose(src, decode, handoff.Config{Envelope: env, Source: "prefill", Destination: "decode", Deadline: 10 * time.Second})
	noErr(t, err)
	noErr(t, h.Accept())
	noErr(t, h.Start(r.e.DeviceToDevice()))
	select {
	case <-h.Done():
	case <-time.After(20 * time.Second):
		t.Fatal("handoff did not finish")
	}
	eq(t, handoff.Delivered, h.State())
	got := h.Destination()
	for i := range want {
		p, err := got.Region(i)
		noErr(t, err)
		eq(t, want[i], readDev(t, d, p, bb), "handed-off block %d", i)
	}
	src.Release()
	got.Release()
	<-src.Settled()
	<-got.Settled()
	noErr(t, prefill.Close())
	noErr(t, decode.Close())
}

// TestCloseWithPool: an arena goes only once its pool is closed and holds
// nothing, and the copies touching it have resolved.
func TestCloseWithPool(t *testing.T) {
	d, gate := gatedHost(t)
	e, err := d.NewCopyEngine()
	noErr(t, err)
	defer func() { noErr(t, e.Close()) }()
	devMem, err := d.AllocDevice(4, 256)
	noErr(t, err)
	pinMem, err := d.AllocPinned(4, 256)
	noErr(t, err)
	dev, err := kvlease.NewPool[DevicePtr](devMem)
	noErr(t, err)
	pin, err := kvlease.NewPool[[]byte](pinMem)
	noErr(t, err)
	other, err := kvlease.NewPool[DevicePtr](devMem)
	noErr(t, err)
	isErr(t, pinMem.CloseWithPool(nil), kvlease.ErrInvalidArgument)

	src, err := dev.Acquire("req-6", 2)
	noErr(t, err)
	dst, err := pin.Acquire("req-6", 2)
	noErr(t, err)
	err = devMem.CloseWithPool(dev)
	isErr(t, err, ErrBusy)
	contains(t, err, "1 open leases, 2 leased")
	_, err = dev.Acquire("late", 1)
	isErr(t, err, kvlease.ErrPoolClosed, "the refused close still closed the pool")

	tr, err := e.DeviceToHost().Start(offloadPairs(t, src, dst), attachBoth(src, dst))
	noErr(t, err)
	src.Release()
	dst.Release()
	contains(t, devMem.CloseWithPool(dev), "2 draining")
	gate <- struct{}{}
	waitDone(t, tr)
	<-src.Settled()
	<-dst.Settled()
	noErr(t, devMem.CloseWithPool(dev))
	noErr(t, pinMem.CloseWithPool(pin))
	noErr(t, other.Close())
}

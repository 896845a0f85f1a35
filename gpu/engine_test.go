package gpu

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/kvlease/kvlease"
)

type cp[S, D any] = kvlease.CopyPair[S, D]

func pair[S, D any](src S, dst D) cp[S, D] { return cp[S, D]{Src: src, Dst: dst} }

// TestCopyRoundTrip moves random data host → device → device → host
// through scattered blocks and checks every byte, on every device kind.
func TestCopyRoundTrip(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		const blocks, bb = 64, 4096
		r := newRig(t, d, blocks, bb)
		rng := rand.New(rand.NewPCG(1, 2))
		for i := range blocks {
			fillRandom(rng, r.pin.Region(kvlease.BlockID(i)))
		}
		// Scatter: pinned block i → device block perm[i]. Pinned blocks
		// 10..19 go to device blocks 40..49, a run the engine merges into
		// one copy; the rest are shuffled.
		var rest []int
		for _, p := range rng.Perm(blocks) {
			if p < 40 || p >= 50 {
				rest = append(rest, p)
			}
		}
		perm := make([]int, blocks)
		for i := range blocks {
			if i >= 10 && i < 20 {
				perm[i] = 30 + i
			} else {
				perm[i], rest = rest[0], rest[1:]
			}
		}
		h2d := make([]cp[[]byte, DevicePtr], blocks)
		for i := range blocks {
			h2d[i] = pair(r.pin.Region(kvlease.BlockID(i)), r.dev.Region(kvlease.BlockID(perm[i])))
		}
		tr, err := r.e.HostToDevice().Start(h2d, noAttach)
		noErr(t, err)
		waitDone(t, tr)
		noErr(t, tr.Err())
		for i := range blocks {
			eq(t, r.pin.Region(kvlease.BlockID(i)), readDev(t, d, r.dev.Region(kvlease.BlockID(perm[i])), bb), "H→D block %d", i)
		}

		// Gather on the device: dev block perm[i] → dev2 block i.
		d2d := make([]cp[DevicePtr, DevicePtr], blocks)
		for i := range blocks {
			d2d[i] = pair(r.dev.Region(kvlease.BlockID(perm[i])), r.dev2.Region(kvlease.BlockID(i)))
		}
		tr, err = r.e.DeviceToDevice().Start(d2d, noAttach)
		noErr(t, err)
		waitDone(t, tr)
		noErr(t, tr.Err())

		// Offload in reverse order: dev2 block i → pin2 block blocks-1-i.
		d2h := make([]cp[DevicePtr, []byte], blocks)
		for i := range blocks {
			d2h[i] = pair(r.dev2.Region(kvlease.BlockID(i)), r.pin2.Region(kvlease.BlockID(blocks-1-i)))
		}
		tr, err = r.e.DeviceToHost().Start(d2h, noAttach)
		noErr(t, err)
		waitDone(t, tr)
		noErr(t, tr.Err())
		for i := range blocks {
			eq(t, r.pin.Region(kvlease.BlockID(i)), r.pin2.Region(kvlease.BlockID(blocks-1-i)), "round trip of block %d", i)
		}
		zero(t, r.e.Pending())
		zero(t, r.dev.Pending())
	})
}

// TestCopySubset copies a few scattered blocks and checks that the blocks
// around them are untouched.
func TestCopySubset(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		const blocks, bb = 16, 512
		r := newRig(t, d, blocks, bb)
		rng := rand.New(rand.NewPCG(3, 4))
		before := make([]byte, blocks*bb)
		fillRandom(rng, before)
		noErr(t, d.CopyFromHost(r.dev.Base(), before))
		for i := range blocks {
			fillRandom(rng, r.pin.Region(kvlease.BlockID(i)))
		}
		targets := map[int]int{3: 0, 7: 5, 8: 6, 15: 15} // dev block → pinned block
		var pairs []cp[[]byte, DevicePtr]
		for dst, src := range targets {
			pairs = append(pairs, pair(r.pin.Region(kvlease.BlockID(src)), r.dev.Region(kvlease.BlockID(dst))))
		}
		tr, err := r.e.HostToDevice().Start(pairs, noAttach)
		noErr(t, err)
		waitDone(t, tr)
		noErr(t, tr.Err())
		after := readDev(t, d, r.dev.Base(), blocks*bb)
		for i := range blocks {
			want := before[i*bb : (i+1)*bb]
			if src, ok := targets[i]; ok {
				want = r.pin.Region(kvlease.BlockID(src))
			}
			eq(t, want, after[i*bb:(i+1)*bb], "device block %d", i)
		}
	})
}

// TestTransferResolvesOnlyAfterCopy holds the fallback's worker back and
// checks that the transfer stays pending, and the destination untouched,
// until the copy has run.
func TestTransferResolvesOnlyAfterCopy(t *testing.T) {
	d, gate := gatedHost(t)
	r := newRig(t, d, 4, 256)
	rng := rand.New(rand.NewPCG(5, 6))
	src := make([]byte, 4*256)
	fillRandom(rng, src)
	noErr(t, d.CopyFromHost(r.dev.Base(), src))
	old := append([]byte(nil), r.pin.Region(1)...)

	tr, err := r.e.DeviceToHost().Start([]cp[DevicePtr, []byte]{pair(r.dev.Region(2), r.pin.Region(1))}, noAttach)
	noErr(t, err)
	eq(t, kvlease.TransferPending, tr.State())
	eq(t, 1, r.e.Pending())
	eq(t, 1, r.dev.Pending())
	eq(t, 1, r.pin.Pending())
	eq(t, old, r.pin.Region(1), "copied before the stream ran")

	gate <- struct{}{}
	waitDone(t, tr)
	noErr(t, tr.Err())
	eq(t, src[2*256:3*256], r.pin.Region(1))
	zero(t, r.e.Pending())
	zero(t, r.pin.Pending())
}

// TestStreamOrder: transfers on one engine complete in start order.
func TestStreamOrder(t *testing.T) {
	d, gate := gatedHost(t)
	r := newRig(t, d, 4, 256)
	first, err := r.e.DeviceToDevice().Start([]cp[DevicePtr, DevicePtr]{pair(r.dev.Region(0), r.dev2.Region(0))}, noAttach)
	noErr(t, err)
	second, err := r.e.DeviceToDevice().Start([]cp[DevicePtr, DevicePtr]{pair(r.dev.Region(1), r.dev2.Region(1))}, noAttach)
	noErr(t, err)
	gate <- struct{}{}
	waitDone(t, first)
	eq(t, kvlease.TransferPending, second.State())
	gate <- struct{}{}
	waitDone(t, second)
}

// TestAttachFailureEnqueuesNothing: attach fails ⇒ the transfer is
// resolved with its error, nothing is copied, nothing stays pending.
func TestAttachFailureEnqueuesNothing(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		r := newRig(t, d, 4, 256)
		rng := rand.New(rand.NewPCG(7, 8))
		fillRandom(rng, r.pin.Region(0))
		old := make([]byte, 256)
		fillRandom(rng, old)
		noErr(t, d.CopyFromHost(r.dev.Region(3), old))

		boom := errors.New("lease closed meanwhile")
		var seen *kvlease.Transfer
		tr, err := r.e.HostToDevice().Start([]cp[[]byte, DevicePtr]{pair(r.pin.Region(0), r.dev.Region(3))}, func(t *kvlease.Transfer) error {
			seen = t
			return boom
		})
		isErr(t, err, boom)
		same(t, seen, tr)
		eq(t, kvlease.TransferResolved, tr.State())
		isErr(t, tr.Err(), boom)
		zero(t, r.e.Pending())
		zero(t, r.dev.Pending())

		// Drain the stream with a later copy; the first must never have run.
		tr2, err := r.e.DeviceToDevice().Start([]cp[DevicePtr, DevicePtr]{pair(r.dev.Region(0), r.dev2.Region(0))}, noAttach)
		noErr(t, err)
		waitDone(t, tr2)
		eq(t, old, readDev(t, d, r.dev.Region(3), 256))
	})
}

func TestAttachPanicSettles(t *testing.T) {
	d := OpenHost()
	defer d.Close()
	r := newRig(t, d, 2, 256)
	var tr *kvlease.Transfer
	func() {
		defer func() { eq(t, "attach bug", recover()) }()
		_, _ = r.e.DeviceToDevice().Start([]cp[DevicePtr, DevicePtr]{pair(r.dev.Region(0), r.dev2.Region(0))}, func(t *kvlease.Transfer) error {
			tr = t
			panic("attach bug")
		})
	}()
	eq(t, kvlease.TransferResolved, tr.State())
	isErr(t, tr.Err(), errAttachPanicked)
	zero(t, r.e.Pending())
	zero(t, r.dev.Pending())
}

// TestCloseRefusedWhilePending: arenas, the engine and the device refuse
// to close while a copy is in flight, say what is alive, and close once it
// resolved.
func TestCloseRefusedWhilePending(t *testing.T) {
	d, gate := gatedHost(t)
	e, err := d.NewCopyEngine()
	noErr(t, err)
	dev, err := d.AllocDevice(4, 256)
	noErr(t, err)
	pin, err := d.AllocPinned(4, 256)
	noErr(t, err)
	tr, err := e.DeviceToHost().Start([]cp[DevicePtr, []byte]{pair(dev.Region(0), pin.Region(0)), pair(dev.Region(2), pin.Region(3))}, noAttach)
	noErr(t, err)

	err = dev.Close()
	isErr(t, err, ErrBusy)
	contains(t, err, "1 copies in flight")
	isErr(t, pin.Close(), ErrBusy)
	err = e.Close()
	isErr(t, err, ErrBusy)
	contains(t, err, "1 transfers in flight")
	err = d.Close()
	isErr(t, err, ErrBusy)
	contains(t, err, "1 device arenas, 1 pinned arenas, 1 copy engines still open")
	// The refused Close left the arena usable.
	notNil(t, pin.Region(0))

	gate <- struct{}{}
	waitDone(t, tr)
	noErr(t, e.Close())
	noErr(t, e.Close(), "second Close")
	noErr(t, dev.Close())
	noErr(t, pin.Close())
	noErr(t, pin.Close(), "second Close")
	isNil(t, pin.Region(0), "a closed pinned arena hands out no memory")

	_, err = e.DeviceToHost().Start([]cp[DevicePtr, []byte]{pair(dev.Region(0), pin.Region(0))}, noAttach)
	isErr(t, err, ErrClosed)
}

// TestCancel: a cancel before the worker reaches the job skips the copy;
// the transfer still resolves (with kvlease.ErrCanceled) only when the worker is
// done with it.
func TestCancel(t *testing.T) {
	d, gate := gatedHost(t)
	r := newRig(t, d, 4, 256)
	old := append([]byte(nil), r.pin.Region(0)...)
	rng := rand.New(rand.NewPCG(9, 10))
	src := make([]byte, 256)
	fillRandom(rng, src)
	noErr(t, d.CopyFromHost(r.dev.Region(1), src))

	tr, err := r.e.DeviceToHost().Start([]cp[DevicePtr, []byte]{pair(r.dev.Region(1), r.pin.Region(0))}, noAttach)
	noErr(t, err)
	tr.Cancel()
	eq(t, kvlease.TransferPending, tr.State(), "a cancel is a request, not evidence")
	gate <- struct{}{}
	waitDone(t, tr)
	isErr(t, tr.Err(), kvlease.ErrCanceled)
	eq(t, old, r.pin.Region(0))
	zero(t, r.e.Pending())
}

// TestCancelDuringAttach: a cancel that arrives during attach (an Abort
// racing the Start) keeps the copy from being enqueued at all.
func TestCancelDuringAttach(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		r := newRig(t, d, 2, 256)
		tr, err := r.e.DeviceToDevice().Start([]cp[DevicePtr, DevicePtr]{pair(r.dev.Region(0), r.dev2.Region(1))}, func(t *kvlease.Transfer) error {
			t.Cancel()
			return nil
		})
		isErr(t, err, kvlease.ErrCanceled)
		eq(t, kvlease.TransferResolved, tr.State())
		isErr(t, tr.Err(), kvlease.ErrCanceled)
		zero(t, r.e.Pending())
	})
}

// TestStickyFailureQuarantines: a failure while waiting for completion
// quarantines the transfer, pins its arenas for good and stops the engine.
func TestStickyFailureQuarantines(t *testing.T) {
	gate := make(chan struct{})
	d := OpenHost(func(c *hostConfig) { c.gate = gate })
	e, err := d.NewCopyEngine()
	noErr(t, err)
	dev, err := d.AllocDevice(2, 256)
	noErr(t, err)
	pin, err := d.AllocPinned(2, 256)
	noErr(t, err)
	other, err := d.AllocDevice(2, 256)
	noErr(t, err)

	tr, err := e.DeviceToHost().Start([]cp[DevicePtr, []byte]{pair(dev.Region(0), pin.Region(1))}, noAttach)
	noErr(t, err)
	d.b.(*hostBackend).injectFault(ErrorIllegalAddress)
	gate <- struct{}{}
	waitState(t, tr, kvlease.TransferQuarantined)
	isErr(t, tr.Err(), ErrDeviceFailed)
	var de *DriverError
	asErr(t, tr.Err(), &de)
	eq(t, ErrorIllegalAddress, de.Code)
	isErr(t, e.Err(), ErrDeviceFailed)

	err = dev.Close()
	isErr(t, err, ErrBusy)
	contains(t, err, "quarantined")
	isErr(t, pin.Close(), ErrBusy)
	contains(t, e.Close(), "quarantined")
	noErr(t, other.Close(), "an arena the failed copy never touched is free to go")

	called := false
	_, err = e.DeviceToDevice().Start([]cp[DevicePtr, DevicePtr]{pair(dev.Region(0), dev.Region(1))}, func(*kvlease.Transfer) error {
		called = true
		return nil
	})
	isErr(t, err, ErrDeviceFailed)
	isFalse(t, called, "a failed engine must refuse before attach")
	isErr(t, d.Close(), ErrBusy)
}

// TestBadInput: malformed pairs are errors (ErrInvalidArgument), never
// panics, and nothing is attached, pinned or enqueued.
func TestBadInput(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		r := newRig(t, d, 4, 512)
		small, err := d.AllocDevice(4, 256)
		noErr(t, err)
		defer func() { noErr(t, small.Close()) }()
		closed, err := d.AllocDevice(1, 512)
		noErr(t, err)
		closedPtr := closed.Region(0)
		noErr(t, closed.Close())
		goMem, err := kvlease.NewHostMemory(4, 512)
		noErr(t, err)
		elsewhere := OpenHost()
		foreign, err := elsewhere.AllocPinned(1, 512)
		noErr(t, err)
		defer func() { noErr(t, foreign.Close()); noErr(t, elsewhere.Close()) }()

		attached := 0
		attach := func(*kvlease.Transfer) error { attached++; return nil }
		d2h := r.e.DeviceToHost()
		h2d := r.e.HostToDevice()
		d2d := r.e.DeviceToDevice()
		cases := []struct {
			name  string
			start func() (*kvlease.Transfer, error)
		}{
			{"nil pairs", func() (*kvlease.Transfer, error) { return d2h.Start(nil, attach) }},
			{"nil attach", func() (*kvlease.Transfer, error) {
				return d2h.Start([]cp[DevicePtr, []byte]{pair(r.dev.Region(0), r.pin.Region(0))}, nil)
			}},
			{"zero transport", func() (*kvlease.Transfer, error) {
				return DeviceToHost{}.Start([]cp[DevicePtr, []byte]{pair(r.dev.Region(0), r.pin.Region(0))}, attach)
			}},
			{"device pointer outside every arena", func() (*kvlease.Transfer, error) {
				return d2h.Start([]cp[DevicePtr, []byte]{pair(DevicePtr(12345), r.pin.Region(0))}, attach)
			}},
			{"device pointer past every live arena", func() (*kvlease.Transfer, error) {
				// Not one past r.dev: a real cuMemAlloc (and the fake) packs
				// allocations, so that is likely another arena's first block.
				return d2h.Start([]cp[DevicePtr, []byte]{pair(pastEveryArena(d), r.pin.Region(0))}, attach)
			}},
			{"device pointer inside a block", func() (*kvlease.Transfer, error) {
				return d2h.Start([]cp[DevicePtr, []byte]{pair(r.dev.Region(1).Add(256), r.pin.Region(0))}, attach)
			}},
			{"device pointer of a closed arena", func() (*kvlease.Transfer, error) {
				return d2h.Start([]cp[DevicePtr, []byte]{pair(closedPtr, r.pin.Region(0))}, attach)
			}},
			{"Go memory as host side", func() (*kvlease.Transfer, error) {
				return d2h.Start([]cp[DevicePtr, []byte]{pair(r.dev.Region(0), goMem.Region(0))}, attach)
			}},
			{"make([]byte) as host side", func() (*kvlease.Transfer, error) {
				return h2d.Start([]cp[[]byte, DevicePtr]{pair(make([]byte, 512), r.dev.Region(0))}, attach)
			}},
			{"pinned memory of another device", func() (*kvlease.Transfer, error) {
				return h2d.Start([]cp[[]byte, DevicePtr]{pair(foreign.Region(0), r.dev.Region(0))}, attach)
			}},
			{"part of a pinned block", func() (*kvlease.Transfer, error) {
				return h2d.Start([]cp[[]byte, DevicePtr]{pair(r.pin.Region(1)[:256], r.dev.Region(0))}, attach)
			}},
			{"pinned slice spanning two blocks", func() (*kvlease.Transfer, error) {
				return h2d.Start([]cp[[]byte, DevicePtr]{pair(r.pin.a.host[:1024], r.dev.Region(0))}, attach)
			}},
			{"empty host region", func() (*kvlease.Transfer, error) {
				return h2d.Start([]cp[[]byte, DevicePtr]{pair([]byte{}, r.dev.Region(0))}, attach)
			}},
			{"mismatched block sizes", func() (*kvlease.Transfer, error) {
				return d2d.Start([]cp[DevicePtr, DevicePtr]{pair(r.dev.Region(0), small.Region(0))}, attach)
			}},
			{"block written twice", func() (*kvlease.Transfer, error) {
				return d2d.Start([]cp[DevicePtr, DevicePtr]{pair(r.dev.Region(0), r.dev2.Region(2)), pair(r.dev.Region(1), r.dev2.Region(2))}, attach)
			}},
			{"block read and written", func() (*kvlease.Transfer, error) {
				return d2d.Start([]cp[DevicePtr, DevicePtr]{pair(r.dev.Region(0), r.dev.Region(1)), pair(r.dev.Region(1), r.dev.Region(2))}, attach)
			}},
			{"block copied onto itself", func() (*kvlease.Transfer, error) {
				return d2d.Start([]cp[DevicePtr, DevicePtr]{pair(r.dev.Region(3), r.dev.Region(3))}, attach)
			}},
		}
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				attached = 0
				tr, err := c.start()
				isErr(t, err, kvlease.ErrInvalidArgument)
				isNil(t, tr)
				zero(t, attached, "attach called")
				zero(t, r.e.Pending())
				zero(t, r.dev.Pending())
				zero(t, r.pin.Pending())
			})
		}
	})
}

// TestConcurrentCopies hammers one fallback device from many goroutines:
// several engines, starts, cancels and arena churn at once; every copy
// that was not canceled must deliver its bytes, and everything must end
// with nothing pending. Run it with -race -count=20.
func TestConcurrentCopies(t *testing.T) {
	d := OpenHost()
	t.Cleanup(func() { noErr(t, d.Close()) })
	engines := make([]*CopyEngine, 3)
	for i := range engines {
		var err error
		engines[i], err = d.NewCopyEngine()
		noErr(t, err)
	}
	const workers, rounds, blocks, bb = 8, 30, 8, 256
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- concurrentWorker(d, engines[w%len(engines)], uint64(w), rounds, blocks, bb)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		noErr(t, err)
	}
	for _, e := range engines {
		zero(t, e.Pending())
		noErr(t, e.Close())
	}
}

func concurrentWorker(d *Device, e *CopyEngine, seed uint64, rounds, blocks, bb int) error {
	rng := rand.New(rand.NewPCG(seed, 99))
	dev, err := d.AllocDevice(blocks, bb)
	if err != nil {
		return err
	}
	pin, err := d.AllocPinned(blocks, bb)
	if err != nil {
		return err
	}
	back, err := d.AllocPinned(blocks, bb)
	if err != nil {
		return err
	}
	for round := range rounds {
		for i := range blocks {
			fillRandom(rng, pin.Region(kvlease.BlockID(i)))
		}
		perm := rng.Perm(blocks)
		up := make([]cp[[]byte, DevicePtr], blocks)
		down := make([]cp[DevicePtr, []byte], blocks)
		for i := range blocks {
			up[i] = pair(pin.Region(kvlease.BlockID(i)), dev.Region(kvlease.BlockID(perm[i])))
			down[i] = pair(dev.Region(kvlease.BlockID(perm[i])), back.Region(kvlease.BlockID(i)))
		}
		t1, err := e.HostToDevice().Start(up, noAttach)
		if err != nil {
			return err
		}
		// Stream order makes the offload see the onload's result.
		t2, err := e.DeviceToHost().Start(down, noAttach)
		if err != nil {
			return err
		}
		cancel := round%5 == 4
		if cancel {
			go t2.Cancel()
		}
		<-t1.Done()
		<-t2.Done()
		if t1.Err() != nil {
			return t1.Err()
		}
		if cancel {
			if t2.Err() != nil && !errors.Is(t2.Err(), kvlease.ErrCanceled) {
				return t2.Err()
			}
			continue
		}
		if t2.Err() != nil {
			return t2.Err()
		}
		for i := range blocks {
			if string(pin.Region(kvlease.BlockID(i))) != string(back.Region(kvlease.BlockID(i))) {
				return fmt.Errorf("round %d block %d: data mismatch", round, i)
			}
		}
	}
	for _, c := range []interface{ Close() error }{dev, pin, back} {
		if err := c.Close(); err != nil {
			return err
		}
	}
	return nil
}

// TestUploadThenScatteredDownload is the device check's correctness loop:
// 20 times, a synchronous upload from pageable Go memory, then at once a
// scattered download on the engine's stream, compared byte for byte. It
// fails if CopyFromHost returns before its bytes have landed.
func TestUploadThenScatteredDownload(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		const blocks, bb = 64, 64 << 10
		r := newRig(t, d, blocks, bb)
		rng := rand.New(rand.NewPCG(41, 42))
		src := make([]byte, blocks*bb)
		for round := range 20 {
			fillRandom(rng, src)
			noErr(t, d.CopyFromHost(r.dev.Base(), src))
			perm := rng.Perm(blocks)
			pairs := make([]cp[DevicePtr, []byte], blocks)
			for i := range pairs {
				pairs[i] = pair(r.dev.Region(kvlease.BlockID(perm[i])), r.pin.Region(kvlease.BlockID(i)))
			}
			tr, err := r.e.DeviceToHost().Start(pairs, noAttach)
			noErr(t, err)
			waitDone(t, tr)
			noErr(t, tr.Err())
			for i := range blocks {
				if !bytes.Equal(src[perm[i]*bb:(perm[i]+1)*bb], r.pin.Region(kvlease.BlockID(i))) {
					t.Fatalf("round %d: pinned block %d differs from uploaded block %d", round, i, perm[i])
				}
			}
		}
		t.Logf("20 rounds of %d KiB uploaded and downloaded scattered: identical; paths: %v", blocks*bb>>10, d.CopyStats())
	})
}

// TestTiming: with timing on, every submission's GPU time is measured
// (CUDA events, or the fallback worker's clock), and none without.
func TestTiming(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		r := newRig(t, d, 4, 4096)
		_, n0 := gpuTime(d)
		setTiming(d, true)
		for range 3 {
			tr, err := r.e.DeviceToHost().Start([]cp[DevicePtr, []byte]{pair(r.dev.Region(1), r.pin.Region(0)), pair(r.dev.Region(0), r.pin.Region(3))}, noAttach)
			noErr(t, err)
			waitDone(t, tr)
		}
		setTiming(d, false)
		tr, err := r.e.DeviceToHost().Start([]cp[DevicePtr, []byte]{pair(r.dev.Region(1), r.pin.Region(0))}, noAttach)
		noErr(t, err)
		waitDone(t, tr)
		el, n := gpuTime(d)
		eq(t, n0+3, n, "timed submissions")
		if el < 0 {
			t.Fatalf("negative GPU time %v", el)
		}
	})
}

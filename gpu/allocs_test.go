package gpu

import (
	"math/rand/v2"
	"testing"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/layout"
)

// TestStartAllocs: a Start allocates one object, the transfer it returns,
// on both paths, flat and layered, once the engine has settled a job to
// reuse (issue 35: at most one allocation). The race detector allocates
// more, so the test skips under it; CI runs it without (35-gpu.sh).
func TestStartAllocs(t *testing.T) {
	if raceOn {
		t.Skip("SKIP under -race (it allocates); .ci/steps/35-gpu.sh runs this test without it")
	}
	forEachDevice(t, func(t *testing.T, d *Device) {
		for _, p := range []Path{PathKernel, PathCopyEngine} {
			t.Run(pathRow(p), func(t *testing.T) {
				const n = 1024
				r := newRig(t, d, n, 256, WithPath(p))
				rng := rand.New(rand.NewPCG(6, 6))
				src, dst := rng.Perm(n), rng.Perm(n)
				pairs := make([]kvlease.CopyPair[DevicePtr, []byte], n)
				for i := range pairs {
					pairs[i] = pair(r.dev.Region(kvlease.BlockID(src[i])), r.pin.Region(kvlease.BlockID(dst[i])))
				}
				done := make(chan struct{}, 1)
				signal := func(error) { done <- struct{}{} }
				flat := func() {
					tr, err := r.e.DeviceToHost().Start(pairs, noAttach)
					if err != nil {
						t.Fatal(err)
					}
					tr.OnResolve(signal)
					<-done
				}
				flat()
				if a := testing.AllocsPerRun(20, flat); a != 1 {
					t.Errorf("flat Start of %d pairs: %v allocations, want 1", n, a)
				}

				dev, err := d.AllocLayered(layout.LayerSeparated(8, 2, 16, 256, ""))
				noErr(t, err)
				host, err := d.AllocLayeredPinned(layout.Contiguous(8, 2, 16, 256, ""))
				noErr(t, err)
				t.Cleanup(func() { noErr(t, dev.Close()); noErr(t, host.Close()) })
				off := make([]kvlease.CopyPair[DeviceBlock, HostBlock], 16)
				for i := range off {
					off[i] = kvlease.CopyPair[DeviceBlock, HostBlock]{Src: dev.Region(kvlease.BlockID(i)), Dst: host.Region(kvlease.BlockID(15 - i))}
				}
				layered := func() {
					tr, err := r.e.LayeredDeviceToHost().Start(off, noAttach)
					if err != nil {
						t.Fatal(err)
					}
					tr.OnResolve(signal)
					<-done
				}
				layered()
				if a := testing.AllocsPerRun(20, layered); a != 1 {
					t.Errorf("layered Start of 16 blocks × 16 pieces: %v allocations, want 1", a)
				}
			})
		}
	})
}

package gpu

import (
	"math/rand/v2"
	"testing"

	"github.com/kvlease/kvlease"
)

// TestCopyLeaseRuns: blocks of kvlease leases, which the pools hand out
// as contiguous runs, cross host → device in one copy per run on both
// sides (Lease.AppendRuns), on every device kind (the CPU fallback
// included); a scattered destination takes one copy per block. The bytes
// arrive either way.
func TestCopyLeaseRuns(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		const blocks, bb = 64, 4096
		r := newRig(t, d, blocks, bb)
		host, err := kvlease.NewPool[[]byte](r.pin)
		noErr(t, err)
		dev, err := kvlease.NewPool[DevicePtr](r.dev)
		noErr(t, err)
		rng := rand.New(rand.NewPCG(3, 4))
		for i := range blocks {
			fillRandom(rng, r.pin.Region(kvlease.BlockID(i)))
		}
		copies := func() int64 {
			st := d.CopyStats()
			return st.BatchedCopies + st.LoopedCopies + st.KernelCopies
		}
		run := func(src *kvlease.Lease[[]byte], dstIDs []kvlease.BlockID) int64 {
			pairs := make([]cp[[]byte, DevicePtr], src.Len())
			for i := range pairs {
				s, err := src.ReadRegion(i)
				noErr(t, err)
				pairs[i] = pair(s, r.dev.Region(dstIDs[i]))
			}
			c0 := copies()
			tr, err := r.e.HostToDevice().Start(pairs, noAttach)
			noErr(t, err)
			waitDone(t, tr)
			noErr(t, tr.Err())
			for i := range pairs {
				eq(t, pairs[i].Src, readDev(t, d, r.dev.Region(dstIDs[i]), bb), "block %d", i)
			}
			return copies() - c0
		}

		a, err := host.Acquire("a", 24)
		noErr(t, err)
		b, err := host.Acquire("b", 8)
		noErr(t, err)
		a.Release() // its 24 blocks go back as a run
		c, err := host.Acquire("c", 16)
		noErr(t, err)
		dl, err := dev.Acquire("c", 16)
		noErr(t, err)
		srcRuns, dstRuns := c.AppendRuns(nil, 0), dl.AppendRuns(nil, 0)
		eq(t, 1, len(srcRuns), "host runs %v", srcRuns)
		eq(t, 1, len(dstRuns), "device runs %v", dstRuns)
		eq(t, int64(1), run(c, dl.AppendBlockIDs(nil, 0)), "copies of one run on both sides")

		// The same source into scattered device blocks: no two adjacent.
		scattered := make([]kvlease.BlockID, 16)
		for i := range scattered {
			scattered[i] = kvlease.BlockID(32 + 2*i)
		}
		eq(t, int64(16), run(c, scattered), "copies into scattered blocks")
		b.Release()
		c.Release()
		dl.Release()
	})
}

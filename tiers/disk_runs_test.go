package tiers

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
)

// writeRead writes blocks to slots in one Write, reads them back in one
// Read, and returns the I/Os each took and the error of each.
func writeRead(t *testing.T, d *Disk, slots []DiskSlot, seed int) (wIOs, rIOs int64, werr, rerr error) {
	t.Helper()
	hashes := chain(seed, len(slots))
	writes := make([]SlotWrite, len(slots))
	for k, s := range slots {
		b := make([]byte, d.BlockBytes())
		stamp(b, hashes[k])
		writes[k] = SlotWrite{Src: b, Dst: s, Hash: hashes[k]}
	}
	nop := func(*kvlease.Transfer) error { return nil }
	before := d.IOs()
	tr, err := d.Write(writes, nop)
	require.NoError(t, err)
	<-tr.Done()
	wIOs, werr = d.IOs()-before, tr.Err()
	if werr != nil {
		return wIOs, 0, werr, nil
	}
	reads := make([]SlotRead, len(slots))
	for k, s := range slots {
		reads[k] = SlotRead{Src: s, Dst: make([]byte, d.BlockBytes()), Hash: hashes[k]}
	}
	before = d.IOs()
	tr, err = d.Read(reads, nop)
	require.NoError(t, err)
	<-tr.Done()
	rIOs, rerr = d.IOs()-before, tr.Err()
	for k, r := range reads {
		if rerr == nil && !holds(r.Dst, hashes[k]) {
			t.Fatalf("slot %d read back another block", slots[k])
		}
	}
	return wIOs, rIOs, werr, rerr
}

// TestDiskRunsMerge: slots adjacent in their file move with one pwrite
// and one pread per run (at most 1 MiB), scattered slots with one each;
// BeforeIO still sees every slot in order and fails the job at its slot.
func TestDiskRunsMerge(t *testing.T) {
	const bb = 4096 // 8 KiB slots: 128 to a 1 MiB run
	one, err := OpenDisk(DiskConfig{Dir: t.TempDir(), Slots: 512, BlockBytes: bb, Workers: 1})
	require.NoError(t, err)
	defer one.Close()
	seq := func(from, n, step int) []DiskSlot {
		s := make([]DiskSlot, n)
		for i := range s {
			s[i] = DiskSlot(from + i*step)
		}
		return s
	}
	for _, c := range []struct {
		name  string
		slots []DiskSlot
		ios   int64
	}{
		{"one run", seq(10, 64, 1), 1},
		{"two runs", append(seq(100, 5, 1), seq(300, 7, 1)...), 2},
		{"scattered", seq(0, 16, 3), 16},
		{"descending", seq(40, 4, -1), 4},
		{"longer than 1 MiB", seq(200, 300, 1), 3},
	} {
		w, r, werr, rerr := writeRead(t, one, c.slots, len(c.name))
		require.NoError(t, werr, c.name)
		require.NoError(t, rerr, c.name)
		require.Equal(t, c.ios, w, "%s: writes", c.name)
		require.Equal(t, c.ios, r, "%s: reads", c.name)
	}

	// Striped over two files: slots two apart are adjacent in a file.
	two, err := OpenDisk(DiskConfig{Dir: t.TempDir(), Files: 2, Slots: 64, BlockBytes: bb, Workers: 1})
	require.NoError(t, err)
	defer two.Close()
	w, r, werr, rerr := writeRead(t, two, seq(4, 8, 2), 7)
	require.NoError(t, errors.Join(werr, rerr))
	require.Equal(t, []int64{1, 1}, []int64{w, r})
	w, r, werr, rerr = writeRead(t, two, seq(4, 8, 1), 8)
	require.NoError(t, errors.Join(werr, rerr))
	require.Equal(t, []int64{2, 2}, []int64{w, r}, "consecutive slots alternate files: one run per file")
	w, _, werr, _ = writeRead(t, two, []DiskSlot{9, 2, 7, 4}, 10)
	require.NoError(t, werr)
	require.Equal(t, int64(2), w, "2 and 4 follow each other in file 0, 7 and 9 in file 1, in any order given")
	w, _, werr, _ = writeRead(t, two, []DiskSlot{1, 6, 11, 0}, 11)
	require.NoError(t, werr)
	require.Equal(t, int64(4), w, "no two of them adjacent in their file")

	// BeforeIO sees every slot of a run, and its error stops the job
	// there: nothing of that run is written.
	var seen []DiskSlot
	boom := errors.New("injected")
	hooked, err := OpenDisk(DiskConfig{Dir: t.TempDir(), Slots: 64, BlockBytes: bb, Workers: 1,
		BeforeIO: func(write bool, s DiskSlot) error {
			seen = append(seen, s)
			if write && s == 13 {
				return fmt.Errorf("slot %d: %w", s, boom)
			}
			return nil
		}})
	require.NoError(t, err)
	defer hooked.Close()
	w, _, werr, _ = writeRead(t, hooked, seq(10, 6, 1), 9)
	require.ErrorIs(t, werr, boom)
	require.Zero(t, w)
	require.Equal(t, seq(10, 4, 1), seen)
}

// BenchmarkDiskRuns writes and reads back 256 blocks of 4 KiB (8 KiB
// slots) on one worker, to slots adjacent in the file (runs of at most
// 1 MiB: 2 I/Os each way) and to scattered slots (one I/O per slot), in
// the same run: MB/s of blocks moved, and I/Os per call.
func BenchmarkDiskRuns(b *testing.B) {
	const n, bb = 256, 4096
	d, err := OpenDisk(DiskConfig{Dir: b.TempDir(), Slots: 4 * n, BlockBytes: bb, Workers: 1})
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	nop := func(*kvlease.Transfer) error { return nil }
	for _, layout := range []string{"contiguous", "scattered"} {
		b.Run(layout, func(b *testing.B) {
			writes, reads := make([]SlotWrite, n), make([]SlotRead, n)
			for k := range n {
				s := DiskSlot(k)
				if layout == "scattered" {
					s = DiskSlot(4*k + k%3) // never adjacent
				}
				h := kvlease.BlockHash(k + 1)
				writes[k] = SlotWrite{Src: make([]byte, bb), Dst: s, Hash: h}
				reads[k] = SlotRead{Src: s, Dst: make([]byte, bb), Hash: h}
			}
			b.SetBytes(2 * n * bb)
			before := d.IOs()
			for b.Loop() {
				for _, tr := range []func() (*kvlease.Transfer, error){
					func() (*kvlease.Transfer, error) { return d.Write(writes, nop) },
					func() (*kvlease.Transfer, error) { return d.Read(reads, nop) },
				} {
					t, err := tr()
					if err != nil {
						b.Fatal(err)
					}
					<-t.Done()
					if t.Err() != nil {
						b.Fatal(t.Err())
					}
				}
			}
			b.ReportMetric(float64(d.IOs()-before)/float64(2*b.N), "IOs/call")
		})
	}
}

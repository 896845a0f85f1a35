package gpu

import (
	"fmt"
	"math/rand/v2"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/kvlease/kvlease"
)

// TestGatherKernel: scattered device-to-device copies run through the
// gather kernel (the PTX on a GPU, the fake's CPU gather through the cgo
// path, the fallback's emulation of its table) and land byte for byte;
// blocks larger than a chunk and merged runs span several descriptors; a
// single contiguous copy stays on the copy engine.
func TestGatherKernel(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		for _, bb := range []int{256, 4096, gatherChunk, 3*gatherChunk + 512} {
			t.Run(fmt.Sprint(bb), func(t *testing.T) {
				const blocks = 24
				r := newRig(t, d, blocks, bb)
				rng := rand.New(rand.NewPCG(uint64(bb), 7))
				src := make([]byte, blocks*bb)
				fillRandom(rng, src)
				noErr(t, d.CopyFromHost(r.dev.Base(), src))
				before := make([]byte, blocks*bb)
				fillRandom(rng, before)
				noErr(t, d.CopyFromHost(r.dev2.Base(), before))

				// dev block perm[i] → dev2 block i for i < 20, with 3..6 → 10..13
				// adjacent on both sides (one run of four blocks); dev2 blocks
				// 20..23 are not written.
				perm := rng.Perm(blocks)
				for i := 10; i < 14; i++ {
					perm[i] = i - 7
				}
				var pairs []cp[DevicePtr, DevicePtr]
				seen := map[int]bool{}
				for i := range 20 {
					p := perm[i]
					if i < 10 || i >= 14 {
						for p = perm[i]; seen[p] || (p >= 3 && p <= 6); p = (p + 1) % blocks {
						}
					}
					seen[p] = true
					perm[i] = p
					pairs = append(pairs, pair(r.dev.Region(kvlease.BlockID(p)), r.dev2.Region(kvlease.BlockID(i))))
				}
				runs := 0 // a pair extends the previous run when both sides are adjacent
				for i := range 20 {
					if i == 0 || perm[i] != perm[i-1]+1 {
						runs++
					}
				}
				if runs > 20-3 {
					t.Fatalf("%d runs: the four adjacent pairs did not merge", runs)
				}
				st0 := d.CopyStats()
				tr, err := r.e.DeviceToDevice().Start(pairs, noAttach)
				noErr(t, err)
				waitDone(t, tr)
				noErr(t, tr.Err())
				got := readDev(t, d, r.dev2.Base(), blocks*bb)
				for i := range blocks {
					want := before[i*bb : (i+1)*bb]
					if i < 20 {
						want = src[perm[i]*bb : (perm[i]+1)*bb]
					}
					eq(t, want, got[i*bb:(i+1)*bb], "dev2 block %d", i)
				}
				st := d.CopyStats()
				noErr(t, st.KernelErr)
				eq(t, true, st.KernelEnabled)
				eq(t, [2]int64{1, int64(runs)}, [2]int64{st.KernelLaunches - st0.KernelLaunches, st.KernelCopies - st0.KernelCopies}, "kernel launches, copies: %v", st)

				// One contiguous run: the copy engine, not the kernel.
				tr, err = r.e.DeviceToDevice().Start([]cp[DevicePtr, DevicePtr]{
					pair(r.dev.Region(0), r.dev2.Region(20)), pair(r.dev.Region(1), r.dev2.Region(21)),
				}, noAttach)
				noErr(t, err)
				waitDone(t, tr)
				eq(t, src[:2*bb], readDev(t, d, r.dev2.Region(20), 2*bb))
				st2 := d.CopyStats()
				eq(t, st.KernelLaunches, st2.KernelLaunches, "a contiguous copy launched the kernel")
				eq(t, st.LoopedSubmits+1, st2.LoopedSubmits)
			})
		}
	})
}

// TestGatherOff: with the kernel turned off, scattered device-to-device
// copies go through the copy engine and are counted there.
func TestGatherOff(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		r := newRig(t, d, 8, 256)
		setKernel(d, false)
		defer setKernel(d, true)
		st0 := d.CopyStats()
		tr, err := r.e.DeviceToDevice().Start([]cp[DevicePtr, DevicePtr]{
			pair(r.dev.Region(5), r.dev2.Region(0)), pair(r.dev.Region(1), r.dev2.Region(4)),
		}, noAttach)
		noErr(t, err)
		waitDone(t, tr)
		noErr(t, tr.Err())
		st := d.CopyStats()
		eq(t, st0.KernelLaunches, st.KernelLaunches)
		eq(t, st0.BatchedCopies+st0.LoopedCopies+2, st.BatchedCopies+st.LoopedCopies, "copies by the copy engine: %v", st)
		isFalse(t, st.KernelEnabled)
	})
}

func TestGatherDescs(t *testing.T) {
	a := &arena{addr: 1 << 20, blocks: 64, blockBytes: gatherChunk}
	b := &arena{addr: 1 << 30, blocks: 64, blockBytes: gatherChunk}
	ops := []copyOp{
		{src: a, dst: b, srcOff: 0, dstOff: 5 * gatherChunk, n: 256},
		{src: a, dst: b, srcOff: gatherChunk, dstOff: 0, n: 2*gatherChunk + 512},
	}
	eq(t, 4, gatherDescCount(ops))
	table := make([]gatherDesc, 4)
	fillGatherDescs(table, ops)
	want := []gatherDesc{
		{src: 1 << 20, dst: 1<<30 + 5*gatherChunk, n: 256},
		{src: 1<<20 + gatherChunk, dst: 1 << 30, n: gatherChunk},
		{src: 1<<20 + 2*gatherChunk, dst: 1<<30 + gatherChunk, n: gatherChunk},
		{src: 1<<20 + 3*gatherChunk, dst: 1<<30 + 2*gatherChunk, n: 512},
	}
	eq(t, want, table)
}

// TestGatherPTX lints the embedded kernel as far as Go can without a JIT:
// the header a conservative driver accepts, the entry and its two
// parameters, balanced braces, every register used declared, every branch
// target defined, every statement terminated.
func TestGatherPTX(t *testing.T) {
	ptx := gatherPTX
	for _, want := range []string{".version 7.0\n", ".target sm_70\n", ".address_size 64\n",
		".visible .entry " + gatherEntry + "(", ".maxntid 256, 1, 1", "\tret;\n"} {
		if !strings.Contains(ptx, want) {
			t.Fatalf("PTX lacks %q", want)
		}
	}
	eq(t, gatherParams, strings.Count(ptx, ".param ."), "parameters")
	eq(t, strings.Count(ptx, "{"), strings.Count(ptx, "}"), "braces")
	eq(t, 256, gatherThreads)
	eq(t, 32, gatherDescBytes)

	decl := map[string]int{}
	for _, m := range regexp.MustCompile(`\.reg \.\w+\s+%(\w+)<(\d+)>;`).FindAllStringSubmatch(ptx, -1) {
		decl[m[1]], _ = strconv.Atoi(m[2])
	}
	eq(t, 3, len(decl), "register classes %v", decl)
	for _, m := range regexp.MustCompile(`%(rd|r|p)(\d+)\b`).FindAllStringSubmatch(ptx, -1) {
		n, _ := strconv.Atoi(m[2])
		if max, ok := decl[m[1]]; !ok || n >= max {
			t.Errorf("register %%%s%s not declared (%v)", m[1], m[2], decl)
		}
	}
	labels := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^(\w+):$`).FindAllStringSubmatch(ptx, -1) {
		labels[m[1]] = true
	}
	for _, m := range regexp.MustCompile(`bra(?:\.uni)?\s+(\w+);`).FindAllStringSubmatch(ptx, -1) {
		if !labels[m[1]] {
			t.Errorf("branch to undefined label %s", m[1])
		}
	}
	body := ptx[strings.Index(ptx, "{\n")+2 : strings.LastIndex(ptx, "}")]
	for _, line := range strings.Split(body, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasSuffix(line, ":") || strings.HasPrefix(line, "//") {
			continue
		}
		if !strings.HasSuffix(line, ";") {
			t.Errorf("statement not terminated: %q", line)
		}
	}
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

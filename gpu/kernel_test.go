package gpu

import (
	"fmt"
	"math/rand/v2"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
)

// paths are the engine options the path-parametrized tests run under.
var paths = []struct {
	name string
	opt  EngineOption
}{
	{"auto", WithPath(PathAuto)},
	{"copyengine", WithPath(PathCopyEngine)},
	{"kernel", WithPath(PathKernel)},
}

// scatterCase copies perm-scattered blocks of bb bytes in direction kind
// through r's engine and checks every destination block, written or not.
// Destination blocks 0..n-1 receive source blocks perm[0..n-1]; blocks 3..6
// of the source go to 10..13, adjacent on both sides (one merged copy).
func scatterCase(t *testing.T, r *rig, kind copyKind, n int) (runs int) {
	t.Helper()
	d, bb, blocks := r.d, r.bb, r.blocks
	rng := rand.New(rand.NewPCG(uint64(bb), uint64(kind)+7))
	src := make([]byte, blocks*bb)
	fillRandom(rng, src)
	before := make([]byte, blocks*bb)
	fillRandom(rng, before)
	// Sources: dev (device) or pin (host); destinations: dev2, or pin2.
	switch kind {
	case hostToDevice:
		copy(r.pin.a.host, src)
		noErr(t, d.CopyFromHost(r.dev2.Base(), before))
	case deviceToHost:
		noErr(t, d.CopyFromHost(r.dev.Base(), src))
		copy(r.pin2.a.host, before)
	default:
		noErr(t, d.CopyFromHost(r.dev.Base(), src))
		noErr(t, d.CopyFromHost(r.dev2.Base(), before))
	}
	perm := rng.Perm(blocks)
	for i := 10; i < 14; i++ {
		perm[i] = i - 7
	}
	seen := map[int]bool{}
	for i := range n {
		p := perm[i]
		if i < 10 || i >= 14 {
			for ; seen[p] || (p >= 3 && p <= 6); p = (p + 1) % blocks {
			}
		}
		seen[p] = true
		perm[i] = p
	}
	for i := range n {
		if i == 0 || perm[i] != perm[i-1]+1 {
			runs++
		}
	}
	id := func(i int) kvlease.BlockID { return kvlease.BlockID(i) }
	var (
		tr  *kvlease.Transfer
		err error
	)
	switch kind {
	case hostToDevice:
		pairs := make([]cp[[]byte, DevicePtr], n)
		for i := range pairs {
			pairs[i] = pair(r.pin.Region(id(perm[i])), r.dev2.Region(id(i)))
		}
		tr, err = r.e.HostToDevice().Start(pairs, noAttach)
	case deviceToHost:
		pairs := make([]cp[DevicePtr, []byte], n)
		for i := range pairs {
			pairs[i] = pair(r.dev.Region(id(perm[i])), r.pin2.Region(id(i)))
		}
		tr, err = r.e.DeviceToHost().Start(pairs, noAttach)
	default:
		pairs := make([]cp[DevicePtr, DevicePtr], n)
		for i := range pairs {
			pairs[i] = pair(r.dev.Region(id(perm[i])), r.dev2.Region(id(i)))
		}
		tr, err = r.e.DeviceToDevice().Start(pairs, noAttach)
	}
	noErr(t, err)
	waitDone(t, tr)
	noErr(t, tr.Err())
	var got []byte
	if kind == deviceToHost {
		got = append([]byte(nil), r.pin2.a.host...)
	} else {
		got = readDev(t, d, r.dev2.Base(), blocks*bb)
	}
	for i := range blocks {
		want := before[i*bb : (i+1)*bb]
		if i < n {
			want = src[perm[i]*bb : (perm[i]+1)*bb]
		}
		eq(t, want, got[i*bb:(i+1)*bb], "destination block %d", i)
	}
	return runs
}

// TestKernelCopies: scattered copies in every direction on every path
// land byte for byte, the blocks around them untouched; warp pieces (up
// to 8 KiB), CTA pieces of one chunk and pieces of several chunks all
// run; the kernel path is one launch per Start, counted in CopyStats.
func TestKernelCopies(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		for _, bb := range []int{256, 4096, warpMaxBytes, warpMaxBytes + 4096, kernelChunk, 2*kernelChunk + 256} {
			for _, p := range paths {
				if p.name == "auto" && bb != 4096 && bb != 2*kernelChunk+256 {
					continue // the forced paths cover the rest; auto picks one of them
				}
				t.Run(fmt.Sprintf("%d/%s", bb, p.name), func(t *testing.T) {
					blocks := 24
					if bb > kernelChunk {
						blocks = 21 // the copy needs 20
					}
					r := newRig(t, d, blocks, bb, p.opt)
					for kind := range kindNames {
						st0 := d.CopyStats()
						runs := scatterCase(t, r, copyKind(kind), 20)
						if runs > 20-3 {
							t.Fatalf("%d runs: the four adjacent pairs did not merge", runs)
						}
						st := d.CopyStats()
						launches, copies := st.KernelLaunches-st0.KernelLaunches, st.KernelCopies-st0.KernelCopies
						wantKernel := p.name == "kernel" || (p.name == "auto" && bb <= 64<<10)
						if !wantKernel {
							eq(t, [2]int64{0, 0}, [2]int64{launches, copies}, "%s: kernel launches, copies: %v", kindNames[kind], st)
							continue
						}
						noErr(t, st.KernelErr)
						eq(t, [2]int64{1, int64(runs)}, [2]int64{launches, copies}, "%s: kernel launches, copies: %v", kindNames[kind], st)
					}
				})
			}
		}
	})
}

// TestKernelSingleCopy: one contiguous copy takes the copy engine on
// PathAuto (one DMA at the link's speed, no SM) and the kernel on
// PathKernel.
func TestKernelSingleCopy(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		for _, p := range paths {
			t.Run(p.name, func(t *testing.T) {
				r := newRig(t, d, 4, 4096, p.opt)
				want := make([]byte, 2*4096)
				fillRandom(rand.New(rand.NewPCG(1, 1)), want)
				copy(r.pin.a.host, want)
				st0 := d.CopyStats()
				tr, err := r.e.HostToDevice().Start([]cp[[]byte, DevicePtr]{
					pair(r.pin.Region(0), r.dev.Region(2)), pair(r.pin.Region(1), r.dev.Region(3)),
				}, noAttach)
				noErr(t, err)
				waitDone(t, tr)
				noErr(t, tr.Err())
				eq(t, want, readDev(t, d, r.dev.Region(2), 2*4096))
				launches := d.CopyStats().KernelLaunches - st0.KernelLaunches
				eq(t, int64(map[string]int{"kernel": 1}[p.name]), launches, "kernel launches for one merged copy")
			})
		}
	})
}

// TestKernelTable: ops become CTA items (chunks of at most kernelChunk of
// pieces above warpMaxBytes) first, then warp items (whole pieces up to
// warpMaxBytes), by device address: a pinned arena's mapped address, not
// its host address.
func TestKernelTable(t *testing.T) {
	dev := &arena{addr: 1 << 30, dptr: 1 << 30, blocks: 64, blockBytes: 256}
	pin := &arena{addr: 0x7f00_0000_0000, dptr: 1 << 40, blocks: 64, blockBytes: 256}
	ops := []copyOp{
		{src: pin, dst: dev, srcOff: 0, dstOff: 4096, n: 256},
		{src: pin, dst: dev, srcOff: 1 << 20, dstOff: 0, n: 2*kernelChunk + 512},
		{src: pin, dst: dev, srcOff: 8192, dstOff: 1 << 21, n: warpMaxBytes},
		{src: pin, dst: dev, srcOff: 1 << 22, dstOff: 1 << 23, n: warpMaxBytes + 256},
	}
	ncta, nwarp, warpBytes := kernelItems(ops)
	eq(t, [3]int{4, 2, 256 + warpMaxBytes}, [3]int{ncta, nwarp, warpBytes}, "CTA items, warp items, warp bytes")
	table := make([]kernelDesc, ncta+nwarp)
	fillKernelTable(table, ops, ncta)
	want := []kernelDesc{
		{src: 1<<40 + 1<<20, dst: 1 << 30, n: kernelChunk},
		{src: 1<<40 + 1<<20 + kernelChunk, dst: 1<<30 + kernelChunk, n: kernelChunk},
		{src: 1<<40 + 1<<20 + 2*kernelChunk, dst: 1<<30 + 2*kernelChunk, n: 512},
		{src: 1<<40 + 1<<22, dst: 1<<30 + 1<<23, n: warpMaxBytes + 256},
		{src: 1 << 40, dst: 1<<30 + 4096, n: 256},
		{src: 1<<40 + 8192, dst: 1<<30 + 1<<21, n: warpMaxBytes},
	}
	eq(t, want, table)
}

// TestKernelGrid: host↔device launches stay within the CTA budget (16 by
// default: no more CTAs than items), warp-only launches of small pieces
// may use up to four times as many, device-to-device launches are sized by
// the SM count.
func TestKernelGrid(t *testing.T) {
	for _, c := range []struct {
		kind                   copyKind
		ncta, nwarp, warpBytes int
		ctas, sms, want        int
	}{
		{hostToDevice, 16384, 0, 0, 16, 132, 16},                // 16 KiB pieces: the default grid
		{deviceToHost, 4, 0, 0, 16, 132, 4},                     // fewer items than CTAs
		{hostToDevice, 0, 1024, 1024 * 4096, 16, 132, 16},       // 4 KiB warp pieces: a full warp round each
		{hostToDevice, 0, 1024, 1024 * 1024, 16, 132, 32},       // 1 KiB: twice the CTAs
		{hostToDevice, 0, 4096, 4096 * 256, 16, 132, 64},        // 256 B: at most four times
		{hostToDevice, 0, 20, 20 * 256, 16, 132, 3},             // 20 warp items: 3 CTAs of 8 warps
		{hostToDevice, 10, 1000, 1000 * 1024, 16, 132, 16},      // mixed: the budget
		{deviceToDevice, 16384, 0, 0, 16, 132, 132 * 4},         // HBM: SMs × 4
		{deviceToDevice, 16384, 0, 0, 16, 0, 512},               // SM count unknown
		{deviceToHost, 100, 0, 0, 1, 132, 1},                    // WithKernelCTAs(1)
		{deviceToDevice, 0, 8, 8 * 256, 16, 132, 1},             // one CTA holds 8 warps
		{hostToDevice, 0, 1, 256, 16, 132, 1},                   // never 0
		{deviceToHost, 0, 100000, 100000 * 8192, 64, 132, 64},   // WithKernelCTAs(64), large warp pieces
		{deviceToHost, 0, 100000, 100000 * 512, 64, 132, 256},   // and small ones
		{hostToDevice, 0, 100000, 100000 * 2048, 16, 132, 16},   // 2 KiB: a full round already
		{hostToDevice, 0, 100000, 100000 * 1536, 16, 132, 32},   // 1.5 KiB
		{deviceToDevice, 5, 0, 0, 16, 132, 5},                   // few items
		{deviceToDevice, 0, 100000, 100000 * 256, 16, 132, 528}, // small pieces on the device: SMs × 4
	} {
		got := kernelGrid(c.kind, c.ncta, c.nwarp, c.warpBytes, c.ctas, c.sms)
		eq(t, c.want, got, "%s ncta %d nwarp %d warp bytes %d budget %d SMs %d", kindNames[c.kind], c.ncta, c.nwarp, c.warpBytes, c.ctas, c.sms)
	}
	eq(t, 16, defaultEngineConfig().ctas)
	e := engineConfig{}
	WithKernelCTAs(0)(&e)
	eq(t, 1, e.ctas)
}

// TestKernelPTX lints the embedded kernel as far as Go can without a JIT:
// the header a conservative driver accepts; the entry and its parameter
// list (a .u64 table and two .u32 counts, in that order, read with the
// matching ld.param); .maxntid equal to the launch's threads; balanced
// braces; three register classes, every register used declared; every
// branch target defined, every label used; every statement terminated;
// the loop shape (each copy loop tests its offset against the length
// before any load, its loads and stores guarded by the same bounds, four
// vectors a round, and a back edge to its head); the warp phase's
// broadcast a full-warp shfl.sync; loads read-only (ld.global.nc) and
// no store outside the two copy loops.
func TestKernelPTX(t *testing.T) {
	ptx := kernelPTX
	for _, want := range []string{".version 7.0\n", ".target sm_70\n", ".address_size 64\n",
		".visible .entry " + kernelEntry + "(\n", fmt.Sprintf(".maxntid %d, 1, 1\n", kernelThreads), "\tret;\n"} {
		if !strings.Contains(ptx, want) {
			t.Fatalf("PTX lacks %q", want)
		}
	}
	eq(t, 1, strings.Count(ptx, ".entry "), "entries")
	params := regexp.MustCompile(`\.param \.(\w+) (\w+)`).FindAllStringSubmatch(ptx, -1)
	eq(t, kernelParams, len(params), "parameters")
	for i, want := range []string{"u64", "u32", "u32"} {
		eq(t, want, params[i][1], "parameter %d's type", i)
		if !strings.Contains(ptx, fmt.Sprintf("ld.param.%s \t", want)) || !strings.Contains(ptx, "["+params[i][2]+"]") {
			t.Errorf("parameter %s is never loaded as .%s", params[i][2], want)
		}
	}
	eq(t, strings.Count(ptx, "{"), strings.Count(ptx, "}"), "braces")
	eq(t, 256, kernelThreads)
	eq(t, 32, descBytes)
	eq(t, 0, kernelChunk%(kernelThreads*16), "a chunk is whole CTA passes")
	eq(t, 0, warpMaxBytes%(32*16), "a warp piece is whole warp passes")

	decl := map[string]int{}
	for _, m := range regexp.MustCompile(`\.reg \.\w+\s+%(\w+)<(\d+)>;`).FindAllStringSubmatch(ptx, -1) {
		decl[m[1]], _ = strconv.Atoi(m[2])
	}
	eq(t, 3, len(decl), "register classes %v", decl)
	for _, m := range regexp.MustCompile(`%(rd|r|p)(\d+)\b`).FindAllStringSubmatch(ptx, -1) {
		n, _ := strconv.Atoi(m[2])
		if limit, ok := decl[m[1]]; !ok || n >= limit {
			t.Errorf("register %%%s%s not declared (%v)", m[1], m[2], decl)
		}
	}
	labels := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^(\w+):$`).FindAllStringSubmatch(ptx, -1) {
		labels[m[1]] = true
	}
	used := map[string]bool{}
	for _, m := range regexp.MustCompile(`bra(?:\.uni)?\s+(\w+);`).FindAllStringSubmatch(ptx, -1) {
		used[m[1]] = true
		if !labels[m[1]] {
			t.Errorf("branch to undefined label %s", m[1])
		}
	}
	for l := range labels {
		if !used[l] && l != "CTA_ITEM" && l != "W_ROUND" && l != "W_ITEM" {
			t.Errorf("label %s is never branched to", l)
		}
	}
	body := ptx[strings.Index(ptx, "{\n")+2 : strings.LastIndex(ptx, "}")]
	var lines []string
	for _, line := range strings.Split(body, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "//") {
			continue
		}
		lines = append(lines, line)
		if !strings.HasSuffix(line, ":") && !strings.HasSuffix(line, ";") {
			t.Errorf("statement not terminated: %q", line)
		}
	}

	// The copy loops: between the label and the back edge, a bounds check
	// first, then four loads and four stores, the first unguarded (the
	// check covered it), the others each guarded by a predicate set by a
	// setp.lt.u64 against the same length.
	for _, loop := range []string{"CTA_COPY", "W_COPY"} {
		start := slicesIndex(lines, loop+":")
		if start < 0 {
			t.Fatalf("no loop %s", loop)
		}
		end := start + 1
		for end < len(lines) && lines[end] != "bra.uni \t"+loop+";" {
			end++
		}
		if end == len(lines) {
			t.Fatalf("loop %s has no back edge", loop)
		}
		body := lines[start+1 : end]
		check := regexp.MustCompile(`^setp\.lt\.u64 \t(%p\d+), (%rd\d+), (%rd\d+);$`).FindStringSubmatch(body[0])
		if check == nil || body[1] != "@!"+check[1]+" bra \t"+strings.TrimSuffix(map[string]string{"CTA_COPY": "CTA_NEXT", "W_COPY": "W_DONE"}[loop], "")+";" {
			t.Fatalf("loop %s does not begin with its bounds check: %q", loop, body[:2])
		}
		length := check[3]
		guards := map[string]bool{}
		for _, l := range body {
			if m := regexp.MustCompile(`^setp\.lt\.u64 \t(%p\d+), %rd\d+, ` + regexp.QuoteMeta(length) + `;$`).FindStringSubmatch(l); m != nil {
				guards[m[1]] = true
			}
		}
		eq(t, 4, len(guards), "loop %s: bounds predicates", loop)
		var loads, stores []string
		for _, l := range body {
			switch {
			case strings.Contains(l, "ld.global"):
				loads = append(loads, l)
			case strings.Contains(l, "st.global"):
				stores = append(stores, l)
			}
		}
		eq(t, 4, len(loads), "loop %s loads", loop)
		eq(t, 4, len(stores), "loop %s stores", loop)
		for i := range 4 {
			for _, l := range []string{loads[i], stores[i]} {
				g := regexp.MustCompile(`^@(%p\d+) `).FindStringSubmatch(l)
				switch {
				case i == 0 && g != nil:
					t.Errorf("loop %s: first vector guarded: %q", loop, l)
				case i > 0 && (g == nil || !guards[g[1]] || g[1] == check[1]):
					t.Errorf("loop %s: vector %d not guarded by a bounds predicate: %q", loop, i, l)
				}
			}
			if !strings.Contains(loads[i], "ld.global.nc.v4.u32") || !strings.Contains(stores[i], "st.global.v4.u32") {
				t.Errorf("loop %s: not 16-byte vectors: %q %q", loop, loads[i], stores[i])
			}
		}
	}
	eq(t, 8, strings.Count(ptx, "st.global"), "stores outside the copy loops")
	eq(t, strings.Count(ptx, "ld.global"), strings.Count(ptx, "ld.global.nc"), "every load read-only")
	eq(t, 5, strings.Count(ptx, "shfl.sync.idx.b32"), "the warp phase broadcasts src, dst (two halves each) and length")
	eq(t, 5, strings.Count(ptx, ", 31, 0xffffffff;"), "every shuffle spans the full warp")
	for _, want := range []string{"mul.wide.u32 \t%rd6, %r7, 32;", "mul.wide.u32 \t%rd11, %r8, 32;", "mul.wide.u32 \t%rd36, %r31, 32;",
		"setp.ge.u32 \t%p1, %r7, %r1;", "setp.lt.u32 \t%p2, %r8, %r1;", "setp.ge.u32 \t%p8, %r28, %r2;", "setp.lt.u32 \t%p9, %r31, %r2;"} {
		if !strings.Contains(ptx, want) {
			t.Errorf("PTX lacks the table indexing or item bound %q", want)
		}
	}
}

func slicesIndex(lines []string, s string) int {
	for i, l := range lines {
		if l == s {
			return i
		}
	}
	return -1
}

// heldDevices runs f on devices whose streams can be held (nothing they
// hold runs) through hold(true), and let go with hold(false): the
// fallback with a gate, and in cgo builds the fake driver with a hold
// file. Held from the start. With sticky, f leaves the device failed: it
// is not closed (it cannot be, as after a real sticky error).
func heldDevices(t *testing.T, sticky bool, f func(t *testing.T, d *Device, hold func(bool))) {
	t.Run("host", func(t *testing.T) {
		gate := make(chan struct{})
		d := OpenHost(func(c *hostConfig) { c.gate = gate })
		fixedCalibration(d)
		if !sticky {
			t.Cleanup(func() { noErr(t, d.Close()) })
		}
		stop := make(chan struct{})
		var wg sync.WaitGroup
		var mu sync.Mutex
		held := true
		wg.Add(1)
		go func() { // feeds the gate while not held
			defer wg.Done()
			for {
				mu.Lock()
				h := held
				mu.Unlock()
				if h {
					select {
					case <-stop:
						return
					case <-time.After(100 * time.Microsecond):
					}
					continue
				}
				select {
				case gate <- struct{}{}:
				case <-stop:
					return
				}
			}
		}()
		t.Cleanup(func() { close(stop); wg.Wait() })
		f(t, d, func(h bool) { mu.Lock(); held = h; mu.Unlock() })
	})
	if fakeHold == nil {
		return
	}
	t.Run("fakecuda", func(t *testing.T) {
		d, hold := fakeHold(t, sticky)
		f(t, d, hold)
	})
}

// fakeHold opens a fake driver whose streams can be held (cgo builds).
var fakeHold func(t *testing.T, sticky bool) (*Device, func(bool))

// TestRingReusedOnlyAfterEvent: a descriptor slot is never handed out
// again before the event of the submission that used it has completed.
// With the first launch held back (its table not read yet), a second
// kernel copy that would need its slot takes the copy engine instead
// (RingFull); once the first completes, the third reuses the slot. Each
// copy's bytes land where its own table said: a table overwritten early
// would send the first copy's blocks to the second's places.
func TestRingReusedOnlyAfterEvent(t *testing.T) {
	heldDevices(t, false, func(t *testing.T, d *Device, hold func(bool)) {
		const blocks, bb, n = 32, 1024, 8
		r := newRig(t, d, blocks, bb, WithPath(PathKernel), withRingDescs(12))
		rng := rand.New(rand.NewPCG(5, 5))
		fillRandom(rng, r.pin.a.host)
		start := func(from, to int) *kvlease.Transfer {
			pairs := make([]cp[[]byte, DevicePtr], n)
			for i := range pairs {
				pairs[i] = pair(r.pin.Region(kvlease.BlockID(from+2*i)), r.dev.Region(kvlease.BlockID(to+2*i)))
			}
			tr, err := r.e.HostToDevice().Start(pairs, noAttach)
			noErr(t, err)
			return tr
		}
		check := func(from, to int) {
			t.Helper()
			for i := range n {
				eq(t, r.pin.Region(kvlease.BlockID(from+2*i)), readDev(t, d, r.dev.Region(kvlease.BlockID(to+2*i)), bb), "block %d", to+2*i)
			}
		}
		hold(true)
		st0 := d.CopyStats()
		t1 := start(0, 0) // slot [0, 8)
		t2 := start(1, 1) // 8 more do not fit a ring of 12 while t1 is in flight
		st2 := d.CopyStats()
		eq(t, kvlease.TransferPending, t1.State())
		hold(false)
		waitDone(t, t1)
		waitDone(t, t2)
		noErr(t, t1.Err())
		noErr(t, t2.Err())
		check(0, 0)
		check(1, 1)
		eq(t, [2]int64{1, 1}, [2]int64{st2.KernelLaunches - st0.KernelLaunches, st2.RingFull - st0.RingFull}, "launches, ring full: %v", st2)
		// Everything completed: the ring is free again, from its start.
		t3 := start(16, 16)
		waitDone(t, t3)
		noErr(t, t3.Err())
		check(16, 16)
		st := d.CopyStats()
		eq(t, [2]int64{2, 1}, [2]int64{st.KernelLaunches - st0.KernelLaunches, st.RingFull - st0.RingFull}, "%v", st)
	})
}

// TestRingWraps: many kernel copies through a ring a few tables long,
// some in flight together, wrap around it again and again; every copy
// lands, and tables never straddle the end of the ring.
func TestRingWraps(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		const blocks, bb = 64, 512
		r := newRig(t, d, blocks, bb, WithPath(PathKernel), withRingDescs(20))
		rng := rand.New(rand.NewPCG(8, 9))
		for round := range 40 {
			fillRandom(rng, r.pin.a.host)
			var trs []*kvlease.Transfer
			var sets [][]cp[[]byte, DevicePtr]
			perm := rng.Perm(blocks)
			k := 0
			for range 3 { // three copies in flight: 7 + 7 + 7 > 20 at times
				n := 3 + rng.IntN(5)
				pairs := make([]cp[[]byte, DevicePtr], n)
				for i := range pairs {
					pairs[i] = pair(r.pin.Region(kvlease.BlockID(perm[k])), r.dev.Region(kvlease.BlockID(perm[k+1])))
					k += 2
				}
				tr, err := r.e.HostToDevice().Start(pairs, noAttach)
				noErr(t, err)
				trs = append(trs, tr)
				sets = append(sets, pairs)
			}
			for i, tr := range trs {
				waitDone(t, tr)
				noErr(t, tr.Err())
				for _, p := range sets[i] {
					eq(t, p.Src, readDev(t, d, p.Dst, bb), "round %d", round)
				}
			}
		}
		st := d.CopyStats()
		if st.KernelLaunches < 40 {
			t.Fatalf("only %d launches: %v", st.KernelLaunches, st)
		}
		eq(t, r.e.ring.head, r.e.ring.tail.Load(), "everything released")
	})
}

// TestRingReserve walks the ring's arithmetic: slots are contiguous,
// skip the ring's end, refuse what does not fit behind the tail, and undo.
func TestRingReserve(t *testing.T) {
	var r descRing
	mem := make([]byte, 10*descBytes)
	r.init(mem, 1000)
	s, addr, end, ok := r.reserve(4)
	eq(t, [3]uint64{4, 1000, 4}, [3]uint64{uint64(len(s)), addr, end})
	isFalse(t, !ok)
	_, addr, end, ok = r.reserve(4)
	eq(t, [2]uint64{1000 + 4*descBytes, 8}, [2]uint64{addr, end})
	isFalse(t, !ok)
	_, _, _, ok = r.reserve(4) // 8..12 wraps: skip to 10 = 0, but 0..4 is in flight
	isFalse(t, ok, "overwrote a slot in flight")
	_, _, _, ok = r.reserve(11)
	isFalse(t, ok, "larger than the ring")
	r.release(4) // the first completed: its slot is free, the second's not
	prev := r.head
	s, addr, end, ok = r.reserve(4) // skips 8..10, takes 0..4 again
	eq(t, [3]uint64{4, 1000, 14}, [3]uint64{uint64(len(s)), addr, end})
	isFalse(t, !ok)
	_, _, _, ok = r.reserve(1)
	isFalse(t, ok, "4..8 is still in flight")
	r.unreserve() // the 0..4 submission enqueued nothing
	eq(t, prev, r.head)
	_, addr, end, ok = r.reserve(2) // 8..10 fits without a skip
	eq(t, [2]uint64{1000 + 8*descBytes, 10}, [2]uint64{addr, end})
	isFalse(t, !ok)

	// Nothing in flight at position 3: a table of 8 (more than fits
	// before the end, more than 3) still goes in, from the start.
	var e descRing
	e.init(make([]byte, 10*descBytes), 1000)
	_, _, end, _ = e.reserve(3)
	e.release(end)
	_, addr, end, ok = e.reserve(8)
	isFalse(t, !ok, "an empty ring refused a table that fits it")
	eq(t, [2]uint64{1000, 18}, [2]uint64{addr, end})
}

// TestPathChoice: PathAuto follows the calibration (here fixed: the
// kernel up to 64 KiB pieces), one contiguous copy takes the copy engine,
// and forced paths ignore both.
func TestPathChoice(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		for _, c := range []struct {
			path   Path
			bb     int
			kernel bool
		}{
			{PathAuto, 16 << 10, true},
			{PathAuto, 64 << 10, true},
			{PathAuto, 256 << 10, false},
			{PathCopyEngine, 16 << 10, false},
			{PathKernel, 256 << 10, true},
		} {
			t.Run(fmt.Sprintf("%v/%d", c.path, c.bb), func(t *testing.T) {
				r := newRig(t, d, 4, c.bb, WithPath(c.path))
				eq(t, c.path, r.e.Path())
				st0 := d.CopyStats()
				tr, err := r.e.DeviceToHost().Start([]cp[DevicePtr, []byte]{
					pair(r.dev.Region(3), r.pin.Region(0)), pair(r.dev.Region(1), r.pin.Region(2)),
				}, noAttach)
				noErr(t, err)
				waitDone(t, tr)
				noErr(t, tr.Err())
				st := d.CopyStats()
				k := st.KernelLaunches - st0.KernelLaunches
				ce := st.BatchedSubmits + st.LoopedSubmits - st0.BatchedSubmits - st0.LoopedSubmits
				if c.kernel {
					eq(t, [2]int64{1, 0}, [2]int64{k, ce}, "kernel, copy engine submissions")
				} else {
					eq(t, [2]int64{0, 1}, [2]int64{k, ce}, "kernel, copy engine submissions")
				}
			})
		}
	})
}

// TestKernelCancel: on the kernel path as on the copy engine's, a cancel
// during attach keeps the copy from being enqueued (its ring slot is not
// consumed); a cancel after enqueue lets a launched kernel finish on a GPU
// and skips it whole on the fallback, whose worker had not begun it;
// either way the transfer resolves only when the stream is done with it.
func TestKernelCancel(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		r := newRig(t, d, 8, 1024, WithPath(PathKernel))
		head := r.e.ring.head
		tr, err := r.e.HostToDevice().Start([]cp[[]byte, DevicePtr]{pair(r.pin.Region(0), r.dev.Region(1)), pair(r.pin.Region(2), r.dev.Region(4))},
			func(t *kvlease.Transfer) error { t.Cancel(); return nil })
		isErr(t, err, kvlease.ErrCanceled)
		eq(t, kvlease.TransferResolved, tr.State())
		eq(t, head, r.e.ring.head, "the ring slot of a copy never enqueued")
		zero(t, r.e.Pending())
	})
	d, gate := gatedHost(t)
	r := newRig(t, d, 8, 1024, WithPath(PathKernel))
	old := readDev(t, d, r.dev.Region(1), 1024)
	fillRandom(rand.New(rand.NewPCG(3, 3)), r.pin.a.host)
	tr, err := r.e.HostToDevice().Start([]cp[[]byte, DevicePtr]{pair(r.pin.Region(0), r.dev.Region(1)), pair(r.pin.Region(2), r.dev.Region(4))}, noAttach)
	noErr(t, err)
	tr.Cancel()
	eq(t, kvlease.TransferPending, tr.State(), "a cancel is a request, not evidence")
	gate <- struct{}{}
	waitDone(t, tr)
	isErr(t, tr.Err(), kvlease.ErrCanceled)
	eq(t, old, readDev(t, d, r.dev.Region(1), 1024), "a skipped launch copied")
	eq(t, r.e.ring.head, r.e.ring.tail.Load(), "its slot is released once the worker is done")
}

// TestKernelAttachFailure: attach fails ⇒ nothing enqueued, no ring slot
// taken, the transfer resolved with attach's error, nothing pending.
func TestKernelAttachFailure(t *testing.T) {
	forEachDevice(t, func(t *testing.T, d *Device) {
		r := newRig(t, d, 8, 512, WithPath(PathKernel))
		old := readDev(t, d, r.dev.Base(), 8*512)
		fillRandom(rand.New(rand.NewPCG(4, 4)), r.pin.a.host)
		boom := fmt.Errorf("lease closed meanwhile")
		st0 := d.CopyStats()
		tr, err := r.e.HostToDevice().Start([]cp[[]byte, DevicePtr]{pair(r.pin.Region(0), r.dev.Region(3)), pair(r.pin.Region(5), r.dev.Region(1))},
			func(*kvlease.Transfer) error { return boom })
		isErr(t, err, boom)
		eq(t, kvlease.TransferResolved, tr.State())
		zero(t, r.e.Pending())
		zero(t, r.dev.Pending())
		eq(t, uint64(0), r.e.ring.head, "no slot taken")
		eq(t, st0.KernelLaunches, d.CopyStats().KernelLaunches)
		// A later copy drains the stream; the first never ran.
		tr, err = r.e.HostToDevice().Start([]cp[[]byte, DevicePtr]{pair(r.pin.Region(7), r.dev.Region(7)), pair(r.pin.Region(6), r.dev.Region(5))}, noAttach)
		noErr(t, err)
		waitDone(t, tr)
		eq(t, old[:5*512], readDev(t, d, r.dev.Base(), 5*512))
	})
}

// TestKernelStickyQuarantines: a device failure while a launch is in
// flight quarantines its transfer; its arenas stay pinned, its ring slot
// is never released, and the engine refuses more work.
func TestKernelStickyQuarantines(t *testing.T) {
	gate := make(chan struct{})
	d := OpenHost(func(c *hostConfig) { c.gate = gate })
	e, err := d.NewCopyEngine(WithPath(PathKernel))
	noErr(t, err)
	dev, err := d.AllocDevice(4, 256)
	noErr(t, err)
	pin, err := d.AllocPinned(4, 256)
	noErr(t, err)
	tr, err := e.DeviceToHost().Start([]cp[DevicePtr, []byte]{pair(dev.Region(0), pin.Region(1)), pair(dev.Region(2), pin.Region(3))}, noAttach)
	noErr(t, err)
	eq(t, int64(1), d.CopyStats().KernelLaunches)
	d.b.(*hostBackend).injectFault(ErrorIllegalAddress)
	gate <- struct{}{}
	waitState(t, tr, kvlease.TransferQuarantined)
	isErr(t, tr.Err(), ErrDeviceFailed)
	eq(t, uint64(0), e.ring.tail.Load(), "the slot of a launch never proven finished is not released")
	isErr(t, dev.Close(), ErrBusy)
	isErr(t, pin.Close(), ErrBusy)
	_, err = e.HostToDevice().Start([]cp[[]byte, DevicePtr]{pair(pin.Region(0), dev.Region(1))}, noAttach)
	isErr(t, err, ErrDeviceFailed)
	contains(t, e.Close(), "quarantined")
	isErr(t, d.Close(), ErrBusy)
}

// TestKernelFaultIsSticky: a launch whose table points outside every live
// allocation faults the context, as a real kernel would: the fallback's
// executor and the fake driver check every address of every table, read
// when the launch runs. Here the table is changed behind the engine's back
// after it was written, to the pinned arena's host address, which no
// kernel can reach (on the fake driver the device view is elsewhere).
func TestKernelFaultIsSticky(t *testing.T) {
	heldDevices(t, true, func(t *testing.T, d *Device, hold func(bool)) {
		e, err := d.NewCopyEngine(WithPath(PathKernel))
		noErr(t, err)
		dev, err := d.AllocDevice(4, 256)
		noErr(t, err)
		pin, err := d.AllocPinned(4, 256)
		noErr(t, err)
		tr, err := e.HostToDevice().Start([]cp[[]byte, DevicePtr]{pair(pin.Region(0), dev.Region(1)), pair(pin.Region(2), dev.Region(3))}, noAttach)
		noErr(t, err)
		eq(t, uint64(256), e.ring.descs[0].n, "the table's first item is a 256-byte warp piece")
		e.ring.descs[0].src = pin.a.addr
		hold(false)
		waitState(t, tr, kvlease.TransferQuarantined)
		isErr(t, tr.Err(), ErrDeviceFailed)
		var de *DriverError
		asErr(t, tr.Err(), &de)
		eq(t, ErrorIllegalAddress, de.Code)
		isErr(t, dev.Close(), ErrBusy)
	})
}

// TestCalibrate: the measurement decides, per direction and nearest
// measured size; the first scattered copy on PathAuto calibrates once
// (concurrent Starts included); Calibrate measures again and replaces the
// choice; a failed measurement leaves the copy engine.
func TestCalibrate(t *testing.T) {
	d := OpenHost()
	t.Cleanup(func() { noErr(t, d.Close()) })
	var mu sync.Mutex
	calls := 0
	kernelUpTo := [3]int{hostToDevice: 16 << 10, deviceToHost: 256 << 10, deviceToDevice: 0}
	d.calMeasure = func(kind copyKind, pieceBytes, pieces int, path Path) (time.Duration, error) {
		mu.Lock()
		calls++
		mu.Unlock()
		if pieces < 8 || pieces > 512 {
			return 0, fmt.Errorf("pieces %d", pieces)
		}
		if path == PathKernel && pieceBytes <= kernelUpTo[kind] {
			return time.Microsecond, nil
		}
		return 2 * time.Microsecond, nil
	}
	r := newRig(t, d, 16, 4096)
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tr, err := r.e.HostToDevice().Start([]cp[[]byte, DevicePtr]{pair(r.pin.Region(0), r.dev.Region(1)), pair(r.pin.Region(2), r.dev.Region(4))}, noAttach)
			if err == nil {
				<-tr.Done()
			}
		}()
	}
	wg.Wait()
	eq(t, 2*len(calSizes)*3, calls, "one calibration: every size, direction and path once")
	eq(t, int64(4), d.CopyStats().KernelLaunches, "4 KiB host-to-device: the kernel")
	tab := d.cal.Load()
	for _, c := range []struct {
		kind   copyKind
		mean   int
		kernel bool
	}{
		{hostToDevice, 256, true}, {hostToDevice, 16 << 10, true}, {hostToDevice, 24 << 10, true},
		{hostToDevice, 48 << 10, false}, {hostToDevice, 1 << 30, false},
		{deviceToHost, 1 << 30, true}, {deviceToDevice, 1024, false},
	} {
		eq(t, c.kernel, tab.useKernel(c.kind, c.mean), "%s mean %d", kindNames[c.kind], c.mean)
	}

	kernelUpTo[hostToDevice] = 0
	c, err := d.Calibrate()
	noErr(t, err)
	eq(t, len(calSizes)*3, len(c.Rows))
	eq(t, "HtoD", c.Rows[0].Direction)
	contains(t, fmt.Errorf("%s", c), "HtoD 4 KiB × 64: copy engine 2µs, kernel 2µs: copy engine")
	st0 := d.CopyStats()
	tr, err := r.e.HostToDevice().Start([]cp[[]byte, DevicePtr]{pair(r.pin.Region(0), r.dev.Region(1)), pair(r.pin.Region(2), r.dev.Region(4))}, noAttach)
	noErr(t, err)
	waitDone(t, tr)
	eq(t, st0.KernelLaunches, d.CopyStats().KernelLaunches, "after the new calibration: the copy engine")

	d.calMeasure = func(copyKind, int, int, Path) (time.Duration, error) { return 0, fmt.Errorf("no scratch memory") }
	c, err = d.Calibrate()
	contains(t, err, "no scratch memory")
	eq(t, err, c.Err)
	isFalse(t, d.cal.Load().useKernel(deviceToHost, 1<<30), "a failed calibration chooses the copy engine")
}

// TestCalibrateMeasures runs the real measurement on the fallback: every
// direction and size measured on both paths, through scratch arenas and
// engines that are all freed again and whose copies are not counted in
// the device's CopyStats.
func TestCalibrateMeasures(t *testing.T) {
	d := OpenHost()
	c, err := d.Calibrate()
	noErr(t, err)
	eq(t, 3*len(calSizes), len(c.Rows))
	for _, r := range c.Rows {
		if r.CopyEngine <= 0 || r.Kernel <= 0 || r.Pieces < 8 {
			t.Errorf("row %+v", r)
		}
	}
	st := d.CopyStats()
	eq(t, [3]int64{0, 0, 0}, [3]int64{st.KernelLaunches, st.LoopedSubmits, st.BatchedSubmits}, "calibration's copies counted in CopyStats")
	noErr(t, d.Close(), "calibration left something open")
}

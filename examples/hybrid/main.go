// Command hybrid runs a hybrid-attention model on kvlease, on the gpu
// package's CPU fallback: full-attention layers with 16-token blocks and
// sliding-window layers (a 64-token window) with 32-token blocks, one pool
// per KV-cache group, each in a per-layer layout (vLLM's
// [2, blocks, block_tokens, heads, dim] tensors). Run it with
//
//	go run ./examples/hybrid
//
// It shows:
//
//   - admission in both groups at once (groups.Coordinator), with one
//     prefix hit length valid for both: the full group needs the whole
//     prefix cached, the window group only the blocks of the window
//     before the hit;
//   - decode growth (Extend in every group) and the window group trimming
//     the blocks that fell out of its window, while an offload copy still
//     reads them: they drain and come back (cached) only when it resolves;
//   - a layout round trip through the copy engine: layer-separated device
//     blocks offloaded to block-contiguous pinned host blocks and onloaded
//     into fresh device blocks, each direction one submission;
//   - a handoff to a pool whose blocks are cut into other pieces, refused
//     at propose time (the envelope names the layout);
//   - markers: every sealed block's pieces are a function of its prefix
//     hash, group, layer and K/V, checked wherever they show up.
//
// The last line is `marker mismatches N` (scripts read it; N is 0).
// With -gpu it runs on CUDA device 0 (gpu.Open) instead of the fallback,
// with the same output:
//
//	go run ./examples/hybrid -gpu
package main

import (
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/cespare/xxhash/v2"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/gpu"
	"github.com/kvlease/kvlease/groups"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/layout"
)

// The model: group 0 (full attention) has 4 layers and 16-token blocks,
// group 1 (sliding window of 64 tokens) has 2 layers and 32-token blocks.
// A piece (one layer's K or V of one block) is 256 bytes in both:
// 16 tokens × 1 head × 8 dims × 2 bytes, and 32 × 1 × 4 × 2.
const (
	full, swa  = 0, 1
	window     = 64
	pieceBytes = 256
	seed       = kvlease.BlockHash(0x68796272) // the model's hash namespace
)

var specs = [2]struct {
	spec   groups.Spec
	layers int
	blocks int
	tag    string
}{
	{groups.Spec{Name: "full", BlockTokens: 16}, 4, 64, "bf16 t16 h1 d8"},
	{groups.Spec{Name: "swa", BlockTokens: 32, Window: window}, 2, 32, "bf16 t32 h1 d4"},
}

func main() {
	onGPU := flag.Bool("gpu", false, "run on CUDA device 0 (gpu.Open) instead of the CPU fallback")
	flag.Parse()
	n, err := run(os.Stdout, config{gpu: *onGPU})
	if err != nil {
		fmt.Fprintln(os.Stderr, "hybrid:", err)
		os.Exit(1)
	}
	if n != 0 {
		os.Exit(1)
	}
}

// config holds what the test varies.
type config struct {
	// corrupt flips one byte of a shared block's piece after the first
	// request, so the test sees the marker check fail.
	corrupt bool
	// gpu runs on CUDA device 0 instead of the CPU fallback.
	gpu bool
}

// engine is the toy serving engine: one device, a layered memory and a
// pool per group, the coordinator, and the marker ledger.
type engine struct {
	w          io.Writer
	dev        *gpu.Device
	mem        [2]*gpu.LayeredDevice
	pool       [2]*kvlease.Pool[gpu.DeviceBlock]
	c          *groups.Coordinator[gpu.DeviceBlock]
	mismatches int
	buf, want  []byte
}

// request is one running request: its tokens and each group's chain of
// block hashes, extended as blocks fill.
type request struct {
	name   string
	r      *groups.Request[gpu.DeviceBlock]
	tokens []int32
	hashes [2][]kvlease.BlockHash
}

// mark fills b with the marker of piece (layer, kv) of the block with
// prefix hash h in group g: content only that prefix produces.
func mark(b []byte, g int, h kvlease.BlockHash, layer, kv int) {
	var x [32]byte
	binary.LittleEndian.PutUint64(x[0:], uint64(h))
	binary.LittleEndian.PutUint64(x[8:], uint64(g<<16|layer<<1|kv))
	for off := 0; off < len(b); off += 8 {
		binary.LittleEndian.PutUint64(x[16:], uint64(off))
		binary.LittleEndian.PutUint64(b[off:], xxhash.Sum64(x[:24]))
	}
}

func run(w io.Writer, cfg config) (int, error) {
	dev := gpu.OpenHost()
	if cfg.gpu {
		var err error
		if dev, err = gpu.Open(0); err != nil {
			return 0, err
		}
	}
	e := &engine{w: w, dev: dev, buf: make([]byte, pieceBytes), want: make([]byte, pieceBytes)}
	defer e.dev.Close()
	var gs []groups.Group[gpu.DeviceBlock]
	for g, s := range specs {
		lay := layout.LayerSeparated(s.layers, 2, s.blocks, pieceBytes, s.tag)
		m, err := e.dev.AllocLayered(lay)
		if err != nil {
			return 0, err
		}
		defer m.Close()
		p, err := kvlease.NewPool[gpu.DeviceBlock](m)
		if err != nil {
			return 0, err
		}
		e.mem[g], e.pool[g] = m, p
		gs = append(gs, groups.Group[gpu.DeviceBlock]{Spec: s.spec, Pool: p})
		kind := "full attention"
		if s.spec.Sliding() {
			kind = fmt.Sprintf("sliding window of %d tokens", s.spec.Window)
		}
		fmt.Fprintf(w, "group %s: %s, %d-token blocks, %d layers × K,V of %d B per block, %d blocks on %s\n",
			s.spec.Name, kind, s.spec.BlockTokens, s.layers, pieceBytes, s.blocks, e.dev.Name())
	}
	c, err := groups.New(gs...)
	if err != nil {
		return 0, err
	}
	e.c = c
	fmt.Fprintf(w, "hits are multiples of %d tokens (both groups' block boundaries)\n", c.Align())

	// A system prompt of 96 tokens that every request starts with.
	system := make([]int32, 96)
	for i := range system {
		system[i] = int32(1000 + i)
	}
	own := func(base int32, n int) []int32 {
		t := append([]int32(nil), system...)
		for i := range n {
			t = append(t, base+int32(i))
		}
		return t
	}

	// Request A: nothing cached yet. It decodes 70 tokens; on its first
	// trim an offload is still reading the blocks that leave the window.
	a, err := e.admit("A", own(5000, 40))
	if err != nil {
		return 0, err
	}
	if err := e.decode(a, 70, true); err != nil {
		return 0, err
	}
	if err := e.roundTrip(a); err != nil {
		return 0, err
	}
	if err := e.refusedHandoff(a); err != nil {
		return 0, err
	}
	e.check(a)
	a.r.Release()
	fmt.Fprintf(w, "release A: %s\n", e.stats())

	if cfg.corrupt { // a bit flip in a cached block of the system prompt
		l, hit, err := e.pool[full].AcquirePrefix("corrupt", a.hashes[full][:3], 3)
		if err != nil || hit != 3 {
			return 0, fmt.Errorf("corrupt: hit %d: %v", hit, err)
		}
		p := e.mem[full].Piece(l.Ref(2).ID, 1, 1)
		if err := e.dev.CopyToHost(e.buf, p); err != nil {
			return 0, err
		}
		e.buf[7] ^= 0x40
		if err := e.dev.CopyFromHost(p, e.buf); err != nil {
			return 0, err
		}
		l.Release()
	}

	// B shares the system prompt: a hit of 96 tokens, the window group
	// taking only blocks 1-2 (the 64 tokens before 96), which A trimmed and
	// left cached.
	b, err := e.admit("B", own(7000, 54))
	if err != nil {
		return 0, err
	}
	// C shares A's first 112 tokens: the full group has 7 blocks cached,
	// the window group's block 3 (tokens 96-127) differs, so the hit both
	// can serve is 96.
	ct := append(own(5000, 16), 9000, 9001, 9002, 9003, 9004, 9005, 9006, 9007, 9008, 9009, 9010, 9011, 9012, 9013, 9014, 9015, 9016, 9017, 9018, 9019, 9020, 9021, 9022, 9023)
	cr, err := e.admit("C", ct)
	if err != nil {
		return 0, err
	}
	for range 40 { // B and C decode side by side, one token per step
		for _, r := range []*request{b, cr} {
			if err := e.decode(r, 1, false); err != nil {
				return 0, err
			}
		}
	}
	for _, r := range []*request{b, cr} {
		e.check(r)
		fmt.Fprintf(w, "%s done at %d tokens: full holds blocks 0-%d, swa holds blocks %d-%d\n", r.name, len(r.tokens),
			r.r.Lease(full).Len()-1, r.r.Base(swa)+r.r.Lease(swa).Trimmed(), r.r.Base(swa)+r.r.Lease(swa).Len()-1)
		r.r.Release()
	}
	fmt.Fprintf(w, "release B, C: %s\n", e.stats())
	for g := range e.pool {
		if err := e.pool[g].CheckQuiescent(); err != nil { // consistent, nothing held
			return 0, fmt.Errorf("group %s: %w", specs[g].spec.Name, err)
		}
	}
	fmt.Fprintf(w, "marker mismatches %d\n", e.mismatches)
	return e.mismatches, nil
}

func (e *engine) stats() string {
	s := ""
	for g, p := range e.pool {
		st := p.Stats()
		if g > 0 {
			s += ", "
		}
		s += fmt.Sprintf("%s leased %d draining %d cached %d free %d", specs[g].spec.Name, st.Leased, st.Draining, st.Cached, st.Free)
	}
	return s
}

// admit admits a request for its prompt in both groups and prefills it:
// the blocks past the hit are computed (stamped) and the full ones
// sealed; the shared blocks' markers are checked.
func (e *engine) admit(name string, prompt []int32) (*request, error) {
	hs := e.c.Hashes(seed, prompt)
	var cached [2]int
	for g := range specs {
		cached[g] = e.pool[g].CachedPrefix(hs[g])
	}
	r, hit, err := e.c.Acquire(name, hs, len(prompt))
	if err != nil {
		return nil, err
	}
	q := &request{name: name, r: r, tokens: prompt, hashes: [2][]kvlease.BlockHash{hs[full], hs[swa]}}
	fmt.Fprintf(e.w, "admit %s: %d prompt tokens; cached prefix: full %d blocks (%d tokens), swa %d blocks (%d tokens); hit %d tokens\n",
		name, len(prompt), cached[full], cached[full]*specs[full].spec.BlockTokens, cached[swa], cached[swa]*specs[swa].spec.BlockTokens, hit)
	for g := range specs {
		bt := specs[g].spec.BlockTokens
		l := r.Lease(g)
		base := r.Base(g)
		shared := hit/bt - base
		what := "shares no block"
		if shared > 0 {
			what = fmt.Sprintf("shares blocks %d-%d", base, base+shared-1)
		}
		extra := ""
		if specs[g].spec.Sliding() {
			extra = fmt.Sprintf(" (the %d tokens before the hit), its lease starts at block %d", window, base)
		}
		fmt.Fprintf(e.w, "  %s: %s%s, computes blocks %d-%d\n", specs[g].spec.Name, what, extra, base+shared, base+l.Len()-1)
		for i := range l.Len() {
			k := base + i
			if i < shared {
				e.checkBlock(name, g, l, i, hs[g][k])
				continue
			}
			if k < len(hs[g]) { // a full block of the prompt: compute and seal
				if err := e.stamp(g, l, i, hs[g][k]); err != nil {
					return nil, err
				}
			}
		}
	}
	return q, nil
}

// stamp writes block i of l (absolute block with hash h of group g): every
// piece gets its marker; then it is sealed.
func (e *engine) stamp(g int, l *kvlease.Lease[gpu.DeviceBlock], i int, h kvlease.BlockHash) error {
	id := l.Ref(i).ID
	for layer := range specs[g].layers {
		for kv := range 2 {
			mark(e.buf, g, h, layer, kv)
			if err := e.dev.CopyFromHost(e.mem[g].Piece(id, layer, kv), e.buf); err != nil {
				return err
			}
		}
	}
	return l.Seal(i, h)
}

// checkBlock compares every piece of block i of l with the marker of h.
func (e *engine) checkBlock(who string, g int, l *kvlease.Lease[gpu.DeviceBlock], i int, h kvlease.BlockHash) {
	id := l.Ref(i).ID
	for layer := range specs[g].layers {
		for kv := range 2 {
			mark(e.want, g, h, layer, kv)
			if err := e.dev.CopyToHost(e.buf, e.mem[g].Piece(id, layer, kv)); err != nil || string(e.buf) != string(e.want) {
				e.mismatches++
				fmt.Fprintf(e.w, "  MISMATCH %s: group %s block %d layer %d kv %d\n", who, specs[g].spec.Name, i, layer, kv)
			}
		}
	}
}

// check checks every sealed block r still holds, in both groups.
func (e *engine) check(r *request) {
	for g := range specs {
		l := r.r.Lease(g)
		for i := l.Trimmed(); i < l.Len(); i++ {
			if k := r.r.Base(g) + i; k < len(r.hashes[g]) {
				e.checkBlock(r.name, g, l, i, r.hashes[g][k])
			}
		}
	}
}

// decode generates steps tokens for r, one per step: Grow covers the new
// token in every group (Extend when a block starts) and trims the window
// group; a block that fills is computed and sealed. With offload, the
// first trim happens while an offload copy of the blocks leaving the
// window is in flight.
func (e *engine) decode(r *request, steps int, offload bool) error {
	for range steps {
		p := len(r.tokens) // the position this step computes
		var before [2]int
		for g := range specs {
			before[g] = r.r.Lease(g).Len()
		}
		sl := r.r.Lease(swa)
		// The window of token p starts at the block holding token p-Window:
		// Grow gives back the blocks before it.
		trimTo := 0
		if p > window {
			trimTo = (p-window)/specs[swa].spec.BlockTokens - r.r.Base(swa)
		}
		var off *offloader
		if offload && trimTo > sl.Trimmed() {
			var err error
			if off, err = e.startOffload(r, sl.Trimmed(), trimTo); err != nil {
				return err
			}
			offload = false
		}
		trimmedBefore := sl.Trimmed()
		r.tokens = append(r.tokens, int32(20000+p))
		if err := r.r.Grow(len(r.tokens)); err != nil {
			return err
		}
		for g := range specs {
			if n := r.r.Lease(g).Len(); n > before[g] {
				fmt.Fprintf(e.w, "  %s token %d: %s extends to %d blocks\n", r.name, p, specs[g].spec.Name, n)
			}
		}
		if t := sl.Trimmed(); t > trimmedBefore {
			b0 := r.r.Base(swa)
			fmt.Fprintf(e.w, "  %s token %d: swa window starts at block %d: trimmed blocks %d-%d (%s)\n",
				r.name, p, b0+t, b0+trimmedBefore, b0+t-1, e.stats())
		}
		if off != nil {
			if err := off.finish(); err != nil {
				return err
			}
		}
		// A block that this token filled is computed and sealed.
		for g := range specs {
			bt := specs[g].spec.BlockTokens
			if len(r.tokens)%bt != 0 {
				continue
			}
			k := len(r.tokens)/bt - 1
			if k != len(r.hashes[g]) {
				return fmt.Errorf("%s: group %s: block %d filled with %d hashes known", r.name, specs[g].spec.Name, k, len(r.hashes[g]))
			}
			parent := seed
			if k > 0 {
				parent = r.hashes[g][k-1]
			}
			h := kvlease.HashBlock(parent, r.tokens[k*bt:(k+1)*bt])
			r.hashes[g] = append(r.hashes[g], h)
			if err := e.stamp(g, r.r.Lease(g), k-r.r.Base(g), h); err != nil {
				return err
			}
		}
	}
	return nil
}

// offloader copies blocks of the window group to host memory in a layout
// of its own (block-contiguous), piece by piece, on a goroutine of its
// own; the goroutine's return is the evidence that resolves its transfer.
// It starts copying only when finish is called, so the example's trim
// deterministically happens while the copy is pending.
type offloader struct {
	e      *engine
	r      *request
	from   int
	t      *kvlease.Transfer
	host   *layout.Host
	go_    chan struct{}
	copied chan error
}

func (e *engine) startOffload(r *request, from, to int) (*offloader, error) {
	sl := r.r.Lease(swa)
	host, err := layout.NewHost(layout.Contiguous(specs[swa].layers, 2, to-from, pieceBytes, specs[swa].tag))
	if err != nil {
		return nil, err
	}
	o := &offloader{e: e, r: r, from: from, t: kvlease.NewTransfer(nil), host: host, go_: make(chan struct{}), copied: make(chan error, 1)}
	if err := sl.AttachRange(o.t, from, to, kvlease.Read); err != nil {
		return nil, err
	}
	b0 := r.r.Base(swa)
	fmt.Fprintf(e.w, "  %s: offload of swa blocks %d-%d to host started (transfer %d pending)\n", r.name, b0+from, b0+to-1, o.t.ID())
	ids := make([]kvlease.BlockID, 0, to-from)
	for i := from; i < to; i++ {
		ids = append(ids, sl.Ref(i).ID)
	}
	go func() {
		<-o.go_
		var err error
		for j, id := range ids {
			for layer := range specs[swa].layers {
				for kv := range 2 {
					if err == nil {
						err = e.dev.CopyToHost(host.Piece(kvlease.BlockID(j), layer, kv), e.mem[swa].Piece(id, layer, kv))
					}
				}
			}
		}
		o.copied <- err
		o.t.Resolve(err) // our last read of the device blocks has returned
	}()
	return o, nil
}

// finish lets the copy run, waits for its evidence and checks the host
// copy's markers.
func (o *offloader) finish() error {
	close(o.go_)
	if err := <-o.copied; err != nil {
		return err
	}
	<-o.t.Done()
	e := o.e
	fmt.Fprintf(e.w, "  %s: offload resolved: the trimmed blocks are back, cached for hits (%s)\n", o.r.name, e.stats())
	for j := range o.host.Blocks() {
		h := o.r.hashes[swa][o.r.r.Base(swa)+o.from+j]
		for layer := range specs[swa].layers {
			for kv := range 2 {
				mark(e.want, swa, h, layer, kv)
				if string(o.host.Piece(kvlease.BlockID(j), layer, kv)) != string(e.want) {
					e.mismatches++
					fmt.Fprintf(e.w, "  MISMATCH offload: block %d layer %d kv %d\n", j, layer, kv)
				}
			}
		}
	}
	return nil
}

// roundTrip offloads every sealed full-attention block of r to pinned
// host memory in the block-contiguous layout and onloads it into fresh
// device blocks, each direction one Start, one Transfer and one
// submission of all pieces; then checks the onloaded blocks' markers.
func (e *engine) roundTrip(r *request) error {
	fl := r.r.Lease(full)
	n := min(fl.Len(), len(r.hashes[full]))
	s := specs[full]
	host, err := e.dev.AllocLayeredPinned(layout.Contiguous(s.layers, 2, n, pieceBytes, s.tag))
	if err != nil {
		return err
	}
	defer host.Close()
	hostPool, err := kvlease.NewPool[gpu.HostBlock](host)
	if err != nil {
		return err
	}
	hl, err := hostPool.Acquire(r.name+"-offload", n)
	if err != nil {
		return err
	}
	defer hl.Release()
	engine, err := e.dev.NewCopyEngine()
	if err != nil {
		return err
	}
	defer engine.Close()

	submits := func() int64 { st := e.dev.CopyStats(); return st.BatchedSubmits + st.LoopedSubmits + st.KernelLaunches }
	copies := func() int64 { st := e.dev.CopyStats(); return st.BatchedCopies + st.LoopedCopies + st.KernelCopies }
	s0, c0 := submits(), copies()
	off := make([]kvlease.CopyPair[gpu.DeviceBlock, gpu.HostBlock], n)
	for i := range off {
		off[i] = kvlease.CopyPair[gpu.DeviceBlock, gpu.HostBlock]{Src: e.mem[full].Region(fl.Ref(i).ID), Dst: host.Region(hl.Ref(i).ID)}
	}
	t, err := engine.LayeredDeviceToHost().Start(off, func(t *kvlease.Transfer) error {
		if err := fl.AttachRange(t, 0, n, kvlease.Read); err != nil {
			return err
		}
		return hl.AttachRange(t, 0, n, kvlease.Write)
	})
	if err != nil {
		return err
	}
	<-t.Done()
	if err := t.Err(); err != nil {
		return err
	}
	s1, c1 := submits(), copies()
	fmt.Fprintf(e.w, "layout round trip of %s's %d full blocks (%d pieces each): offload layer-separated → block-contiguous: %d submission, %d copies\n",
		r.name, n, s.layers*2, s1-s0, c1-c0)

	back, err := e.pool[full].Acquire(r.name+"-onload", n)
	if err != nil {
		return err
	}
	on := make([]kvlease.CopyPair[gpu.HostBlock, gpu.DeviceBlock], n)
	for i := range on {
		on[i] = kvlease.CopyPair[gpu.HostBlock, gpu.DeviceBlock]{Src: host.Region(hl.Ref(i).ID), Dst: e.mem[full].Region(back.Ref(i).ID)}
	}
	t2, err := engine.LayeredHostToDevice().Start(on, func(t *kvlease.Transfer) error {
		if err := hl.AttachRange(t, 0, n, kvlease.Read); err != nil {
			return err
		}
		return back.AttachRange(t, 0, n, kvlease.Write)
	})
	if err != nil {
		back.Release()
		return err
	}
	<-t2.Done()
	if err := t2.Err(); err != nil {
		back.Release()
		return err
	}
	s2, c2 := submits(), copies()
	fmt.Fprintf(e.w, "layout round trip: onload block-contiguous → layer-separated: %d submission, %d copies\n", s2-s1, c2-c1)
	for i := range n {
		e.checkBlock(r.name+"-onload", full, back, i, r.hashes[full][i])
	}
	back.Release()
	return nil
}

// refusedHandoff proposes r's full-attention blocks to a decode pool whose
// blocks hold the same bytes cut differently (8 layers of 128-byte
// pieces): the envelope names the model's layout, and Propose refuses the
// mismatch before anything is acquired or attached.
func (e *engine) refusedHandoff(r *request) error {
	s := specs[full]
	other, err := layout.NewHost(layout.LayerSeparated(8, 2, 64, pieceBytes/2, s.tag))
	if err != nil {
		return err
	}
	decode, err := kvlease.NewPool[layout.Block](other)
	if err != nil {
		return err
	}
	env := handoff.Envelope{BlockTokens: s.spec.BlockTokens, BlockBytes: e.mem[full].BlockBytes(), PoolBlocks: 64,
		MaxContextTokens: 1024, MaxPrefillTokens: 256, MaxRunningRequests: 8, Layout: e.mem[full].Layout()}
	_, err = handoff.Propose(r.r.Lease(full), decode, handoff.Config{Envelope: env})
	if !errors.Is(err, kvlease.ErrInvalidArgument) {
		return fmt.Errorf("a handoff across layouts was not refused: %v", err)
	}
	fmt.Fprintf(e.w, "handoff of %s's full blocks to a pool of 8 layers × %d B pieces: refused at propose time, decode pool leased %d: %v\n",
		r.name, pieceBytes/2, decode.Stats().Leased, err)
	return nil
}

package gpu

import (
	"bytes"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/layout"
)

// countingStream counts a stream's submissions and the copy ops in them:
// on a real device each submission is one cuMemcpyBatchAsync (or one call
// per op without it), on the fallback one job of the worker.
type countingStream struct {
	stream
	mu          sync.Mutex
	submissions int
	ops         int
}

func (s *countingStream) submit(sub *submission) (fence, error, error) {
	s.mu.Lock()
	s.submissions++
	s.ops += len(sub.ops)
	s.mu.Unlock()
	return s.stream.submit(sub)
}

func (s *countingStream) counts() (int, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.submissions, s.ops
}

// countEngine returns a copy engine on the fallback whose submissions are
// counted.
func countEngine(t *testing.T, d *Device) (*CopyEngine, *countingStream) {
	t.Helper()
	e, err := d.NewCopyEngine()
	if err != nil {
		t.Fatal(err)
	}
	cs := &countingStream{stream: e.s}
	e.s = cs
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Error(err)
		}
	})
	return e, cs
}

// fillPieces writes a marker of (block, layer, kv) into every piece of
// block id.
func fillPieces(t *testing.T, d *Device, m *LayeredDevice, id kvlease.BlockID, seed byte) {
	t.Helper()
	lay := m.Layout()
	buf := make([]byte, lay.PieceBytes)
	for l := range lay.Layers {
		for kv := range lay.KVs {
			for i := range buf {
				buf[i] = seed ^ byte(id) ^ byte(l*3+kv*7) ^ byte(i)
			}
			if err := d.CopyFromHost(m.Piece(id, l, kv), buf); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// A layout round trip through the copy engine on the fallback: 64 blocks
// × 32 layers × K and V, layer-separated on the device, block-contiguous
// in pinned host memory, offloaded and onloaded into a second device
// memory through pools and leases. Each direction is one Start, one
// Transfer and one submission; the content survives piece for piece.
func TestLayeredRoundTripOneSubmissionPerDirection(t *testing.T) {
	const blocks, layers, piece = 64, 32, Alignment
	d := OpenHost()
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Error(err)
		}
	})
	devLay := layout.LayerSeparated(layers, 2, blocks, piece, "bf16 t16 h1 d8")
	hostLay := layout.Contiguous(layers, 2, blocks, piece, "bf16 t16 h1 d8")
	if devLay.Fingerprint() != hostLay.Fingerprint() {
		t.Fatal("layouts that differ only in strides have different fingerprints")
	}
	src, err := d.AllocLayered(devLay)
	noErr(t, err)
	dst, err := d.AllocLayered(devLay)
	noErr(t, err)
	host, err := d.AllocLayeredPinned(hostLay)
	noErr(t, err)
	t.Cleanup(func() { noErr(t, src.Close()); noErr(t, dst.Close()); noErr(t, host.Close()) })

	srcPool, err := kvlease.NewPool[DeviceBlock](src)
	noErr(t, err)
	hostPool, err := kvlease.NewPool[HostBlock](host)
	noErr(t, err)
	dstPool, err := kvlease.NewPool[DeviceBlock](dst)
	noErr(t, err)
	sl, err := srcPool.Acquire("prefill", blocks)
	noErr(t, err)
	hl, err := hostPool.Acquire("offload", blocks)
	noErr(t, err)
	dl, err := dstPool.Acquire("decode", blocks)
	noErr(t, err)
	for i := range blocks {
		fillPieces(t, d, src, sl.Ref(i).ID, 0x5a)
	}

	e, cs := countEngine(t, d)
	off := make([]kvlease.CopyPair[DeviceBlock, HostBlock], blocks)
	for i := range off {
		s, err := sl.Region(i)
		noErr(t, err)
		h, err := hl.Region(i)
		noErr(t, err)
		off[i] = kvlease.CopyPair[DeviceBlock, HostBlock]{Src: s, Dst: h}
	}
	tr, err := e.LayeredDeviceToHost().Start(off, func(tr *kvlease.Transfer) error {
		if err := sl.AttachRange(tr, 0, blocks, kvlease.Read); err != nil {
			return err
		}
		return hl.AttachRange(tr, 0, blocks, kvlease.Write)
	})
	noErr(t, err)
	sl.Release() // the prefill side lets go at once; its blocks drain
	<-tr.Done()
	noErr(t, tr.Err())
	<-sl.Settled()
	subs, ops := cs.counts()
	if subs != 1 {
		t.Fatalf("offload of %d blocks × %d layers: %d submissions, want 1", blocks, layers, subs)
	}
	// Source pieces of adjacent blocks merge per (layer, kv) only when
	// the destination is adjacent too; the contiguous host side is not,
	// so every piece is its own op, all in the one submission.
	if ops != blocks*layers*2 {
		t.Fatalf("offload: %d ops, want %d", ops, blocks*layers*2)
	}

	on := make([]kvlease.CopyPair[HostBlock, DeviceBlock], blocks)
	for i := range on {
		h, err := hl.Region(i)
		noErr(t, err)
		dd, err := dl.Region(i)
		noErr(t, err)
		on[i] = kvlease.CopyPair[HostBlock, DeviceBlock]{Src: h, Dst: dd}
	}
	tr2, err := e.LayeredHostToDevice().Start(on, func(tr *kvlease.Transfer) error {
		if err := hl.AttachRange(tr, 0, blocks, kvlease.Read); err != nil {
			return err
		}
		return dl.AttachRange(tr, 0, blocks, kvlease.Write)
	})
	noErr(t, err)
	<-tr2.Done()
	noErr(t, tr2.Err())
	if subs, _ := cs.counts(); subs != 2 {
		t.Fatalf("after the onload: %d submissions, want 2 (one per direction)", subs)
	}

	// Every piece arrived where the layout says, in the second device.
	want := make([]byte, piece)
	got := make([]byte, piece)
	for i := range blocks {
		sid, did := sl.Ref(i).ID, dl.Ref(i).ID
		for l := range layers {
			for kv := range 2 {
				for k := range want {
					want[k] = 0x5a ^ byte(sid) ^ byte(l*3+kv*7) ^ byte(k)
				}
				noErr(t, d.CopyToHost(got, dst.Piece(did, l, kv)))
				if !bytes.Equal(got, want) {
					t.Fatalf("block %d layer %d kv %d: content differs after the round trip", i, l, kv)
				}
			}
		}
	}
	hl.Release()
	dl.Release()
	if st := hostPool.Stats(); st.Free != blocks {
		t.Fatalf("host pool after release: %+v", st)
	}
}

// Layouts that agree piece by piece merge adjacent blocks: layer-separated
// on both sides, 8 consecutive blocks of 16 are one op per (layer, kv).
func TestLayeredMergesAdjacentPieces(t *testing.T) {
	d := OpenHost()
	t.Cleanup(func() { noErr(t, d.Close()) })
	lay := layout.LayerSeparated(4, 2, 16, Alignment, "")
	a, err := d.AllocLayered(lay)
	noErr(t, err)
	h, err := d.AllocLayeredPinned(lay)
	noErr(t, err)
	t.Cleanup(func() { noErr(t, a.Close()); noErr(t, h.Close()) })
	e, cs := countEngine(t, d)
	pairs := make([]kvlease.CopyPair[DeviceBlock, HostBlock], 8)
	for i := range pairs {
		pairs[i] = kvlease.CopyPair[DeviceBlock, HostBlock]{Src: a.Region(kvlease.BlockID(i)), Dst: h.Region(kvlease.BlockID(i))}
	}
	tr, err := e.LayeredDeviceToHost().Start(pairs, func(*kvlease.Transfer) error { return nil })
	noErr(t, err)
	<-tr.Done()
	if subs, ops := cs.counts(); subs != 1 || ops != 4*2 {
		t.Fatalf("%d submissions, %d ops; want 1 and %d", subs, ops, 4*2)
	}
}

func TestLayeredRefusesMismatch(t *testing.T) {
	d := OpenHost()
	t.Cleanup(func() { noErr(t, d.Close()) })
	a, err := d.AllocLayered(layout.LayerSeparated(4, 2, 4, Alignment, "bf16"))
	noErr(t, err)
	h, err := d.AllocLayeredPinned(layout.LayerSeparated(4, 2, 4, Alignment, "fp8"))
	noErr(t, err)
	t.Cleanup(func() { noErr(t, a.Close()); noErr(t, h.Close()) })
	e, cs := countEngine(t, d)
	attached := false
	_, err = e.LayeredDeviceToHost().Start([]kvlease.CopyPair[DeviceBlock, HostBlock]{{Src: a.Region(0), Dst: h.Region(0)}},
		func(*kvlease.Transfer) error { attached = true; return nil })
	if !errors.Is(err, kvlease.ErrInvalidArgument) || attached {
		t.Fatalf("mismatched layouts: err %v attached %v", err, attached)
	}
	_, err = e.LayeredDeviceToHost().Start([]kvlease.CopyPair[DeviceBlock, HostBlock]{{Src: a.Region(0)}},
		func(*kvlease.Transfer) error { return nil })
	if !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("zero block: %v", err)
	}
	_, err = e.LayeredDeviceToHost().Start(nil, func(*kvlease.Transfer) error { return nil })
	if !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("no pairs: %v", err)
	}
	// With compatible layouts: a block outside its memory, a block written
	// twice, a closed memory.
	ok, err := d.AllocLayeredPinned(layout.LayerSeparated(4, 2, 4, Alignment, "bf16"))
	noErr(t, err)
	gone, err := d.AllocLayeredPinned(layout.LayerSeparated(4, 2, 4, Alignment, "bf16"))
	noErr(t, err)
	noErr(t, gone.Close())
	t.Cleanup(func() { noErr(t, ok.Close()) })
	for name, pairs := range map[string][]kvlease.CopyPair[DeviceBlock, HostBlock]{
		"block outside":  {{Src: DeviceBlock{a, 4}, Dst: ok.Region(0)}},
		"negative block": {{Src: a.Region(0), Dst: HostBlock{ok, -1}}},
		"written twice":  {{Src: a.Region(0), Dst: ok.Region(1)}, {Src: a.Region(2), Dst: ok.Region(1)}},
		"closed memory":  {{Src: a.Region(0), Dst: HostBlock{gone, 0}}},
	} {
		_, err = e.LayeredDeviceToHost().Start(pairs, func(*kvlease.Transfer) error { attached = true; return nil })
		if !errors.Is(err, kvlease.ErrInvalidArgument) || attached {
			t.Fatalf("%s: err %v attached %v", name, err, attached)
		}
		if strings.Contains(err.Error(), "layout: ") {
			t.Fatalf("%s: refused for its layout, not for what it tests: %v", name, err)
		}
	}
	tr, err := e.LayeredDeviceToHost().Start([]kvlease.CopyPair[DeviceBlock, HostBlock]{{Src: a.Region(1), Dst: ok.Region(2)}}, func(*kvlease.Transfer) error { return nil })
	noErr(t, err, "the compatible pair itself")
	<-tr.Done()
	if subs, _ := cs.counts(); subs != 1 {
		t.Fatalf("%d submissions for refused copies and one good one", subs-1)
	}
	zero(t, e.Pending())
	zero(t, a.Arena().Pending())
	// Geometry the arenas cannot take.
	for _, lay := range []layout.Layout{
		layout.LayerSeparated(2, 2, 4, 100, ""), // not a multiple of Alignment
		{Layers: 2, KVs: 2, Blocks: 4, PieceBytes: Alignment, LayerStride: Alignment, KVStride: Alignment, BlockStride: Alignment}, // overlap
		{Layers: 1, KVs: 1, Blocks: 2, PieceBytes: Alignment, BlockStride: Alignment + 8},                                          // stride not a multiple
	} {
		if _, err := d.AllocLayered(lay); !errors.Is(err, kvlease.ErrInvalidArgument) {
			t.Fatalf("AllocLayered(%v): %v", lay, err)
		}
	}
}

package ucx_test

import (
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/layout"
	"github.com/kvlease/kvlease/ucx"
)

// 4 layers × K, V × 256-byte pieces: 2048-byte blocks.
const (
	lLayers = 4
	lPiece  = 256
	lTag    = "bf16 t16 h1 d64"
	lBlock  = lLayers * 2 * lPiece
)

func newHost(t testing.TB, l layout.Layout) *layout.Host {
	t.Helper()
	h, err := layout.NewHost(l)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// pieceMark is byte j of the marker of piece (layer, kv) of block i.
func pieceMark(seed byte, i, layer, kv, j int) byte {
	return seed + byte(31*i+7*layer+3*kv) + byte(j%5)
}

func stampBlock(b layout.Block, seed byte, i int) {
	lay := b.Layout()
	for layer := range lay.Layers {
		for kv := range lay.KVs {
			p := b.Piece(layer, kv)
			for j := range p {
				p[j] = pieceMark(seed, i, layer, kv, j)
			}
		}
	}
}

// checkBlock reports the first piece of b that is not marker (seed, i).
func checkBlock(b layout.Block, seed byte, i int) error {
	lay := b.Layout()
	for layer := range lay.Layers {
		for kv := range lay.KVs {
			p := b.Piece(layer, kv)
			for j := range p {
				if p[j] != pieceMark(seed, i, layer, kv, j) {
					return fmt.Errorf("block %d (id %d), piece (%d, %d), byte %d: %d, want %d", i, b.ID, layer, kv, j, p[j], pieceMark(seed, i, layer, kv, j))
				}
			}
		}
	}
	return nil
}

// untouched reports a byte of h outside blocks ids that is not zero.
func untouched(h *layout.Host, ids []int) error {
	covered := make([]bool, len(h.Base()))
	for _, id := range ids {
		for _, p := range h.Layout().AppendPieces(nil, id) {
			for k := p.Off; k < p.Off+p.Len; k++ {
				covered[k] = true
			}
		}
	}
	for k, c := range h.Base() {
		if !covered[k] && c != 0 {
			return fmt.Errorf("byte %d outside the handoff's blocks written", k)
		}
	}
	return nil
}

func blocksOf(h *layout.Host, ids []int) []layout.Block {
	out := make([]layout.Block, len(ids))
	for i, id := range ids {
		out[i] = h.Region(kvlease.BlockID(id))
	}
	return out
}

// runsOf counts the runs of consecutive ids once sorted.
func runsOf(ids []int) int {
	seen := map[int]bool{}
	for _, id := range ids {
		seen[id] = true
	}
	n := 0
	for id := range seen {
		if !seen[id-1] {
			n++
		}
	}
	return n
}

func layeredPlanes(t *testing.T, cfg ucx.Config) (*ucx.Sender[layout.Block], *ucx.Receiver[layout.Block]) {
	t.Helper()
	sender, err := ucx.NewSender(ucx.Config{Pull: cfg.Pull}, ucx.LayeredPieces[layout.Block])
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sender.Close() })
	recv, err := ucx.NewReceiver(cfg, ucx.LayeredPieces[layout.Block])
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = recv.Close() })
	return sender, recv
}

func TestLayeredSeparatedToContiguous(t *testing.T) {
	// A layer-separated source ([layers][K, V][blocks][piece]) into a
	// block-contiguous destination: every piece lands at its place in
	// the destination block, nothing else of the destination is written.
	// Pushed, each block is one message gathered from the source's pieces
	// and scattered into the destination's, and nothing is registered;
	// pulled, the source registered one run per layer and kind per
	// stretch of consecutive blocks: exactly the handoff's pieces.
	fragmented := make([]int, 40) // 320 registrations: the run table is read remotely
	dstFrag := make([]int, 40)
	for i := range fragmented {
		fragmented[i], dstFrag[i] = 2*i+1, 95-i
	}
	for _, tc := range []struct {
		name     string
		src, dst []int
	}{
		{"runs", []int{3, 4, 5, 9, 10, 11, 12, 20}, []int{7, 2, 3, 0, 1, 30, 31, 15}},
		{"one block", []int{50}, []int{0}},
		{"fragmented", fragmented, dstFrag},
	} {
		for _, pull := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/pull=%v", tc.name, pull), func(t *testing.T) {
				src := newHost(t, layout.LayerSeparated(lLayers, 2, 96, lPiece, lTag))
				dst := newHost(t, layout.Contiguous(lLayers, 2, 96, lPiece, lTag))
				sender, recv := layeredPlanes(t, ucx.Config{Pull: pull})
				sb, db := blocksOf(src, tc.src), blocksOf(dst, tc.dst)
				for i, b := range sb {
					stampBlock(b, 9, i)
				}
				moveOnce(t, sender, recv, handoff.PlaneID{Session: 1, Handoff: 1}, sb, db)
				for i, b := range db {
					if err := checkBlock(b, 9, i); err != nil {
						t.Fatal(err)
					}
				}
				if err := untouched(dst, tc.dst); err != nil {
					t.Fatal(err)
				}
				n := int64(len(tc.src) * lBlock)
				if !pull {
					if s := sender.Stats(); s.Registrations != 0 || s.Messages != len(tc.src) || s.Completed != 1 {
						t.Fatalf("sender %+v, want %d messages, no registration", s, len(tc.src))
					}
					if s := recv.Stats(); s.Registrations != 0 || s.Messages != len(tc.src) || s.Bytes != n || s.Completed != 1 {
						t.Fatalf("receiver %+v, want %d messages of %d bytes", s, len(tc.src), n)
					}
					return
				}
				if s := sender.Stats(); s.Registrations != runsOf(tc.src)*lLayers*2 || s.RegisteredBytes != n || s.Completed != 1 {
					t.Fatalf("sender %+v, want %d registrations of %d bytes", s, runsOf(tc.src)*lLayers*2, n)
				}
				// The destination's blocks are contiguous, the source's
				// pieces are not: one get per piece.
				if s := recv.Stats(); s.Registrations != runsOf(tc.dst) || s.RegisteredBytes != n || s.Gets != len(tc.dst)*lLayers*2 || s.Bytes != n {
					t.Fatalf("receiver %+v, want %d registrations of %d bytes, %d gets", s, runsOf(tc.dst), n, len(tc.dst)*lLayers*2)
				}
			})
		}
	}
}

func TestLayeredBatchesGets(t *testing.T) {
	// Pulled, pieces contiguous on both sides share a get: layer by
	// layer when both are layer-separated, block by block when both are
	// contiguous.
	ids, dids := []int{3, 4, 5, 6, 7, 8, 9, 10}, []int{0, 1, 2, 3, 4, 5, 6, 7}
	for _, tc := range []struct {
		name     string
		src, dst func(layers, kvs, blocks, pieceBytes int, tag string) layout.Layout
		gets     int
	}{
		{"separated", layout.LayerSeparated, layout.LayerSeparated, lLayers * 2},
		{"contiguous", layout.Contiguous, layout.Contiguous, 1},
		{"contiguous to separated", layout.Contiguous, layout.LayerSeparated, len(ids) * lLayers * 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := newHost(t, tc.src(lLayers, 2, 16, lPiece, lTag))
			dst := newHost(t, tc.dst(lLayers, 2, 16, lPiece, lTag))
			sender, recv := layeredPlanes(t, ucx.Config{Pull: true})
			sb, db := blocksOf(src, ids), blocksOf(dst, dids)
			for i, b := range sb {
				stampBlock(b, 3, i)
			}
			moveOnce(t, sender, recv, handoff.PlaneID{Session: 2, Handoff: 1}, sb, db)
			for i, b := range db {
				if err := checkBlock(b, 3, i); err != nil {
					t.Fatal(err)
				}
			}
			if err := untouched(dst, dids); err != nil {
				t.Fatal(err)
			}
			if s := recv.Stats(); s.Gets != tc.gets {
				t.Fatalf("receiver %+v, want %d gets", s, tc.gets)
			}
			wantRegs := lLayers * 2 // one per layer and kind
			if tc.src(lLayers, 2, 16, lPiece, lTag).IsContiguous() {
				wantRegs = 1
			}
			if s := sender.Stats(); s.Registrations != wantRegs {
				t.Fatalf("sender %+v, want %d registrations", s, wantRegs)
			}
		})
	}
}

func TestLayeredFromPlainBlocks(t *testing.T) {
	// A plain []byte block is the one-piece case: it holds a layered
	// block's pieces one after the other (the contiguous layout), so a
	// plain source feeds a layer-separated destination piece by piece.
	sender, err := ucx.NewSender(ucx.Config{}, ucx.HostBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer sender.Close()
	_, recv := layeredPlanes(t, ucx.Config{})
	dst := newHost(t, layout.LayerSeparated(lLayers, 2, 16, lPiece, lTag))
	ref := newHost(t, layout.Contiguous(lLayers, 2, 16, lPiece, lTag))
	ids := []int{5, 6, 1}
	var src [][]byte
	for i, b := range blocksOf(ref, ids) {
		stampBlock(b, 21, i)
		off := int(b.ID) * lBlock
		src = append(src, ref.Base()[off:off+lBlock:off+lBlock])
	}
	db := blocksOf(dst, []int{8, 9, 10})
	moveOnce(t, sender, recv, handoff.PlaneID{Session: 3, Handoff: 1}, src, db)
	for i, b := range db {
		if err := checkBlock(b, 21, i); err != nil {
			t.Fatal(err)
		}
	}
	if err := untouched(dst, []int{8, 9, 10}); err != nil {
		t.Fatal(err)
	}
}

func TestLayeredMismatchRefused(t *testing.T) {
	// Pieces that do not match are refused before the destination
	// registers, connects or attaches anything.
	src := newHost(t, layout.LayerSeparated(lLayers, 2, 16, lPiece, lTag))
	sender, recv := layeredPlanes(t, ucx.Config{})
	attach := func(*kvlease.Transfer) error { t.Fatal("attached"); return nil }
	ok := func(*kvlease.Transfer) error { return nil }
	sb := blocksOf(src, []int{1, 2, 3})
	for n, dl := range []layout.Layout{
		layout.LayerSeparated(2*lLayers, 2, 16, lPiece/2, lTag), // same block bytes, other pieces
		layout.Contiguous(lLayers, 1, 16, 2*lPiece, lTag),       // same block bytes, other pieces
		layout.LayerSeparated(lLayers, 2, 16, 2*lPiece, lTag),   // larger pieces
		layout.Contiguous(lLayers, 2, 16, lPiece/2, lTag),       // smaller blocks
	} {
		id := handoff.PlaneID{Session: 4, Handoff: uint64(n)}
		accept, err := recv.Prepare(id, 3)
		if err != nil {
			t.Fatal(err)
		}
		start, err := sender.Send(id, sb, accept, ok)
		if err != nil {
			t.Fatal(err)
		}
		dst := newHost(t, dl)
		if err := recv.Receive(id, blocksOf(dst, []int{0, 1, 2}), start, attach); !errors.Is(err, ucx.ErrCorrupt) {
			t.Fatalf("into %v: %v", dl, err)
		}
		sender.Finish(id, errors.New("refused"))
	}
	// Every truncation of layered Start bytes, with the segments implied
	// (separated blocks 1-3: one segment per registration) and listed
	// (contiguous blocks 5, 3, 4: one registration, two segments), is
	// refused the same way.
	csrc := newHost(t, layout.Contiguous(lLayers, 2, 16, lPiece, lTag))
	for n, blocks := range [][]layout.Block{sb, blocksOf(csrc, []int{5, 3, 4})} {
		id := handoff.PlaneID{Session: 6, Handoff: uint64(n)}
		accept, err := recv.Prepare(id, 3)
		if err != nil {
			t.Fatal(err)
		}
		start, err := sender.Send(id, blocks, accept, ok)
		if err != nil {
			t.Fatal(err)
		}
		dst := blocksOf(newHost(t, layout.Contiguous(lLayers, 2, 16, lPiece, lTag)), []int{0, 1, 2})
		for k := range len(start) {
			bad := handoff.PlaneID{Session: 7, Handoff: uint64(k)}
			if _, err := recv.Prepare(bad, 3); err != nil {
				t.Fatal(err)
			}
			if err := recv.Receive(bad, dst, start[:k], attach); !errors.Is(err, ucx.ErrCorrupt) {
				t.Fatalf("start of %d of %d bytes: %v", k, len(start), err)
			}
		}
		sender.Finish(id, errors.New("refused"))
	}
	if s := recv.Stats(); s.Registrations != 0 || s.Started != 0 {
		t.Fatalf("receiver registered or started: %+v", s)
	}
	// A source whose own regions disagree is refused before it
	// registers anything.
	other := newHost(t, layout.LayerSeparated(lLayers, 2, 16, 2*lPiece, lTag))
	before := sender.Stats()
	for _, bad := range [][]layout.Block{
		{src.Region(1), {}},
		{src.Region(1), other.Region(2)},
		{src.Region(1), src.Region(1)}, // the same pieces twice
	} {
		id := handoff.PlaneID{Session: 5, Handoff: 1}
		accept, err := recv.Prepare(id, len(bad))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := sender.Send(id, bad, accept, attach); !errors.Is(err, kvlease.ErrInvalidArgument) {
			t.Fatalf("send of %v: %v", bad, err)
		}
		recv.Forget(id)
	}
	if s := sender.Stats(); s.Registrations != before.Registrations || s.Started != before.Started {
		t.Fatalf("sender registered bad regions: %+v after %+v", s, before)
	}
}

func TestLayeredHandoff(t *testing.T) {
	// A whole handoff: the prefill side's pool is layer-separated, the
	// decode side's block-contiguous, both envelopes name the same
	// Layout. One Transfer per side; the blocks arrive piece by piece.
	lay := layout.Layout{Layers: 8, KVs: 2, PieceBytes: 256, Tag: lTag} // 4096-byte blocks
	e := env(64)
	e.Layout = lay
	srcH := newHost(t, layout.LayerSeparated(8, 2, 64, 256, lTag))
	dstH := newHost(t, layout.Contiguous(8, 2, 64, 256, lTag))
	srcPool, err := kvlease.NewPool[layout.Block](srcH)
	if err != nil {
		t.Fatal(err)
	}
	dstPool, err := kvlease.NewPool[layout.Block](dstH)
	if err != nil {
		t.Fatal(err)
	}
	sender, recv := layeredPlanes(t, ucx.Config{})
	got := make(chan *handoff.Incoming[layout.Block], 1)
	dst, err := handoff.NewDestination(dstPool, recv, handoff.DestinationConfig[layout.Block]{
		HalfConfig:  withAuth(handoff.HalfConfig{Envelope: e, Name: "decode", Peer: "prefill", Deadline: 10 * time.Second}, testKey),
		OnDelivered: func(*handoff.Incoming[layout.Block]) {}, // the test reads, then releases
		OnFinal:     func(in *handoff.Incoming[layout.Block]) { got <- in },
	})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() {
		c, err := ln.Accept()
		_ = ln.Close()
		if err != nil {
			served <- err
			return
		}
		served <- dst.Serve(c)
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	src, err := handoff.NewSource(c, sender, withAuth(handoff.HalfConfig{Envelope: e, Name: "prefill", Peer: "decode", Deadline: 10 * time.Second}, testKey))
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = src.Close()
		<-served
		for _, p := range []*kvlease.Pool[layout.Block]{srcPool, dstPool} {
			if err := p.Check(); err != nil {
				t.Error(err)
			}
		}
	}()
	lease, err := srcPool.Acquire("r1", 10)
	if err != nil {
		t.Fatal(err)
	}
	for i := range lease.Len() {
		b, err := lease.Region(i)
		if err != nil {
			t.Fatal(err)
		}
		stampBlock(b, 17, i)
	}
	o, err := src.Propose(1, "r1", lease, nil)
	if err != nil {
		t.Fatal(err)
	}
	waitFinal(t, o)
	if o.State() != handoff.Delivered {
		t.Fatalf("source %v: %v", o.State(), o.History())
	}
	var in *handoff.Incoming[layout.Block]
	select {
	case in = <-got:
	case <-time.After(20 * time.Second):
		t.Fatal("destination never finished")
	}
	if in.State() != handoff.Delivered {
		t.Fatalf("destination %v: %v", in.State(), in.History())
	}
	for i := range in.Lease().Len() {
		b, err := in.Lease().ReadRegion(i)
		if err != nil {
			t.Fatal(err)
		}
		if err := checkBlock(b, 17, i); err != nil {
			t.Fatal(err)
		}
	}
	in.Lease().Release()
	lease.Release()
	if s := sender.Stats(); s.Started != 1 || s.Completed != 1 {
		t.Fatalf("sender %+v", s)
	}
	if s := recv.Stats(); s.Started != 1 || s.Completed != 1 || s.Bytes != 10*4096 {
		t.Fatalf("receiver %+v", s)
	}
}

func TestLayeredCancelBetweenPieces(t *testing.T) {
	// A cancel stops a layered read between gets as it stops a plain one:
	// the blocks read before it are whole, nothing after it is written,
	// and a flush after the posted gets is the evidence (kvlease.ErrCanceled).
	stuck, release := make(chan struct{}), make(chan struct{})
	sender, recv := layeredPlanes(t, ucx.Config{Pull: true, MaxGet: lPiece, Window: 1, BeforeGet: func(_ handoff.PlaneID, block int) {
		if block == 2 {
			select {
			case <-stuck:
			default:
				close(stuck)
				<-release
			}
		}
	}})
	src := newHost(t, layout.LayerSeparated(lLayers, 2, 16, lPiece, lTag))
	dst := newHost(t, layout.LayerSeparated(lLayers, 2, 16, lPiece, lTag))
	ids := []int{4, 5, 6, 7}
	sb, db := blocksOf(src, ids), blocksOf(dst, ids)
	for i, b := range sb {
		stampBlock(b, 40, i)
	}
	id := handoff.PlaneID{Session: 8, Handoff: 1}
	_, dt := startOnce(t, sender, recv, id, sb, db)
	cancelStuck(t, dt, stuck, release)
	// One piece per get, block by block: blocks 0 and 1 arrived whole.
	for i, b := range db[:2] {
		if err := checkBlock(b, 40, i); err != nil {
			t.Fatal(err)
		}
	}
	if err := untouched(dst, ids[:2]); err != nil {
		t.Fatal(err)
	}
	if s := recv.Stats(); s.Canceled != 1 || s.Gets != 2*lLayers*2 {
		t.Fatalf("receiver %+v, want %d gets", s, 2*lLayers*2)
	}
	sender.Finish(id, errors.New("test over"))
}

func TestLayeredPushRuns(t *testing.T) {
	// Pushed, a block-contiguous source's run of consecutive blocks is
	// one message, scattered into a layer-separated destination's pieces;
	// a layer-separated source's blocks are one message each (a block's
	// pieces are not adjacent there).
	ids, dids := []int{3, 4, 5, 6, 9, 10, 20}, []int{0, 1, 2, 3, 4, 5, 6}
	for _, tc := range []struct {
		name     string
		src, dst func(layers, kvs, blocks, pieceBytes int, tag string) layout.Layout
		messages int
	}{
		{"contiguous to separated", layout.Contiguous, layout.LayerSeparated, 3},
		{"contiguous to contiguous", layout.Contiguous, layout.Contiguous, 3},
		{"separated to contiguous", layout.LayerSeparated, layout.Contiguous, len(ids)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := newHost(t, tc.src(lLayers, 2, 32, lPiece, lTag))
			dst := newHost(t, tc.dst(lLayers, 2, 32, lPiece, lTag))
			sender, recv := layeredPlanes(t, ucx.Config{})
			sb, db := blocksOf(src, ids), blocksOf(dst, dids)
			for i, b := range sb {
				stampBlock(b, 4, i)
			}
			moveOnce(t, sender, recv, handoff.PlaneID{Session: 3, Handoff: 1}, sb, db)
			for i, b := range db {
				if err := checkBlock(b, 4, i); err != nil {
					t.Fatal(err)
				}
			}
			if err := untouched(dst, dids); err != nil {
				t.Fatal(err)
			}
			if s := sender.Stats(); s.Messages != tc.messages || s.Registrations != 0 {
				t.Fatalf("sender %+v, want %d messages", s, tc.messages)
			}
			if s := recv.Stats(); s.Messages != tc.messages || s.Bytes != int64(len(ids)*lBlock) {
				t.Fatalf("receiver %+v, want %d messages", s, tc.messages)
			}
		})
	}
}

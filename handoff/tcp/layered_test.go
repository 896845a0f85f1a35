package tcp_test

import (
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/gpu"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
	"github.com/kvlease/kvlease/layout"
)

// 8 layers × K, V × 256-byte pieces: 4096-byte blocks (blockBytes), so
// the layered planes and the contiguous ones share the envelope.
const (
	lLayers = 8
	lPiece  = 256
)

func layeredEnv(poolBlocks int) handoff.Envelope {
	e := env(poolBlocks)
	e.Layout = layout.Layout{Layers: lLayers, KVs: 2, PieceBytes: lPiece, Tag: "bf16 t16 h2 d64"}
	return e
}

func hostLayout(t testing.TB, l layout.Layout) (*layout.Host, *kvlease.Pool[layout.Block]) {
	t.Helper()
	h, err := layout.NewHost(l)
	if err != nil {
		t.Fatal(err)
	}
	p, err := kvlease.NewPool[layout.Block](h)
	if err != nil {
		t.Fatal(err)
	}
	return h, p
}

// pieceMark is the marker byte j of piece (layer, kv) of block i.
func pieceMark(seed byte, i, layer, kv, j int) byte {
	return seed + byte(31*i+7*layer+3*kv) + byte(j%5)
}

func stampPieces(t testing.TB, l *kvlease.Lease[layout.Block], seed byte) {
	t.Helper()
	for i := range l.Len() {
		b, err := l.Region(i)
		if err != nil {
			t.Fatal(err)
		}
		for layer := range lLayers {
			for kv := range 2 {
				p := b.Piece(layer, kv)
				for j := range p {
					p[j] = pieceMark(seed, i, layer, kv, j)
				}
			}
		}
	}
}

// checkPieces returns the number of pieces of l whose marker is wrong.
func checkPieces(t testing.TB, l *kvlease.Lease[layout.Block], seed byte) int {
	t.Helper()
	bad := 0
	for i := range l.Len() {
		b, err := l.ReadRegion(i)
		if err != nil {
			t.Fatal(err)
		}
		for layer := range lLayers {
			for kv := range 2 {
				p := b.Piece(layer, kv)
				for j := range p {
					if p[j] != pieceMark(seed, i, layer, kv, j) {
						bad++
						break
					}
				}
			}
		}
	}
	return bad
}

// halves is a Source and a Destination over 127.0.0.1, with whatever
// planes the test gives them.
type halves[S, D any] struct {
	src    *handoff.Source[S]
	dst    *handoff.Destination[D]
	sender *tcp.Sender
	recv   *tcp.Receiver
	finals chan *handoff.Incoming[D]
}

func newHalves[S, D any](t testing.TB, srcPool *kvlease.Pool[S], dstPool *kvlease.Pool[D], e handoff.Envelope,
	send func(*tcp.Sender) handoff.SendPlane[S], recv func(*tcp.Receiver) handoff.RecvPlane[D], wrapRecv func(net.Conn) net.Conn) *halves[S, D] {
	t.Helper()
	ctlLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dataLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h := &halves[S, D]{sender: tcp.NewSender(tcp.Config{}), recv: tcp.NewReceiver(dataLn, tcp.Config{WrapConn: wrapRecv}),
		finals: make(chan *handoff.Incoming[D], 16)}
	h.dst, err = handoff.NewDestination(dstPool, recv(h.recv), handoff.DestinationConfig[D]{
		HalfConfig:       handoff.HalfConfig{Envelope: e, Name: "decode", Peer: "prefill", Deadline: 10 * time.Second, Auth: testAuth},
		OnDelivered:      func(*handoff.Incoming[D]) {}, // the test reads and releases the lease
		MaxSessionBlocks: -1,                            // a handoff may take the whole pool
		OnFinal:          func(in *handoff.Incoming[D]) { h.finals <- in },
	})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() {
		c, err := ctlLn.Accept()
		_ = ctlLn.Close()
		if err != nil {
			served <- err
			return
		}
		served <- h.dst.Serve(c)
	}()
	c, err := net.Dial("tcp", ctlLn.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	h.src, err = handoff.NewSource(c, send(h.sender), handoff.HalfConfig{Envelope: e, Name: "prefill", Peer: "decode", Deadline: 10 * time.Second, Auth: testAuth})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = h.src.Close()
		<-served
		_ = h.sender.Close()
		_ = h.recv.Close()
		if err := srcPool.Check(); err != nil {
			t.Error(err)
		}
		if err := dstPool.Check(); err != nil {
			t.Error(err)
		}
	})
	return h
}

func (h *halves[S, D]) final(t testing.TB) *handoff.Incoming[D] {
	t.Helper()
	select {
	case in := <-h.finals:
		return in
	case <-time.After(10 * time.Second):
		t.Fatal("the destination never finished the handoff")
		return nil
	}
}

func layered(s *tcp.Sender) handoff.SendPlane[layout.Block] { return tcp.SendLayered[layout.Block](s) }
func layeredRecv(r *tcp.Receiver) handoff.RecvPlane[layout.Block] {
	return tcp.ReceiveLayered[layout.Block](r)
}

// A layer-separated source pool hands 12 blocks to a destination pool in
// another arrangement (block-contiguous) over loopback: one Transfer per
// side, every piece lands where the destination's layout puts it with
// its marker intact, and the destination's prefix cache fills.
func TestLayeredLoopbackRoundTrip(t *testing.T) {
	tag := layeredEnv(64).Layout.Tag
	_, srcPool := hostLayout(t, layout.LayerSeparated(lLayers, 2, 64, lPiece, tag))
	dstHost, dstPool := hostLayout(t, layout.Contiguous(lLayers, 2, 64, lPiece, tag))
	h := newHalves(t, srcPool, dstPool, layeredEnv(64), layered, layeredRecv, nil)

	lease, err := srcPool.Acquire("r1", 12)
	if err != nil {
		t.Fatal(err)
	}
	stampPieces(t, lease, 3)
	tokens := make([]int32, 16*12)
	for i := range tokens {
		tokens[i] = int32(i)
	}
	hashes := kvlease.ChainHashes(9, tokens, 16)
	o, err := h.src.Propose(1, "r1", lease, hashes[:10])
	if err != nil {
		t.Fatal(err)
	}
	waitFinal(t, o)
	in := h.final(t)
	if o.State() != handoff.Delivered || in.State() != handoff.Delivered {
		t.Fatalf("source %v, destination %v: %v / %v", o.State(), in.State(), o.History(), in.History())
	}
	if bad := checkPieces(t, in.Lease(), 3); bad != 0 {
		t.Fatalf("marker mismatches %d", bad)
	}
	// The destination is block-contiguous: block b of its memory is one
	// span whose pieces follow in (layer, kv) order.
	b, _ := in.Lease().ReadRegion(5)
	span := dstHost.Base()[int(b.ID)*blockBytes : (int(b.ID)+1)*blockBytes]
	for layer := range lLayers {
		for kv := range 2 {
			if got, want := span[(layer*2+kv)*lPiece], pieceMark(3, 5, layer, kv, 0); got != want {
				t.Fatalf("contiguous block 5, piece (%d, %d): %d, want %d", layer, kv, got, want)
			}
		}
	}
	if s, r := h.sender.Stats(), h.recv.Stats(); s.Started != 1 || s.Completed != 1 || r.Started != 1 || r.Completed != 1 ||
		s.Bytes != 12*blockBytes || r.Bytes != 12*blockBytes {
		t.Fatalf("one transfer per side expected: sender %+v, receiver %+v", s, r)
	}
	in.Lease().Release()
	if got := dstPool.CachedPrefix(hashes[:10]); got != 10 {
		t.Fatalf("destination cached %d of 10 delivered full blocks", got)
	}
	lease.Release()
	<-lease.Settled()
}

// The wire is the contiguous plane's, so a layered source reaches a plain
// []byte pool (the blocks arrive block-contiguous) and a plain source
// reaches a layered pool (piece by piece).
func TestLayeredInteroperatesWithContiguous(t *testing.T) {
	tag := layeredEnv(64).Layout.Tag
	sep := layout.LayerSeparated(lLayers, 2, 64, lPiece, tag)

	t.Run("layered to contiguous", func(t *testing.T) {
		_, srcPool := hostLayout(t, sep)
		dstPool := hostPool(t, 64)
		h := newHalves(t, srcPool, dstPool, layeredEnv(64), layered,
			func(r *tcp.Receiver) handoff.RecvPlane[[]byte] { return r }, nil)
		lease, _ := srcPool.Acquire("r", 4)
		stampPieces(t, lease, 5)
		o, err := h.src.Propose(1, "r", lease, nil)
		if err != nil {
			t.Fatal(err)
		}
		waitFinal(t, o)
		in := h.final(t)
		if in.State() != handoff.Delivered {
			t.Fatalf("destination %v: %v", in.State(), in.History())
		}
		for i := range 4 {
			r, _ := in.Lease().Region(i)
			for layer := range lLayers {
				for kv := range 2 {
					for j := range lPiece {
						if got, want := r[(layer*2+kv)*lPiece+j], pieceMark(5, i, layer, kv, j); got != want {
							t.Fatalf("block %d piece (%d, %d) byte %d: %d, want %d", i, layer, kv, j, got, want)
						}
					}
				}
			}
		}
		in.Lease().Release()
		lease.Release()
	})

	t.Run("contiguous to layered", func(t *testing.T) {
		srcPool := hostPool(t, 64)
		_, dstPool := hostLayout(t, sep)
		h := newHalves(t, srcPool, dstPool, layeredEnv(64),
			func(s *tcp.Sender) handoff.SendPlane[[]byte] { return s }, layeredRecv, nil)
		lease, _ := srcPool.Acquire("r", 4)
		for i := range 4 {
			r, _ := lease.Region(i)
			for layer := range lLayers {
				for kv := range 2 {
					for j := range lPiece {
						r[(layer*2+kv)*lPiece+j] = pieceMark(6, i, layer, kv, j)
					}
				}
			}
		}
		o, err := h.src.Propose(1, "r", lease, nil)
		if err != nil {
			t.Fatal(err)
		}
		waitFinal(t, o)
		in := h.final(t)
		if in.State() != handoff.Delivered {
			t.Fatalf("destination %v: %v", in.State(), in.History())
		}
		if bad := checkPieces(t, in.Lease(), 6); bad != 0 {
			t.Fatalf("marker mismatches %d", bad)
		}
		in.Lease().Release()
		lease.Release()
	})
}

// corruptAfter flips one byte of the stream once n bytes have passed.
type corruptAfter struct {
	net.Conn
	n    int64
	seen atomic.Int64
}

func (c *corruptAfter) Read(p []byte) (int, error) {
	k, err := c.Conn.Read(p)
	start := c.seen.Add(int64(k)) - int64(k)
	if start <= c.n && c.n < start+int64(k) {
		p[c.n-start] ^= 0xff
	}
	return k, err
}

// A corrupted piece fails the destination's transfer with ErrCorrupt
// (its own loop stopped: evidence), the handoff is Failed on both sides,
// and no block is lost: the destination lease goes back, the source lease
// stays the caller's.
func TestLayeredCorruptPieceFails(t *testing.T) {
	tag := layeredEnv(64).Layout.Tag
	_, srcPool := hostLayout(t, layout.LayerSeparated(lLayers, 2, 64, lPiece, tag))
	_, dstPool := hostLayout(t, layout.LayerSeparated(lLayers, 2, 64, lPiece, tag))
	// Past the hello and two blocks, inside block 2's fourth piece.
	at := int64(27 + 2*(12+blockBytes) + 12 + 3*lPiece + 17)
	h := newHalves(t, srcPool, dstPool, layeredEnv(64), layered, layeredRecv,
		func(c net.Conn) net.Conn { return &corruptAfter{Conn: c, n: at} })
	lease, _ := srcPool.Acquire("r", 6)
	stampPieces(t, lease, 1)
	o, err := h.src.Propose(1, "r", lease, nil)
	if err != nil {
		t.Fatal(err)
	}
	waitFinal(t, o)
	in := h.final(t)
	if in.State() != handoff.Failed || !errors.Is(in.Err(), tcp.ErrCorrupt) {
		t.Fatalf("destination %v (%v), want Failed with ErrCorrupt", in.State(), in.Err())
	}
	if o.State() != handoff.Failed {
		t.Fatalf("source %v (%v), want Failed", o.State(), o.Err())
	}
	if lease.State() != kvlease.LeaseActive {
		t.Fatalf("source lease %v after a failed handoff", lease.State())
	}
	lease.Release()
	<-lease.Settled()
	if st := dstPool.Stats(); st.Free+st.Cached != 64 {
		t.Fatalf("destination pool after the failure: %+v", st)
	}
}

// Regions whose layouts disagree are refused before anything is dialled
// or attached; so is a zero region.
func TestLayeredPlanesRefuseMixedLayouts(t *testing.T) {
	tag := layeredEnv(64).Layout.Tag
	a, _ := layout.NewHost(layout.LayerSeparated(lLayers, 2, 4, lPiece, tag))
	b, _ := layout.NewHost(layout.LayerSeparated(lLayers/2, 2, 4, 2*lPiece, tag))
	dataLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := tcp.NewReceiver(dataLn, tcp.Config{})
	s := tcp.NewSender(tcp.Config{})
	t.Cleanup(func() { _ = s.Close(); _ = r.Close() })
	lr, ls := tcp.ReceiveLayered[layout.Block](r), tcp.SendLayered[layout.Block](s)
	id := handoff.PlaneID{Session: 1, Handoff: 1}
	accept, err := lr.Prepare(id, 2)
	if err != nil {
		t.Fatal(err)
	}
	attached := 0
	attach := func(*kvlease.Transfer) error { attached++; return nil }
	for name, regions := range map[string][]layout.Block{
		"mixed": {a.Region(0), b.Region(0)},
		"zero":  {a.Region(0), {}},
	} {
		if _, err := ls.Send(id, regions, accept, attach); !errors.Is(err, kvlease.ErrInvalidArgument) {
			t.Errorf("Send of %s regions: %v", name, err)
		}
	}
	if err := lr.Receive(id, []layout.Block{a.Region(0), b.Region(1)}, nil, attach); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Errorf("Receive of mixed regions: %v", err)
	}
	if attached != 0 || s.Stats().Started != 0 || r.Stats().Started != 0 {
		t.Fatalf("refused calls attached %d transfers: sender %+v receiver %+v", attached, s.Stats(), r.Stats())
	}
	// The refused Receive dropped the prepared id.
	if err := lr.Receive(id, []layout.Block{a.Region(0), a.Region(1)}, nil, attach); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("Receive after a refusal: %v", err)
	}
}

// BenchmarkLayeredHandoff moves 64 blocks of 16 pieces (4 KiB blocks,
// 256 KiB in all) per handoff over loopback, layer-separated on both
// sides, next to the contiguous plane moving the same bytes in the same
// run: x-contiguous is the ratio of the layered time to the contiguous
// one.
func BenchmarkLayeredHandoff(b *testing.B) {
	const n = 64
	tag := layeredEnv(n).Layout.Tag
	_, sp := hostLayout(b, layout.LayerSeparated(lLayers, 2, n, lPiece, tag))
	_, dp := hostLayout(b, layout.LayerSeparated(lLayers, 2, n, lPiece, tag))
	cs, cd := hostPool(b, n), hostPool(b, n)
	lh := newHalves(b, sp, dp, layeredEnv(n), layered, layeredRecv, nil)
	ch := newHalves(b, cs, cd, env(n), func(s *tcp.Sender) handoff.SendPlane[[]byte] { return s },
		func(r *tcp.Receiver) handoff.RecvPlane[[]byte] { return r }, nil)
	var id uint64
	layeredOnce := func() {
		id++
		l, err := sp.Acquire("r", n)
		if err != nil {
			b.Fatal(err)
		}
		o, err := lh.src.Propose(id, "r", l, nil)
		if err != nil {
			b.Fatal(err)
		}
		<-o.Done()
		in := <-lh.finals
		if o.State() != handoff.Delivered || in.State() != handoff.Delivered {
			b.Fatalf("%v %v", o.State(), in.State())
		}
		in.Lease().Release()
		l.Release()
		<-l.Settled()
	}
	contigOnce := func() {
		id++
		l, err := cs.Acquire("r", n)
		if err != nil {
			b.Fatal(err)
		}
		o, err := ch.src.Propose(id, "r", l, nil)
		if err != nil {
			b.Fatal(err)
		}
		<-o.Done()
		in := <-ch.finals
		if o.State() != handoff.Delivered || in.State() != handoff.Delivered {
			b.Fatalf("%v %v", o.State(), in.State())
		}
		in.Lease().Release()
		l.Release()
		<-l.Settled()
	}
	b.SetBytes(n * blockBytes)
	var base time.Duration
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		start := time.Now()
		contigOnce()
		base += time.Since(start)
		b.StartTimer()
		layeredOnce()
	}
	b.StopTimer()
	baseNs := float64(base.Nanoseconds()) / float64(b.N)
	b.ReportMetric(baseNs, "contiguous-ns/op")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/baseNs, "x-contiguous")
}

// Pinned host blocks in a layout cross a TCP handoff as they are.
var _ tcp.LayeredRegion = gpu.HostBlock{}

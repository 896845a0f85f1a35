package tcp_test

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
	"github.com/kvlease/kvlease/layout"
)

// The streaming tests run a simulated prefill that computes the prompt
// layer by layer: for each layer it spends a delay (the layer's compute),
// then writes that layer's bytes of every block (a marker of request,
// block and layer) and only then marks the layer written. Before the
// prefill the source blocks hold a stale pattern, so a plane that reads a
// part before its mark ships stale bytes and the destination's marker
// check fails.

const (
	sLayers = 8 // layers of the flat tests' progress: 512-byte parts of 4096-byte blocks
	stale   = 0xEE
)

// partMark is byte j of part (block i, layer l) of request seed.
func partMark(seed byte, i, l, j int) byte { return seed + byte(31*i) + byte(7*l) + byte(j%5) }

// streamOpts configures a streaming rig.
type streamOpts struct {
	insecure           bool
	wrapSend, wrapRecv func(net.Conn) net.Conn
	wrapCtl            func(net.Conn) net.Conn // the source's control connection
	deadline           time.Duration
	stall              time.Duration // both planes' StallTimeout
}

// streamHalves are halves that also pass on each accepted handoff.
type streamHalves[S, D any] struct {
	*halves[S, D]
	accepted chan *handoff.Incoming[D]
}

// newStreamHalves is newHalves with the options of the streaming tests.
func newStreamHalves[S, D any](t testing.TB, srcPool *kvlease.Pool[S], dstPool *kvlease.Pool[D], e handoff.Envelope,
	send func(*tcp.Sender) handoff.SendPlane[S], recv func(*tcp.Receiver) handoff.RecvPlane[D], o streamOpts) *streamHalves[S, D] {
	t.Helper()
	ctlLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dataLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if o.deadline == 0 {
		o.deadline = 10 * time.Second
	}
	half := func(name, peer string) handoff.HalfConfig {
		h := handoff.HalfConfig{Envelope: e, Name: name, Peer: peer, Deadline: o.deadline, Auth: testAuth}
		if o.insecure {
			h.Auth, h.Insecure, h.Logf = nil, true, quiet
		}
		return h
	}
	h := &streamHalves[S, D]{halves: &halves[S, D]{sender: tcp.NewSender(tcp.Config{WrapConn: o.wrapSend, StallTimeout: o.stall}),
		recv: tcp.NewReceiver(dataLn, tcp.Config{WrapConn: o.wrapRecv, StallTimeout: o.stall}), finals: make(chan *handoff.Incoming[D], 16)},
		accepted: make(chan *handoff.Incoming[D], 16)}
	h.dst, err = handoff.NewDestination(dstPool, recv(h.recv), handoff.DestinationConfig[D]{
		HalfConfig:       half("decode", "prefill"),
		OnDelivered:      func(*handoff.Incoming[D]) {},
		MaxSessionBlocks: -1,
		OnAccept: func(in *handoff.Incoming[D]) {
			select {
			case h.accepted <- in:
			default: // nobody is waiting for them (benchmarks)
			}
		},
		OnFinal: func(in *handoff.Incoming[D]) { h.finals <- in },
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
	if o.wrapCtl != nil {
		c = o.wrapCtl(c)
	}
	if h.src, err = handoff.NewSource(c, send(h.sender), half("prefill", "decode")); err != nil {
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

func flat(s *tcp.Sender) handoff.SendPlane[[]byte]       { return s }
func flatRecv(r *tcp.Receiver) handoff.RecvPlane[[]byte] { return r }

// prefill computes layers [0, upTo) of p's layers: for each, delay, then
// fill(layer), then the mark. It returns when done or when stop closes
// (before the next layer).
func prefill(t testing.TB, p *handoff.Progress, delay time.Duration, upTo int, fill func(layer int), stop <-chan struct{}) {
	for l := range upTo {
		select {
		case <-time.After(delay):
		case <-stop:
			return
		}
		fill(l)
		if err := p.WroteLayers(l + 1); err != nil {
			t.Error(err)
			return
		}
	}
}

// flatLease acquires n blocks holding the stale pattern, and returns
// fill, which writes request seed's markers into layer l of each.
func flatLease(t testing.TB, pool *kvlease.Pool[[]byte], n int, seed byte, layers int) (*kvlease.Lease[[]byte], func(int)) {
	t.Helper()
	l, err := pool.Acquire(fmt.Sprintf("r%d", seed), n)
	if err != nil {
		t.Fatal(err)
	}
	regions := make([][]byte, n)
	for i := range n {
		if regions[i], err = l.Region(i); err != nil {
			t.Fatal(err)
		}
		for j := range regions[i] {
			regions[i][j] = stale
		}
	}
	pb := len(regions[0]) / layers
	return l, func(layer int) {
		for i, r := range regions {
			part := r[layer*pb : (layer+1)*pb]
			for j := range part {
				part[j] = partMark(seed, i, layer, j)
			}
		}
	}
}

// checkFlat returns the first part of l that does not hold request
// seed's marker.
func checkFlat(l *kvlease.Lease[[]byte], seed byte, layers int) error {
	for i := range l.Len() {
		r, err := l.ReadRegion(i)
		if err != nil {
			return err
		}
		pb := len(r) / layers
		for j := range r {
			if r[j] != partMark(seed, i, j/pb, j%pb) {
				return fmt.Errorf("block %d, layer %d, byte %d: %#x, want %#x (stale %#x)", i, j/pb, j%pb, r[j], partMark(seed, i, j/pb, j%pb), stale)
			}
		}
	}
	return nil
}

// watchHost is a layered host memory whose blocks count every piece a
// plane asks for before the progress marks its layer written: the plane
// must never read an unmarked part.
type watchHost struct {
	*layout.Host
	prog  atomic.Pointer[handoff.Progress]
	early atomic.Int64
}

// watchBlock is a block of a watchHost.
type watchBlock struct {
	layout.Block
	w *watchHost
}

func (w *watchHost) Region(id kvlease.BlockID) watchBlock { return watchBlock{w.Host.Region(id), w} }

// Piece is what the plane calls to read (or write) a piece.
func (b watchBlock) Piece(layer, kv int) []byte {
	if p := b.w.prog.Load(); p != nil {
		if l, _ := p.Written(); layer >= l {
			b.w.early.Add(1)
		}
	}
	return b.Block.Piece(layer, kv)
}

// layeredLease acquires n blocks of a watchHost pool holding the stale
// pattern, and returns fill, which writes request seed's piece markers
// into layer l of each (not through Piece: the test's own writes do not
// count).
func layeredLease(t testing.TB, pool *kvlease.Pool[watchBlock], n int, seed byte) (*kvlease.Lease[watchBlock], func(int)) {
	t.Helper()
	l, err := pool.Acquire(fmt.Sprintf("r%d", seed), n)
	if err != nil {
		t.Fatal(err)
	}
	blocks := make([]layout.Block, n)
	for i := range n {
		b, err := l.Region(i)
		if err != nil {
			t.Fatal(err)
		}
		blocks[i] = b.Block
		for layer := range lLayers {
			for kv := range 2 {
				p := b.Block.Piece(layer, kv)
				for j := range p {
					p[j] = stale
				}
			}
		}
	}
	return l, func(layer int) {
		for i, b := range blocks {
			for kv := range 2 {
				p := b.Piece(layer, kv)
				for j := range p {
					p[j] = pieceMark(seed, i, layer, kv, j)
				}
			}
		}
	}
}

func watchPool(t testing.TB, l layout.Layout) (*watchHost, *kvlease.Pool[watchBlock]) {
	t.Helper()
	h, err := layout.NewHost(l)
	if err != nil {
		t.Fatal(err)
	}
	w := &watchHost{Host: h}
	p, err := kvlease.NewPool[watchBlock](w)
	if err != nil {
		t.Fatal(err)
	}
	return w, p
}

func watchSend(s *tcp.Sender) handoff.SendPlane[watchBlock] { return tcp.SendLayered[watchBlock](s) }

// TestStreamDelivers: a prefill that writes 8 layers, 3 ms each, streams
// 12 blocks to the destination, PSK-authenticated and insecure, from a
// plain []byte pool and from a layered pool (layer-separated, to a
// block-contiguous one): the handoff is Delivered on both sides, every
// byte holds its (request, block, layer) marker, the plane never asked for
// a piece of a layer not yet marked, the Start went out before the
// prefill finished, and one transfer moved the bytes each way.
func TestStreamDelivers(t *testing.T) {
	const n, delay = 12, 3 * time.Millisecond
	for _, auth := range []string{"psk", "none"} {
		o := streamOpts{insecure: auth == "none"}
		t.Run("flat/"+auth, func(t *testing.T) {
			srcPool, dstPool := hostPool(t, 64), hostPool(t, 64)
			h := newStreamHalves(t, srcPool, dstPool, env(64), flat, flatRecv, o)
			lease, fill := flatLease(t, srcPool, n, 5, sLayers)
			prog, err := handoff.NewProgress(n, sLayers)
			if err != nil {
				t.Fatal(err)
			}
			out, err := h.src.Propose(1, "r5", lease, nil, handoff.Streaming(prog))
			if err != nil {
				t.Fatal(err)
			}
			in := waitIn(t, h, out)
			prefill(t, prog, delay, sLayers, fill, nil)
			waitFinal(t, out)
			if out.State() != handoff.Delivered || in.State() != handoff.Delivered {
				t.Fatalf("source %v, destination %v: %v / %v", out.State(), in.State(), out.History(), in.History())
			}
			if err := checkFlat(in.Lease(), 5, sLayers); err != nil {
				t.Fatalf("marker mismatch: %v", err)
			}
			oneTransfer(t, h.sender.Stats(), h.recv.Stats(), n*blockBytes)
			in.Lease().Release()
			lease.Release()
		})
		t.Run("layered/"+auth, func(t *testing.T) {
			e := layeredEnv(64)
			watch, srcPool := watchPool(t, layout.LayerSeparated(lLayers, 2, 64, lPiece, e.Layout.Tag))
			_, dstPool := hostLayout(t, layout.Contiguous(lLayers, 2, 64, lPiece, e.Layout.Tag))
			h := newStreamHalves(t, srcPool, dstPool, e, watchSend, layeredRecv, o)
			lease, fill := layeredLease(t, srcPool, n, 6)
			prog, err := handoff.NewProgress(n, lLayers)
			if err != nil {
				t.Fatal(err)
			}
			watch.prog.Store(prog)
			out, err := h.src.Propose(1, "r6", lease, nil, handoff.Streaming(prog))
			if err != nil {
				t.Fatal(err)
			}
			in := waitIn(t, h, out)
			prefill(t, prog, delay, lLayers, fill, nil)
			waitFinal(t, out)
			if out.State() != handoff.Delivered || in.State() != handoff.Delivered {
				t.Fatalf("source %v, destination %v: %v / %v", out.State(), in.State(), out.History(), in.History())
			}
			if bad := checkPieces(t, in.Lease(), 6); bad != 0 {
				t.Fatalf("marker mismatches %d", bad)
			}
			if early := watch.early.Load(); early != 0 {
				t.Fatalf("the plane asked for %d pieces of layers not yet marked", early)
			}
			oneTransfer(t, h.sender.Stats(), h.recv.Stats(), n*blockBytes)
			in.Lease().Release()
			lease.Release()
		})
	}
}

// waitIn waits until the destination has accepted out and the source has
// started it (the Start went out before the prefill wrote anything), and
// returns the destination's handle.
func waitIn[S, D any](t *testing.T, h *streamHalves[S, D], out *handoff.Outgoing[S]) *handoff.Incoming[D] {
	t.Helper()
	waitState(t, "source", out.State, handoff.Transferring)
	var in *handoff.Incoming[D]
	select {
	case in = <-h.accepted:
	case <-time.After(bound):
		t.Fatal("the destination never accepted the handoff")
	}
	if in.ID() != out.ID() {
		t.Fatalf("the destination accepted %d, want %d", in.ID(), out.ID())
	}
	waitState(t, "destination", in.State, handoff.Transferring)
	return in
}

func oneTransfer(t *testing.T, s, r handoff.PlaneStats, bytes int) {
	t.Helper()
	if s.Started != 1 || s.Completed != 1 || r.Started != 1 || r.Completed != 1 || s.Bytes != int64(bytes) || r.Bytes != int64(bytes) {
		t.Fatalf("one transfer of %d bytes per side expected: sender %+v, receiver %+v", bytes, s, r)
	}
}

// TestStreamChunkedPrefill: a prefill that finishes blocks front to back
// (WroteBlocks: a chunked prefill), with a progress of 4 layers, streams
// every byte intact: each block goes as soon as it is marked.
func TestStreamChunkedPrefill(t *testing.T) {
	const n = 10
	srcPool, dstPool := hostPool(t, 64), hostPool(t, 64)
	h := newStreamHalves(t, srcPool, dstPool, env(64), flat, flatRecv, streamOpts{})
	lease, _ := flatLease(t, srcPool, n, 9, 1)
	prog, _ := handoff.NewProgress(n, 4)
	out, err := h.src.Propose(1, "r9", lease, nil, handoff.Streaming(prog))
	if err != nil {
		t.Fatal(err)
	}
	in := waitIn(t, h, out)
	for b := range n {
		time.Sleep(time.Millisecond)
		r, _ := lease.Region(b)
		for j := range r {
			r[j] = partMark(9, b, 0, j)
		}
		if err := prog.WroteBlocks(b + 1); err != nil {
			t.Fatal(err)
		}
	}
	waitFinal(t, out)
	if out.State() != handoff.Delivered || in.State() != handoff.Delivered {
		t.Fatalf("source %v, destination %v: %v / %v", out.State(), in.State(), out.History(), in.History())
	}
	if err := checkFlat(in.Lease(), 9, 1); err != nil {
		t.Fatalf("marker mismatch: %v", err)
	}
	in.Lease().Release()
	lease.Release()
}

// streamMidway starts a streaming handoff of n flat blocks and runs its
// prefill for layers layers of sLayers; it returns both sides' handles,
// the progress and the lease once those layers are marked.
func streamMidway(t *testing.T, h *streamHalves[[]byte, []byte], pool *kvlease.Pool[[]byte], n, layers int) (*handoff.Outgoing[[]byte], *handoff.Incoming[[]byte], *kvlease.Lease[[]byte]) {
	t.Helper()
	lease, fill := flatLease(t, pool, n, 7, sLayers)
	prog, _ := handoff.NewProgress(n, sLayers)
	out, err := h.src.Propose(1, "r7", lease, nil, handoff.Streaming(prog))
	if err != nil {
		t.Fatal(err)
	}
	in := waitIn(t, h, out)
	prefill(t, prog, time.Millisecond, layers, fill, nil)
	return out, in, lease
}

// TestStreamAbortBetweenLayers: the source, or the destination, aborts
// after 3 of 8 layers while the prefill is still computing: both sides
// end Aborted by their own evidence (the writer's wait for progress ends
// at once), the leases drain, and no block is leaked or quarantined.
func TestStreamAbortBetweenLayers(t *testing.T) {
	for _, by := range []string{"source", "destination"} {
		t.Run(by, func(t *testing.T) {
			srcPool, dstPool := hostPool(t, 64), hostPool(t, 64)
			h := newStreamHalves(t, srcPool, dstPool, env(64), flat, flatRecv, streamOpts{})
			out, in, lease := streamMidway(t, h, srcPool, 12, 3)
			var err error
			if by == "source" {
				err = out.Abort("prefill", nil)
			} else {
				err = in.Abort("decode", nil)
			}
			if err != nil {
				t.Fatal(err)
			}
			waitFinal(t, out)
			waitFinal(t, in)
			if out.State() != handoff.Aborted || in.State() != handoff.Aborted {
				t.Fatalf("source %v, destination %v: %v / %v", out.State(), in.State(), out.History(), in.History())
			}
			for _, tr := range []*kvlease.Transfer{out.Transfer(), in.Transfer()} {
				if tr == nil || tr.State() != kvlease.TransferResolved {
					t.Fatal("Aborted without its own transfer resolved")
				}
			}
			lease.Release()
			waitSettled(t, lease)
			if s, d := srcPool.Stats(), dstPool.Stats(); s.Leased+s.Draining+s.Quarantined != 0 || d.Leased+d.Draining+d.Quarantined != 0 {
				t.Fatalf("blocks held after the abort: source %+v, destination %+v", s, d)
			}
		})
	}
}

func waitSettled[R any](t *testing.T, l *kvlease.Lease[R]) {
	t.Helper()
	select {
	case <-l.Settled():
	case <-time.After(bound):
		t.Fatalf("lease still %v", l.State())
	}
}

// conns collects the connections a wrapper saw.
type conns struct {
	mu sync.Mutex
	cs []net.Conn
}

func (c *conns) wrap(conn net.Conn) net.Conn {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cs = append(c.cs, conn)
	return conn
}

func (c *conns) kill() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, conn := range c.cs {
		_ = conn.Close()
	}
}

// TestStreamKilledBetweenLayers: after 3 of 8 layers the data connection
// dies (cut on the sender's side or the receiver's), or the source's
// connections all die at once (its process gone, as the destination sees
// it): each surviving side ends by its own evidence — its loop returned
// with the connection's error — as Failed, and no block leaks.
func TestStreamKilledBetweenLayers(t *testing.T) {
	for _, cut := range []string{"sender-data", "receiver-data", "source-gone"} {
		t.Run(cut, func(t *testing.T) {
			var send, recv, ctl conns
			o := streamOpts{wrapSend: send.wrap, wrapRecv: recv.wrap, wrapCtl: ctl.wrap}
			srcPool, dstPool := hostPool(t, 64), hostPool(t, 64)
			h := newStreamHalves(t, srcPool, dstPool, env(64), flat, flatRecv, o)
			out, in, lease := streamMidway(t, h, srcPool, 12, 3)
			switch cut {
			case "sender-data":
				send.kill()
			case "receiver-data":
				recv.kill()
			case "source-gone":
				ctl.kill()
				send.kill()
			}
			waitFinal(t, in)
			if in.State() != handoff.Failed {
				t.Fatalf("destination %v: %v", in.State(), in.History())
			}
			if in.Transfer().State() != kvlease.TransferResolved || in.Transfer().Err() == nil {
				t.Fatalf("destination Failed without its own failed transfer: %v", in.Transfer().Err())
			}
			if cut != "source-gone" {
				// The source learns of it on the data connection (a
				// failed write) or from the destination's Done.
				waitFinal(t, out)
				if out.State() != handoff.Failed {
					t.Fatalf("source %v: %v", out.State(), out.History())
				}
			}
			_ = out.Abort("prefill", nil) // the prefill gives up either way
			waitFinal(t, out)
			if tr := out.Transfer(); tr.State() != kvlease.TransferResolved {
				t.Fatalf("source transfer %v", tr.State())
			}
			in.Lease().Release()
			lease.Release()
			waitSettled(t, lease)
		})
	}
}

// TestStreamRefusesBadLayers: a progress whose layers do not split the
// plane's blocks is refused by SendStream before anything is attached.
func TestStreamRefusesBadLayers(t *testing.T) {
	s := tcp.NewSender(tcp.Config{})
	defer s.Close()
	prog, _ := handoff.NewProgress(2, 3) // 3 does not split 4096
	ready, _ := prog.Ready(0)
	accept := append([]byte{9, 0}, "127.0.0.1:1"...)
	accept = append(accept, make([]byte, 16)...)
	attached := false
	_, err := s.SendStream(handoff.PlaneID{Handoff: 1}, [][]byte{make([]byte, 4096), make([]byte, 4096)}, ready, accept,
		func(*kvlease.Transfer) error { attached = true; return nil })
	if !errors.Is(err, kvlease.ErrInvalidArgument) || attached {
		t.Fatalf("SendStream with 3 layers over 4096-byte blocks: %v (attached %v)", err, attached)
	}
}

// TestStreamProcDestinationKilled: the destination is another process,
// killed after 3 of 8 layers while the source's writer waits for the
// next one. The source learns it from the lost control connection (its
// transfer is asked to stop, which ends the wait at once), ends Failed
// by its own evidence (the writer returned), and its lease is the
// caller's again, no block leaked.
func TestStreamProcDestinationKilled(t *testing.T) {
	ln := listen(t)
	p := startPeer(t, peerConfig{Role: "dest", Ctrl: ln.Addr().String(), BlockBytes: procBlockBytes, PoolBlocks: procPool, HoldAfter: -1})
	pool := hostPool2(t, procPool, procBlockBytes)
	sender := tcp.NewSender(tcp.Config{})
	src, err := handoff.NewSource(acceptOne(t, ln), sender, handoff.HalfConfig{Envelope: envFor(procBlockBytes, procPool),
		Name: "prefill", Peer: "decode", Deadline: bound, Auth: testAuth})
	if err != nil {
		t.Fatal(err)
	}
	p.expect("ready")
	t.Cleanup(func() {
		p.kill()
		_ = src.Close()
		_ = sender.Close()
		if err := pool.Check(); err != nil {
			t.Error(err)
		}
	})
	lease, fill := flatLease(t, pool, 8, 33, sLayers)
	prog, _ := handoff.NewProgress(8, sLayers)
	o, err := src.Propose(1, "seed=33", lease, nil, handoff.Streaming(prog))
	if err != nil {
		t.Fatal(err)
	}
	waitState(t, "source", o.State, handoff.Transferring)
	prefill(t, prog, time.Millisecond, 3, fill, nil)
	p.kill()
	if st := waitDone(t, "source", o.Done(), o.State); st != handoff.Failed {
		t.Fatalf("source %v: %v", st, o.History())
	}
	if tr := o.Transfer(); tr == nil || tr.State() != kvlease.TransferResolved {
		t.Fatal("Failed without its own transfer resolved")
	}
	if lease.State() != kvlease.LeaseActive {
		t.Fatalf("source lease %v: a failed handoff leaves it the caller's", lease.State())
	}
	prefill(t, prog, 0, sLayers, fill, nil) // the prefill goes on: nothing reads it now
	lease.Release()
	wantStats(t, "source", localStats(pool, sender.Stats()), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok started=1 completed=0")
}

// TestStreamInteroperates: the stream wire is layout-independent (a part
// is a slice of the block's contiguous form), so a layered source streams
// to a plain []byte pool, and a plain source to a layered pool (PSK:
// keyed), with the layout's layers (8: a part is a layer's K and V
// pieces) or whole blocks (1 layer: a part is every piece).
func TestStreamInteroperates(t *testing.T) {
	e := layeredEnv(64)
	contiguous := func(b layout.Block) []byte { // the block's pieces in (layer, kv) order
		var out []byte
		for _, p := range b.AppendPieces(nil) {
			out = append(out, p...)
		}
		return out
	}
	t.Run("layered-to-flat", func(t *testing.T) {
		watch, srcPool := watchPool(t, layout.LayerSeparated(lLayers, 2, 64, lPiece, e.Layout.Tag))
		dstPool := hostPool(t, 64)
		h := newStreamHalves(t, srcPool, dstPool, e, watchSend, flatRecv, streamOpts{})
		lease, fill := layeredLease(t, srcPool, 6, 4)
		prog, _ := handoff.NewProgress(6, lLayers)
		watch.prog.Store(prog)
		out, err := h.src.Propose(1, "r4", lease, nil, handoff.Streaming(prog))
		if err != nil {
			t.Fatal(err)
		}
		in := waitIn(t, h, out)
		prefill(t, prog, time.Millisecond, lLayers, fill, nil)
		waitFinal(t, out)
		if out.State() != handoff.Delivered || in.State() != handoff.Delivered {
			t.Fatalf("source %v, destination %v: %v / %v", out.State(), in.State(), out.History(), in.History())
		}
		for i := range 6 {
			r, _ := in.Lease().ReadRegion(i)
			for j, c := range r {
				k := j / lPiece // piece k = (layer k/2, kv k%2)
				if want := pieceMark(4, i, k/2, k%2, j%lPiece); c != want {
					t.Fatalf("block %d byte %d: %#x, want %#x", i, j, c, want)
				}
			}
		}
		if early := watch.early.Load(); early != 0 {
			t.Fatalf("the plane asked for %d pieces of layers not yet marked", early)
		}
		in.Lease().Release()
		lease.Release()
	})
	for _, layers := range []int{lLayers, 1} {
		t.Run(fmt.Sprintf("flat-to-layered/%d-layers", layers), func(t *testing.T) {
			srcPool := hostPool(t, 64)
			_, dstPool := hostLayout(t, layout.LayerSeparated(lLayers, 2, 64, lPiece, e.Layout.Tag))
			h := newStreamHalves(t, srcPool, dstPool, e, flat, layeredRecv, streamOpts{})
			lease, fill := flatLease(t, srcPool, 6, 8, layers)
			prog, _ := handoff.NewProgress(6, layers)
			out, err := h.src.Propose(1, "r8", lease, nil, handoff.Streaming(prog))
			if err != nil {
				t.Fatal(err)
			}
			in := waitIn(t, h, out)
			prefill(t, prog, 0, layers, fill, nil)
			waitFinal(t, out)
			if out.State() != handoff.Delivered || in.State() != handoff.Delivered {
				t.Fatalf("source %v, destination %v: %v / %v", out.State(), in.State(), out.History(), in.History())
			}
			pb := blockBytes / layers
			for i := range 6 {
				b, _ := in.Lease().ReadRegion(i)
				for j, c := range contiguous(b) {
					if want := partMark(8, i, j/pb, j%pb); c != want {
						t.Fatalf("block %d byte %d: %#x, want %#x", i, j, c, want)
					}
				}
			}
			in.Lease().Release()
			lease.Release()
		})
	}
}

// TestStreamReusesConnections: streaming and whole handoffs share the
// sender's pooled data connection: one dial, then every handoff reuses
// it, and each arrives intact.
func TestStreamReusesConnections(t *testing.T) {
	const n, rounds = 6, 4
	srcPool, dstPool := hostPool(t, 64), hostPool(t, 64)
	h := newStreamHalves(t, srcPool, dstPool, env(64), flat, flatRecv, streamOpts{})
	for id := uint64(1); id <= rounds; id++ {
		seed := byte(10 * id)
		lease, fill := flatLease(t, srcPool, n, seed, sLayers)
		var opts []handoff.ProposeOption
		prog, err := handoff.NewProgress(n, sLayers)
		if err != nil {
			t.Fatal(err)
		}
		stream := id%2 == 1
		if stream {
			opts = append(opts, handoff.Streaming(prog))
		} else {
			prefill(t, prog, 0, sLayers, fill, nil)
		}
		out, err := h.src.Propose(id, "r", lease, nil, opts...)
		if err != nil {
			t.Fatal(err)
		}
		if stream {
			waitIn(t, h, out)
			prefill(t, prog, time.Millisecond, sLayers, fill, nil)
		}
		waitFinal(t, out)
		if !stream {
			<-h.accepted // waitIn took the streaming ones'
		}
		in := h.final(t)
		if out.State() != handoff.Delivered || in.State() != handoff.Delivered {
			t.Fatalf("handoff %d: source %v, destination %v", id, out.State(), in.State())
		}
		if err := checkFlat(in.Lease(), seed, sLayers); err != nil {
			t.Fatalf("handoff %d: marker mismatch: %v", id, err)
		}
		in.Lease().Release()
		lease.Release()
		<-lease.Settled()
		idleIs(t, h.sender, 1)
	}
	if s := h.sender.Stats(); s.Dials != 1 || s.Reuses != rounds-1 || s.Completed != rounds {
		t.Fatalf("sender %+v: want 1 dial and %d reuses", s, rounds-1)
	}
}

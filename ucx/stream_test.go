package ucx_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/layout"
	"github.com/kvlease/kvlease/ucx"
)

// The streaming tests run a simulated prefill that computes the prompt
// layer by layer: for each layer it spends a delay (the layer's compute),
// then writes that layer's bytes of every block (a marker of request,
// block and layer) and only then marks the layer written. Before the
// prefill the source blocks hold a stale pattern: a plane that read a
// part before its mark would ship stale bytes, and the destination's
// marker check (and, keyed, its block sums, computed over the blocks as
// they are once written) would fail.

const (
	sLayers = 8 // 512-byte parts of 4096-byte blocks
	stale   = 0xEE
	bound   = 20 * time.Second
)

// partMark is byte j of part (block i, layer l) of request seed.
func partMark(seed byte, i, l, j int) byte { return seed + byte(31*i) + byte(7*l) + byte(j%5) }

// staleLease acquires n blocks holding the stale pattern and returns
// fill, which writes request seed's markers into layer l of each.
func staleLease(t testing.TB, pool *kvlease.Pool[[]byte], n int, seed byte) (*kvlease.Lease[[]byte], func(int)) {
	t.Helper()
	l, err := pool.Acquire(fmt.Sprintf("r%d", seed), n)
	if err != nil {
		t.Fatal(err)
	}
	regions := regionsOf(t, l)
	for _, r := range regions {
		for j := range r {
			r[j] = stale
		}
	}
	pb := blockBytes / sLayers
	return l, func(layer int) {
		for i, r := range regions {
			part := r[layer*pb : (layer+1)*pb]
			for j := range part {
				part[j] = partMark(seed, i, layer, j)
			}
		}
	}
}

// checkParts returns the first byte of l that does not hold request
// seed's marker.
func checkParts(l *kvlease.Lease[[]byte], seed byte) error {
	pb := blockBytes / sLayers
	for i := range l.Len() {
		r, err := l.ReadRegion(i)
		if err != nil {
			return err
		}
		for j := range r {
			if want := partMark(seed, i, j/pb, j%pb); r[j] != want {
				return fmt.Errorf("block %d, layer %d, byte %d: %#x, want %#x (stale %#x)", i, j/pb, j%pb, r[j], want, stale)
			}
		}
	}
	return nil
}

// prefill computes layers [from, upTo) of p: for each, delay, then
// fill(layer), then the mark.
func prefill(t testing.TB, p *handoff.Progress, delay time.Duration, from, upTo int, fill func(int)) {
	t.Helper()
	for l := from; l < upTo; l++ {
		time.Sleep(delay)
		fill(l)
		if err := p.WroteLayers(l + 1); err != nil {
			t.Fatal(err)
		}
	}
}

// waitFor polls cond every millisecond for up to bound.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, bound)
		}
		time.Sleep(time.Millisecond)
	}
}

// startStream proposes n stale blocks of request seed as a streaming
// handoff of sLayers layers on l, and waits until the destination has
// accepted it and the source has started it (the Start went out before
// any layer was written).
func startStream(t *testing.T, l *loop, n int, seed byte) (*handoff.Outgoing[[]byte], *handoff.Incoming[[]byte], *kvlease.Lease[[]byte], *handoff.Progress, func(int)) {
	t.Helper()
	lease, fill := staleLease(t, l.srcPool, n, seed)
	prog, err := handoff.NewProgress(n, sLayers)
	if err != nil {
		t.Fatal(err)
	}
	out, err := l.src.Propose(uint64(seed), fmt.Sprintf("r%d", seed), lease, nil, handoff.Streaming(prog))
	if err != nil {
		t.Fatal(err)
	}
	var in *handoff.Incoming[[]byte]
	for in == nil || in.ID() != out.ID() { // earlier handoffs' come first
		select {
		case in = <-l.accepted:
		case <-time.After(bound):
			t.Fatal("the destination never accepted the handoff")
		}
	}
	waitFor(t, "source Transferring", func() bool { return out.State() == handoff.Transferring })
	waitFor(t, "destination Transferring", func() bool { return in.State() == handoff.Transferring })
	return out, in, lease, prog, fill
}

// TestStreamDelivers: a prefill that writes 8 layers, 2 ms each, streams
// 12 blocks through the two halves (PSK: keyed block sums): as one run
// (one message per layer) and block by block (MaxGet of one block: a
// message per block and layer). The Start goes out before any layer is
// written, the first layers' messages go out while the prefill still
// computes, both sides end Delivered, every byte holds its (request,
// block, layer) marker (no stale part was read before its mark), and
// the handoff used one connection each way.
func TestStreamDelivers(t *testing.T) {
	const n = 12
	for _, tc := range []struct {
		name string
		cfg  ucx.Config
		msgs int // messages of the blocks, before the layers
	}{
		{"run", ucx.Config{}, 1},
		{"per-block", ucx.Config{MaxGet: blockBytes}, n},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newLoop(t, loopConfig{keepLeases: true, send: tc.cfg, recv: tc.cfg})
			out, in, lease, prog, fill := startStream(t, l, n, 5)
			defer lease.Release()
			prefill(t, prog, 2*time.Millisecond, 0, 3, fill)
			// Layers 0..2 go out while layers 3..7 are still computed.
			waitFor(t, "the first 3 layers sent", func() bool { return l.sender.Stats().Messages >= 3*tc.msgs })
			if got := l.sender.Stats().Messages; got != 3*tc.msgs {
				t.Fatalf("%d messages sent after 3 layers, want %d", got, 3*tc.msgs)
			}
			prefill(t, prog, 2*time.Millisecond, 3, sLayers, fill)
			waitFinal(t, out)
			waitFinal(t, in)
			if out.State() != handoff.Delivered || in.State() != handoff.Delivered {
				t.Fatalf("source %v, destination %v: %v / %v", out.State(), in.State(), out.History(), in.History())
			}
			if err := checkParts(in.Lease(), 5); err != nil {
				t.Fatalf("marker mismatch: %v", err)
			}
			in.Lease().Release()
			s, r := l.sender.Stats(), l.recv.Stats()
			if s.Messages != sLayers*tc.msgs || r.Messages != sLayers*tc.msgs || s.Keyed != 1 || r.Completed != 1 || r.Bytes != n*blockBytes {
				t.Fatalf("want %d messages, keyed: source %+v, destination %+v", sLayers*tc.msgs, s, r)
			}
		})
	}
}

// TestStreamReusesConnection: streamed handoffs one after the other on
// one session, each holding its connection for its whole prefill, reuse
// one connection a side; a start-after-prefill handoff in between reuses
// it too.
func TestStreamReusesConnection(t *testing.T) {
	l := newLoop(t, loopConfig{keepLeases: true})
	for i := range 3 {
		seed := byte(10 + i)
		out, in, lease, prog, fill := startStream(t, l, 6, seed)
		prefill(t, prog, time.Millisecond, 0, sLayers, fill)
		waitFinal(t, out)
		waitFinal(t, in)
		if out.State() != handoff.Delivered || in.State() != handoff.Delivered {
			t.Fatalf("handoff %d: source %v, destination %v: %v / %v", i, out.State(), in.State(), out.History(), in.History())
		}
		if err := checkParts(in.Lease(), seed); err != nil {
			t.Fatalf("handoff %d: %v", i, err)
		}
		in.Lease().Release()
		lease.Release()
		if i == 1 {
			plain, err := l.srcPool.Acquire("plain", 4)
			if err != nil {
				t.Fatal(err)
			}
			stamp(t, plain, 77)
			proposeDelivered(t, l, 77, plain)
			in := waitIncoming(t, l, 77)
			if err := marked(in.Lease(), 77); err != nil {
				t.Fatal(err)
			}
			in.Lease().Release()
			plain.Release()
		}
	}
	s, r := l.sender.Stats(), l.recv.Stats()
	if s.Connects != 1 || s.Reuses != 3 || s.Completed != 4 || r.Workers != 1 || r.Reuses != 3 || r.Completed != 4 {
		t.Fatalf("want one connection a side, 3 reuses: source %+v, destination %+v", s, r)
	}
}

// TestStreamAbortBetweenLayers: after 3 of 8 layers, while the prefill
// still computes, the source or the destination aborts: both sides end
// Aborted with their own transfers resolved (the source's waiting sender
// stopped by the cancel), the leases drain, and no block is leaked or
// quarantined (the loop's cleanup checks both pools).
func TestStreamAbortBetweenLayers(t *testing.T) {
	for _, by := range []string{"source", "destination"} {
		t.Run(by, func(t *testing.T) {
			l := newLoop(t, loopConfig{keepLeases: true})
			out, in, lease, prog, fill := startStream(t, l, 12, 7)
			prefill(t, prog, time.Millisecond, 0, 3, fill)
			waitFor(t, "the first 3 layers sent", func() bool { return l.sender.Stats().Messages >= 3 })
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
			// The prefill finishes; nothing more is sent.
			sent := l.sender.Stats().Messages
			prefill(t, prog, 0, 3, sLayers, fill)
			lease.Release()
			waitSettled(t, lease)
			if got := l.sender.Stats().Messages; got != sent {
				t.Fatalf("%d messages sent after the abort", got-sent)
			}
			if s, d := l.srcPool.Stats(), l.dstPool.Stats(); s.Leased+s.Draining+s.Quarantined != 0 || d.Leased+d.Draining+d.Quarantined != 0 {
				t.Fatalf("blocks held after the abort: source %+v, destination %+v", s, d)
			}
		})
	}
}

// TestStreamPeerGoneBetweenLayers: after 3 of 8 layers one side's plane
// goes away (Close: the operator's way out, every handoff's worker
// destroyed, as a dead process's would be): the side whose plane closed
// ends by its revocation, the other by its own evidence (the peer's
// failure on its endpoint, or the peer's word), neither Delivered, and
// no block leaks.
func TestStreamPeerGoneBetweenLayers(t *testing.T) {
	for _, gone := range []string{"source-plane", "destination-plane"} {
		t.Run(gone, func(t *testing.T) {
			l := newLoop(t, loopConfig{keepLeases: true, deadline: 5 * time.Second})
			out, in, lease, prog, fill := startStream(t, l, 12, 9)
			prefill(t, prog, time.Millisecond, 0, 3, fill)
			waitFor(t, "the first 3 layers sent", func() bool { return l.sender.Stats().Messages >= 3 })
			if gone == "source-plane" {
				_ = l.sender.Close()
			} else {
				_ = l.recv.Close()
			}
			waitFinal(t, out)
			waitFinal(t, in)
			if out.State() == handoff.Delivered || in.State() == handoff.Delivered {
				t.Fatalf("source %v, destination %v after the plane went away", out.State(), in.State())
			}
			for _, tr := range []*kvlease.Transfer{out.Transfer(), in.Transfer()} {
				if tr == nil || tr.State() != kvlease.TransferResolved || tr.Err() == nil {
					t.Fatal("ended without its own failed transfer")
				}
			}
			if gone == "source-plane" && !errors.Is(out.Transfer().Err(), ucx.ErrClosed) {
				t.Fatalf("source transfer: %v", out.Transfer().Err())
			}
			prefill(t, prog, 0, 3, sLayers, fill)
			lease.Release()
			waitSettled(t, lease)
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

// TestStreamLayered: layered regions stream at the plane's level, a
// block's layer j being its pieces of layer j (K then V): from a
// block-contiguous source (consecutive blocks: runs, a message per run
// and layer, gathered from each block's slice) to a layer-separated
// destination (each part scattered into its pieces), and from a
// layer-separated source (a message per block and layer). The prefill
// writes each layer's pieces after a stale pattern, then marks it; every
// destination piece holds its marker and nothing outside the handoff's
// blocks is written.
func TestStreamLayered(t *testing.T) {
	ids, dids := []int{3, 4, 5, 6, 9, 10, 20}, []int{0, 1, 2, 3, 4, 5, 6}
	for _, tc := range []struct {
		name     string
		src, dst func(layers, kvs, blocks, pieceBytes int, tag string) layout.Layout
		messages int // before the layers
	}{
		{"contiguous to separated", layout.Contiguous, layout.LayerSeparated, 3},
		{"separated to contiguous", layout.LayerSeparated, layout.Contiguous, len(ids)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := newHost(t, tc.src(lLayers, 2, 32, lPiece, lTag))
			dst := newHost(t, tc.dst(lLayers, 2, 32, lPiece, lTag))
			sender, recv := layeredPlanes(t, ucx.Config{})
			sb, db := blocksOf(src, ids), blocksOf(dst, dids)
			fill := func(layer int, seed byte) {
				for i, b := range sb {
					for kv := range 2 {
						p := b.Piece(layer, kv)
						for j := range p {
							p[j] = seed
							if seed != stale {
								p[j] = pieceMark(seed, i, layer, kv, j)
							}
						}
					}
				}
			}
			for layer := range lLayers {
				fill(layer, stale)
			}
			prog, err := handoff.NewProgress(len(ids), lLayers)
			if err != nil {
				t.Fatal(err)
			}
			ready, err := prog.Ready(0)
			if err != nil {
				t.Fatal(err)
			}
			id := handoff.PlaneID{Session: 3, Handoff: 1}
			accept, err := recv.Prepare(id, len(db))
			if err != nil {
				t.Fatal(err)
			}
			var st, dt *kvlease.Transfer
			start, err := sender.SendStream(id, sb, ready, accept, func(t *kvlease.Transfer) error { st = t; return nil })
			if err != nil {
				t.Fatal(err)
			}
			if err := recv.Receive(id, db, start, func(t *kvlease.Transfer) error { dt = t; return nil }); err != nil {
				t.Fatal(err)
			}
			for layer := range lLayers {
				time.Sleep(time.Millisecond)
				fill(layer, 4)
				if err := prog.WroteLayers(layer + 1); err != nil {
					t.Fatal(err)
				}
			}
			select {
			case <-dt.Done():
			case <-time.After(bound):
				t.Fatal("the destination's transfer never resolved")
			}
			if err := dt.Err(); err != nil {
				t.Fatal(err)
			}
			sender.Finish(id, nil)
			<-st.Done()
			if err := st.Err(); err != nil {
				t.Fatal(err)
			}
			for i, b := range db {
				if err := checkBlock(b, 4, i); err != nil {
					t.Fatal(err)
				}
			}
			if err := untouched(dst, dids); err != nil {
				t.Fatal(err)
			}
			if s := sender.Stats(); s.Messages != tc.messages*lLayers {
				t.Fatalf("sender %+v, want %d messages", s, tc.messages*lLayers)
			}
		})
	}
}

// TestStreamPullStartsAfterPrefill: the pull model does not stream (its
// destination reads whenever it has the Start bytes): a streaming
// handoff's SendStream returns only once the progress is complete, and
// the handoff then delivers every marker.
func TestStreamPullStartsAfterPrefill(t *testing.T) {
	cfg := ucx.Config{Pull: true}
	l := newLoop(t, loopConfig{keepLeases: true, send: cfg, recv: cfg})
	lease, fill := staleLease(t, l.srcPool, 6, 21)
	defer lease.Release()
	prog, _ := handoff.NewProgress(6, sLayers)
	out, err := l.src.Propose(21, "r21", lease, nil, handoff.Streaming(prog))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "source Accepted", func() bool { return out.State() == handoff.Accepted })
	prefill(t, prog, time.Millisecond, 0, sLayers-1, fill)
	if st := out.State(); st != handoff.Accepted || l.sender.Stats().Started != 0 {
		t.Fatalf("the pull plane started (%v, %+v) before the prefill finished", st, l.sender.Stats())
	}
	prefill(t, prog, time.Millisecond, sLayers-1, sLayers, fill)
	waitFinal(t, out)
	in := waitIncoming(t, l, 21)
	if out.State() != handoff.Delivered || in.State() != handoff.Delivered {
		t.Fatalf("source %v, destination %v: %v / %v", out.State(), in.State(), out.History(), in.History())
	}
	if err := checkParts(in.Lease(), 21); err != nil {
		t.Fatal(err)
	}
	in.Lease().Release()
}

// TestProcsStreamPeerKilled: the other process dies between layers of a
// streaming handoff (SIGKILL, after 3 of 8 layers were marked and sent).
// The destination's evidence is its withdrawn receives or its revocation
// (never a completion), the source's its revocation; each ends Aborted
// or Failed with every block of its pool back.
func TestProcsStreamPeerKilled(t *testing.T) {
	t.Run("peer-is-source", func(t *testing.T) {
		p := startPeer(t, "source", "KVUCX_SEED=61", "KVUCX_STREAM=3")
		d := newLocalDest(t, p.conn, ucx.Config{}, 20*time.Second)
		p.expect("layers 3 sent")
		p.kill()
		d.stoppedShort(t)
	})
	t.Run("peer-is-destination", func(t *testing.T) {
		p := startPeer(t, "dest", "KVUCX_SEED=62")
		s := newLocalSource(t, p.conn, 20*time.Second, 62)
		prog, err := handoff.NewProgress(suiteBlocks, sLayers)
		if err != nil {
			t.Fatal(err)
		}
		o, err := s.src.Propose(1, "r", s.lease, nil, handoff.Streaming(prog))
		if err != nil {
			t.Fatal(err)
		}
		waitFor(t, "source Transferring", func() bool { return o.State() == handoff.Transferring })
		// The blocks hold their markers already: the prefill only marks.
		for l := range 3 {
			time.Sleep(time.Millisecond)
			if err := prog.WroteLayers(l + 1); err != nil {
				t.Fatal(err)
			}
		}
		waitFor(t, "3 layers sent", func() bool { return s.sender.Stats().Messages >= 3 })
		p.kill()
		if st := o.Wait(30 * time.Second); st != handoff.Failed && st != handoff.Aborted {
			t.Fatalf("source %v: %v", st, o.History())
		}
		if err := o.Transfer().Err(); !errors.Is(err, ucx.ErrRevoked) {
			t.Fatalf("source transfer resolved with %v, want a revocation", err)
		}
		s.finish(t, 62)
	})
}

// TestStreamDeadlineStopsAWaitingSender: a prefill that stops after 2 of
// 8 layers leaves the source's sender waiting for progress; the halves'
// deadline cancels both transfers, which stop (the waiting sender by its
// revocation, the destination by withdrawing its receives): neither
// side is Delivered, both transfers are resolved by their own evidence,
// and marks after the end send nothing.
func TestStreamDeadlineStopsAWaitingSender(t *testing.T) {
	l := newLoop(t, loopConfig{keepLeases: true, deadline: 400 * time.Millisecond})
	out, in, lease, prog, fill := startStream(t, l, 12, 23)
	prefill(t, prog, time.Millisecond, 0, 2, fill)
	waitFinal(t, out)
	waitFinal(t, in)
	if out.State() == handoff.Delivered || in.State() == handoff.Delivered {
		t.Fatalf("source %v, destination %v past the deadline", out.State(), in.State())
	}
	if err := out.Transfer().Err(); !errors.Is(err, ucx.ErrRevoked) {
		t.Fatalf("source transfer: %v, want a revocation", err)
	}
	if tr := in.Transfer(); tr.State() != kvlease.TransferResolved || tr.Err() == nil {
		t.Fatalf("destination transfer %v: %v", tr.State(), tr.Err())
	}
	sent := l.sender.Stats().Messages
	prefill(t, prog, 0, 2, sLayers, fill)
	lease.Release()
	waitSettled(t, lease)
	if got := l.sender.Stats().Messages; got != sent {
		t.Fatalf("%d messages sent after the end", got-sent)
	}
}

package handoff

import (
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
)

func TestProgressMarks(t *testing.T) {
	if _, err := NewProgress(0, 1); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("0 blocks: %v", err)
	}
	if _, err := NewProgress(1, MaxLayers+1); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("too many layers: %v", err)
	}
	p, err := NewProgress(6, 4)
	if err != nil {
		t.Fatal(err)
	}
	for _, bad := range []error{p.WroteLayers(5), p.WroteLayers(-1), p.WroteBlocks(7), p.WroteBlocks(-1)} {
		if !errors.Is(bad, kvlease.ErrInvalidArgument) {
			t.Fatalf("out of range mark: %v", bad)
		}
	}
	r, err := p.Ready(2) // the plane sends blocks 2..5
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Ready(7); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("ready past the end: %v", err)
	}
	check := func(what string, l, b int, complete bool) {
		t.Helper()
		if gl, gb := r.Written(); gl != l || gb != b || r.Complete() != complete || p.Complete() != complete {
			t.Fatalf("%s: written (%d layers, %d blocks) complete %v, want (%d, %d) %v", what, gl, gb, r.Complete(), l, b, complete)
		}
	}
	check("nothing", 0, 0, false)
	_ = p.WroteLayers(1)
	check("layer 0", 1, 0, false)
	_ = p.WroteBlocks(2) // blocks before the plane's first
	check("blocks 0,1", 1, 0, false)
	_ = p.WroteBlocks(3)
	check("blocks 0..2", 1, 1, false)
	_ = p.WroteLayers(0) // backwards: no change
	_ = p.WroteBlocks(1)
	check("backwards", 1, 1, false)
	_ = p.WroteLayers(4)
	check("every layer", 4, 4, true)

	var zero Ready
	if zero.Streaming() || !zero.Complete() || zero.Layers() != 1 {
		t.Fatal("the zero Ready must be complete and not streaming")
	}
}

// TestProgressWait: a waiter sees each mark (or the stop), concurrently
// with the marking goroutine.
func TestProgressWait(t *testing.T) {
	p, _ := NewProgress(4, 8)
	r, _ := p.Ready(0)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for l := 1; l <= 8; l++ {
			_ = p.WroteLayers(l)
		}
	}()
	l, b := 0, 0
	for steps := 0; !r.Complete(); steps++ {
		if steps > 8 {
			t.Fatalf("more waits than marks: at %d layers", l)
		}
		nl, nb, ok := r.Wait(l, b, stop)
		if !ok || (nl <= l && nb <= b) {
			t.Fatalf("wait returned (%d, %d, %v) from (%d, %d)", nl, nb, ok, l, b)
		}
		l, b = nl, nb
	}
	wg.Wait()
	q, _ := NewProgress(4, 8)
	qr, _ := q.Ready(1)
	close(stop)
	if _, _, ok := qr.Wait(0, 0, stop); ok {
		t.Fatal("a stopped wait must report it")
	}
}

// streamPlane is a manual SendPlane that streams: it records the Ready
// each SendStream got.
type streamPlane struct {
	*manualPlane
	readies chan Ready
}

func (p *streamPlane) SendStream(_ PlaneID, regions [][]byte, ready Ready, _ []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	p.readies <- ready
	return nil, p.attach(attach)
}

// checkingPlane is a non-streaming SendPlane that records whether Send
// came before the progress was complete.
type checkingPlane struct {
	*manualPlane
	p     *Progress
	early chan bool
}

func (p *checkingPlane) Send(id PlaneID, regions [][]byte, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	p.early <- !p.p.Complete()
	return p.manualPlane.Send(id, regions, accept, attach)
}

// streamHalves connects a source with send plane sp to a destination on
// a manual plane, and returns the source and the accepted handoffs.
func streamHalves(t *testing.T, sp SendPlane[[]byte]) (*Source[[]byte], *kvlease.Pool[[]byte], *manualPlane, chan *Incoming[[]byte]) {
	t.Helper()
	srcPool, dstPool := newHostPool(t, 32, hbBytes), newHostPool(t, 32, hbBytes)
	recv, incoming := newManualPlane(), make(chan *Incoming[[]byte], 8)
	a, b := net.Pipe()
	dst, err := NewDestination(dstPool, recv, DestinationConfig[[]byte]{
		HalfConfig: HalfConfig{Envelope: testEnvelope(), Auth: testPSK},
		OnAccept:   func(in *Incoming[[]byte]) { incoming <- in },
	})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() { _ = dst.Serve(b); close(served) }()
	src, err := NewSource(a, sp, HalfConfig{Envelope: testEnvelope(), Auth: testPSK})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = src.Close()
		<-served
		for _, p := range []*kvlease.Pool[[]byte]{srcPool, dstPool} {
			if err := p.Check(); err != nil {
				t.Error(err)
			}
		}
	})
	return src, srcPool, recv, incoming
}

// TestStreamingPropose: a streaming plane gets the progress at accept,
// seen from the destination's first missing block; a plane that cannot
// stream is called only once the progress is complete; an abort while
// waiting for the prefill sends nothing.
func TestStreamingPropose(t *testing.T) {
	t.Run("streaming plane", func(t *testing.T) {
		sp := &streamPlane{manualPlane: newManualPlane(), readies: make(chan Ready, 1)}
		src, pool, recv, incoming := streamHalves(t, sp)
		lease, _ := pool.Acquire("r", 4)
		p, _ := NewProgress(4, 2)
		o, err := src.Propose(1, "r", lease, nil, Streaming(p))
		if err != nil {
			t.Fatal(err)
		}
		in := <-incoming
		ready := <-sp.readies
		if !ready.Streaming() || ready.Complete() || ready.Layers() != 2 {
			t.Fatalf("plane got %+v", ready)
		}
		st, dt := sp.next(t), recv.next(t)
		_ = p.WroteLayers(1)
		if l, b := ready.Written(); l != 1 || b != 0 {
			t.Fatalf("ready after layer 0: (%d, %d)", l, b)
		}
		p.WroteAll()
		st.Resolve(nil)
		dt.Resolve(nil)
		waitHalf(t, "source", o.State, Delivered)
		waitHalf(t, "destination", in.State, Delivered)
		lease.Release()
	})
	t.Run("plane that cannot stream", func(t *testing.T) {
		p, _ := NewProgress(4, 2)
		cp := &checkingPlane{manualPlane: newManualPlane(), p: p, early: make(chan bool, 1)}
		src, pool, recv, incoming := streamHalves(t, cp)
		lease, _ := pool.Acquire("r", 4)
		o, err := src.Propose(1, "r", lease, nil, Streaming(p))
		if err != nil {
			t.Fatal(err)
		}
		in := <-incoming
		waitHalf(t, "source", o.State, Accepted)
		_ = p.WroteLayers(1)
		p.WroteAll()
		if early := <-cp.early; early {
			t.Fatal("Send came before the progress was complete")
		}
		cp.next(t).Resolve(nil)
		recv.next(t).Resolve(nil)
		waitHalf(t, "source", o.State, Delivered)
		waitHalf(t, "destination", in.State, Delivered)
		lease.Release()
	})
	t.Run("abort before the prefill ends", func(t *testing.T) {
		p, _ := NewProgress(4, 2)
		cp := &checkingPlane{manualPlane: newManualPlane(), p: p, early: make(chan bool, 1)}
		src, pool, _, incoming := streamHalves(t, cp)
		lease, _ := pool.Acquire("r", 4)
		o, err := src.Propose(1, "r", lease, nil, Streaming(p))
		if err != nil {
			t.Fatal(err)
		}
		in := <-incoming
		waitHalf(t, "source", o.State, Accepted)
		if err := o.Abort("test", nil); err != nil {
			t.Fatal(err)
		}
		waitHalf(t, "source", o.State, Aborted)
		waitHalf(t, "destination", in.State, Aborted)
		p.WroteAll()
		select {
		case <-cp.early:
			t.Fatal("an aborted handoff was sent")
		case <-time.After(20 * time.Millisecond):
		}
	})
	t.Run("progress that does not fit", func(t *testing.T) {
		src, pool, _, _ := streamHalves(t, newManualPlane())
		lease, _ := pool.Acquire("r", 4)
		defer lease.Release()
		for _, p := range []*Progress{must(NewProgress(3, 1)), must(NewProgress(4, 3))} {
			if _, err := src.Propose(1, "r", lease, nil, Streaming(p)); !errors.Is(err, kvlease.ErrInvalidArgument) {
				t.Fatalf("progress of %d×%d: %v", p.Blocks(), p.Layers(), err)
			}
		}
		if _, err := src.Propose(1, "r", lease, nil, Streaming(nil)); !errors.Is(err, kvlease.ErrInvalidArgument) {
			t.Fatalf("nil progress: %v", err)
		}
	})
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// FuzzProgress drives a progress with arbitrary marks (valid and not) and
// checks its invariants after each: marks only move forward, an invalid
// mark changes nothing, a plane's view is the progress seen from its
// first block, and complete means every part of every block is written.
func FuzzProgress(f *testing.F) {
	f.Add(uint8(5), uint8(3), uint8(2), []byte{0x01, 0x82, 0x03, 0x85})
	f.Add(uint8(1), uint8(1), uint8(0), []byte{0x81})
	f.Fuzz(func(t *testing.T, blocks, layers, from uint8, marks []byte) {
		p, err := NewProgress(int(blocks), int(layers))
		if blocks == 0 || layers == 0 {
			if !errors.Is(err, kvlease.ErrInvalidArgument) {
				t.Fatalf("%d×%d: %v", blocks, layers, err)
			}
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		r, err := p.Ready(int(from))
		if int(from) > int(blocks) {
			if !errors.Is(err, kvlease.ErrInvalidArgument) {
				t.Fatalf("ready from %d of %d: %v", from, blocks, err)
			}
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range marks {
			l0, b0 := p.Written()
			v := int(m & 0x7f)
			if m&0x80 != 0 {
				err = p.WroteBlocks(v)
				if (v > int(blocks)) != (err != nil) {
					t.Fatalf("WroteBlocks(%d) of %d: %v", v, blocks, err)
				}
			} else {
				err = p.WroteLayers(v)
				if (v > int(layers)) != (err != nil) {
					t.Fatalf("WroteLayers(%d) of %d: %v", v, layers, err)
				}
			}
			l, b := p.Written()
			if l < l0 || b < b0 || (err != nil && (l != l0 || b != b0)) {
				t.Fatalf("(%d, %d) → (%d, %d) after mark %#x (err %v)", l0, b0, l, b, m, err)
			}
			complete := l == int(layers) || b == int(blocks)
			if p.Complete() != complete || (complete && (l != int(layers) || b != int(blocks))) {
				t.Fatalf("written (%d, %d) of %d×%d, Complete %v", l, b, blocks, layers, p.Complete())
			}
			rl, rb := r.Written()
			if rl != l || rb != min(max(b-int(from), 0), int(blocks)-int(from)) || (complete && !r.Complete()) {
				t.Fatalf("view from %d: (%d, %d) of (%d, %d)", from, rl, rb, l, b)
			}
		}
	})
}

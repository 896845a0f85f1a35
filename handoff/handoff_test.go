package handoff

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvlease/kvlease"
)

// These tests drive the handoff through manualTransport, which lets each
// test decide when (and whether) a transfer resolves. The faulty
// asynchronous transport is exercised in package inproc and in
// examples/disagg.

const hbBytes = 64 // block size of the test pools

func testEnvelope() Envelope {
	return Envelope{BlockTokens: 16, BlockBytes: hbBytes, PoolBlocks: 32,
		MaxContextTokens: 512, MaxPrefillTokens: 128, MaxRunningRequests: 8}
}

func newHostPool(t testing.TB, blocks, blockBytes int) *kvlease.Pool[[]byte] {
	t.Helper()
	mem, err := kvlease.NewHostMemory(blocks, blockBytes)
	if err != nil {
		t.Fatal(err)
	}
	p, err := kvlease.NewPool[[]byte](mem)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// manualTransport starts nothing by itself: Start creates the transfer,
// calls attach and remembers the pairs; the test copies and resolves.
type manualTransport struct {
	mu       sync.Mutex
	starts   int                 // Start calls
	attached []*kvlease.Transfer // transfers whose attach succeeded
	pairs    [][]kvlease.CopyPair[[]byte, []byte]
	cancels  atomic.Int32 // cancel hook runs

	startErr     error                     // returned before attaching
	noAttach     bool                      // return a transfer without attaching (contract violation)
	beforeAttach func()                    // runs just before attach
	onCancel     func(t *kvlease.Transfer) // runs inside the cancel hook
}

func (m *manualTransport) Start(pairs []kvlease.CopyPair[[]byte, []byte], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	m.mu.Lock()
	m.starts++
	m.mu.Unlock()
	if m.startErr != nil {
		return nil, m.startErr
	}
	var t *kvlease.Transfer
	t = kvlease.NewTransfer(func() {
		m.cancels.Add(1)
		if m.onCancel != nil {
			m.onCancel(t)
		}
	})
	if m.noAttach {
		return t, nil
	}
	if m.beforeAttach != nil {
		m.beforeAttach()
	}
	if err := attach(t); err != nil {
		t.Resolve(err)
		return nil, err
	}
	m.mu.Lock()
	m.attached = append(m.attached, t)
	m.pairs = append(m.pairs, pairs)
	m.mu.Unlock()
	return t, nil
}

// copyAll performs the k-th attached copy.
func (m *manualTransport) copyAll(k int) {
	m.mu.Lock()
	pairs := m.pairs[k]
	m.mu.Unlock()
	for _, p := range pairs {
		copy(p.Dst, p.Src)
	}
}

func (m *manualTransport) startCount() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.starts
}

func (m *manualTransport) attachCount() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.attached)
}

// fixture is one proposed handoff of n blocks between two 32-block pools.
type fixture struct {
	src, dst *kvlease.Pool[[]byte]
	lease    *kvlease.Lease[[]byte]
	h        *Handoff[[]byte, []byte]
	tr       *manualTransport
}

func newFixture(t testing.TB, n int, deadline time.Duration) *fixture {
	t.Helper()
	f := &fixture{src: newHostPool(t, 32, hbBytes), dst: newHostPool(t, 32, hbBytes), tr: &manualTransport{}}
	var err error
	if f.lease, err = f.src.Acquire("req", n); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		r, _ := f.lease.Region(i)
		for j := range r {
			r[j] = byte(i + 1)
		}
	}
	f.h, err = Propose(f.lease, f.dst, Config{Envelope: testEnvelope(), Source: "prefill", Destination: "decode", Deadline: deadline})
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func (f *fixture) start(t testing.TB) *kvlease.Transfer {
	t.Helper()
	if err := f.h.Accept(); err != nil {
		t.Fatal(err)
	}
	if err := f.h.Start(f.tr); err != nil {
		t.Fatal(err)
	}
	return f.h.Transfer()
}

// stats returns the block counts of both pools as one string.
func (f *fixture) stats() string {
	s, d := f.src.Stats(), f.dst.Stats()
	return fmt.Sprintf("src free=%d leased=%d draining=%d quarantined=%d; dst free=%d leased=%d draining=%d quarantined=%d",
		s.Free, s.Leased, s.Draining, s.Quarantined, d.Free, d.Leased, d.Draining, d.Quarantined)
}

func (f *fixture) check(t testing.TB) {
	t.Helper()
	if err := f.src.Check(); err != nil {
		t.Errorf("source pool: %v", err)
	}
	if err := f.dst.Check(); err != nil {
		t.Errorf("destination pool: %v", err)
	}
}

func wantStats(t testing.TB, f *fixture, want string) {
	t.Helper()
	if got := f.stats(); got != want {
		t.Fatalf("stats:\n got %s\nwant %s", got, want)
	}
}

func waitDone(t testing.TB, h *Handoff[[]byte, []byte]) {
	t.Helper()
	select {
	case <-h.Done():
	case <-time.After(10 * time.Second):
		t.Fatalf("handoff still %v", h.State())
	}
}

// steps renders the history as "from→to by/event" lines, without errors.
func steps(h *Handoff[[]byte, []byte]) []string {
	var out []string
	for _, s := range h.History() {
		out = append(out, fmt.Sprintf("%v→%v %s/%v", s.From, s.To, s.By, s.Event))
	}
	return out
}

func wantSteps(t testing.TB, h *Handoff[[]byte, []byte], want ...string) {
	t.Helper()
	if got := steps(h); !reflect.DeepEqual(got, want) {
		t.Fatalf("history:\n got %q\nwant %q", got, want)
	}
}

func wantState(t testing.TB, h *Handoff[[]byte, []byte], want State) {
	t.Helper()
	if got := h.State(); got != want {
		t.Fatalf("state %v, want %v (history %q)", got, want, steps(h))
	}
}

// TestHandoffTable walks the transition table: every cell against the
// issue's state list, and the properties the design relies on.
func TestHandoffTable(t *testing.T) {
	// The moves, written from the specification, not from the table.
	spec := map[string]bool{
		"none --propose--> proposed":             true,
		"proposed --accept--> accepted":          true,
		"proposed --reject--> rejected":          true,
		"proposed --abort--> aborted":            true,
		"accepted --reject--> rejected":          true,
		"accepted --attach--> transferring":      true,
		"accepted --start-fail--> failed":        true,
		"accepted --abort--> aborted":            true,
		"transferring --resolve--> delivered":    true,
		"transferring --resolve-error--> failed": true,
		"transferring --abort--> aborting":       true,
		"transferring --expire--> quarantined":   true,
		"aborting --resolve--> aborted":          true,
		"aborting --resolve-error--> aborted":    true,
		"aborting --expire--> quarantined":       true,
		"quarantined --resolve--> aborted":       true,
		"quarantined --resolve-error--> aborted": true,
	}
	// The idempotent repeats that return nil and change nothing.
	noops := map[string]bool{
		"rejected reject": true, "rejected expire": true,
		"delivered expire": true, "failed expire": true,
		"aborting abort": true, "aborted abort": true, "aborted expire": true,
		"quarantined abort": true, "quarantined expire": true,
	}
	for s := State(0); s < numStates; s++ {
		for e := Event(1); e < numEvents; e++ {
			edge := next(s, e)
			switch edge.kind {
			case edgeMove:
				key := fmt.Sprintf("%v --%v--> %v", s, e, edge.to)
				if !spec[key] {
					t.Errorf("table moves %s, not in the specification", key)
				}
				delete(spec, key)
				if s.Final() {
					t.Errorf("final state %v has a move on %v", s, e)
				}
			case edgeNoop:
				key := fmt.Sprintf("%v %v", s, e)
				if !noops[key] {
					t.Errorf("table has an unexpected no-op %s", key)
				}
				if edge.to != s {
					t.Errorf("no-op %s changes the state to %v", key, edge.to)
				}
				delete(noops, key)
			}
		}
	}
	for k := range spec {
		t.Errorf("specified move %s missing from the table", k)
	}
	for k := range noops {
		t.Errorf("specified no-op %s missing from the table", k)
	}
	if got := next(numStates, EventAbort); got.kind != edgeRefuse {
		t.Errorf("an invalid state is not refused: %+v", got)
	}
	if got := next(Proposed, numEvents); got.kind != edgeRefuse {
		t.Errorf("an invalid event is not refused: %+v", got)
	}

	// Reachability: from Rejected nothing is reachable (no transfer can
	// ever start); every state is reachable from none; Quarantined is left
	// only by the transfer's resolution.
	reach := func(from State) map[State]bool {
		seen := map[State]bool{from: true}
		stack := []State{from}
		for len(stack) > 0 {
			s := stack[len(stack)-1]
			stack = stack[:len(stack)-1]
			for e := Event(1); e < numEvents; e++ {
				if edge := next(s, e); edge.kind == edgeMove && !seen[edge.to] {
					seen[edge.to] = true
					stack = append(stack, edge.to)
				}
			}
		}
		return seen
	}
	if r := reach(Rejected); len(r) != 1 {
		t.Errorf("states reachable from rejected: %v", r)
	}
	if r := reach(stateNone); len(r) != int(numStates) {
		t.Errorf("only %d of %d states reachable", len(r), numStates)
	}
	for e := Event(1); e < numEvents; e++ {
		if edge := next(Quarantined, e); edge.kind == edgeMove && e != EventResolve && e != EventResolveError {
			t.Errorf("quarantine lifted by %v, which is not evidence", e)
		}
	}
	for s := State(0); s <= numStates; s++ {
		if s.String() == "" {
			t.Errorf("state %d has no name", s)
		}
	}
	if Event(0).String() != "invalid" || numEvents.String() != "invalid" || numStates.String() != "invalid" {
		t.Error("invalid enum values have names")
	}
}

func TestHandoffDelivered(t *testing.T) {
	f := newFixture(t, 3, -1)
	wantState(t, f.h, Proposed)
	if f.h.Destination() != nil || f.h.Transfer() != nil || f.h.Blocks() != 3 || f.h.Source() != f.lease {
		t.Fatal("a proposed handoff holds something")
	}
	tr := f.start(t)
	wantState(t, f.h, Transferring)
	wantStats(t, f, "src free=29 leased=3 draining=0 quarantined=0; dst free=29 leased=3 draining=0 quarantined=0")

	f.tr.copyAll(0)
	if !tr.Resolve(nil) {
		t.Fatal("resolve lost")
	}
	if tr.Resolve(errors.New("again")) {
		t.Fatal("a transport resolving twice won the second time")
	}
	waitDone(t, f.h)
	wantState(t, f.h, Delivered)
	wantSteps(t, f.h,
		"none→proposed prefill/propose",
		"proposed→accepted decode/accept",
		"accepted→transferring transport/attach",
		"transferring→delivered transport/resolve")
	if f.h.Err() != nil {
		t.Fatalf("delivered with error %v", f.h.Err())
	}
	if h := f.h.History(); h[2].Transfer != tr.ID() || h[3].Transfer != tr.ID() || h[1].Transfer != 0 {
		t.Fatalf("steps do not name the transfer: %v", h)
	}
	d := f.h.Destination()
	for i := range 3 {
		r, err := d.Region(i)
		if err != nil || r[0] != byte(i+1) || r[hbBytes-1] != byte(i+1) {
			t.Fatalf("destination block %d: %v %v", i, r[:2], err)
		}
	}
	if st := f.lease.State(); st != kvlease.LeaseActive {
		t.Fatalf("source lease %v after delivery, want active (untouched)", st)
	}
	if err := f.h.Abort("decode", nil); !errors.Is(err, ErrState) {
		t.Fatalf("abort after delivery = %v, want ErrState", err)
	}
	if d.State() != kvlease.LeaseActive {
		t.Fatal("a refused abort touched the delivered lease")
	}
	if err := f.h.Expire("deadline", nil); err != nil {
		t.Fatalf("a late deadline after delivery = %v, want nil", err)
	}
	d.Release()
	f.lease.Release()
	wantStats(t, f, "src free=32 leased=0 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
	f.check(t)
}

func TestHandoffRejected(t *testing.T) {
	t.Run("by decision before accept", func(t *testing.T) {
		f := newFixture(t, 2, -1)
		if err := f.h.Reject("decode", errors.New("decode queue full")); err != nil {
			t.Fatal(err)
		}
		rejectedForever(t, f)
		wantSteps(t, f.h, "none→proposed prefill/propose", "proposed→rejected decode/reject")
		if err := f.h.Reject("decode", nil); err != nil {
			t.Fatalf("second reject = %v, want nil", err)
		}
		if f.h.Err().Error() != "decode queue full" {
			t.Fatalf("Err = %v", f.h.Err())
		}
	})
	t.Run("after accept", func(t *testing.T) {
		f := newFixture(t, 2, -1)
		if err := f.h.Accept(); err != nil {
			t.Fatal(err)
		}
		if err := f.h.Accept(); !errors.Is(err, ErrState) {
			t.Fatalf("second accept = %v", err)
		}
		if err := f.h.Reject("scheduler", nil); err != nil {
			t.Fatal(err)
		}
		if !errors.Is(f.h.Err(), ErrRejected) {
			t.Fatalf("default reason %v", f.h.Err())
		}
		rejectedForever(t, f)
		if f.h.Destination().State() != kvlease.LeaseSettled {
			t.Fatal("the destination lease of a rejected handoff is not settled")
		}
	})
	t.Run("by exhaustion", func(t *testing.T) {
		f := newFixture(t, 4, -1)
		hog, _ := f.dst.Acquire("hog", 30)
		err := f.h.Accept()
		if !errors.Is(err, kvlease.ErrExhausted) {
			t.Fatalf("accept on a full pool = %v, want kvlease.ErrExhausted", err)
		}
		if !errors.Is(f.h.Err(), kvlease.ErrExhausted) {
			t.Fatalf("recorded reason %v", f.h.Err())
		}
		hog.Release()
		rejectedForever(t, f)
		wantSteps(t, f.h, "none→proposed prefill/propose", "proposed→rejected decode/reject")
	})
	t.Run("destination larger than pool", func(t *testing.T) {
		f := newFixture(t, 4, -1)
		small := newHostPool(t, 2, hbBytes)
		h, err := Propose(f.lease, small, Config{Envelope: testEnvelope()})
		if err != nil {
			t.Fatal(err)
		}
		if err := h.Accept(); !errors.Is(err, kvlease.ErrExceedsCapacity) {
			t.Fatalf("accept = %v, want kvlease.ErrExceedsCapacity", err)
		}
		if h.State() != Rejected || h.History()[1].By != "destination" || h.History()[0].By != "source" {
			t.Fatalf("state %v, history %v", h.State(), h.History())
		}
	})
	t.Run("closed destination pool", func(t *testing.T) {
		f := newFixture(t, 1, -1)
		f.dst.Close()
		if err := f.h.Accept(); !errors.Is(err, kvlease.ErrPoolClosed) {
			t.Fatalf("accept = %v, want kvlease.ErrPoolClosed", err)
		}
		wantState(t, f.h, Rejected)
	})
}

// rejectedForever checks that a rejected handoff can never start a
// transfer, and that its source lease is untouched.
func rejectedForever(t *testing.T, f *fixture) {
	t.Helper()
	wantState(t, f.h, Rejected)
	select {
	case <-f.h.Done():
	default:
		t.Fatal("Done not closed on rejection")
	}
	for _, call := range []func() error{
		func() error { return f.h.Start(f.tr) },
		f.h.Accept,
		func() error { return f.h.Abort("prefill", nil) },
	} {
		if err := call(); !errors.Is(err, ErrState) {
			t.Fatalf("call after rejection = %v, want ErrState", err)
		}
	}
	if err := f.h.Expire("deadline", nil); err != nil {
		t.Fatalf("expire after rejection = %v, want nil", err)
	}
	if f.tr.startCount() != 0 {
		t.Fatal("a rejected handoff reached the transport")
	}
	if f.lease.State() != kvlease.LeaseActive {
		t.Fatalf("source lease %v, want untouched", f.lease.State())
	}
	wantStats(t, f, fmt.Sprintf("src free=%d leased=%d draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0",
		32-f.lease.Len(), f.lease.Len()))
	f.check(t)
}

func TestHandoffFailed(t *testing.T) {
	t.Run("transfer resolves with error", func(t *testing.T) {
		f := newFixture(t, 3, -1)
		tr := f.start(t)
		boom := errors.New("link down, copy fenced")
		tr.Resolve(boom)
		waitDone(t, f.h)
		wantState(t, f.h, Failed)
		if !errors.Is(f.h.Err(), boom) {
			t.Fatalf("Err = %v", f.h.Err())
		}
		wantSteps(t, f.h, "none→proposed prefill/propose", "proposed→accepted decode/accept",
			"accepted→transferring transport/attach", "transferring→failed transport/resolve-error")
		if f.lease.State() != kvlease.LeaseActive {
			t.Fatal("source lease touched by a failure")
		}
		wantStats(t, f, "src free=29 leased=3 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
		if err := f.h.Abort("prefill", nil); !errors.Is(err, ErrState) {
			t.Fatalf("abort after failure = %v", err)
		}
		f.check(t)
	})
	t.Run("source closed before start", func(t *testing.T) {
		f := newFixture(t, 2, -1)
		if err := f.h.Accept(); err != nil {
			t.Fatal(err)
		}
		f.lease.Release()
		if err := f.h.Start(f.tr); !errors.Is(err, kvlease.ErrLeaseClosed) {
			t.Fatalf("start = %v, want kvlease.ErrLeaseClosed", err)
		}
		wantState(t, f.h, Failed)
		if f.tr.startCount() != 0 {
			t.Fatal("the transport was called")
		}
		wantStats(t, f, "src free=32 leased=0 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
	})
	t.Run("source closed during start", func(t *testing.T) {
		f := newFixture(t, 2, -1)
		if err := f.h.Accept(); err != nil {
			t.Fatal(err)
		}
		f.tr.beforeAttach = f.lease.Release
		if err := f.h.Start(f.tr); !errors.Is(err, kvlease.ErrLeaseClosed) {
			t.Fatalf("start = %v, want kvlease.ErrLeaseClosed", err)
		}
		wantState(t, f.h, Failed)
		if f.tr.attachCount() != 0 {
			t.Fatal("attached")
		}
		wantStats(t, f, "src free=32 leased=0 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
		f.check(t)
	})
	t.Run("transport fails to start", func(t *testing.T) {
		f := newFixture(t, 2, -1)
		if err := f.h.Accept(); err != nil {
			t.Fatal(err)
		}
		f.tr.startErr = errors.New("no route to decode worker")
		err := f.h.Start(f.tr)
		if err == nil || err.Error() != "kvlease: handoff start: no route to decode worker" {
			t.Fatalf("start = %v", err)
		}
		wantState(t, f.h, Failed)
		wantSteps(t, f.h, "none→proposed prefill/propose", "proposed→accepted decode/accept", "accepted→failed transport/start-fail")
		wantStats(t, f, "src free=30 leased=2 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
	})
	t.Run("transport returns without attaching", func(t *testing.T) {
		f := newFixture(t, 2, -1)
		if err := f.h.Accept(); err != nil {
			t.Fatal(err)
		}
		f.tr.noAttach = true
		if err := f.h.Start(f.tr); err == nil {
			t.Fatal("start without attach succeeded")
		}
		wantState(t, f.h, Failed)
	})
}

func TestHandoffStartRefused(t *testing.T) {
	f := newFixture(t, 2, -1)
	if err := f.h.Start(f.tr); !errors.Is(err, ErrState) {
		t.Fatalf("start before accept = %v", err)
	}
	if err := f.h.Start(nil); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("start with nil transport = %v", err)
	}
	if err := f.h.Expire("deadline", nil); !errors.Is(err, ErrState) {
		t.Fatalf("expire with nothing in flight = %v", err)
	}
	tr := f.start(t)
	if err := f.h.Start(f.tr); !errors.Is(err, ErrState) {
		t.Fatalf("second start = %v", err)
	}
	if err := f.h.Reject("decode", nil); !errors.Is(err, ErrState) {
		t.Fatalf("reject after start = %v", err)
	}
	if f.tr.attachCount() != 1 || f.tr.startCount() != 1 {
		t.Fatalf("%d starts, %d attached", f.tr.startCount(), f.tr.attachCount())
	}
	// An attach the transport calls for a second transfer is refused too.
	if err := f.h.attach(kvlease.NewTransfer(nil)); !errors.Is(err, ErrState) {
		t.Fatalf("second attach = %v", err)
	}
	tr.Resolve(nil)
	waitDone(t, f.h)
	wantState(t, f.h, Delivered)
}

func TestHandoffAborted(t *testing.T) {
	t.Run("proposed", func(t *testing.T) {
		f := newFixture(t, 2, -1)
		if err := f.h.Abort("frontend", errors.New("client gone")); err != nil {
			t.Fatal(err)
		}
		wantState(t, f.h, Aborted)
		if f.lease.State() != kvlease.LeaseSettled {
			t.Fatalf("source lease %v, want aborted and settled", f.lease.State())
		}
		if err := f.h.Accept(); !errors.Is(err, ErrState) {
			t.Fatalf("accept after abort = %v", err)
		}
		if err := f.h.Abort("frontend", nil); err != nil {
			t.Fatalf("second abort = %v", err)
		}
		wantSteps(t, f.h, "none→proposed prefill/propose", "proposed→aborted frontend/abort")
		wantStats(t, f, "src free=32 leased=0 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
	})
	t.Run("accepted", func(t *testing.T) {
		f := newFixture(t, 2, -1)
		if err := f.h.Accept(); err != nil {
			t.Fatal(err)
		}
		if err := f.h.Abort("decode", nil); err != nil {
			t.Fatal(err)
		}
		if err := f.h.Start(f.tr); !errors.Is(err, ErrState) {
			t.Fatalf("start after abort = %v", err)
		}
		if f.tr.startCount() != 0 {
			t.Fatal("an aborted handoff reached the transport")
		}
		wantState(t, f.h, Aborted)
		if !errors.Is(f.h.Err(), kvlease.ErrAborted) {
			t.Fatalf("default cause %v", f.h.Err())
		}
		wantStats(t, f, "src free=32 leased=0 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
	})
	t.Run("transferring, then the copy completes", func(t *testing.T) {
		// Delivering after abort: the copy's success arrives, but the
		// request is gone; the evidence only settles the blocks.
		f := newFixture(t, 3, -1)
		tr := f.start(t)
		if err := f.h.Abort("frontend", errors.New("client gone")); err != nil {
			t.Fatal(err)
		}
		wantState(t, f.h, Aborting)
		if f.tr.cancels.Load() != 1 || !tr.CancelRequested() {
			t.Fatal("the transfer was not cancelled exactly once")
		}
		// Both leases are closed; their blocks drain until the evidence.
		wantStats(t, f, "src free=29 leased=0 draining=3 quarantined=0; dst free=29 leased=0 draining=3 quarantined=0")
		if err := f.h.Abort("decode", nil); err != nil {
			t.Fatalf("second abort = %v", err)
		}
		if err := f.h.Reject("decode", nil); !errors.Is(err, ErrState) {
			t.Fatalf("reject while aborting = %v", err)
		}
		select {
		case <-f.h.Done():
			t.Fatal("done before the transport proved quiescence")
		default:
		}
		f.tr.copyAll(0) // the copy ignored the cancel and ran to the end
		tr.Resolve(nil)
		waitDone(t, f.h)
		wantState(t, f.h, Aborted)
		wantSteps(t, f.h, "none→proposed prefill/propose", "proposed→accepted decode/accept",
			"accepted→transferring transport/attach", "transferring→aborting frontend/abort",
			"aborting→aborted transport/resolve")
		wantStats(t, f, "src free=32 leased=0 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
		if d := f.h.Destination(); d.State() != kvlease.LeaseSettled {
			t.Fatalf("destination lease %v", d.State())
		}
		f.check(t)
	})
	t.Run("cancel hook resolves synchronously", func(t *testing.T) {
		f := newFixture(t, 2, -1)
		f.tr.onCancel = func(t *kvlease.Transfer) { t.Resolve(errors.New("canceled before any write")) }
		f.start(t)
		if err := f.h.Abort("decode", nil); err != nil {
			t.Fatal(err)
		}
		// The evidence came inside Abort's own lease abort, on this
		// goroutine, with the handoff's lock held: parked for Abort,
		// recorded before it returned.
		wantState(t, f.h, Aborted)
		waitDone(t, f.h)
		if got := f.h.History()[4]; got.Event != EventResolveError || got.By != "transport" {
			t.Fatalf("evidence %v", got)
		}
		wantStats(t, f, "src free=32 leased=0 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
	})
	t.Run("source lease aborted by its owner", func(t *testing.T) {
		// Aborting the source lease directly cancels the transfer; the
		// transport's evidence then fails the handoff.
		f := newFixture(t, 2, -1)
		f.tr.onCancel = func(t *kvlease.Transfer) { t.Resolve(errors.New("canceled")) }
		f.start(t)
		f.lease.Abort(nil)
		waitDone(t, f.h)
		wantState(t, f.h, Failed)
		wantStats(t, f, "src free=32 leased=0 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
	})
}

// TestHandoffLostAck: the copy stops but its acknowledgement never comes.
// The deadline quarantines the transfer with both leases; time alone never
// frees the blocks; the late evidence lifts the quarantine.
func TestHandoffLostAck(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t, 3, 5*time.Second)
		tr := f.start(t)
		f.tr.copyAll(0) // ...and the acknowledgement is lost.

		time.Sleep(5*time.Second - time.Nanosecond)
		synctest.Wait()
		wantState(t, f.h, Transferring)
		time.Sleep(time.Nanosecond)
		synctest.Wait()
		wantState(t, f.h, Quarantined)
		if !errors.Is(f.h.Err(), kvlease.ErrQuarantined) || tr.State() != kvlease.TransferQuarantined {
			t.Fatalf("handoff err %v, transfer %v", f.h.Err(), tr.State())
		}
		wantStats(t, f, "src free=29 leased=0 draining=0 quarantined=3; dst free=29 leased=0 draining=0 quarantined=3")
		if f.tr.cancels.Load() != 1 {
			t.Fatal("the quarantined transfer was not cancelled")
		}

		// Time alone frees nothing; repeats change nothing.
		time.Sleep(time.Hour)
		synctest.Wait()
		if err := f.h.Abort("frontend", nil); err != nil {
			t.Fatalf("abort while quarantined = %v", err)
		}
		if err := f.h.Expire("supervisor", nil); err != nil {
			t.Fatalf("expire while quarantined = %v", err)
		}
		wantState(t, f.h, Quarantined)
		wantStats(t, f, "src free=29 leased=0 draining=0 quarantined=3; dst free=29 leased=0 draining=0 quarantined=3")

		tr.Resolve(nil) // the late evidence
		synctest.Wait()
		wantState(t, f.h, Aborted)
		wantSteps(t, f.h, "none→proposed prefill/propose", "proposed→accepted decode/accept",
			"accepted→transferring transport/attach", "transferring→quarantined deadline/expire",
			"quarantined→aborted transport/resolve")
		wantStats(t, f, "src free=32 leased=0 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
		f.check(t)
	})
}

func TestHandoffExpire(t *testing.T) {
	t.Run("evidence in time cancels the deadline", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			f := newFixture(t, 2, 5*time.Second)
			tr := f.start(t)
			time.Sleep(time.Second)
			tr.Resolve(nil)
			synctest.Wait()
			wantState(t, f.h, Delivered)
			time.Sleep(time.Minute)
			synctest.Wait()
			wantState(t, f.h, Delivered)
			f.h.Destination().Release()
		})
	})
	t.Run("while aborting", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			f := newFixture(t, 2, 5*time.Second)
			tr := f.start(t)
			f.h.Abort("frontend", nil)
			time.Sleep(5 * time.Second)
			synctest.Wait()
			wantState(t, f.h, Quarantined)
			wantStats(t, f, "src free=30 leased=0 draining=0 quarantined=2; dst free=30 leased=0 draining=0 quarantined=2")
			tr.Resolve(errors.New("finally fenced"))
			synctest.Wait()
			wantState(t, f.h, Aborted)
			wantSteps(t, f.h, "none→proposed prefill/propose", "proposed→accepted decode/accept",
				"accepted→transferring transport/attach", "transferring→aborting frontend/abort",
				"aborting→quarantined deadline/expire", "quarantined→aborted transport/resolve-error")
			wantStats(t, f, "src free=32 leased=0 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
		})
	})
	t.Run("by a supervisor, no deadline", func(t *testing.T) {
		f := newFixture(t, 2, -1)
		tr := f.start(t)
		reason := errors.New("transport reports the copy stopped, no ack")
		if err := f.h.Expire("supervisor", reason); err != nil {
			t.Fatal(err)
		}
		wantState(t, f.h, Quarantined)
		if !errors.Is(f.h.Err(), reason) || !errors.Is(tr.Err(), reason) {
			t.Fatalf("reason not recorded: %v / %v", f.h.Err(), tr.Err())
		}
		tr.Resolve(nil)
		waitDone(t, f.h)
		wantState(t, f.h, Aborted)
	})
	t.Run("evidence already there", func(t *testing.T) {
		// The transfer resolved but the watcher has not recorded it yet:
		// Expire records the evidence, not a quarantine.
		f := newFixture(t, 2, -1)
		if err := f.h.Accept(); err != nil {
			t.Fatal(err)
		}
		tr := kvlease.NewTransfer(nil)
		f.h.mu.Lock()
		f.h.state = Transferring // as attach would, without its watcher
		f.h.t = tr
		f.h.mu.Unlock()
		tr.Resolve(nil)
		if err := f.h.Expire("deadline", nil); err != nil {
			t.Fatal(err)
		}
		wantState(t, f.h, Delivered)
		if last := f.h.History()[2]; last.Event != EventResolve || last.By != "transport" {
			t.Fatalf("recorded %v", last)
		}
		f.h.Destination().Release()
	})
	t.Run("a transport that never resolves", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			f := newFixture(t, 1, 0) // zero: the default deadline
			tr := f.start(t)
			time.Sleep(DefaultDeadline)
			synctest.Wait()
			wantState(t, f.h, Quarantined)
			if f.h.History()[3].By != "deadline" {
				t.Fatalf("history %v", f.h.History())
			}
			tr.Resolve(nil) // let the watcher finish
			synctest.Wait()
		})
	})
}

func TestProposeBadInput(t *testing.T) {
	src := newHostPool(t, 32, hbBytes)
	dst := newHostPool(t, 32, hbBytes)
	other := newHostPool(t, 32, 2*hbBytes)
	lease, _ := src.Acquire("req", 2)
	big, _ := src.Acquire("big", 17)
	shortCtx := testEnvelope()
	shortCtx.MaxContextTokens = 256 // 16 blocks
	closed, _ := src.Acquire("closed", 1)
	closed.Release()
	env := testEnvelope()
	badEnv := env
	badEnv.MaxPrefillTokens = 0
	badEnv.MaxRunningRequests = 100

	for _, tt := range []struct {
		name  string
		lease *kvlease.Lease[[]byte]
		pool  *kvlease.Pool[[]byte]
		env   Envelope
		want  error
		text  string
	}{
		{"nil lease", nil, dst, env, kvlease.ErrInvalidArgument, "nil source lease"},
		{"nil pool", lease, nil, env, kvlease.ErrInvalidArgument, "nil source lease or destination pool"},
		{"invalid envelope", lease, dst, badEnv, kvlease.ErrInvalidArgument, "MaxPrefillTokens: must be positive, got 0; MaxRunningRequests: 100 running requests"},
		{"destination block size", lease, other, env, kvlease.ErrInvalidArgument, "source pool 64 bytes, destination pool 128 bytes, envelope 64 bytes"},
		{"envelope block size", lease, dst, Envelope{BlockTokens: 16, BlockBytes: 128, PoolBlocks: 32, MaxContextTokens: 512, MaxPrefillTokens: 128, MaxRunningRequests: 8},
			kvlease.ErrInvalidArgument, "envelope 128 bytes"},
		{"closed lease", closed, dst, env, kvlease.ErrLeaseClosed, "lease closed"},
		{"more than a context", big, dst, shortCtx, kvlease.ErrExceedsCapacity, "17 blocks exceed the 16 blocks of a 256-token context"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var h *Handoff[[]byte, []byte]
			var err error
			if tt.lease == nil {
				h, err = Propose[[]byte, []byte](nil, tt.pool, Config{Envelope: tt.env})
			} else {
				h, err = Propose(tt.lease, tt.pool, Config{Envelope: tt.env})
			}
			if h != nil || !errors.Is(err, tt.want) {
				t.Fatalf("Propose = %v, %v; want %v", h, err, tt.want)
			}
			if !strings.Contains(err.Error(), tt.text) {
				t.Fatalf("error %q lacks %q", err, tt.text)
			}
		})
	}
	if lease.State() != kvlease.LeaseActive {
		t.Fatal("a refused proposal touched the lease")
	}
}

func TestHandoffAcceptWait(t *testing.T) {
	f := newFixture(t, 4, -1)
	hog, _ := f.dst.Acquire("hog", 30)
	//lint:ignore SA1012 the nil-context guard is what this checks
	if err := f.h.AcceptWait(nil); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("nil context = %v", err)
	}
	done := make(chan error)
	go func() { done <- f.h.AcceptWait(context.Background()) }()
	for f.dst.Stats().Waiters == 0 {
		time.Sleep(time.Millisecond)
	}
	wantState(t, f.h, Proposed) // waiting holds nothing
	hog.Release()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	wantState(t, f.h, Accepted)

	g := newFixture(t, 4, -1)
	hog, _ = g.dst.Acquire("hog", 30)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { done <- g.h.AcceptWait(ctx) }()
	for g.dst.Stats().Waiters == 0 {
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled wait = %v", err)
	}
	wantState(t, g.h, Rejected)
	hog.Release()
	rejectedForever(t, g)
}

func TestHandoffAcceptLosesToAbort(t *testing.T) {
	// An Abort that lands while Accept waits for blocks wins; the blocks
	// Accept then gets go straight back.
	f := newFixture(t, 4, -1)
	hog, _ := f.dst.Acquire("hog", 30)
	done := make(chan error)
	go func() { done <- f.h.AcceptWait(context.Background()) }()
	for f.dst.Stats().Waiters == 0 {
		time.Sleep(time.Millisecond)
	}
	if err := f.h.Abort("frontend", nil); err != nil {
		t.Fatal(err)
	}
	hog.Release()
	if err := <-done; !errors.Is(err, ErrState) {
		t.Fatalf("accept after abort = %v", err)
	}
	wantState(t, f.h, Aborted)
	if f.h.Destination() != nil {
		t.Fatal("the losing accept kept its lease")
	}
	wantStats(t, f, "src free=32 leased=0 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
}

func TestHandoffStepString(t *testing.T) {
	s := Step{From: Transferring, To: Failed, Event: EventResolveError, By: "transport",
		Err: errors.New("link down"), Transfer: 7}
	if got, want := s.String(), "transferring → failed  transport/resolve-error (transfer 7): link down"; got != want {
		t.Fatalf("%q, want %q", got, want)
	}
	s = Step{From: Proposed, To: Accepted, Event: EventAccept, By: "decode"}
	if got, want := s.String(), "proposed → accepted  decode/accept"; got != want {
		t.Fatalf("%q, want %q", got, want)
	}
}

// TestHandoffRaceAbortDelivery races Abort against the transport's
// successful Resolve. Either may win; the outcome must be one of the two
// defined ones, consistently: delivered (abort refused, destination lease
// open and complete) or aborted (abort accepted, both leases closed), and
// every block returns.
func TestHandoffRaceAbortDelivery(t *testing.T) {
	outcomes := map[State]int{}
	for i := range 200 {
		f := newFixture(t, 3, -1)
		tr := f.start(t)
		var abortErr error
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			abortErr = f.h.Abort("frontend", errors.New("client gone"))
		}()
		go func() {
			defer wg.Done()
			f.tr.copyAll(0)
			tr.Resolve(nil)
		}()
		wg.Wait()
		waitDone(t, f.h)
		switch st := f.h.State(); st {
		case Delivered:
			if !errors.Is(abortErr, ErrState) {
				t.Fatalf("run %d: delivered, but abort returned %v", i, abortErr)
			}
			d := f.h.Destination()
			if d.State() != kvlease.LeaseActive {
				t.Fatalf("run %d: delivered lease %v", i, d.State())
			}
			for b := range 3 {
				if r, _ := d.Region(b); r[0] != byte(b+1) {
					t.Fatalf("run %d: block %d incomplete", i, b)
				}
			}
			d.Release()
			f.lease.Release()
		case Aborted:
			if abortErr != nil {
				t.Fatalf("run %d: aborted, but abort returned %v", i, abortErr)
			}
		default:
			t.Fatalf("run %d: outcome %v", i, st)
		}
		outcomes[f.h.State()]++
		wantStats(t, f, "src free=32 leased=0 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
		f.check(t)
	}
	t.Logf("outcomes: %v", outcomes)
}

// TestHandoffRaceRejectStart races Reject against Start: a rejected
// handoff never has a transfer attached, and a started one refuses the
// rejection.
func TestHandoffRaceRejectStart(t *testing.T) {
	for i := range 200 {
		f := newFixture(t, 2, -1)
		if err := f.h.Accept(); err != nil {
			t.Fatal(err)
		}
		var startErr, rejectErr error
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); startErr = f.h.Start(f.tr) }()
		go func() { defer wg.Done(); rejectErr = f.h.Reject("decode", nil) }()
		wg.Wait()
		switch st := f.h.State(); st {
		case Rejected:
			if rejectErr != nil || !errors.Is(startErr, ErrState) || f.tr.attachCount() != 0 {
				t.Fatalf("run %d: rejected, reject %v, start %v, %d attached", i, rejectErr, startErr, f.tr.attachCount())
			}
		case Transferring:
			if startErr != nil || !errors.Is(rejectErr, ErrState) || f.tr.attachCount() != 1 {
				t.Fatalf("run %d: transferring, reject %v, start %v", i, rejectErr, startErr)
			}
			f.h.Transfer().Resolve(nil)
			waitDone(t, f.h)
			f.h.Destination().Release()
		default:
			t.Fatalf("run %d: state %v", i, st)
		}
		f.lease.Release()
		wantStats(t, f, "src free=32 leased=0 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
	}
}

// TestHandoffRaceEverything fires every caller event at once, many times,
// with a transport that resolves when cancelled. Whatever interleaving
// wins, the handoff ends final or quarantined-then-lifted, its history is
// a path through the table, and no block is lost.
func TestHandoffRaceEverything(t *testing.T) {
	final := map[State]int{}
	for i := range 300 {
		f := newFixture(t, 2, -1)
		f.tr.onCancel = func(t *kvlease.Transfer) { t.Resolve(errors.New("canceled")) }
		if i%2 == 0 {
			_ = f.h.Accept() // so that Start and Resolve get to win too
		}
		var wg sync.WaitGroup
		calls := []func(){
			func() { _ = f.h.Accept() },
			func() { _ = f.h.Start(f.tr) },
			func() { _ = f.h.Reject("decode", nil) },
			func() { _ = f.h.Abort("frontend", nil) },
			func() { _ = f.h.Expire("supervisor", nil) },
			func() {
				if tr := f.h.Transfer(); tr != nil {
					tr.Resolve(nil)
				}
			},
		}
		// Rotate the order so every call gets to go first sometimes.
		for k := range calls {
			c := calls[(k+i)%len(calls)]
			wg.Add(1)
			go func() { defer wg.Done(); c() }()
		}
		wg.Wait()
		if tr := f.h.Transfer(); tr != nil {
			tr.Resolve(nil)
		} else if !f.h.State().Final() {
			_ = f.h.Abort("cleanup", nil)
		}
		waitDone(t, f.h)
		final[f.h.State()]++
		hist := f.h.History()
		for k, s := range hist {
			if e := next(s.From, s.Event); e.kind != edgeMove || e.to != s.To {
				t.Fatalf("run %d: step %d %v is not a table move", i, k, s)
			}
			if k > 0 && hist[k-1].To != s.From {
				t.Fatalf("run %d: history is not a path: %v", i, hist)
			}
		}
		if f.h.State() == Delivered {
			f.h.Destination().Release()
		}
		f.lease.Release()
		wantStats(t, f, "src free=32 leased=0 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
		f.check(t)
	}
	var names []string
	for s, n := range final {
		names = append(names, fmt.Sprintf("%v=%d", s, n))
	}
	sort.Strings(names)
	t.Logf("final states: %v", names)
}

// TestHandoffRaceAccept: two Accepts race on one handoff whose destination
// has room for one lease. Exactly one wins; the other returns ErrState and
// changes nothing, whatever its acquire did (issue 11, bug 1).
func TestHandoffRaceAccept(t *testing.T) {
	for range 50 {
		f := newFixture(t, 20, -1) // 32-block destination: room for one
		errs := make(chan error, 2)
		var start sync.WaitGroup
		start.Add(1)
		for range 2 {
			go func() { start.Wait(); errs <- f.h.Accept() }()
		}
		start.Done()
		e1, e2 := <-errs, <-errs
		if (e1 == nil) == (e2 == nil) {
			t.Fatalf("accepts returned %v and %v: want exactly one nil", e1, e2)
		}
		loser := e1
		if loser == nil {
			loser = e2
		}
		if !errors.Is(loser, ErrState) {
			t.Fatalf("losing accept = %v, want ErrState", loser)
		}
		wantState(t, f.h, Accepted)
		if d := f.h.Destination(); d == nil || d.Len() != 20 || d.State() != kvlease.LeaseActive {
			t.Fatalf("winner's destination lease %v", d)
		}
		wantStats(t, f, "src free=12 leased=20 draining=0 quarantined=0; dst free=12 leased=20 draining=0 quarantined=0")
		f.start2(t)
		f.check(t)
	}
}

// start2 completes an accepted fixture: start, copy, resolve, delivered.
func (f *fixture) start2(t *testing.T) {
	t.Helper()
	if err := f.h.Start(f.tr); err != nil {
		t.Fatal(err)
	}
	f.tr.copyAll(0)
	f.h.Transfer().Resolve(nil)
	wantState(t, f.h, Delivered)
}

// TestHandoffRaceAcceptWait: a second AcceptWait, cancelled while the
// first still waits (or after it was served), changes nothing: the first
// is served and the handoff is Accepted, not Rejected.
func TestHandoffRaceAcceptWait(t *testing.T) {
	for range 20 {
		f := newFixture(t, 20, -1)
		hog, err := f.dst.Acquire("hog", 30)
		if err != nil {
			t.Fatal(err)
		}
		first := make(chan error, 1)
		go func() { first <- f.h.AcceptWait(context.Background()) }()
		for f.dst.Stats().Waiters == 0 {
			time.Sleep(100 * time.Microsecond)
		}
		ctx, cancel := context.WithCancel(context.Background())
		second := make(chan error, 1)
		go func() { second <- f.h.AcceptWait(ctx) }()
		cancel()
		hog.Release()
		if err := <-first; err != nil {
			t.Fatalf("first AcceptWait = %v", err)
		}
		if err := <-second; !errors.Is(err, ErrState) {
			t.Fatalf("second AcceptWait = %v, want ErrState", err)
		}
		wantState(t, f.h, Accepted)
		if d := f.h.Destination(); d == nil || d.State() != kvlease.LeaseActive {
			t.Fatal("the winner's destination lease was closed")
		}
		f.start2(t)
		f.check(t)
	}
}

// TestHandoffStateCurrentAfterResolve: once Resolve returns, State says
// so at once, also when late evidence lifts a quarantine (issue 12, item 7).
func TestHandoffStateCurrentAfterResolve(t *testing.T) {
	for range 200 {
		f := newFixture(t, 3, -1)
		tr := f.start(t)
		f.tr.copyAll(0)
		tr.Resolve(nil)
		if s := f.h.State(); s != Delivered {
			t.Fatalf("state right after Resolve = %v", s)
		}
	}
	for range 200 {
		f := newFixture(t, 3, -1)
		tr := f.start(t)
		if err := f.h.Expire("test", nil); err != nil {
			t.Fatal(err)
		}
		wantState(t, f.h, Quarantined)
		tr.Resolve(errors.New("late"))
		if s := f.h.State(); s != Aborted {
			t.Fatalf("state right after the late Resolve = %v", s)
		}
		wantStats(t, f, "src free=32 leased=0 draining=0 quarantined=0; dst free=32 leased=0 draining=0 quarantined=0")
	}
}

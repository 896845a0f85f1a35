package kvlease

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// The lifecycle table of DESIGN.md, as (from, to) edges. Quarantined +
// Release/Abort stays Quarantined: a self-loop, not an edge.
var designLeaseEdges = map[[2]LeaseState]bool{
	{LeaseActive, LeaseDraining}:      true, // Release/Abort with transfers pending
	{LeaseActive, LeaseSettled}:       true, // Release/Abort with nothing gating
	{LeaseActive, LeaseQuarantined}:   true, // a gating transfer is quarantined
	{LeaseDraining, LeaseSettled}:     true, // the last gating transfer resolves
	{LeaseDraining, LeaseQuarantined}: true, // a gating transfer is quarantined
	{LeaseQuarantined, LeaseActive}:   true, // late Resolve, open
	{LeaseQuarantined, LeaseDraining}: true, // late Resolve, closed, others pending
	{LeaseQuarantined, LeaseSettled}:  true, // late Resolve, closed, nothing else
}

var allLeaseStates = []LeaseState{0, LeaseActive, LeaseDraining, LeaseSettled, LeaseQuarantined, 99}

func TestLeaseEdgeTable(t *testing.T) {
	for _, from := range allLeaseStates {
		for _, to := range allLeaseStates {
			want := designLeaseEdges[[2]LeaseState{from, to}]
			if got := leaseEdge(from, to); got != want {
				t.Errorf("leaseEdge(%v, %v) = %v, want %v", from, to, got, want)
			}
		}
	}
}

func TestNextLeaseStateTable(t *testing.T) {
	for _, closed := range []bool{false, true} {
		for pending := 0; pending <= 3; pending++ {
			for quar := 0; quar <= 3; quar++ {
				var want LeaseState
				switch {
				case quar > 0:
					want = LeaseQuarantined // open or closed
				case !closed:
					want = LeaseActive
				case pending > 0:
					want = LeaseDraining
				default:
					want = LeaseSettled
				}
				if got := nextLeaseState(closed, pending, quar); got != want {
					t.Errorf("nextLeaseState(closed=%v, pending=%d, quarantined=%d) = %v, want %v",
						closed, pending, quar, got, want)
				}
			}
		}
	}
}

// leaseFacts is what a lease's state is a function of.
type leaseFacts struct {
	closed               bool
	pending, quarantined int
}

// leaseEvents are every event that changes a lease's facts.
var leaseEvents = []struct {
	name  string
	apply func(f leaseFacts) (leaseFacts, bool) // false: not applicable
}{
	{"release/abort", func(f leaseFacts) (leaseFacts, bool) {
		if f.closed {
			return f, true // idempotent
		}
		f.closed = true
		return f, true
	}},
	{"attach pending", func(f leaseFacts) (leaseFacts, bool) {
		f.pending++
		return f, !f.closed
	}},
	{"attach quarantined", func(f leaseFacts) (leaseFacts, bool) {
		f.quarantined++
		return f, !f.closed
	}},
	{"resolve pending", func(f leaseFacts) (leaseFacts, bool) {
		f.pending--
		return f, f.pending >= 0
	}},
	{"quarantine pending", func(f leaseFacts) (leaseFacts, bool) {
		f.pending--
		f.quarantined++
		return f, f.pending >= 0
	}},
	{"late resolve", func(f leaseFacts) (leaseFacts, bool) {
		f.quarantined--
		return f, f.quarantined >= 0
	}},
}

// Walk every reachable (state, event) pair from a fresh lease and check
// that each state change nextLeaseState computes is an edge of the
// design's table, that every edge of the table is taken, that Settled is
// terminal, and that an open lease is never Draining or Settled.
func TestLeaseStateMachineWalk(t *testing.T) {
	start := leaseFacts{}
	seen := map[leaseFacts]bool{start: true}
	queue := []leaseFacts{start}
	taken := map[[2]LeaseState]bool{}
	// Birth: a fresh lease's facts make it Active, the state its zero
	// value reads as (lease.current).
	if born := nextLeaseState(start.closed, start.pending, start.quarantined); born != (&lease{}).current() {
		t.Errorf("a fresh lease is born %v, its zero value reads %v", born, (&lease{}).current())
	}
	for len(queue) > 0 {
		f := queue[0]
		queue = queue[1:]
		from := nextLeaseState(f.closed, f.pending, f.quarantined)
		if !f.closed && (from == LeaseDraining || from == LeaseSettled) {
			t.Errorf("open lease %+v in state %v", f, from)
		}
		for _, e := range leaseEvents {
			g, ok := e.apply(f)
			if !ok {
				continue
			}
			to := nextLeaseState(g.closed, g.pending, g.quarantined)
			if from == LeaseSettled && to != LeaseSettled {
				t.Errorf("%+v --%s--> %+v leaves Settled for %v", f, e.name, g, to)
			}
			if from != to {
				if !leaseEdge(from, to) || !designLeaseEdges[[2]LeaseState{from, to}] {
					t.Errorf("%+v (%v) --%s--> %+v (%v): not an edge of the lifecycle", f, from, e.name, g, to)
				}
				taken[[2]LeaseState{from, to}] = true
			}
			if e.name == "release/abort" && from == LeaseQuarantined && to != LeaseQuarantined {
				t.Errorf("Release while quarantined went to %v", to)
			}
			if g.pending <= 3 && g.quarantined <= 3 && !seen[g] {
				seen[g] = true
				queue = append(queue, g)
			}
		}
	}
	for e := range designLeaseEdges {
		if !taken[e] {
			t.Errorf("edge %v → %v never taken", e[0], e[1])
		}
	}
}

func TestStateNames(t *testing.T) {
	for s, name := range map[LeaseState]string{LeaseActive: "active", LeaseDraining: "draining",
		LeaseSettled: "settled", LeaseQuarantined: "quarantined"} {
		if s.String() != name {
			t.Errorf("%d.String() = %q", s, s.String())
		}
	}
	for s, name := range map[TransferState]string{TransferPending: "pending", TransferResolved: "resolved",
		TransferQuarantined: "quarantined"} {
		if s.String() != name {
			t.Errorf("%d.String() = %q", s, s.String())
		}
	}
	_ = LeaseState(200).String()
	_ = TransferState(200).String()
}

// smPool is a small host pool for the internal tests.
func smPool(t *testing.T, n int, opts ...Option) *Pool[[]byte] {
	t.Helper()
	return hostPool(t, n, 32, opts...)
}

// hostPool is a pool of n host blocks of blockBytes each.
func hostPool(t testing.TB, n, blockBytes int, opts ...Option) *Pool[[]byte] {
	t.Helper()
	mem, err := NewHostMemory(n, blockBytes)
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewPool[[]byte](mem, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func smCheck(t *testing.T, p *Pool[[]byte]) {
	t.Helper()
	if err := p.Check(); err != nil {
		t.Fatal(err)
	}
	st := p.Stats()
	if st.Free+st.Cached+st.Leased+st.Draining+st.Quarantined != st.Capacity {
		t.Fatalf("counts do not sum to capacity: %+v", st)
	}
}

// Every edge of both state machines, driven through the public API, with
// the observer's view of each lease transition.
func TestLifecycleEdgesThroughAPI(t *testing.T) {
	type step struct {
		do   string // acquire|attach <t>|release|abort|resolve <t>|quarantine <t>
		want LeaseState
	}
	cases := []struct {
		name  string
		steps []step
	}{
		{"active→settled (release)", []step{{"release", LeaseSettled}}},
		{"active→settled (abort)", []step{{"abort", LeaseSettled}}},
		{"active→draining→settled", []step{{"attach a", LeaseActive}, {"release", LeaseDraining}, {"resolve a", LeaseSettled}}},
		{"active→draining (abort)", []step{{"attach a", LeaseActive}, {"abort", LeaseDraining}, {"resolve a", LeaseSettled}}},
		{"active→quarantined→active", []step{{"attach a", LeaseActive}, {"quarantine a", LeaseQuarantined}, {"resolve a", LeaseActive}, {"release", LeaseSettled}}},
		{"draining→quarantined→settled", []step{{"attach a", LeaseActive}, {"release", LeaseDraining}, {"quarantine a", LeaseQuarantined}, {"resolve a", LeaseSettled}}},
		{"quarantined→draining", []step{{"attach a", LeaseActive}, {"attach b", LeaseActive}, {"quarantine a", LeaseQuarantined}, {"release", LeaseQuarantined}, {"resolve a", LeaseDraining}, {"resolve b", LeaseSettled}}},
		{"quarantined+release stays", []step{{"attach a", LeaseActive}, {"quarantine a", LeaseQuarantined}, {"release", LeaseQuarantined}, {"release", LeaseQuarantined}, {"abort", LeaseQuarantined}, {"resolve a", LeaseSettled}}},
		{"quarantined+abort stays", []step{{"attach a", LeaseActive}, {"quarantine a", LeaseQuarantined}, {"abort", LeaseQuarantined}, {"resolve a", LeaseSettled}}},
		{"two quarantined", []step{{"attach a", LeaseActive}, {"attach b", LeaseActive}, {"quarantine a", LeaseQuarantined}, {"quarantine b", LeaseQuarantined}, {"resolve b", LeaseQuarantined}, {"resolve a", LeaseActive}, {"abort", LeaseSettled}}},
		{"resolve while active", []step{{"attach a", LeaseActive}, {"resolve a", LeaseActive}, {"quarantine a", LeaseActive}, {"release", LeaseSettled}}},
		{"settled is terminal", []step{{"attach a", LeaseActive}, {"release", LeaseDraining}, {"resolve a", LeaseSettled}, {"quarantine a", LeaseSettled}, {"release", LeaseSettled}, {"abort", LeaseSettled}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var trans []LeaseState
			obs := ObserverFunc(func(e Event) {
				switch e.Kind {
				case EventLeaseQuarantined:
					trans = append(trans, LeaseQuarantined)
				case EventSettled:
					trans = append(trans, LeaseSettled)
				}
			})
			p := smPool(t, 4, WithObserver(obs))
			l, err := p.Acquire("l", 2)
			if err != nil {
				t.Fatal(err)
			}
			ts := map[string]*Transfer{"a": NewTransfer(nil), "b": NewTransfer(nil)}
			prev := l.State()
			for i, s := range c.steps {
				var verb, arg string
				fmt.Sscan(s.do, &verb, &arg)
				switch verb {
				case "attach":
					if err := l.AttachRange(ts[arg], 0, 1, Write); err != nil {
						t.Fatal(err)
					}
				case "release":
					l.Release()
				case "abort":
					l.Abort(nil)
				case "resolve":
					ts[arg].Resolve(nil)
				case "quarantine":
					ts[arg].Quarantine(nil)
				}
				got := l.State()
				if got != s.want {
					t.Fatalf("step %d (%s): state %v, want %v", i, s.do, got, s.want)
				}
				if got != prev && !designLeaseEdges[[2]LeaseState{prev, got}] {
					t.Fatalf("step %d (%s): %v → %v is not in the lifecycle table", i, s.do, prev, got)
				}
				prev = got
				smCheck(t, p)
			}
			settled := 0
			for _, s := range trans {
				if s == LeaseSettled {
					settled++
				}
			}
			if settled != 1 {
				t.Fatalf("EventSettled reported %d times", settled)
			}
			st := p.Stats()
			if st.Free != 4 {
				t.Fatalf("blocks lost: %+v", st)
			}
		})
	}
}

// Closed tells an open quarantined lease from a closed one, which State
// cannot.
func TestLeaseClosedWhileQuarantined(t *testing.T) {
	p := newTestPool(t, 4)
	l, err := p.Acquire("q", 2)
	require.NoError(t, err)
	tr := NewTransfer(nil)
	require.NoError(t, l.Attach(tr))
	tr.Quarantine(nil)
	require.Equal(t, LeaseQuarantined, l.State())
	require.False(t, l.Closed())
	l.Release()
	require.Equal(t, LeaseQuarantined, l.State())
	require.True(t, l.Closed())
	tr.Resolve(nil)
	require.Equal(t, LeaseSettled, l.State())
}

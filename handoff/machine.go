package handoff

import (
	"fmt"
	"strings"
	"sync"
	"time"

	"go.uber.org/atomic"
)

// State is where a handoff is. See Handoff for the diagram.
type State uint8

// The handoff states.
const (
	stateNone State = iota // before Propose; only in History's first From

	// Proposed: the source offers a lease; the destination holds
	// nothing yet.
	Proposed
	// Rejected: the destination refused. Final: no transfer can
	// ever start; the source lease is untouched and still the caller's.
	Rejected
	// Accepted: the destination holds a lease of the same length;
	// no transfer yet.
	Accepted
	// Transferring: one transfer is attached to both leases (Read
	// on the source, Write on the destination).
	Transferring
	// Delivered: the transfer resolved without error. Final: the
	// destination lease is the caller's (Destination); the source lease is
	// untouched.
	Delivered
	// Failed: the transfer resolved with an error, or the transport
	// could not start it. Final: the destination lease is released (the
	// memory was already quiescent); the source lease is untouched.
	Failed
	// Aborting: Abort came while the transfer was in flight. Both
	// leases are aborted and the transfer cancelled; their blocks drain
	// until the transport proves quiescence.
	Aborting
	// Aborted: aborted, and nothing the handoff started can touch
	// memory any more. Final.
	Aborted
	// Quarantined: no evidence came in time (Expire): the transfer
	// is quarantined with every block of both leases, which are aborted.
	// Not final: only the transfer's late Resolve lifts it, to Aborted.
	Quarantined

	numStates
)

var stateNames = [numStates]string{
	"none", "proposed", "rejected", "accepted", "transferring",
	"delivered", "failed", "aborting", "aborted", "quarantined",
}

func (s State) String() string {
	if s < numStates {
		return stateNames[s]
	}
	return "invalid"
}

// Final reports whether s is final: Rejected, Delivered, Failed or
// Aborted. No event leaves a final state.
func (s State) Final() bool {
	return s == Rejected || s == Delivered || s == Failed || s == Aborted
}

// Event is what moves a handoff: a caller's decision or the
// transport's evidence. Each step of History names one.
type Event uint8

// The handoff events.
const (
	// EventPropose: Propose created the handoff.
	EventPropose Event = iota + 1
	// EventAccept: the destination acquired its lease.
	EventAccept
	// EventReject: the destination refused, by decision (Reject) or
	// because its acquire failed (Accept, AcceptWait).
	EventReject
	// EventAttach: the transport attached the transfer to both leases;
	// bytes may move from now on.
	EventAttach
	// EventStartFail: Start could not attach a transfer (the source
	// lease was closed, the transport failed). Nothing moved.
	EventStartFail
	// EventResolve: the transfer resolved without error: quiescent and
	// complete.
	EventResolve
	// EventResolveError: the transfer resolved with an error: quiescent,
	// content incomplete.
	EventResolveError
	// EventAbort: either side gave up on the request (Abort).
	EventAbort
	// EventExpire: no evidence by the deadline (the handoff's timer or a
	// caller's Expire), and the transfer was still unresolved.
	EventExpire
	// EventQuiescent (the source half only): the source's own transfer
	// resolved, its blocks quiescent, while the destination's word is
	// still missing; Err is the transfer's outcome. A note: the state
	// stays Transferring until the destination reports.
	EventQuiescent
	// EventPeerOutcome (the source half only): the destination's word on
	// a started transfer: its Done (Err nil for success, else its
	// error), its Reject or Abort, or the loss of the control connection
	// (ErrConnLost). A note: the source's own transfer still decides
	// when the handoff is final.
	EventPeerOutcome

	numEvents
)

var eventNames = [numEvents]string{
	"", "propose", "accept", "reject", "attach", "start-fail",
	"resolve", "resolve-error", "abort", "expire", "quiescent", "peer-outcome",
}

func (e Event) String() string {
	if e > 0 && e < numEvents {
		return eventNames[e]
	}
	return "invalid"
}

// edge is one cell of the transition table.
type edge struct {
	to   State
	kind edgeKind
}

type edgeKind uint8

const (
	edgeRefuse edgeKind = iota // the event is not allowed here: ErrState
	edgeMove                   // the state changes to `to`
	edgeNoop                   // already done (a second Abort, a late timer): nil, nothing changes
	edgeNote                   // recorded in History, the state unchanged (`to` is the state itself)
)

// table is the handoff's one transition function, as a table: the
// cell for (state, event) says whether the event moves the handoff, is an
// idempotent repeat, or is refused. Missing cells are refusals. Every
// state change goes through next.
var table = [numStates][numEvents]edge{
	stateNone: {
		EventPropose: {Proposed, edgeMove},
	},
	Proposed: {
		EventAccept: {Accepted, edgeMove},
		EventReject: {Rejected, edgeMove},
		EventAbort:  {Aborted, edgeMove},
	},
	Rejected: {
		EventReject: {Rejected, edgeNoop},
		EventExpire: {Rejected, edgeNoop},
	},
	Accepted: {
		EventReject:    {Rejected, edgeMove},
		EventAttach:    {Transferring, edgeMove},
		EventStartFail: {Failed, edgeMove},
		EventAbort:     {Aborted, edgeMove},
	},
	Transferring: {
		EventResolve:      {Delivered, edgeMove},
		EventResolveError: {Failed, edgeMove},
		EventAbort:        {Aborting, edgeMove},
		EventExpire:       {Quarantined, edgeMove},
		EventQuiescent:    {Transferring, edgeNote},
		EventPeerOutcome:  {Transferring, edgeNote},
	},
	Delivered: {
		EventExpire: {Delivered, edgeNoop},
	},
	Failed: {
		EventExpire: {Failed, edgeNoop},
	},
	Aborting: {
		EventResolve:      {Aborted, edgeMove},
		EventResolveError: {Aborted, edgeMove},
		EventAbort:        {Aborting, edgeNoop},
		EventExpire:       {Quarantined, edgeMove},
		EventPeerOutcome:  {Aborting, edgeNote},
	},
	Aborted: {
		EventAbort:  {Aborted, edgeNoop},
		EventExpire: {Aborted, edgeNoop},
	},
	Quarantined: {
		EventResolve:      {Aborted, edgeMove},
		EventResolveError: {Aborted, edgeMove},
		EventAbort:        {Quarantined, edgeNoop},
		EventExpire:       {Quarantined, edgeNoop},
		EventPeerOutcome:  {Quarantined, edgeNote},
	},
}

// next looks up (s, e) in the transition table.
func next(s State, e Event) edge {
	if s >= numStates || e == 0 || e >= numEvents {
		return edge{}
	}
	return table[s][e]
}

// A Step is one transition of a handoff with the evidence that made
// it: which component, which event, and the error it carried (the
// rejection reason, the transfer's outcome, the abort cause).
type Step struct {
	From, To State
	Event    Event
	By       string    // the component: a side's name, "transport", "deadline"
	Err      error     // reason, cause or outcome; nil for success
	Transfer uint64    // the transfer's ID, once one is attached
	At       time.Time // when the handoff recorded it
}

// String renders the step as "from → to  by/event: err".
func (s Step) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%v → %v  %s/%v", s.From, s.To, s.By, s.Event)
	if s.Transfer != 0 {
		fmt.Fprintf(&b, " (transfer %d)", s.Transfer)
	}
	if s.Err != nil {
		fmt.Fprintf(&b, ": %v", s.Err)
	}
	return b.String()
}

// machine is a handoff's state as one side holds it: the in-process
// Handoff and both halves (Outgoing, Incoming) embed one. fire is the one
// place that performs a transition: it looks the edge up in the table,
// records the step and closes Done on a final state. The owner decides
// which event an input is (a caller's method, a peer's message, the
// transfer's evidence, a deadline) and fires it under mu; effects that may
// call back into the handoff (aborting a lease cancels its transfer, whose
// hook may resolve it, whose OnResolve callback takes mu) are queued with
// later and run by unlock, once mu is released. The read methods (state,
// err, steps) only read.
type machine struct {
	mu      sync.Mutex
	state   State
	history []Step
	seen    uint32        // the events fired so far (moves and notes), one bit each
	tid     uint64        // the attached transfer's ID
	done    chan struct{} // closed on entering a final state
	onFinal func()        // if set, called (under mu) on entering a final state
	after   []func()      // effects queued under mu, run by unlock
	timer   *time.Timer   // the deadline, if one is running; stopped when final
	hooks   *hooks        // the explorer's (hooks.go); nil in production

	// effecting is set while the holder of mu performs an effect that may
	// resolve the transfer on its own goroutine (aborting a lease cancels
	// its transfer, whose hook may Resolve it at once): the transfer's
	// OnResolve callback then parks its evidence for that holder instead
	// of waiting for mu, which would deadlock. See effect and arrive.
	effecting atomic.Bool
	parked    atomic.Pointer[parkedEvidence]
}

// parkedEvidence is a transfer's outcome waiting for the holder of mu.
type parkedEvidence struct{ err error }

func newMachine() machine { return machine{done: make(chan struct{})} }

// fire applies e: a move changes the state, a note records the step and
// keeps the state (once: a repeated note is a no-op), a no-op or refusal
// changes nothing. It returns the edge's kind and the state it left.
// Called with m.mu held.
func (m *machine) fire(by string, e Event, err error) (edgeKind, State) {
	edge := next(m.state, e)
	from := m.state
	switch {
	case edge.kind == edgeNote && m.saw(e):
		return edgeNoop, from
	case edge.kind != edgeMove && edge.kind != edgeNote:
		return edge.kind, from
	}
	m.state = edge.to
	m.seen |= 1 << e
	m.history = append(m.history, Step{From: from, To: edge.to, Event: e, By: by, Err: err, Transfer: m.tid, At: time.Now()})
	if edge.to.Final() {
		close(m.done)
		if m.timer != nil {
			m.timer.Stop()
		}
		if m.onFinal != nil {
			m.onFinal()
		}
	}
	return edge.kind, from
}

// saw reports whether e was fired (as a move or a note). Called with m.mu
// held.
func (m *machine) saw(e Event) bool { return m.seen&(1<<e) != 0 }

// noted returns the error of the step that recorded e, and whether one
// did. Called with m.mu held.
func (m *machine) noted(e Event) (error, bool) {
	for i := len(m.history) - 1; i >= 0; i-- {
		if m.history[i].Event == e {
			return m.history[i].Err, true
		}
	}
	return nil, false
}

// later queues f to run once m.mu is released (unlock). Called with m.mu
// held.
func (m *machine) later(f func()) { m.after = append(m.after, f) }

// unlock releases m.mu, then runs the queued effects in order.
func (m *machine) unlock() {
	fs := m.after
	m.after = nil
	m.mu.Unlock()
	for _, f := range fs {
		f()
	}
}

// deadline arms the deadline timer: f runs on its own goroutine after d
// (never for d < 0) unless the handoff is final first. Called with m.mu
// held.
func (m *machine) deadline(d time.Duration, f func()) {
	if d >= 0 && m.timer == nil && !m.state.Final() {
		m.timer = m.hooks.afterFunc(d, f)
	}
}

// effect runs f with m.mu held and returns the transfer's evidence if it
// arrived meanwhile (on this goroutine, from inside f, or on another):
// the caller handles it before releasing m.mu. Called with m.mu held.
func (m *machine) effect(f func()) (error, bool) {
	m.effecting.Store(true)
	f()
	m.effecting.Store(false)
	return m.unpark()
}

func (m *machine) unpark() (error, bool) {
	if p := m.parked.Swap(nil); p != nil {
		return p.err, true
	}
	return nil, false
}

// arrive begins every OnResolve callback. It parks err; if the holder of
// m.mu is inside an effect, that holder takes the evidence (it is
// handled before m.mu is released, so State is current once Resolve
// returns) and arrive returns false. Otherwise it returns with m.mu held
// and the evidence, unless another holder took it first (false, m.mu
// released). Sequentially consistent atomics make this exact: a holder
// that clears effecting then swaps parked sees every evidence parked by
// a callback that saw effecting set.
func (m *machine) arrive(err error) (error, bool) {
	m.parked.Store(&parkedEvidence{err})
	if m.effecting.Load() {
		return nil, false
	}
	m.mu.Lock()
	e, ok := m.unpark()
	if !ok {
		m.unlock()
	}
	return e, ok
}

func (m *machine) lastErr() error { return m.history[len(m.history)-1].Err }

// The pure reads behind every handle's State, Err and History.

func (m *machine) current() State {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.state
}

func (m *machine) err() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.lastErr()
}

func (m *machine) steps() []Step {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]Step(nil), m.history...)
}

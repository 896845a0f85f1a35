package kvlease

import (
	"fmt"
)

// LeaseState is where a lease is in its lifecycle.
//
//	Active ──Release/Abort──▶ Draining ──last transfer resolves──▶ Settled
//	   │  └───────────── (nothing gates it) ─────────────────────▶ Settled
//	   └──transfer quarantined──▶ Quarantined ──late Resolve──▶ Active | Draining | Settled
//
// Draining also goes to Quarantined when a gating transfer is quarantined.
type LeaseState uint8

// The lease states.
const (
	// LeaseActive: open; its owner may read, write, extend and attach.
	LeaseActive LeaseState = iota + 1
	// LeaseDraining: closed; some blocks wait for pending transfers.
	LeaseDraining
	// LeaseSettled: closed and holding none of its blocks. Terminal.
	LeaseSettled
	// LeaseQuarantined: some gating transfer ended without proof; open or
	// closed, its blocks are not reused until late evidence resolves it.
	LeaseQuarantined
)

var leaseStateNames = [...]string{"invalid", "active", "draining", "settled", "quarantined"}

func (s LeaseState) String() string {
	if int(s) < len(leaseStateNames) {
		return leaseStateNames[s]
	}
	return "invalid"
}

// nextLeaseState is the lease state machine's one transition function. A
// lease's state is a function of three facts, so every event (close, a
// transfer attached, quarantined or resolved) recomputes it here.
func nextLeaseState(closed bool, pending, quarantined int) LeaseState {
	switch {
	case quarantined > 0:
		return LeaseQuarantined
	case !closed:
		return LeaseActive
	case pending > 0:
		return LeaseDraining
	default:
		return LeaseSettled
	}
}

// leaseEdge reports whether from → to is an edge of the lifecycle table in
// doc.go. Every transition is verified against it.
func leaseEdge(from, to LeaseState) bool {
	switch from {
	case LeaseActive:
		return to == LeaseDraining || to == LeaseSettled || to == LeaseQuarantined
	case LeaseDraining:
		return to == LeaseSettled || to == LeaseQuarantined
	case LeaseQuarantined:
		return to == LeaseActive || to == LeaseDraining || to == LeaseSettled
	}
	return false
}

// transition moves l to the state its facts now imply, with the side
// effects of entering it: the one writer of a lease's state.
// Called with c.mu held, after every change of the facts: a close, a
// transfer attached, quarantined or resolved. A lease's state is a
// function of its facts (nextLeaseState); the field records the last
// edge entered, so that the next change knows what it leaves (see
// current for the two states that need no record).
func (c *core) transition(l *lease, ev *outbox) {
	prev, next := l.state, nextLeaseState(l.closed, int(l.pending), int(l.quarantined))
	if prev == 0 {
		prev = LeaseActive // no edge recorded yet: it was Active until this change
	}
	if next == prev {
		return
	}
	if !leaseEdge(prev, next) {
		impossibleEdge(l, prev, next)
	}
	l.state = next
	// The side effects of entering next.
	switch {
	case next == LeaseQuarantined:
		c.stats.quarantines++
	case prev == LeaseQuarantined:
		c.stats.quarantineLifts++
	}
	if c.obs != nil {
		switch {
		case next == LeaseQuarantined:
			ev.add(c.obs, Event{Kind: EventLeaseQuarantined, Owner: l.owner, Lease: l.id, Blocks: len(l.blocks)})
		case prev == LeaseQuarantined:
			ev.add(c.obs, Event{Kind: EventQuarantineLifted, Owner: l.owner, Lease: l.id, Blocks: len(l.blocks)})
		}
	}
	if next == LeaseSettled {
		c.unhold(l)
		if ch := l.settledChan(); ch != nil {
			close(ch)
		}
		if x := l.extra; x != nil && x.timer != nil {
			x.timer.Stop()
			x.timer = nil
		}
		if c.obs != nil {
			ev.add(c.obs, Event{Kind: EventSettled, Owner: l.owner, Lease: l.id, Blocks: len(l.blocks)})
		}
	}
}

// current is l's state. Until transition records an edge (l.state is
// zero) a lease's state is what its facts imply: Active from birth (a
// lease is carved zeroed and never reused), Settled after a close that
// settles it quietly (settlesQuietly). Called with c.mu held.
func (l *lease) current() LeaseState {
	if l.state == 0 {
		return nextLeaseState(l.closed, int(l.pending), int(l.quarantined))
	}
	return l.state
}

// settlesQuietly reports whether closing l (its facts already closed)
// takes it from Active to Settled with nothing to enter: no edge
// recorded yet, nothing gating it, no observer, no Settled channel, no
// quiescence record (its deadline timer starts only once a closed lease
// has not settled). Then the close need not call transition: the state
// reads Settled from the facts (current), and nothing is written. It is
// every plain Acquire+Release cycle's close.
func (c *core) settlesQuietly(l *lease) bool {
	return l.state == 0 && l.pending|l.quarantined == 0 && c.obs == nil && unwatched(l)
}

// unwatched reports whether no one waits on l's settling: no Settled
// channel, no quiescence record (its deadline timer starts only once a
// closed lease has not settled).
func unwatched(l *lease) bool {
	x := l.extra
	return x == nil || x.settled == nil && x.hold == 0
}

// impossibleEdge panics: a transition off the lifecycle table is a bug.
//
//go:noinline
func impossibleEdge(l *lease, prev, next LeaseState) {
	panic(fmt.Sprintf("kvlease: lease %d: impossible transition %v → %v", l.id, prev, next))
}

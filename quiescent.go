package kvlease

import (
	"errors"
	"fmt"
	"strings"

	"github.com/kvlease/kvlease/internal/slots"
)

// Quiescence.
//
// Check proves the pool's bookkeeping is consistent; it says nothing of
// whether anyone still holds blocks, and a forgotten open lease passes it.
// CheckQuiescent proves the pool is at rest: no lease open, none draining
// or quarantined, no waiter queued, and so no block leased, draining or
// quarantined (only free and cached ones). It is what an engine asks at
// shutdown and a test at its end, and its error names who holds what.
//
// To name owners, a pool that watches its leases (WithObserver,
// WithLeakCheck(true), or a checked build: -race or -tags invariants)
// keeps a table of holders, written under its lock: every lease from the
// moment it opens until it settles. An unwatched pool counts what is held
// (open leases, leased, draining and quarantined blocks) but names
// nobody: recording every lease would cost each lease cycle an
// allocation (Acquire(1)+Release is held to 3× a bare free list, and a
// lease released with a transfer pending, to 3× the slot table's). The
// table holds a closed lease's pointer (its transfers reach it anyway)
// but only the id and owner of an open one, so a lease the owner drops
// is still found unreachable by the leak check, and marked leaked here.

// ErrNotQuiescent is what CheckQuiescent's *QuiescenceError wraps: the
// pool still holds something.
var ErrNotQuiescent = errors.New("kvlease: pool not quiescent")

// A Holding is a lease that still holds blocks of the pool.
type Holding struct {
	Lease uint64 // the lease's id (Lease.ID, observer events)
	Owner string
	// State is LeaseActive for a lease still open (which may be
	// quarantined too), or LeaseDraining or LeaseQuarantined for a
	// closed one that has not settled.
	State LeaseState
	// Leaked: the lease became unreachable while open (the observer was
	// told, EventLeaked); its blocks stay leased for good.
	Leaked bool
	// Blocks is how many blocks a closed lease still references (0 for
	// an open one: it holds its whole table, Lease.Len).
	Blocks int
}

// string names the lease, its owner and its state, for the error.
func (h Holding) string() string {
	what := h.State.String()
	switch {
	case h.Leaked:
		what = "leaked while open"
	case h.State == LeaseActive:
		what = "open"
	}
	s := fmt.Sprintf("lease %d (%s) %s", h.Lease, h.Owner, what)
	if h.Blocks > 0 {
		s += fmt.Sprintf(", %d blocks", h.Blocks)
	}
	return s
}

// A QuiescenceError is CheckQuiescent's report of what a pool still
// holds. It wraps ErrNotQuiescent.
type QuiescenceError struct {
	// OpenLeases counts the leases not yet released or aborted, named in
	// Holdings or not (an unwatched pool does not name open leases).
	OpenLeases int
	// Holdings names each lease that has not settled, open or closed, in
	// a pool that watches its leases; an unwatched pool names none.
	// Ordered by lease id.
	Holdings []Holding
	// Blocks in each state that is not at rest, and waiters queued.
	Leased, Draining, Quarantined, Waiters int
}

func (e *QuiescenceError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "kvlease: pool not quiescent: %d open leases, %d blocks leased, %d draining, %d quarantined, %d waiters",
		e.OpenLeases, e.Leased, e.Draining, e.Quarantined, e.Waiters)
	for i, h := range e.Holdings {
		if i == 16 {
			fmt.Fprintf(&b, "; and %d more", len(e.Holdings)-i)
			break
		}
		b.WriteString("; ")
		b.WriteString(h.string())
	}
	return b.String()
}

// Unwrap returns ErrNotQuiescent.
func (e *QuiescenceError) Unwrap() error { return ErrNotQuiescent }

// CheckQuiescent returns nil when the pool is consistent (Check) and at
// rest: no open lease, no closed lease still draining or quarantined, no
// AcquireWait caller queued, and so every block free or cached. Otherwise
// it returns Check's error alone (a consistent-looking count over broken
// bookkeeping proves nothing) or a *QuiescenceError wrapping
// ErrNotQuiescent that counts what is held and names the leases holding
// it with their owners (see Holding; leases are named when the pool
// watches them: WithObserver, WithLeakCheck(true) or a checked build).
// Call it at shutdown, after every request ended and the transports
// resolved their transfers, and at the end of tests. It takes the pool's
// lock for O(capacity) time.
func (p *Pool[R]) CheckQuiescent() error {
	if err := p.Check(); err != nil {
		return err
	}
	c := &p.core
	c.mu.Lock()
	defer c.unlock()
	e := &QuiescenceError{
		OpenLeases:  c.openLeases,
		Leased:      c.tab.Count(slots.Leased),
		Draining:    c.tab.Count(slots.Draining),
		Quarantined: c.tab.Count(slots.Quarantined),
		Waiters:     c.queued(),
	}
	for _, h := range c.holds.recs {
		if h.id == 0 {
			continue
		}
		hd := Holding{Lease: h.id, Owner: h.owner, State: LeaseActive, Leaked: h.leaked}
		if l := h.closed; l != nil {
			hd.State = l.current()
			hd.Blocks = len(l.blocks) - l.first()
		}
		e.Holdings = append(e.Holdings, hd)
	}
	if e.OpenLeases == 0 && len(e.Holdings) == 0 && e.Leased+e.Draining+e.Quarantined+e.Waiters == 0 {
		return nil
	}
	sortHoldings(e.Holdings)
	return e
}

func sortHoldings(hs []Holding) {
	for i := 1; i < len(hs); i++ { // insertion sort: few, mostly in order
		for j := i; j > 0 && hs[j].Lease < hs[j-1].Lease; j-- {
			hs[j], hs[j-1] = hs[j-1], hs[j]
		}
	}
}

// holdings is the pool's table of holders (see the top of this file),
// guarded by c.mu. A recorded lease keeps its index+1 in leaseExtra.hold.
type holdings struct {
	recs []holder
	free []int32 // indices of unused recs
}

type holder struct {
	id     uint64 // 0: unused
	owner  string
	closed *lease // set once the lease is closed (unsettled)
	leaked bool
}

// hold records l, opening in a watched pool, in the table. Called with
// c.mu held.
func (c *core) hold(l *lease) {
	x := l.ext()
	t := &c.holds
	var i int32
	if n := len(t.free); n > 0 {
		i, t.free = t.free[n-1], t.free[:n-1]
	} else {
		i = int32(len(t.recs))
		t.recs = append(t.recs, holder{})
	}
	t.recs[i] = holder{id: l.id, owner: l.owner}
	x.hold = i + 1
}

// unhold removes l from the table, if there. Called with c.mu held.
func (c *core) unhold(l *lease) {
	if x := l.extra; x != nil && x.hold != 0 {
		i := x.hold - 1
		c.holds.recs[i] = holder{}
		c.holds.free = append(c.holds.free, i)
		x.hold = 0
	}
}

// markLeaked marks the holder at index i (hold-1) of lease id leaked; the
// leak check's cleanup calls it.
func (c *core) markLeaked(hold int32, id uint64) {
	c.mu.Lock()
	if i := hold - 1; i >= 0 && int(i) < len(c.holds.recs) && c.holds.recs[i].id == id {
		c.holds.recs[i].leaked = true
	}
	c.mu.Unlock()
}

package handoff

import "time"

// hooks are the schedule explorer's handles on a half (explore_test.go,
// EXPLORER.md): a clock that arms the deadline timers, so that every
// deadline firing is one of the explorer's choices, and a deliberately
// broken variant of the halves (a mutant) that the mutation suite must
// catch. A production half has none: Source.hooks and Destination.hooks
// are nil, and only the package's tests set them, before the first
// Propose or Serve.
type hooks struct {
	// after replaces time.AfterFunc for the handoffs' deadline timers.
	after func(d time.Duration, f func()) *time.Timer
	// mutant is the broken variant the half runs (mutantNone: none).
	mutant mutant
}

// mutant names a deliberately broken variant of the halves. Each breaks
// one rule the explorer checks; see explore_mutants_test.go.
type mutant uint8

const (
	mutantNone mutant = iota
	// mutantResolveOnAck: the source takes the destination's Done as
	// evidence and resolves its own transfer (rule 3: a peer's word is
	// not evidence).
	mutantResolveOnAck
	// mutantFreeOnTimeout: the destination's deadline resolves its
	// transfer instead of quarantining it (rule 4: time alone never
	// frees).
	mutantFreeOnTimeout
	// mutantRejectStarts: the source attaches its transfer even after
	// the destination's Reject arrived (rule 1: a rejected handoff never
	// starts a transfer).
	mutantRejectStarts
	// mutantSealShort: the destination seals what arrived even when its
	// transfer ended short of the last byte. (Sealing when the transfer
	// attaches, before any byte, is no mutant: the pool refuses to seal a
	// block a pending write gates.)
	mutantSealShort
	// mutantLeaseOnly: the source's deadline and abort abort only its
	// lease and do not cancel the transfer (issue 30's item 1: a lease
	// released after Propose is closed, and aborting it cancels nothing).
	mutantLeaseOnly
)

// is reports whether the half runs mutant m (never for mutantNone).
func (h *hooks) is(m mutant) bool { return h != nil && m != mutantNone && h.mutant == m }

// afterFunc arms a deadline timer: time.AfterFunc unless the explorer
// replaced it.
func (h *hooks) afterFunc(d time.Duration, f func()) *time.Timer {
	if h == nil || h.after == nil {
		return time.AfterFunc(d, f)
	}
	return h.after(d, f)
}

package kvlease

import (
	"errors"
	"fmt"
)

// Errors a caller is expected to handle. Every error kvlease returns wraps
// one of these with context, so test with errors.Is.
var (
	// ErrInvalidArgument is returned for a malformed call: n ≤ 0, an empty
	// owner, an index or range outside a lease, a Write over sealed content,
	// a nil memory or transfer.
	ErrInvalidArgument = errors.New("kvlease: invalid argument")
	// ErrExceedsCapacity is returned when a request can never succeed: it
	// asks for more blocks than the pool has, or a lease would outgrow it.
	ErrExceedsCapacity = errors.New("kvlease: exceeds capacity")
	// ErrExhausted is returned when not enough free or evictable blocks
	// exist now, or when a plain acquire would overtake a queued waiter.
	// Retrying later may succeed.
	ErrExhausted = errors.New("kvlease: exhausted")
	// ErrQuarantineBound is returned when a request asks for more blocks
	// than could ever be free while the current quarantine lasts: more
	// than Stats.Usable (capacity minus quarantined blocks) for an
	// acquire, more than the usable blocks the lease does not already hold
	// for an Extend. It wraps ErrExhausted, so callers that retry on
	// ErrExhausted still do; a caller that tests for it knows retrying
	// cannot help until late evidence lifts some quarantine. A queued
	// AcquireWait waiter in that position is failed with it rather than
	// blocking the queue behind it forever.
	ErrQuarantineBound = fmt.Errorf("kvlease: more blocks than quarantine leaves usable: %w", ErrExhausted)
	// ErrPoolClosed is returned by acquires on a closed pool and to the
	// waiters a Close wakes.
	ErrPoolClosed = errors.New("kvlease: pool closed")
	// ErrLeaseClosed is returned by operations on a lease after Release or
	// Abort.
	ErrLeaseClosed = errors.New("kvlease: lease closed")
	// ErrReadOnly is returned by Lease.Region and AppendRegions, the
	// writable accessors, for a block that is sealed (its content is
	// immutable: others may hit it in the prefix cache) or shared with
	// another lease. Read such blocks with ReadRegion.
	ErrReadOnly = errors.New("kvlease: block is read-only")
	// ErrStaleRef is returned for a BlockRef whose slot is free or has moved
	// on to another generation: the content it named is gone.
	ErrStaleRef = errors.New("kvlease: stale block reference")
	// ErrCanceled is the outcome of a copy or transfer that honoured a
	// cancel (Transfer.Cancel, a lease's Abort, a handoff's deadline): it
	// stopped before doing all its work, so its destination holds
	// unspecified content, but it is resolved: nothing of it is in flight
	// any more. Every data plane, copy engine and tier wraps this one
	// sentinel with its own context instead of defining its own, so
	// errors.Is(err, ErrCanceled) holds across packages.
	ErrCanceled = errors.New("kvlease: canceled")
)

// Reasons the library itself records; they appear as Transfer.Err or in
// observer events.
var (
	// ErrDrainDeadline is the quarantine reason given to the pending
	// transfers of a closed lease that did not settle within the drain
	// deadline (see WithDrainDeadline). It is not evidence: the blocks stay
	// quarantined until the transfers resolve.
	ErrDrainDeadline = errors.New("kvlease: drain deadline passed without evidence of quiescence")
	// ErrAborted is the default cause recorded by Abort(nil).
	ErrAborted = errors.New("kvlease: lease aborted")
	// ErrQuarantined is the default reason recorded by Quarantine(nil).
	ErrQuarantined = errors.New("kvlease: transfer ended without proof of quiescence")
)

// exhaustedError is the error of an acquire or extend refused for want of
// blocks. Schedulers probe under pressure, so it is cheap to make: one
// small allocation, formatted only if someone reads it. It wraps
// ErrExhausted.
type exhaustedError struct {
	op     string // "acquire" or "extend"
	owner  string
	lease  uint64 // extend: the lease
	n      int    // blocks asked for
	hits   int    // prefix hits among them
	avail  int    // free or evictable blocks
	queued int    // waiters queued ahead (acquire)
}

func (e *exhaustedError) Error() string {
	var what string
	switch {
	case e.op == "extend":
		what = fmt.Sprintf("extend lease %d (%s) by %d blocks", e.lease, e.owner, e.n)
	case e.hits > 0:
		what = fmt.Sprintf("acquire %d blocks (%d prefix hits) for %q", e.n, e.hits, e.owner)
	default:
		what = fmt.Sprintf("acquire %d blocks for %q", e.n, e.owner)
	}
	if e.queued > 0 {
		return fmt.Sprintf("kvlease: %s: %d waiters queued ahead: %v", what, e.queued, ErrExhausted)
	}
	return fmt.Sprintf("kvlease: %s: %d free or evictable: %v", what, e.avail, ErrExhausted)
}

func (e *exhaustedError) Unwrap() error { return ErrExhausted }

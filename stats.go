package kvlease

import (
	"context"
	"errors"
	"github.com/kvlease/kvlease/internal/slots"
)

// Stats is a snapshot of a pool. The five state counts are block counts,
// each block counted once in its one state, and always sum to Capacity. A
// block that qualifies for several states counts in the first that
// applies: Quarantined, Leased, Draining, Cached, Free.
type Stats struct {
	// SealRecords reports whether the pool records how each block was
	// sealed, for SealInfo: with WithSealRecords, WithVerifiedPrefix or
	// WithKVEvents (package tiers requires it of its pools).
	SealRecords bool

	Capacity    int
	Free        int // unreferenced, no content worth keeping
	Cached      int // unreferenced, holds a findable sealed prefix block (evictable)
	Leased      int // held by at least one open lease
	Draining    int // held only by pending transfers of closed leases
	Quarantined int // gated by a transfer that ended without proof

	// QuarantinedLeased counts the Quarantined blocks an open lease still
	// holds: a running request uses them though they count as
	// Quarantined, so Leased+QuarantinedLeased is the blocks in use.
	QuarantinedLeased int
	// Usable is Capacity minus Quarantined: the most blocks that could
	// ever be free while the current quarantine lasts. A request for more
	// (an acquire of more than Usable) fails with ErrQuarantineBound; an
	// admission check (an envelope's pool size) should be asked against
	// Usable, not Capacity.
	Usable int

	Waiters    int    // AcquireWait callers queued now
	OpenLeases int    // leases acquired and not yet closed
	Acquires   uint64 // leases handed out
	Rejections uint64 // acquires that failed (any reason)

	// Prefix cache. PrefixQueries and PrefixHits count the lookups of
	// admitted prefix acquires only, together, so PrefixHits/PrefixQueries
	// is the hit rate; lookups of acquires refused for want of blocks are
	// counted in PrefixRefused instead (a request refused three times then
	// admitted counts once in PrefixQueries).
	PrefixQueries    uint64 // blocks looked up by admitted prefix acquires
	PrefixHits       uint64 // of those, blocks served from the cache
	PrefixRefused    uint64 // blocks looked up by prefix acquires then refused (ErrExhausted)
	Evictions        uint64 // cached blocks evicted to make room
	DuplicateSeals   uint64 // seals whose hash was already findable elsewhere
	VerifyMismatches uint64 // verified-mode lookups whose hash matched but content did not

	// Rejections by reason; they sum to Rejections.
	RejectedExhausted       uint64 // ErrExhausted (not ErrQuarantineBound nor ErrQuota): no room now
	RejectedQuarantineBound uint64 // ErrQuarantineBound: more than quarantine leaves usable
	RejectedQuota           uint64 // ErrQuota: more than a tenant's cap leaves (quota.go)
	RejectedCanceled        uint64 // the caller's context ended while queued (AcquireWait)
	RejectedClosed          uint64 // ErrPoolClosed
	RejectedInvalid         uint64 // any other error: ErrInvalidArgument, ErrExceedsCapacity

	// Transfers, counted once per lease a transfer gates, when the
	// transfer first ends: resolved without error, resolved with an error
	// (the memory is quiescent all the same), or quarantined (no proof).
	TransfersResolved    uint64
	TransfersFailed      uint64
	TransfersQuarantined uint64
	Quarantines          uint64 // leases that entered LeaseQuarantined
	QuarantineLifts      uint64 // leases late evidence brought out of LeaseQuarantined
	// LeakedLeases counts leases found unreachable while open. The
	// detection is armed only with WithObserver; without one it stays 0.
	LeakedLeases uint64
}

type counters struct {
	acquires                                             uint64
	prefixQueries, prefixHits, evictions, duplicateSeals uint64
	prefixRefused                                        uint64
	verifyMismatches                                     uint64
	transfersResolved, transfersFailed, transfersQuar    uint64
	quarantines, quarantineLifts                         uint64
}

// The reasons Stats splits Rejections into.
const (
	rejectExhausted = iota
	rejectQuarantineBound
	rejectCanceled
	rejectClosed
	rejectInvalid
	rejectQuota
	numRejectReasons
)

func rejectReason(err error) int {
	switch {
	case errors.Is(err, ErrQuarantineBound):
		return rejectQuarantineBound
	case errors.Is(err, ErrQuota):
		return rejectQuota
	case errors.Is(err, ErrExhausted):
		return rejectExhausted
	case errors.Is(err, ErrPoolClosed):
		return rejectClosed
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return rejectCanceled
	}
	return rejectInvalid
}

// reject counts and reports a failed acquire and returns err.
func (c *core) reject(owner string, n int, err error) error {
	c.rejections.Inc()
	c.rejectedBy[rejectReason(err)].Inc()
	if c.obs != nil {
		c.obs.Observe(Event{Kind: EventRejected, Owner: owner, Blocks: n, Err: err})
	}
	return err
}

// Stats returns a snapshot of the pool's counts.
func (p *Pool[R]) Stats() Stats {
	c := &p.core
	c.mu.Lock()
	defer c.unlock()
	return Stats{
		SealRecords:       c.records,
		Capacity:          c.tab.Len(),
		Free:              c.tab.Count(slots.Free),
		Cached:            c.tab.Count(slots.Cached),
		Leased:            c.tab.Count(slots.Leased),
		Draining:          c.tab.Count(slots.Draining),
		Quarantined:       c.tab.Count(slots.Quarantined),
		QuarantinedLeased: c.tab.QuarantinedLeased(),
		Usable:            c.usable(),
		Waiters:           c.queued(),
		OpenLeases:        c.openLeases,
		Acquires:          c.stats.acquires,
		Rejections:        c.rejections.Load(),
		PrefixQueries:     c.stats.prefixQueries,
		PrefixHits:        c.stats.prefixHits,
		PrefixRefused:     c.stats.prefixRefused,
		Evictions:         c.stats.evictions,
		DuplicateSeals:    c.stats.duplicateSeals,
		VerifyMismatches:  c.stats.verifyMismatches,

		RejectedExhausted:       c.rejectedBy[rejectExhausted].Load(),
		RejectedQuarantineBound: c.rejectedBy[rejectQuarantineBound].Load(),
		RejectedQuota:           c.rejectedBy[rejectQuota].Load(),
		RejectedCanceled:        c.rejectedBy[rejectCanceled].Load(),
		RejectedClosed:          c.rejectedBy[rejectClosed].Load(),
		RejectedInvalid:         c.rejectedBy[rejectInvalid].Load(),
		TransfersResolved:       c.stats.transfersResolved,
		TransfersFailed:         c.stats.transfersFailed,
		TransfersQuarantined:    c.stats.transfersQuar,
		Quarantines:             c.stats.quarantines,
		QuarantineLifts:         c.stats.quarantineLifts,
		LeakedLeases:            c.leaked.Load(),
	}
}

package kvlease

import (
	"errors"
	"fmt"
	"sync"
)

// TransferGroup is one logical transfer made of per-rank transfers: with
// tensor parallelism each rank moves its own shard of every block, on its
// own device or connection, and each rank's transport resolves its own
// Transfer on its own evidence. The logical transfer is:
//
//   - Resolved once every rank has resolved (only then is the whole block
//     quiescent);
//   - Quarantined while any rank is quarantined; a rank's late Resolve
//     lifts that, and the group is Pending again if other ranks still are,
//     Resolved if none is;
//   - Pending otherwise.
//
// The group adds no evidence of its own: its state is always derived from
// its ranks' states at the moment it is asked. To gate a lease by the
// whole group, attach every rank (AttachGroup, AttachGroupRange): the
// lease then settles when the last rank resolves and is LeaseQuarantined
// while any rank is, exactly as the group is. Each rank's leases in its
// own pool are gated by that rank's transfer alone.
//
// All methods are safe for concurrent use.
type TransferGroup struct {
	ranks []*Transfer

	once sync.Once
	done chan struct{}
}

// NewTransferGroup returns the logical transfer made of ranks (rank i is
// ranks[i]). Errors wrap ErrInvalidArgument for no ranks, a nil rank or
// the same transfer named twice.
func NewTransferGroup(ranks ...*Transfer) (*TransferGroup, error) {
	if len(ranks) == 0 {
		return nil, fmt.Errorf("kvlease: transfer group of no ranks: %w", ErrInvalidArgument)
	}
	for i, t := range ranks {
		if t == nil {
			return nil, fmt.Errorf("kvlease: transfer group: rank %d is nil: %w", i, ErrInvalidArgument)
		}
		for j := range i {
			if ranks[j] == t {
				return nil, fmt.Errorf("kvlease: transfer group: ranks %d and %d are the same transfer %d: %w", j, i, t.id, ErrInvalidArgument)
			}
		}
	}
	return &TransferGroup{ranks: append([]*Transfer(nil), ranks...)}, nil
}

// Ranks returns the number of ranks.
func (g *TransferGroup) Ranks() int { return len(g.ranks) }

// Rank returns rank i's transfer; an i outside [0, Ranks()) panics like a
// slice index.
func (g *TransferGroup) Rank(i int) *Transfer { return g.ranks[i] }

// State returns the logical state: Quarantined if any rank is
// quarantined, else Pending if any rank is pending, else Resolved.
func (g *TransferGroup) State() TransferState {
	st := TransferResolved
	for _, t := range g.ranks {
		switch t.State() {
		case TransferQuarantined:
			return TransferQuarantined
		case TransferPending:
			st = TransferPending
		}
	}
	return st
}

// Quarantined appends to dst the ranks quarantined now and returns it.
func (g *TransferGroup) Quarantined(dst []int) []int {
	for i, t := range g.ranks {
		if t.State() == TransferQuarantined {
			dst = append(dst, i)
		}
	}
	return dst
}

// Err returns the ranks' outcomes and quarantine reasons joined, each
// prefixed with its rank (nil when no rank has one): once Resolved it is
// the logical outcome, nil only if every rank succeeded.
func (g *TransferGroup) Err() error {
	var errs []error
	for i, t := range g.ranks {
		if err := t.Err(); err != nil {
			errs = append(errs, fmt.Errorf("rank %d: %w", i, err))
		}
	}
	return errors.Join(errs...)
}

// Done returns a channel closed once every rank has resolved. The first
// call starts one goroutine that waits for the ranks in turn; it ends when
// the last one resolves.
func (g *TransferGroup) Done() <-chan struct{} {
	g.once.Do(func() {
		if g.State() == TransferResolved {
			g.done = closedChan
			return
		}
		g.done = make(chan struct{})
		go func() {
			for _, t := range g.ranks {
				<-t.Done()
			}
			close(g.done)
		}()
	})
	return g.done
}

// Cancel asks every rank's transport to stop (each hook runs at most
// once, never after its rank resolved). It changes no state.
func (g *TransferGroup) Cancel() {
	for _, t := range g.ranks {
		t.Cancel()
	}
}

// AttachGroup attaches every rank of g to l with Attach, so l is gated by
// the logical transfer: it settles when the last rank resolves and is
// LeaseQuarantined while any rank is. If attaching a rank fails (the lease
// closed meanwhile), the ranks attached before it stay attached (a closed
// lease still drains them) and the error names the rank.
func AttachGroup[R any](l *Lease[R], g *TransferGroup) error {
	for i, t := range g.ranks {
		if err := l.Attach(t); err != nil {
			return fmt.Errorf("kvlease: attach rank %d of %d: %w", i, len(g.ranks), err)
		}
	}
	return nil
}

// AttachGroupRange is AttachGroup with AttachRange: every rank gates
// blocks from..to-1 of l with access a. The range is checked before any
// rank is attached.
func AttachGroupRange[R any](l *Lease[R], g *TransferGroup, from, to int, a Access) error {
	for i, t := range g.ranks {
		if err := l.AttachRange(t, from, to, a); err != nil {
			return fmt.Errorf("kvlease: attach rank %d of %d: %w", i, len(g.ranks), err)
		}
	}
	return nil
}

package kvlease

import (
	"fmt"
	"github.com/kvlease/kvlease/internal/slots"
)

// Access says how a transfer touches the blocks it gates.
type Access uint8

const (
	// Read: the transfer reads the blocks (a send, an offload). Their
	// content stays intact, so sealed blocks may keep serving prefix hits.
	Read Access = iota + 1
	// Write: the transfer writes the blocks (a receive, an onload). Their
	// content is in flux until it resolves: no Seal, no prefix hit.
	Write
)

func (a Access) String() string {
	switch a {
	case Read:
		return "read"
	case Write:
		return "write"
	}
	return "access(?)"
}

// attachment is one transfer gating blocks [from, to) of a lease, or all of
// them (whole) including blocks Extend adds later. applied is the transfer
// state this attachment's pins currently reflect; the transfer moves it
// forward under the pool's lock, so Extend and Resolve agree on what is
// pinned without the transfer's lock. Once its transfer resolves, an
// attachment is removed (see removeAtt): a lease keeps records only of
// transfers still pending or quarantined, so a long-lived lease that
// attaches and resolves a transfer every decode step stays small, and
// Extend, Abort and the deadline scan cost O(live attachments).
type attachment struct {
	t        *Transfer
	from, to int32
	access   Access
	whole    bool
	applied  TransferState
	// deferred: a pending Read range attached to an open lease pins
	// nothing yet. While the lease holds its blocks a read pin changes
	// nothing anyone asks of them (their class is leased, and only write
	// pins bar seals and hits), so the pins are applied when the lease
	// gives blocks back (close, TrimTo: pinDeferred and release's fused
	// loop) or the transfer is quarantined first; a transfer that
	// resolves first unpins nothing. BenchmarkLeaseCycleTransfer guards it.
	deferred bool
}

// att returns attachment i (0 ≤ i < natts).
func (l *lease) att(i int32) *attachment {
	if i == 0 {
		return &l.att0
	}
	return &l.extra.more[i-1]
}

// addAtt records a as the last live attachment.
func (l *lease) addAtt(a attachment) {
	if l.natts == 0 {
		l.att0 = a
	} else {
		x := l.ext()
		x.more = append(x.more, a)
	}
	l.natts++
}

// findAtt returns the index of a live attachment of t not yet in state
// to, or -1. A transfer attached to a lease twice (two ranges) has two
// attachments; each call of apply moves one. The scan is O(live
// attachments), usually one or two.
func (l *lease) findAtt(t *Transfer, to TransferState) int32 {
	for i := range l.natts {
		if a := l.att(i); a.t == t && a.applied != to {
			return i
		}
	}
	return -1
}

// removeAtt drops live attachment i (its transfer resolved), moving the
// last one into its place, and gives back the memory of a mostly empty
// list, so that what a lease keeps is bounded by what is still live.
func (l *lease) removeAtt(i int32) {
	last := l.natts - 1
	if i != last {
		*l.att(i) = *l.att(last)
	}
	*l.att(last) = attachment{}
	l.natts--
	if last > 0 {
		x := l.extra
		x.more = x.more[:last-1]
		switch n := len(x.more); {
		case cap(x.more) <= 8:
			// Small: keep it for the next attachments.
		case n == 0:
			x.more = nil
		case n < cap(x.more)/4:
			x.more = append([]attachment(nil), x.more...)
		}
	}
}

// AttachRange registers an in-flight transfer that touches blocks
// from..to-1 of this lease with the given access. A pending transfer holds
// its blocks out of reuse either way; a pending Write also bars Seal and
// prefix hits on them. If the transfer is quarantined, all its blocks are
// quarantined; its Write blocks stop serving hits, its Read blocks keep
// serving them. Ranges are fixed: blocks added later by Extend are not in
// them (Attach gates those).
//
// A Write over a sealed block is refused with ErrInvalidArgument (sealed
// content is immutable), as is a bad range or access, or a nil transfer.
// An empty range is allowed and gates nothing; so is attaching a transfer
// that has already resolved. After Release or Abort the error wraps
// ErrLeaseClosed and nothing is attached.
func (l *Lease[R]) AttachRange(t *Transfer, from, to int, a Access) error {
	return l.ls.attach(t, from, to, a, false)
}

// Attach registers t as gating every block of the lease, including blocks
// Extend adds later: as a Write on unsealed blocks and a Read on sealed
// ones, so it works after prefix hits (a decode step appends to fresh
// blocks while the shared prefix is only read). Errors as AttachRange.
func (l *Lease[R]) Attach(t *Transfer) error {
	return l.ls.attach(t, 0, 0, 0, true)
}

func (l *lease) attach(t *Transfer, from, to int, acc Access, whole bool) error {
	c := l.c
	if t == nil {
		return fmt.Errorf("kvlease: attach to lease %d (%s): nil transfer: %w", l.id, l.owner, ErrInvalidArgument)
	}
	if !whole && acc != Read && acc != Write {
		return fmt.Errorf("kvlease: attach to lease %d (%s): unknown access %d: %w", l.id, l.owner, acc, ErrInvalidArgument)
	}
	var ev outbox
	t.mu.Lock()
	c.mu.Lock()
	err := l.attachLocked(t, from, to, acc, whole, &ev)
	c.serve(&ev) // attaching a quarantined transfer quarantines blocks
	c.unlock()
	t.mu.Unlock()
	ev.flush()
	return err
}

// attachLocked does the work of attach with t.mu and c.mu held.
func (l *lease) attachLocked(t *Transfer, from, to int, acc Access, whole bool, ev *outbox) error {
	c := l.c
	if l.closed {
		return fmt.Errorf("kvlease: attach transfer %d to lease %d (%s): %w", t.id, l.id, l.owner, ErrLeaseClosed)
	}
	if whole {
		from, to = l.first(), len(l.blocks)
	} else if from < l.first() || to > len(l.blocks) || from > to {
		return fmt.Errorf("kvlease: attach transfer %d to blocks [%d,%d) of lease %d (%s) with %d blocks: %w",
			t.id, from, to, l.id, l.owner, len(l.blocks), ErrInvalidArgument)
	}
	if !whole && acc == Write {
		for i := from; i < to; i++ {
			if c.tab.Sealed(int32(l.blocks[i].ID)) {
				return fmt.Errorf("kvlease: attach transfer %d as a write over block %d of lease %d (%s): the block is sealed: %w",
					t.id, i, l.id, l.owner, ErrInvalidArgument)
			}
		}
	}
	st := t.state.Load()
	if st == TransferResolved || (!whole && from == to) {
		return nil // gates nothing
	}
	deferred := st == TransferPending && !whole && acc == Read
	if deferred {
		// Pinned when the lease gives the blocks back (see attachment).
	} else if st == TransferPending && !whole {
		c.tab.PinPending(refs(l.blocks[from:to]), true)
	} else {
		pin := pinOf(st)
		for i := from; i < to; i++ {
			id := int32(l.blocks[i].ID)
			c.tab.Repin(id, slots.PinNone, pin, acc == Write || (whole && !c.tab.Sealed(id)))
		}
	}
	l.addAtt(attachment{t: t, from: int32(from), to: int32(to), access: acc, whole: whole, applied: st, deferred: deferred})
	if st == TransferPending {
		l.pending++
	} else {
		l.quarantined++
	}
	t.gate(l)
	if c.obs != nil {
		ev.add(c.obs, Event{Kind: EventAttached, Owner: l.owner, Lease: l.id, Transfer: t.id, Blocks: to - from})
	}
	// (A pending transfer on an active lease changes nothing: no call.)
	if nextLeaseState(l.closed, int(l.pending), int(l.quarantined)) != l.current() {
		c.transition(l, ev)
	}
	return nil
}

// pinDeferred applies the pins of l's deferred attachments (see
// attachment) before l gives blocks back. Called with c.mu held.
func (c *core) pinDeferred(l *lease) {
	for i := range l.natts {
		if a := l.att(i); a.deferred {
			c.tab.PinPending(refs(l.blocks[a.from:a.to]), false)
			a.deferred = false
		}
	}
}

// dropGated is close's drop of blocks from..Len()-1 of a lease that
// transfers gate: their deferred pins applied (see attachment), in one
// pass with the drop when one pending read covers them all (a send, an
// offload: BenchmarkLeaseCycleTransfer). Called with c.mu held.
func (c *core) dropGated(l *lease, from int) {
	blocks := l.blocks[from:]
	if a := &l.att0; l.natts == 1 && a.deferred && int(a.from) == from && int(a.to) == len(l.blocks) {
		a.deferred = false
		if rest := c.tab.DropPinned(refs(blocks)); rest > 0 {
			c.tab.PinPending(refs(blocks[:rest]), false) // what that pass left
			c.drop(blocks[:rest])
		}
		return
	}
	c.pinDeferred(l)
	c.drop(blocks)
}

// pinOf is the slot table's pin state of a transfer state.
func pinOf(st TransferState) slots.Pin {
	switch st {
	case TransferPending:
		return slots.PinPending
	case TransferQuarantined:
		return slots.PinQuarantined
	}
	return slots.PinNone
}

// applyRange moves the pins of blocks lo..hi-1 of attachment a from
// transfer state from to state to, tail first: the general case of
// apply. Called with c.mu held.
func (c *core) applyRange(blocks []BlockRef, lo, hi int, a *attachment, from, to TransferState) {
	pf, pt := pinOf(from), pinOf(to)
	for i := hi - 1; i >= lo; i-- {
		id := int32(blocks[i].ID)
		c.tab.Repin(id, pf, pt, a.access == Write || (a.whole && !c.tab.Sealed(id)))
	}
}

// apply moves one attachment of t to l to transfer state to, adjusting
// the pins of every block it gates, and returns blocks nobody holds any
// more to the pool; a resolved attachment is removed. Called with c.mu
// held (and the transfer's mutex).
func (c *core) apply(l *lease, to TransferState, t *Transfer, ev *outbox) {
	idx := l.findAtt(t, to)
	if idx < 0 {
		return
	}
	a := l.att(idx)
	from := a.applied
	if from == TransferResolved {
		return
	}
	lo, hi := int(a.from), int(a.to)
	if a.whole {
		hi = len(l.blocks) // from the first block it gated (see TrimTo)
	}
	// Tail first, as Release does, so a chain enters the LRU from its end.
	switch {
	case a.deferred && to == TransferResolved:
		// Nothing was pinned: nothing to unpin.
	case a.deferred:
		c.applyRange(l.blocks, lo, hi, a, TransferResolved, to) // pins from none
		a.deferred = false
	case from == TransferPending && to == TransferResolved:
		c.tab.Resolve(refs(l.blocks[lo:hi]), a.access == Write, a.whole)
	default:
		c.applyRange(l.blocks, lo, hi, a, from, to)
	}
	a.applied = to
	if from == TransferPending {
		l.pending--
	} else {
		l.quarantined--
	}
	if from == TransferPending {
		switch {
		case to == TransferQuarantined:
			c.stats.transfersQuar++
		case t.err != nil:
			c.stats.transfersFailed++
		default:
			c.stats.transfersResolved++
		}
	}
	kind := EventTransferResolved
	if to == TransferQuarantined {
		l.quarantined++
		kind = EventTransferQuarantined
	} else {
		l.removeAtt(idx) // resolved: the lease no longer needs the record
	}
	if c.obs != nil {
		ev.add(c.obs, Event{Kind: kind, Owner: l.owner, Lease: l.id, Transfer: t.id, Blocks: hi - lo, Err: t.err})
	}
	c.transition(l, ev)
}

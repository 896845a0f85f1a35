package kvlease

import (
	"fmt"
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
	c.mu.Unlock()
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
			if c.slots[l.blocks[i].ID].sealed {
				return fmt.Errorf("kvlease: attach transfer %d as a write over block %d of lease %d (%s): the block is sealed: %w",
					t.id, i, l.id, l.owner, ErrInvalidArgument)
			}
		}
	}
	st := t.state.Load()
	if st == TransferResolved || (!whole && from == to) {
		return nil // gates nothing
	}
	if st == TransferPending && !whole {
		// The common case, kept tight: the lease is open, so each block is
		// leased (or quarantined) and a pending pin changes neither.
		var w int32
		if acc == Write {
			w = 1
		}
		pinPending(c.slots, l.blocks[from:to], w)
	} else {
		for i := from; i < to; i++ {
			id := l.blocks[i].ID
			s := &c.slots[id]
			s.pin(st, acc == Write || (whole && !s.sealed))
			if st != TransferPending {
				if s.quar == 1 && s.refs > 0 {
					c.quarLeased++
				}
				c.settleSlot(id)
			}
		}
	}
	l.addAtt(attachment{t: t, from: int32(from), to: int32(to), access: acc, whole: whole, applied: st})
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
	if nextLeaseState(l.closed, int(l.pending), int(l.quarantined)) != l.state {
		c.transition(l, ev)
	}
	return nil
}

// pinPending adds one pending pin, and w write pins, to each block: a
// leaf, so that its loop keeps everything in registers (inlined into
// attachLocked, it spilled its counter: callgrind).
//
//go:noinline
func pinPending(slots []slot, blocks []BlockRef, w int32) {
	for _, r := range blocks {
		s := &slots[r.ID]
		s.pins++
		s.wpins += w
	}
}

// pin records one more attachment of a transfer in state st over the slot.
func (s *slot) pin(st TransferState, write bool) {
	if st == TransferPending {
		s.pins++
	} else {
		s.quar++
	}
	if write {
		s.wpins++
	}
}

// resolveRange drops one pending pin (and write pin, for a write; for a
// whole-lease attachment, on unsealed blocks) from each block, tail
// first: the common end of a transfer. A block that was draining only on
// it (unsealed, nobody else holds it) goes straight onto the free stack;
// a block an open lease holds stays leased; anything else goes through
// settleSlot. Called with c.mu held.
func (c *core) resolveRange(blocks []BlockRef, write, whole bool) {
	var w int32
	if write {
		w = 1
	}
	slots := c.slots
	k0 := len(c.free)
	i, k := unpinFast(slots, blocks, c.free[:cap(c.free)], k0, w, whole)
	c.free = c.free[:k]
	freed := k - k0
	c.counts[classDraining] -= freed
	c.counts[classFree] += freed
	// The rest, from the first block unpinFast left: settleSlot's cases.
	for i--; i >= 0; i-- {
		id := blocks[i].ID
		s := &slots[id]
		s.pins--
		if whole && !s.sealed {
			s.wpins--
		} else {
			s.wpins -= w
		}
		if s.refs > 0 && s.quar == 0 {
			continue // an open lease still holds it: still leased
		}
		c.settleSlot(id)
	}
}

// unpinFast is resolveRange's loop over its common outcome, tail first:
// a block that was draining on this one pending pin alone (so unsealed:
// its write pin, if any, is w, or 1 for a whole-lease attachment) is
// unpinned and goes onto the free stack room[k:]. It stops before the
// first block with any other outcome, and returns how many blocks are
// left (that one included) and the new top of room. A leaf, so that its
// loop keeps everything in registers.
func unpinFast(slots []slot, blocks []BlockRef, room []BlockID, k int, w int32, whole bool) (i, top int) {
	if whole {
		w = 1
	}
	draining, free, one := headDraining, headFree, gatesOnePin
	for i = len(blocks); i > 0 && k < len(room); i-- {
		id := blocks[i-1].ID
		s := &slots[id]
		if s.head() != draining || s.gates() != one {
			break
		}
		s.pins = 0
		s.wpins -= w
		s.setHead(free)
		room[k] = id
		k++
	}
	return i, k
}

// applyRange moves the pins of blocks lo..hi-1 of attachment a from
// transfer state from to state to and settles each block: the general
// case of apply. Called with c.mu held.
func (c *core) applyRange(blocks []BlockRef, lo, hi int, a *attachment, from, to TransferState) {
	for i := hi - 1; i >= lo; i-- {
		id := blocks[i].ID
		s := &c.slots[id]
		write := a.access == Write || (a.whole && !s.sealed)
		if from == TransferPending {
			s.pins--
		} else {
			s.quar--
		}
		switch {
		case to == TransferQuarantined:
			s.quar++
		case write:
			s.wpins--
		}
		if s.refs > 0 {
			// Quarantined and leased: count the slot's entry and exit.
			if to == TransferQuarantined && s.quar == 1 {
				c.quarLeased++
			} else if from == TransferQuarantined && to != TransferQuarantined && s.quar == 0 {
				c.quarLeased--
			}
		}
		c.settleSlot(id)
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
	if from == TransferPending && to == TransferResolved {
		c.resolveRange(l.blocks[lo:hi], a.access == Write, a.whole)
	} else {
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

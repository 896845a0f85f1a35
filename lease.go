package kvlease

import (
	"fmt"
	"runtime"
	"time"
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
// doc.go. Checked builds verify every transition against it.
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

// Lease is the typed ownership handle of a set of blocks. While it is open
// (Active, or Quarantined and not yet closed), its owner may read and write
// the regions, extend it, seal blocks and attach transfers. Release and
// Abort close it at once: no new work can be attached and Region fails with
// ErrLeaseClosed. Each block returns to the pool only when every transfer
// gating it has resolved; Settled tells when that is done for all of them.
//
// Region hands out a block for writing only while it is not sealed and no
// other lease shares it (ErrReadOnly otherwise): one request can never
// overwrite KV another reads. ReadRegion serves every held block for
// reading.
//
// A lease must be closed exactly as a file must: one that becomes
// unreachable while open is reported to the observer as leaked (when the
// leak check is on) and its blocks stay leased forever. All methods are
// safe for concurrent use.
//
// Leases are carved from per-pool slabs of about 16 KiB (see slab.go), so
// acquiring one allocates nothing on average; the price is that a lease
// kept reachable keeps its slab's memory. Drop closed leases you no longer
// need.
type Lease[R any] struct {
	ls lease // first: transfers point at it, and it starts the allocation
	p  *Pool[R]
}

// lease is the non-generic part of a lease. Everything but owner, id and
// c is guarded by c.mu.
type lease struct {
	c      *core
	id     uint64
	owner  string
	blocks []BlockRef

	state       LeaseState
	closed      bool
	pending     int32 // attachments whose transfer is pending
	quarantined int32 // attachments whose transfer is quarantined
	natts       int32 // live attachments (pending or quarantined): att0, then extra.more

	att0  attachment  // the first attachment inline: none allocated for one transfer
	extra *leaseExtra // only when something rarer is needed (see leaseExtra)
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

// newLease returns a fresh lease whose table has n zero entries (the
// caller fills them before anyone sees the lease), carved from the pool's
// slabs (see slab.go). Called with c.mu held.
func (p *Pool[R]) newLease(owner string, n int) *Lease[R] {
	l, blocks := p.slabs.carve(n, p.cfg.leakCheck)
	l.p = p
	l.ls.c = &p.core
	l.ls.owner = owner
	l.ls.blocks = blocks[:n] // filled by the caller before anyone sees it
	return l
}

// leaseExtra holds what only some leases need, off the hot path: a
// lease is carved for every request, and every byte of it is garbage to
// collect.
type leaseExtra struct {
	more    []attachment  // attachments after the first
	settled chan struct{} // made on demand by Settled
	timer   *time.Timer   // drain deadline
	leak    runtime.Cleanup
	watched bool // leak is registered
	trimmed int  // blocks before this index were given back by TrimTo (trim.go)
}

func (l *lease) ext() *leaseExtra {
	if l.extra == nil {
		l.extra = new(leaseExtra)
	}
	return l.extra
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

// settledChan returns the Settled channel if anyone asked for it, else nil.
func (l *lease) settledChan() chan struct{} {
	if l.extra == nil {
		return nil
	}
	return l.extra.settled
}

type leakInfo struct {
	c     *core
	obs   Observer
	owner string
	id    uint64
}

// watchLeak registers the cleanup that reports this lease if it becomes
// unreachable while open. Called with c.mu held when the lease opens.
func (l *lease) watchLeak() {
	if l.c.obs == nil {
		return
	}
	x := l.ext()
	x.leak = runtime.AddCleanup(l, func(i leakInfo) {
		i.c.leaked.Inc()
		i.obs.Observe(Event{Kind: EventLeaked, Owner: i.owner, Lease: i.id,
			Err: fmt.Errorf("kvlease: lease %d (%s) became unreachable while open; its blocks stay leased", i.id, i.owner)})
	}, leakInfo{l.c, l.c.obs, l.owner, l.id})
	x.watched = true
}

// ID returns the lease's id, unique within its pool; observer events carry
// it. Ids increase in the order leases are handed out (for waiters: the
// order they are served).
func (l *Lease[R]) ID() uint64 { return l.ls.id }

// Owner returns the owner named at acquire.
func (l *Lease[R]) Owner() string { return l.ls.owner }

// Pool returns the pool the lease came from.
func (l *Lease[R]) Pool() *Pool[R] { return l.p }

// snapshot returns the block table as it is now. Entries are never
// rewritten once set (Extend only appends), so the caller may index the
// returned slice without the lock.
func (l *lease) snapshot() []BlockRef {
	l.c.mu.Lock()
	b := l.blocks
	l.c.mu.Unlock()
	return b
}

// Len returns the number of blocks in the lease (it still answers after the
// lease closes).
func (l *Lease[R]) Len() int { return len(l.ls.snapshot()) }

// Ref returns the reference of block i: its slot and the generation it had
// when this lease got it. It still answers after the lease closes, so a
// caller can keep refs and later check them for staleness with
// Pool.Region. An i outside [0, Len()) panics like a slice index.
func (l *Lease[R]) Ref(i int) BlockRef { return l.ls.snapshot()[i] }

// AppendBlockIDs appends the ids of blocks from..Len()-1 to dst and returns
// it: the block table an attention kernel indexes. An engine sends only the
// new tail each decode step. It allocates nothing when dst has room; a
// from outside [0, Len()] panics like a slice expression.
func (l *Lease[R]) AppendBlockIDs(dst []BlockID, from int) []BlockID {
	for _, r := range l.ls.liveFrom(from) {
		dst = append(dst, r.ID)
	}
	return dst
}

// Region returns block i's region for writing. It fails with
// ErrLeaseClosed once the lease is released or aborted (the region may be
// someone else's soon), with ErrInvalidArgument for an i outside [0,
// Len()), and with ErrReadOnly when block i is sealed or shared with
// another lease (a prefix hit, a Share): its content is immutable and
// others read it, so no lease may write it. Read such a block with
// ReadRegion.
func (l *Lease[R]) Region(i int) (R, error) {
	return l.region(i, true)
}

// ReadRegion returns block i's region for reading: any block the open
// lease holds, sealed or shared included. A transport that sends or
// offloads a lease's content reads it here (or through Pool.Region).
// Writing through it is a contract violation the library cannot catch.
// Errors as Region, except ErrReadOnly.
func (l *Lease[R]) ReadRegion(i int) (R, error) {
	return l.region(i, false)
}

func (l *Lease[R]) region(i int, write bool) (R, error) {
	var zero R
	c := l.ls.c
	c.mu.Lock()
	if l.ls.closed {
		c.mu.Unlock()
		return zero, fmt.Errorf("kvlease: region %d of lease %d (%s): %w", i, l.ls.id, l.ls.owner, ErrLeaseClosed)
	}
	if i < l.ls.first() || i >= len(l.ls.blocks) {
		n := len(l.ls.blocks)
		c.mu.Unlock()
		return zero, fmt.Errorf("kvlease: region %d of lease %d (%s) with %d blocks: %w", i, l.ls.id, l.ls.owner, n, ErrInvalidArgument)
	}
	id := l.ls.blocks[i].ID
	if write {
		if s := &c.slots[id]; s.sealed || s.refs > 1 {
			sealed, refs := s.sealed, s.refs
			c.mu.Unlock()
			return zero, readOnlyErr(&l.ls, i, sealed, refs)
		}
	}
	c.mu.Unlock()
	return l.p.mem.Region(id), nil
}

// readOnlyErr is the error of a write access to a sealed or shared block.
func readOnlyErr(l *lease, i int, sealed bool, refs int32) error {
	why := "sealed"
	if !sealed {
		why = fmt.Sprintf("shared by %d leases", refs)
	}
	return fmt.Errorf("kvlease: writable region %d of lease %d (%s): the block is %s: %w", i, l.id, l.owner, why, ErrReadOnly)
}

// AppendRegions appends the writable regions of blocks from..Len()-1 to
// dst and returns it, under one lock acquisition: what a copy or a kernel
// launch that writes wants, rather than a Region call (and a lock) per
// block. Errors as Region (ErrReadOnly if any of those blocks is sealed or
// shared: nothing is appended then); a from outside [0, Len()] wraps
// ErrInvalidArgument. AppendReadRegions serves every block for reading.
func (l *Lease[R]) AppendRegions(dst []R, from int) ([]R, error) {
	return l.appendRegions(dst, from, true)
}

// AppendReadRegions is AppendRegions for reading: it serves sealed and
// shared blocks too (what a send or an offload wants).
func (l *Lease[R]) AppendReadRegions(dst []R, from int) ([]R, error) {
	return l.appendRegions(dst, from, false)
}

func (l *Lease[R]) appendRegions(dst []R, from int, write bool) ([]R, error) {
	c := l.ls.c
	c.mu.Lock()
	if l.ls.closed {
		c.mu.Unlock()
		return dst, fmt.Errorf("kvlease: regions of lease %d (%s): %w", l.ls.id, l.ls.owner, ErrLeaseClosed)
	}
	blocks, first := l.ls.blocks, l.ls.first()
	if from < first || from > len(blocks) {
		c.mu.Unlock()
		return dst, fmt.Errorf("kvlease: regions from %d of lease %d (%s) with %d blocks: %w",
			from, l.ls.id, l.ls.owner, len(blocks), ErrInvalidArgument)
	}
	if write {
		for i := from; i < len(blocks); i++ {
			if s := &c.slots[blocks[i].ID]; s.sealed || s.refs > 1 {
				sealed, refs := s.sealed, s.refs
				c.mu.Unlock()
				return dst, readOnlyErr(&l.ls, i, sealed, refs)
			}
		}
	}
	c.mu.Unlock()
	for _, r := range blocks[from:] {
		dst = append(dst, l.p.mem.Region(r.ID))
	}
	return dst, nil
}

// Closed reports whether the lease has been released or aborted. (State
// alone cannot tell: LeaseQuarantined means open or closed.)
func (l *Lease[R]) Closed() bool {
	c := l.ls.c
	c.mu.Lock()
	defer c.mu.Unlock()
	return l.ls.closed
}

// State returns the lease's lifecycle state.
func (l *Lease[R]) State() LeaseState {
	c := l.ls.c
	c.mu.Lock()
	defer c.mu.Unlock()
	return l.ls.state
}

// Settled returns a channel that is closed once the lease is closed and
// holds none of its blocks any more: every transfer gating it has resolved
// and its references are dropped. (The blocks may still be leased by
// others, or be cached or free.) The channel is made on first call.
func (l *Lease[R]) Settled() <-chan struct{} {
	c := l.ls.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if l.ls.state == LeaseSettled {
		return closedChan
	}
	x := l.ls.ext()
	if x.settled == nil {
		x.settled = make(chan struct{})
	}
	return x.settled
}

// Release closes the lease: from now on nothing can be attached and Region
// fails. Blocks no pending transfer gates return to the pool at once (a
// chain's tail first, so the cache evicts it from its end); the others as
// their transfers resolve. Release is idempotent, and a no-op after Abort.
func (l *Lease[R]) Release() { l.ls.close(false, nil) }

// Abort closes the lease like Release and then calls Cancel on every
// attached transfer that has not resolved (pending or quarantined).
// Cancelling is a request to the transport; the blocks still return only
// when the transfers resolve. cause is reported to the observer (nil means
// ErrAborted). Abort is idempotent, and a no-op after Release.
func (l *Lease[R]) Abort(cause error) {
	if cause == nil {
		cause = ErrAborted
	}
	l.ls.close(true, cause)
}

func (l *lease) close(abort bool, cause error) {
	c := l.c
	var ev events
	var toCancel []*Transfer
	c.mu.Lock()
	if l.closed {
		c.mu.Unlock()
		return
	}
	l.closed = true
	c.openLeases--
	// x is loaded once: nothing below, under the lock, sets l.extra.
	x := l.extra
	if x != nil && x.watched {
		x.leak.Stop()
		x.watched = false
	}
	if c.obs != nil {
		if abort {
			ev.add(c.obs, Event{Kind: EventAborted, Owner: l.owner, Lease: l.id, Blocks: len(l.blocks), Err: cause})
		} else {
			ev.add(c.obs, Event{Kind: EventReleased, Owner: l.owner, Lease: l.id, Blocks: len(l.blocks)})
		}
	}
	from := 0 // l.first()
	if x != nil {
		from = x.trimmed
	}
	// c.drop, by hand: its call would be one more per cycle.
	if i := c.dropFast(l.blocks[from:]); i > 0 {
		c.dropSlow(l.blocks[from : from+i])
	}
	if abort {
		var cancel [4]*Transfer // zeroed only on this path
		toCancel = cancel[:0]
		for i := range l.natts {
			if a := l.att(i); a.applied != TransferResolved {
				toCancel = append(toCancel, a.t)
			}
		}
	}
	if l.pending|l.quarantined == 0 && l.state == LeaseActive && (x == nil || x.settled == nil) && c.obs == nil {
		// Nothing gates it and nobody watches: Active → Settled directly.
		l.state = LeaseSettled
	} else {
		c.transition(l, &ev)
		if l.state != LeaseSettled {
			c.startDeadline(l)
		}
	}
	c.serve(&ev)
	c.mu.Unlock()
	ev.flush()
	for _, t := range toCancel {
		t.Cancel()
	}
}

// transition moves l to the state its facts now imply, with the side
// effects of entering it. Called with c.mu held.
func (c *core) transition(l *lease, ev *events) {
	next := nextLeaseState(l.closed, int(l.pending), int(l.quarantined))
	prev := l.state
	if next == prev {
		return
	}
	if !leaseEdge(prev, next) {
		panic(fmt.Sprintf("kvlease: lease %d: impossible transition %v → %v", l.id, prev, next))
	}
	l.state = next
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

// Extend appends n fresh blocks to the open lease, all or nothing: a
// request's KV grows by a block every block-size tokens while it decodes.
// Growth of running work is not queued behind AcquireWait waiters (their
// order governs admission of new work only), but it does evict cached
// blocks when nothing is free. Transfers attached with Attach gate the new
// blocks too (as writes: they are unsealed); AttachRange ranges are fixed.
// Errors wrap ErrInvalidArgument (n ≤ 0), ErrLeaseClosed, ErrPoolClosed,
// ErrExceedsCapacity (the lease would outgrow the pool) or ErrExhausted.
func (l *Lease[R]) Extend(n int) error {
	ls := &l.ls
	c := ls.c
	if n <= 0 {
		return fmt.Errorf("kvlease: extend lease %d (%s) by %d blocks: n must be positive: %w", ls.id, ls.owner, n, ErrInvalidArgument)
	}
	var ev events
	c.mu.Lock()
	var err error
	switch have := len(ls.blocks) - ls.first(); {
	case ls.closed:
		err = fmt.Errorf("kvlease: extend lease %d (%s): %w", ls.id, ls.owner, ErrLeaseClosed)
	case c.closed.Load():
		err = fmt.Errorf("kvlease: extend lease %d (%s): %w", ls.id, ls.owner, ErrPoolClosed)
	case n > len(c.slots)-have: // not have+n: that overflows for a huge n
		err = fmt.Errorf("kvlease: extend lease %d (%s) from %d by %d blocks: pool capacity is %d: %w",
			ls.id, ls.owner, have, n, len(c.slots), ErrExceedsCapacity)
	case c.available() < n:
		held := 0 // usable blocks this lease holds already (trimmed ones it gave back)
		for _, r := range ls.blocks[ls.first():] {
			if c.slots[r.ID].quar == 0 {
				held++
			}
		}
		if err = c.boundErr(ls.owner, n, held); err == nil {
			err = &exhaustedError{op: "extend", owner: ls.owner, lease: ls.id, n: n, avail: c.available()}
		}
	}
	if err != nil {
		c.mu.Unlock()
		return err
	}
	from := len(ls.blocks)
	if cap(ls.blocks)-from < n {
		// Grow by doubling, outside the inline array.
		nb := make([]BlockRef, from, max(2*cap(ls.blocks), from+n))
		copy(nb, ls.blocks)
		ls.blocks = nb
	}
	ls.blocks = ls.blocks[:from+n]
	c.fill(ls.blocks[from:], &ev)
	for i := range ls.natts {
		a := ls.att(i)
		if a.whole && a.applied != TransferResolved {
			for _, r := range ls.blocks[from:] {
				s := &c.slots[r.ID]
				s.pin(a.applied, true)
				if a.applied == TransferQuarantined && s.quar == 1 {
					c.quarLeased++ // fresh, so held by this lease alone
				}
				c.settleSlot(r.ID)
			}
		}
	}
	if c.obs != nil {
		ev.add(c.obs, Event{Kind: EventExtended, Owner: ls.owner, Lease: ls.id, Blocks: n})
	}
	c.serve(&ev) // a quarantined Attach may have quarantined the new blocks
	c.mu.Unlock()
	ev.flush()
	return nil
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
	var ev events
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
func (l *lease) attachLocked(t *Transfer, from, to int, acc Access, whole bool, ev *events) error {
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
func (c *core) apply(l *lease, to TransferState, t *Transfer, ev *events) {
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

package kvlease

import "fmt"

// Trimming: a sliding-window request no longer needs the blocks that fell
// out of its window, and gives them back while its lease stays open.
//
// Indices stay absolute. Block i of a lease is always the block at
// position i of the request (tokens i·B … i·B+B-1 for B-token blocks),
// before and after a trim, so an engine's arithmetic never changes:
//
//   - Len still counts every position, trimmed ones included.
//   - Ref(i) still answers for a trimmed block (the ref it had; check it
//     with Pool.Region: it goes stale once the slot is reused).
//   - Trimmed returns the first index still held. Region, Seal and
//     AttachRange refuse an index below it with ErrInvalidArgument;
//     AppendRegions and AppendBlockIDs take from ≥ Trimmed (AppendBlockIDs
//     panics below it, like a slice index: a trimmed id handed to a kernel
//     would name memory the lease no longer owns).
//   - Attach gates the held blocks and those Extend adds later.
//   - Share refuses a trimmed lease (it shares a leading range).
//   - Extend's capacity check counts held blocks only, so a long request
//     with a short window never outgrows the pool.
//
// A trimmed block follows the rules of a release: the lease drops its
// reference at once (tail first, as Release does); a block some pending
// transfer gates drains and returns when that transfer resolves; a
// quarantined one stays quarantined until late evidence; a sealed block
// nobody else holds stays cached for prefix hits. Attachments keep their
// ranges (absolute indices too): a transfer attached before the trim still
// gates the trimmed blocks it covered until it resolves, and Abort still
// cancels it.

// first returns the first block index the lease still holds. Called with
// c.mu held.
func (l *lease) first() int {
	if l.extra == nil {
		return 0
	}
	return l.extra.trimmed
}

// liveFrom returns the blocks from..Len()-1 and panics, like a slice
// expression, for a from outside [Trimmed(), Len()]. Entries are never
// rewritten once set, so the caller may read them without the lock.
func (l *lease) liveFrom(from int) []BlockRef {
	l.c.mu.Lock()
	b, first := l.blocks, l.first()
	l.c.unlock()
	if from < first && from >= 0 {
		panic(fmt.Sprintf("kvlease: block ids from %d of lease %d: blocks before %d were trimmed", from, l.id, first))
	}
	return b[from:]
}

// Trimmed returns how many leading blocks the lease has given back with
// TrimTo: the first index it still holds (0 if it never trimmed).
func (l *Lease[R]) Trimmed() int {
	c := l.ls.c
	c.mu.Lock()
	defer c.unlock()
	return l.ls.first()
}

// TrimTo gives back every block before index i while the lease stays
// open: a sliding-window request drops the blocks that fell out of its
// window as it decodes. Indices stay absolute (see the top of trim.go):
// Len is unchanged and Trimmed returns i afterwards. The blocks follow the
// rules of a release: pending transfers gating them must resolve first,
// sealed ones stay cached.
//
// An i at or below Trimmed() is a no-op; i == Len() gives back everything
// (the lease stays open and may Extend). Errors wrap ErrInvalidArgument for
// an i outside [0, Len()] and ErrLeaseClosed after Release or Abort;
// nothing changes then.
func (l *Lease[R]) TrimTo(i int) error {
	ls := &l.ls
	c := ls.c
	var ev outbox
	c.mu.Lock()
	switch {
	case ls.closed:
		c.unlock()
		return fmt.Errorf("kvlease: trim lease %d (%s) to %d: %w", ls.id, ls.owner, i, ErrLeaseClosed)
	case i < 0 || i > len(ls.blocks):
		n := len(ls.blocks)
		c.unlock()
		return fmt.Errorf("kvlease: trim lease %d (%s) with %d blocks to %d: %w", ls.id, ls.owner, n, i, ErrInvalidArgument)
	}
	first := ls.first()
	if i <= first {
		c.unlock()
		return nil
	}
	ls.ext().trimmed = i
	if ls.natts > 0 {
		c.pinDeferred(ls) // the trimmed blocks drain until their transfers resolve
	}
	c.drop(ls.blocks[first:i])
	c.serve(&ev)
	if c.obs != nil {
		ev.add(c.obs, Event{Kind: EventTrimmed, Owner: ls.owner, Lease: ls.id, Blocks: i - first})
	}
	c.unlock()
	ev.flush()
	return nil
}

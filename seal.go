package kvlease

import (
	"fmt"
)

// Seal declares block i full and immutable from now on, findable by h for
// prefix hits once nobody references it (and while they do). If another
// block is already findable by h, Seal still returns nil: the existing
// block stays findable and this one is sealed but private (counted in
// Stats.DuplicateSeals and reported as EventDuplicateSeal; once
// unreferenced it is free, not cached). Sealing again with the same hash is
// a no-op.
//
// Errors wrap ErrLeaseClosed after Release or Abort, and
// ErrInvalidArgument for an i outside the lease, a block with a pending or
// quarantined write (its content is not known), or a block already sealed
// with a different hash.
func (l *Lease[R]) Seal(i int, h BlockHash) error {
	return l.ls.seal(i, h, nil)
}

// sealTokens carries what verified mode records: the parent hash, the
// block's tokens and its extra keys; chain overrides where its KV event places the block in
// its chain (SealChained).
type sealTokens struct {
	parent BlockHash
	tokens []int32
	chain  chainPlace
	extra  []string // the block's extra keys (mixed into its hash), owned by the seal from now on
}

// chainPlace says where a sealed block sits in its chain, for its KV event.
type chainPlace uint8

const (
	chainByLease  chainPlace = iota // block 0 of the lease starts a chain, later blocks follow parent
	chainChild                      // parent is a block: the event names it, whatever i is
	chainStartAny                   // the chain's first block: no parent, whatever i is
)

func (l *lease) seal(i int, h BlockHash, st *sealTokens) error {
	c := l.c
	var ev outbox
	c.mu.Lock()
	err := l.sealLocked(i, h, st, &ev)
	c.unlock()
	ev.flush()
	return err
}

func (l *lease) sealLocked(i int, h BlockHash, st *sealTokens, ev *outbox) error {
	c := l.c
	if l.closed {
		return fmt.Errorf("kvlease: seal block %d of lease %d (%s): %w", i, l.id, l.owner, ErrLeaseClosed)
	}
	if i < l.first() || i >= len(l.blocks) {
		return fmt.Errorf("kvlease: seal block %d of lease %d (%s) with %d blocks: %w", i, l.id, l.owner, len(l.blocks), ErrInvalidArgument)
	}
	id := l.blocks[i].ID
	if c.tab.Sealed(int32(id)) {
		if old := c.pre[id].hash; old != h {
			return fmt.Errorf("kvlease: seal block %d of lease %d (%s) with hash %016x: already sealed with %016x: %w",
				i, l.id, l.owner, uint64(h), uint64(old), ErrInvalidArgument)
		}
		return nil
	}
	if c.tab.Writing(int32(id)) {
		return fmt.Errorf("kvlease: seal block %d of lease %d (%s): a transfer is still writing it: %w",
			i, l.id, l.owner, ErrInvalidArgument)
	}
	if st != nil || c.meta != nil { // (a plain Seal on a plain pool has nothing to check)
		if err := c.checkSealTokens(st); err != nil {
			return fmt.Errorf("kvlease: seal block %d of lease %d (%s): %w", i, l.id, l.owner, err)
		}
	}
	c.tab.Seal(int32(id))
	if l.extra != nil || c.ret != nil || c.tab.RetentionUsed() {
		c.tab.SetRetention(int32(id), uint8(c.retentionOf(l, id)))
	}
	c.pre[id].hash = h
	c.recordSeal(id, st)
	if !c.index.insert(h, id) {
		c.stats.duplicateSeals++
		if c.obs != nil {
			ev.add(c.obs, Event{Kind: EventDuplicateSeal, Owner: l.owner, Lease: l.id, Blocks: 1})
		}
		return nil
	}
	c.tab.SetIndexed(int32(id), true)
	if c.kv != nil {
		c.kv.sealed(c, l, i, id, h, st)
	}
	return nil
}

// SealTokens seals block i with the hash of its tokens under parent (the
// previous block's hash, or the namespace seed for the first block) and
// returns that hash: HashBlock's, or the pool's Hasher (WithHasher). It is Seal with the hash computed for you, and the
// only way to seal in verified mode (WithVerifiedPrefix), where the pool
// keeps parent and tokens to check every later hit against. In every mode
// tokens must be exactly one full block (the configured block tokens): a
// partial block is never sealed (its KV will still grow), and a pool
// without WithBlockTokens or WithVerifiedPrefix refuses SealTokens. Both
// wrap ErrInvalidArgument; other errors as Seal.
func (l *Lease[R]) SealTokens(i int, parent BlockHash, tokens []int32) (BlockHash, error) {
	h := l.ls.c.hashBlock(parent, tokens, nil)
	return h, l.ls.seal(i, h, &sealTokens{parent: parent, tokens: tokens})
}

// SealChained is SealTokens for a block whose place in its chain is not
// its place in the lease, such as a lower tier's copy of a block (a tiered
// cache offloads blocks of many chains in one lease). hasParent says
// whether parent is a block, so that the block's KV event names it as the
// parent even for block 0 of the lease, or the namespace seed (the block
// starts its chain: the event names no parent, even for a later block of
// the lease). The hash, the checks and the errors are SealTokens'.
func (l *Lease[R]) SealChained(i int, parent BlockHash, hasParent bool, tokens []int32) (BlockHash, error) {
	h := l.ls.c.hashBlock(parent, tokens, nil)
	place := chainStartAny
	if hasParent {
		place = chainChild
	}
	return h, l.ls.seal(i, h, &sealTokens{parent: parent, tokens: tokens, chain: place})
}

// Share returns a second lease, owned by owner, over the first n blocks of
// this one: the same slots at the same generations, reference counted, for
// parallel sampling and beam search. Every shared block must be sealed
// (shared content must be immutable): a block still being written is
// refused with ErrInvalidArgument, as is an n outside [1, Len()]. The new
// lease is independent: it may Extend with fresh blocks and is released on
// its own. Errors also wrap ErrLeaseClosed and ErrPoolClosed.
func (l *Lease[R]) Share(owner string, n int) (*Lease[R], error) {
	ls := &l.ls
	c := ls.c
	if owner == "" {
		return nil, fmt.Errorf("kvlease: share lease %d (%s): empty owner: %w", ls.id, ls.owner, ErrInvalidArgument)
	}
	var ev outbox
	c.mu.Lock()
	var err error
	switch {
	case ls.closed:
		err = fmt.Errorf("kvlease: share lease %d (%s): %w", ls.id, ls.owner, ErrLeaseClosed)
	case c.closed.Load():
		err = fmt.Errorf("kvlease: share lease %d (%s): %w", ls.id, ls.owner, ErrPoolClosed)
	case n <= 0 || n > len(ls.blocks) || ls.first() > 0:
		err = fmt.Errorf("kvlease: share %d blocks of lease %d (%s) with %d blocks: %w", n, ls.id, ls.owner, len(ls.blocks), ErrInvalidArgument)
	default:
		for i, r := range ls.blocks[:n] {
			if !c.tab.Sealed(int32(r.ID)) {
				err = fmt.Errorf("kvlease: share block %d of lease %d (%s): not sealed, its content may still change: %w",
					i, ls.id, ls.owner, ErrInvalidArgument)
				break
			}
		}
	}
	if err != nil {
		c.unlock()
		return nil, err
	}
	nl := l.p.newLease(owner, n)
	for _, r := range ls.blocks[:n] {
		c.tab.Ref(int32(r.ID))
	}
	copy(nl.ls.blocks, ls.blocks[:n])
	c.opened(&nl.ls, n, &ev)
	c.unlock()
	ev.flush()
	return nl, nil
}

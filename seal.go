package kvlease

import (
	"fmt"
	"slices"

	"github.com/kvlease/kvlease/internal/slots"
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

// sealTokens carries what a seal says beyond the hash: the parent hash,
// the block's tokens and its extra keys; chain overrides where its KV
// event places the block in its chain (SealAs). noTokens: a
// seal with a known parent but no tokens (SealAs), which verified mode
// refuses like a plain Seal.
type sealTokens struct {
	parent   BlockHash
	tokens   []int32
	chain    chainPlace
	noTokens bool
	extra    []string // the block's extra keys (mixed into its hash), owned by the seal from now on
	// SealAs only: what the block's record says beyond its place.
	// plain: the parent is not known (a plain Seal's record); ns: its
	// namespace ("": the lease's tenant's); adapter: its adapter (the
	// zero Adapter: the lease's tag).
	plain   bool
	ns      string
	adapter Adapter
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
	if st != nil || c.verified { // (a plain Seal on a plain pool has nothing to check)
		if err := c.checkSealTokens(st); err != nil {
			return fmt.Errorf("kvlease: seal block %d of lease %d (%s): %w", i, l.id, l.owner, err)
		}
		if st != nil && st.ns != "" && l.tenant != 0 {
			// A tenant's lease seals only under the tenant's namespace.
			if own := c.tenants[l.tenant].ns; own != nil && own.ns != st.ns {
				return fmt.Errorf("kvlease: seal block %d of lease %d (%s) of tenant %q under namespace %q, not the tenant's: %w",
					i, l.id, l.owner, c.tenants[l.tenant].name, st.ns, ErrInvalidArgument)
			}
		}
	}
	c.tab.Seal(int32(id))
	if l.extra != nil || c.ret != nil || c.tab.RetentionUsed() {
		c.tab.SetRetention(int32(id), uint8(c.retentionOf(l, id)))
	}
	c.pre[id].hash = h
	if c.records {
		// (Only verification, the KV events and SealInfo read the record:
		// a pool without them does not write it. BenchmarkEvictionChurn.)
		c.recordSeal(l, i, id, st)
	}
	if !c.index.insert(h, id) {
		c.stats.duplicateSeals++
		if c.obs != nil {
			ev.add(c.obs, Event{Kind: EventDuplicateSeal, Owner: l.owner, Lease: l.id, Blocks: 1})
		}
		return nil
	}
	c.tab.SetIndexed(int32(id), true)
	if c.kv != nil {
		c.kv.sealed(c, id, h)
	}
	return nil
}

// SealTokens seals block i with the hash of its tokens under parent (the
// previous block's hash, or the namespace seed for the first block) and
// returns that hash: HashBlock's (with its extra keys), or the pool's Hasher (WithHasher;
// its error is returned wrapped and nothing is sealed). It is Seal with
// the hash computed for you, and the only way to seal in verified mode
// (WithVerifiedPrefix), where the pool keeps parent and tokens to check
// every later hit against. In every mode tokens must be exactly one full
// block (the configured block tokens): a partial block is never sealed
// (its KV will still grow), and a pool without WithBlockTokens or
// WithVerifiedPrefix refuses SealTokens. Both wrap ErrInvalidArgument;
// other errors as Seal.
//
// extra are the block's extra keys (see ExtraKey), none for most blocks:
// they are mixed into its hash, recorded with the seal (verified lookups
// compare them) and published with its BlockStored event. The pool keeps
// its own copy of them.
func (l *Lease[R]) SealTokens(i int, parent BlockHash, tokens []int32, extra ...string) (BlockHash, error) {
	h, err := l.ls.c.hashBlock(parent, tokens, extra)
	if err != nil {
		return 0, err
	}
	st := &sealTokens{parent: parent, tokens: tokens}
	if len(extra) > 0 {
		st.extra = slices.Clone(extra)
	}
	return h, l.ls.seal(i, h, st)
}

// SealAs seals block i as s says: findable as s.Hash, with s.Parent as
// its recorded parent when s.HasParent (s.Chained: the parent is a block,
// so the block's KV event names it, whatever i is; otherwise the block
// starts its chain) and s.Tokens as its tokens when given. It is how a
// copy of a block in another pool is sealed as its original was: read
// the original's record with Pool.SealInfo, seal the copy with SealAs,
// and both pools' records (and KV events) agree.
//
// Tokens are optional: without them the block is sealed by hash, as
// Seal does, but with its parent recorded (a plain Seal knows the parent
// only when the lease's previous block is sealed). With them the pool
// checks what SealTokens checks (a full block; the pool needs
// WithBlockTokens) and that its hash of Parent and Tokens is s.Hash.
// Without s.HasParent, SealAs is Seal(i, s.Hash) and s.Tokens must be
// nil. Verified mode needs the tokens. Errors wrap ErrInvalidArgument for
// a refused s; others as Seal.
func (l *Lease[R]) SealAs(i int, s SealInfo) error {
	if s.Adapter.Name == "" && s.Adapter.ID != 0 {
		return fmt.Errorf("kvlease: seal block %d as %016x: adapter id %d without a name: %w", i, uint64(s.Hash), s.Adapter.ID, ErrInvalidArgument)
	}
	var extra []string
	if len(s.ExtraKeys) > 0 {
		extra = slices.Clone(s.ExtraKeys)
	}
	tagged := s.Namespace != "" || s.Adapter != (Adapter{}) || extra != nil
	if !s.HasParent {
		if s.Tokens != nil {
			return fmt.Errorf("kvlease: seal block %d as %016x: tokens without a parent: %w", i, uint64(s.Hash), ErrInvalidArgument)
		}
		if !tagged {
			return l.ls.seal(i, s.Hash, nil)
		}
		return l.ls.seal(i, s.Hash, &sealTokens{plain: true, noTokens: true, extra: extra, ns: s.Namespace, adapter: s.Adapter})
	}
	st := &sealTokens{parent: s.Parent, tokens: s.Tokens, chain: chainStartAny, noTokens: s.Tokens == nil,
		extra: extra, ns: s.Namespace, adapter: s.Adapter}
	if s.Chained {
		st.chain = chainChild
	}
	if s.Tokens != nil && len(s.Tokens) == l.ls.c.cfg.blockTokens {
		h, err := l.ls.c.hashBlock(s.Parent, s.Tokens, extra)
		if err != nil {
			return err
		}
		if h != s.Hash {
			return fmt.Errorf("kvlease: seal block %d as %016x: its parent and tokens hash to %016x: %w",
				i, uint64(s.Hash), uint64(h), ErrInvalidArgument)
		}
	}
	return l.ls.seal(i, s.Hash, st)
}

// SealInfo is how a block was sealed, as its pool records it (see
// WithSealRecords) and Pool.SealInfo reports it; Lease.SealAs seals a
// block the same way.
type SealInfo struct {
	// Hash is the hash the block was sealed with.
	Hash BlockHash
	// Parent is the hash it was sealed under (the previous block's hash,
	// or the namespace seed for a chain's first block), when HasParent.
	// SealTokens and SealAs with a parent know
	// it; a plain Seal knows it only when the lease's previous block was
	// sealed (that block's hash).
	Parent    BlockHash
	HasParent bool
	// Chained: Parent is a block (false for a chain's first block, whose
	// parent is the seed): the block's KV event names Parent.
	Chained bool
	// Tokens are the block's tokens when it was sealed with them, else
	// nil.
	Tokens []int32
	// Namespace is the public namespace identifier of the block's tenant
	// (Tenant.Namespace), "" for none; Adapter is the adapter it was
	// tagged with (Lease.SetAdapter), the zero Adapter for the base
	// model; ExtraKeys are its extra keys (mixed into its hash), nil for
	// none. SealAs records all three with the copy (a lease of a tenant
	// with a namespace seals only under that namespace), so its KV events
	// publish them as the original's did.
	Namespace string
	Adapter   Adapter
	ExtraKeys []string
}

// SealInfo reports how the block ref names was sealed, its tokens copied
// into tokens' array: SealInfo.Tokens is append(tokens[:0], the block's
// tokens...), or nil when it was sealed without. Pass a buffer with room
// for a block to allocate nothing (extra keys, rare, are copied into a
// fresh slice). ok is false when the pool keeps no seal records (see
// WithSealRecords), when ref is outside the pool or stale (the slot has
// moved to another generation), or when the block is not sealed.
//
// A block stays sealed while a lease holds it or the cache keeps it:
// read the record of a block you hold (an eviction hook's offered lease,
// a prefix hit) and it cannot change under you.
func (p *Pool[R]) SealInfo(ref BlockRef, tokens []int32) (info SealInfo, ok bool) {
	c := &p.core
	if !c.records || ref.ID < 0 || int(ref.ID) >= c.tab.Len() {
		return SealInfo{}, false
	}
	c.mu.Lock()
	defer c.unlock()
	id := int32(ref.ID)
	if c.tab.Gen(id) != ref.Gen || c.tab.ClassOf(id) == slots.Free || !c.tab.Sealed(id) {
		return SealInfo{}, false
	}
	r, toks := c.sealRecord(ref.ID)
	info = SealInfo{Hash: c.pre[id].hash, Parent: r.parent, HasParent: r.known, Chained: r.chained,
		Namespace: r.ns(), ExtraKeys: slices.Clone(r.keys())}
	if r.adapter != 0 {
		info.Adapter = c.adapters[r.adapter]
	}
	if toks != nil {
		info.Tokens = append(tokens[:0], toks...)
	}
	return info, true
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
	nl.ls.tenant = ls.tenant // its Extends are charged as this lease's
	for _, r := range ls.blocks[:n] {
		c.tab.Ref(int32(r.ID))
	}
	copy(nl.ls.blocks, ls.blocks[:n])
	c.opened(&nl.ls, n, &ev)
	c.unlock()
	ev.flush()
	return nl, nil
}

// sealRecord is how a block was sealed: one per slot, written when it is
// sealed (in a pool with verified mode, KV events or WithSealRecords:
// nothing else reads it) and meaningful while it stays sealed (a slot
// that is unsealed keeps a stale record nobody reads). Verified mode
// checks hits against it, the KV events (a stored event, a snapshot) are
// made from it, and Pool.SealInfo reports it (the tiers copy a block's
// record with it): the one record of a block's parent and tokens, read
// through core.sealRecord.
type sealRecord struct {
	// parent is the hash the block was sealed under: the previous block's
	// hash, or the namespace seed for a chain's first block.
	parent BlockHash
	// known: parent is known (SealTokens and SealAs give it; a plain
	// Seal knows it only when the lease's previous block is sealed).
	known bool
	// chained: parent is a block, so the block's KV event names it (false
	// for a chain's first block: the seed is not a block).
	chained bool
	// tokens: the block's tokens are in the pool's token arena.
	tokens bool
	// adapter: the sealing lease's adapter (Lease.SetAdapter), an index
	// into the pool's interned adapters (0: none).
	adapter int32
	// extra: the block's extra keys and their digest, and its
	// namespace; nil for none (a multimodal or a tenant's block: a
	// pointer keeps the record small, and a tenant's blocks without
	// extra keys share its tenantRecord's).
	extra *extraKeys
}

// extraKeys are a sealed block's extra keys (SequenceSpec.Extra) and its
// namespace (Tenant.Namespace). Never written once a record points to it.
type extraKeys struct {
	keys   []string
	digest BlockHash // extraDigest(keys)
	ns     string
}

// ns is the record's namespace ("": none).
func (r *sealRecord) ns() string {
	if r.extra == nil {
		return ""
	}
	return r.extra.ns
}

// extraDigest is the record's extra keys' digest (0: none).
func (r *sealRecord) extraDigest() BlockHash {
	if r.extra == nil {
		return 0
	}
	return r.extra.digest
}

// keys is the record's extra keys (nil: none).
func (r *sealRecord) keys() []string {
	if r.extra == nil {
		return nil
	}
	return r.extra.keys
}

// recordSeal writes the seal record of block i of l (slot id), sealed
// with st (nil for a plain Seal). Called with c.mu held, after
// checkSealTokens, in a pool whose records someone reads (c.records).
func (c *core) recordSeal(l *lease, i int, id BlockID, st *sealTokens) {
	var r sealRecord
	if st != nil && !st.plain {
		r.parent, r.known = st.parent, true
		r.chained = st.chain == chainChild || (st.chain == chainByLease && i > 0)
		if bt := c.cfg.blockTokens; bt > 0 && len(st.tokens) == bt {
			if c.sealTok == nil {
				c.sealTok = make([]int32, c.tab.Len()*bt)
			}
			copy(c.sealTok[int(id)*bt:(int(id)+1)*bt], st.tokens)
			r.tokens = true
		}
	} else if i > 0 {
		// A plain Seal: block 0 of a lease starts its chain; a later block
		// follows the block before it in the lease when that one is sealed.
		if pid := l.blocks[i-1].ID; c.tab.Sealed(int32(pid)) {
			r.parent, r.known, r.chained = c.pre[pid].hash, true, true
		}
	}
	if l.extra != nil {
		r.adapter = l.extra.tagIx
	}
	var ns *extraKeys
	if l.tenant != 0 {
		ns = c.tenants[l.tenant].ns
	}
	if st != nil {
		if st.adapter != (Adapter{}) {
			r.adapter = c.internAdapter(st.adapter)
		}
		if len(st.extra) > 0 || (st.ns != "" && (ns == nil || ns.ns != st.ns)) {
			k := &extraKeys{ns: st.ns}
			if k.ns == "" && ns != nil {
				k.ns = ns.ns
			}
			if len(st.extra) > 0 {
				k.keys, k.digest = st.extra, extraDigest(st.extra)
			}
			ns = k
		}
	}
	r.extra = ns
	c.seals[id] = r
}

// sealRecord returns how slot id was sealed and its tokens (a view of the
// arena, nil when sealed without them). Meaningful while the slot is
// sealed. Called with c.mu held.
func (c *core) sealRecord(id BlockID) (sealRecord, []int32) {
	r := c.seals[id]
	if !r.tokens {
		return r, nil
	}
	bt := c.cfg.blockTokens
	return r, c.sealTok[int(id)*bt : (int(id)+1)*bt : (int(id)+1)*bt]
}

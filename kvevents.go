package kvlease

import (
	"fmt"
	"slices"
	"sync"
)

// KV events tell a cache-aware router which prefix blocks a pool can serve.
// Their fields follow vLLM's BlockStored / BlockRemoved / AllBlocksCleared
// so an adapter to its wire format is a thin layer:
//
//	KVBlockStored      → BlockStored{block_hashes: [BlockHash], parent_block_hash: ParentBlockHash
//	                     (None unless HasParent), token_ids: TokenIDs, block_size: BlockSize,
//	                     extra_keys: [ExtraKeys, plus Namespace last on a chain's first block]}
//	KVBlockRemoved     → BlockRemoved{block_hashes: [BlockHash]}
//	KVAllBlocksCleared → AllBlocksCleared{}
//
// (an adapter may batch consecutive events of one kind into one list).
// A block is "stored" when it becomes findable (Seal) and "removed" when it
// stops being findable (eviction, ResetCache), not when a lease releases it:
// an unreferenced cached block is still served.
//
// The allocator never waits for a consumer: events go into a bounded ring.
// When it is full the newest events are dropped and counted; the consumer
// sees a gap in Seq and a non-zero Dropped from DrainKVEvents, and should
// resynchronise from SnapshotKVBlocks.
//
// The first block of a chain (block 0 of the lease that seals it) has no
// parent, whether it was sealed with Seal or SealTokens: HasParent is false
// and a wire adapter sends parent_block_hash None, which is what routers
// expect for a chain start (llm-d's indexer looks a non-nil parent up among
// the blocks it knows and drops the event when it is missing, and the
// namespace seed is never a block it knows). Every later block sealed with
// SealTokens names its parent; one sealed with Seal names it when the block
// before it in the lease is sealed. SealAs says where the block sits
// in its chain explicitly, whatever its place in the lease.

// KVEventKind names a KV event.
type KVEventKind uint8

// The KV events.
const (
	KVBlockStored KVEventKind = iota + 1
	KVBlockRemoved
	KVAllBlocksCleared
)

func (k KVEventKind) String() string {
	switch k {
	case KVBlockStored:
		return "BlockStored"
	case KVBlockRemoved:
		return "BlockRemoved"
	case KVAllBlocksCleared:
		return "AllBlocksCleared"
	}
	return "KVEvent(?)"
}

// KVEvent is one change to the set of findable prefix blocks.
type KVEvent struct {
	Seq             uint64 // 1, 2, 3, … per pool; a gap means events were dropped
	Kind            KVEventKind
	BlockHash       BlockHash // the block stored or removed
	ParentBlockHash BlockHash // stored: the parent's hash (zero for the first block of a chain)
	HasParent       bool      // stored: ParentBlockHash is known (false for the first block of a chain)
	TokenIDs        []int32   // stored via SealTokens: a copy of the block's tokens
	BlockSize       int       // stored: tokens per block (WithBlockTokens), 0 if not configured
	// Stored: the adapter of the lease that sealed the block
	// (Lease.SetAdapter); LoraName "" means the base model.
	LoraID   int
	LoraName string
	// Stored: the block's extra keys (mixed into its hash), nil if none.
	// Shared, read only.
	ExtraKeys []string
	// Stored: the public namespace identifier of the tenant whose lease
	// sealed the block (Tenant.Namespace), or the one its copy was sealed
	// under (SealInfo.Namespace); "" for none. The events package sends it
	// as the last extra key of a chain's first block.
	Namespace string
}

// WithKVEvents turns on KV events with a ring of buffer events (1 to 2²⁴).
func WithKVEvents(buffer int) Option {
	return newOption(fmt.Sprintf("WithKVEvents(%d)", buffer), func(c *config) error {
		if buffer <= 0 || buffer > maxKVEvents {
			return fmt.Errorf("kvlease: KV event buffer %d must be in [1, %d]: %w", buffer, maxKVEvents, ErrInvalidArgument)
		}
		if err := c.claim("KV event buffer", c.kvEvents == buffer); err != nil {
			return err
		}
		c.kvEvents = buffer
		return nil
	})
}

// maxKVEvents bounds the ring WithKVEvents allocates up front.
const maxKVEvents = 1 << 24

// kvEventLog is the bounded ring of KV events, guarded by the pool's mutex.
// A drain swaps the ring (and its token area) with a spare under the
// pool's mutex, an O(1) critical section, and copies the events out of
// the swapped-out ring after unlocking, so a consumer never holds the
// allocator up for longer than the swap; drainMu keeps a second drain from
// swapping back a ring the first is still reading.
type kvEventLog struct {
	ring    []KVEvent
	spare   []KVEvent
	drainMu sync.Mutex
	head, n int
	seq     uint64 // last sequence number given out
	dropped uint64 // since the last drain
	ready   chan struct{}
	// Tokens are copied, never allocated, on the allocator's path: a
	// stored event's into ringTok at its ring index (bt tokens each:
	// SealTokens takes exactly one block), allocated at the first
	// SealTokens. Drains copy them out for their caller. What a snapshot
	// re-announces (parent, tokens) is the pool's seal record.
	bt                int
	ringTok, spareTok []int32
}

func newKVEventLog(n int) *kvEventLog {
	return &kvEventLog{ring: make([]KVEvent, n), spare: make([]KVEvent, n), ready: make(chan struct{}, 1)}
}

func (k *kvEventLog) push(e KVEvent) {
	k.seq++
	e.Seq = k.seq
	if k.n == len(k.ring) {
		k.dropped++
		return
	}
	k.ring[(k.head+k.n)%len(k.ring)] = e
	k.n++
	// The hint is level-triggered (drain until empty after each
	// receive), so only the push into an empty ring needs to send it: a
	// non-empty ring already has one pending or being served.
	if k.n == 1 {
		select {
		case k.ready <- struct{}{}:
		default:
		}
	}
}

// storedEvent is the KVBlockStored event of slot id, findable as h,
// made from its seal record; tokens is the record's view of the arena.
func storedEvent(c *core, id BlockID, h BlockHash) (KVEvent, []int32) {
	r, tokens := c.sealRecord(id)
	e := KVEvent{Kind: KVBlockStored, BlockHash: h, HasParent: r.chained, BlockSize: c.cfg.blockTokens,
		ExtraKeys: r.keys(), Namespace: r.ns()}
	if r.chained {
		e.ParentBlockHash = r.parent
	}
	if r.adapter != 0 {
		a := c.adapters[r.adapter]
		e.LoraID, e.LoraName = a.ID, a.Name
	}
	return e, tokens
}

// sealed records the KV event of slot id becoming findable as h. Called
// with c.mu held, after its seal record is written.
func (k *kvEventLog) sealed(c *core, id BlockID, h BlockHash) {
	e, tokens := storedEvent(c, id, h)
	if tokens != nil {
		if k.ringTok == nil {
			k.bt = len(tokens)
			k.ringTok = make([]int32, len(k.ring)*k.bt)
			k.spareTok = make([]int32, len(k.ring)*k.bt)
		}
		if k.n < len(k.ring) { // else push drops it
			j := (k.head + k.n) % len(k.ring)
			e.TokenIDs = k.ringTok[j*k.bt : (j+1)*k.bt : (j+1)*k.bt]
			copy(e.TokenIDs, tokens)
		}
	}
	k.push(e)
}

func (k *kvEventLog) removed(h BlockHash) { k.push(KVEvent{Kind: KVBlockRemoved, BlockHash: h}) }

func (k *kvEventLog) cleared() { k.push(KVEvent{Kind: KVAllBlocksCleared}) }

// DrainKVEvents appends every buffered KV event to dst in order and
// returns it (no allocation when dst has room), with the number of events
// dropped since the last drain because the ring was full. dropped > 0
// means the consumer missed changes: resynchronise with SnapshotKVBlocks.
// Without WithKVEvents it returns dst and 0.
//
// A consumer that drains in a loop passes the same slice back, cut to
// length zero, so a steady drain allocates nothing for the events
// themselves (only one token copy per drain that holds stored events):
//
//	buf := make([]kvlease.KVEvent, 0, 1024)
//	for range tick.C {
//		var dropped uint64
//		buf, dropped = pool.DrainKVEvents(buf[:0])
//		if dropped > 0 {
//			resync(pool.SnapshotKVBlocks(nil)) // a gap: start over from a snapshot
//		}
//		publish(buf) // done with buf before the next drain overwrites it
//	}
//
// The next drain overwrites the events in buf; their TokenIDs are copies
// and stay valid after it, so a consumer may keep those.
func (p *Pool[R]) DrainKVEvents(dst []KVEvent) (events []KVEvent, dropped uint64) {
	c := &p.core
	if c.kv == nil {
		return dst, 0
	}
	k := c.kv
	k.drainMu.Lock()
	defer k.drainMu.Unlock()
	c.mu.Lock()
	ring, head, n := k.ring, k.head, k.n
	k.ring, k.spare = k.spare, k.ring
	k.ringTok, k.spareTok = k.spareTok, k.ringTok
	k.head, k.n = 0, 0
	dropped, k.dropped = k.dropped, 0
	c.unlock()
	// Stored events' tokens live in the swapped-out token area, written
	// again only after the next swap: copy them out, in one allocation.
	total := 0
	for i := range n {
		total += len(ring[(head+i)%len(ring)].TokenIDs)
	}
	var tok []int32
	if total > 0 {
		tok = make([]int32, 0, total)
	}
	for i := range n {
		j := (head + i) % len(ring)
		e := ring[j]
		if n := len(e.TokenIDs); n > 0 {
			lo := len(tok)
			tok = append(tok, e.TokenIDs...)
			e.TokenIDs = tok[lo : lo+n : lo+n]
		}
		dst = append(dst, e)
		ring[j] = KVEvent{}
	}
	return dst, dropped
}

// KVEventsReady returns a channel that receives a value when events are
// buffered (level-triggered hint: drain until empty after each receive).
// It is nil without WithKVEvents.
func (p *Pool[R]) KVEventsReady() <-chan struct{} {
	if p.kv == nil {
		return nil
	}
	return p.kv.ready
}

// SnapshotKVBlocks appends to dst one KVBlockStored event for every
// findable block, each with the parent and tokens its own stored event
// carried (Seq is zero), and returns it with the sequence number of the
// last event the snapshot includes. A parent that is itself findable comes
// before its children, so a consumer that resolves parents as it goes (as
// llm-d's indexer does) can replay the list in order. A consumer that lost
// events clears its view, applies the snapshot, and then only events with
// a larger Seq. Without WithKVEvents it returns dst and 0: nothing was
// recorded.
func (p *Pool[R]) SnapshotKVBlocks(dst []KVEvent) (seq uint64, blocks []KVEvent) {
	c := &p.core
	if c.kv == nil {
		return 0, dst
	}
	c.mu.Lock()
	defer c.unlock()
	k := c.kv
	type recAt struct {
		e      KVEvent
		tokens []int32
	}
	rec := func(h BlockHash) (recAt, bool) {
		id, ok := c.index.find(h)
		if !ok {
			return recAt{}, false
		}
		e, tokens := storedEvent(c, id, h)
		return recAt{e, tokens}, true
	}
	// Every emitted block's tokens, copied out of the seal records: capacity
	// for all of them up front, so the slices handed out stay put.
	var tok []int32
	if c.sealTok != nil {
		tok = make([]int32, 0, c.index.len()*c.cfg.blockTokens)
	}
	hashes := make([]BlockHash, 0, c.index.len())
	for h := range c.index.all() {
		hashes = append(hashes, h)
	}
	slices.Sort(hashes) // deterministic order among unrelated chains
	done := make(map[BlockHash]bool, len(hashes))
	var stack []recAt
	for _, h := range hashes {
		// Walk up to the oldest findable ancestor not yet emitted, then
		// emit back down (bounded by the number of findable blocks, so a
		// parent cycle from colliding hashes cannot loop).
		for r, ok := rec(h); ok && !done[r.e.BlockHash] && len(stack) <= len(hashes); {
			done[r.e.BlockHash] = true
			stack = append(stack, r)
			if !r.e.HasParent {
				break
			}
			r, ok = rec(r.e.ParentBlockHash)
		}
		for j := len(stack) - 1; j >= 0; j-- {
			r := stack[j]
			if r.tokens != nil {
				lo := len(tok)
				tok = append(tok, r.tokens...)
				r.e.TokenIDs = tok[lo:len(tok):len(tok)]
			}
			dst = append(dst, r.e)
		}
		stack = stack[:0]
	}
	return k.seq, dst
}

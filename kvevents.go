package kvlease

import (
	"fmt"
	"slices"
)

// KV events tell a cache-aware router which prefix blocks a pool can serve.
// Their fields follow vLLM's BlockStored / BlockRemoved / AllBlocksCleared
// so an adapter to its wire format is a thin layer:
//
//	KVBlockStored      → BlockStored{block_hashes: [BlockHash], parent_block_hash: ParentBlockHash
//	                     (None unless HasParent), token_ids: TokenIDs, block_size: BlockSize}
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
// resynchronise from SnapshotKVCache.

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
	ParentBlockHash BlockHash // stored: the parent's hash (the seed for a first block)
	HasParent       bool      // stored: ParentBlockHash is known
	TokenIDs        []int32   // stored via SealTokens: a copy of the block's tokens
	BlockSize       int       // stored: tokens per block (WithBlockTokens), 0 if not configured
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
type kvEventLog struct {
	ring    []KVEvent
	head, n int
	seq     uint64 // last sequence number given out
	dropped uint64 // since the last drain
	ready   chan struct{}
}

func newKVEventLog(n int) *kvEventLog {
	return &kvEventLog{ring: make([]KVEvent, n), ready: make(chan struct{}, 1)}
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
	select {
	case k.ready <- struct{}{}:
	default:
	}
}

func (k *kvEventLog) stored(h, parent BlockHash, hasParent bool, tokens []int32, blockTokens int) {
	k.push(KVEvent{Kind: KVBlockStored, BlockHash: h, ParentBlockHash: parent, HasParent: hasParent,
		TokenIDs: slices.Clone(tokens), BlockSize: blockTokens})
}

func (k *kvEventLog) removed(h BlockHash) { k.push(KVEvent{Kind: KVBlockRemoved, BlockHash: h}) }

func (k *kvEventLog) cleared() { k.push(KVEvent{Kind: KVAllBlocksCleared}) }

// DrainKVEvents appends every buffered KV event to dst in order and
// returns it (no allocation when dst has room), with the number of events
// dropped since the last drain because the ring was full. dropped > 0
// means the consumer missed changes: resynchronise with SnapshotKVCache.
// Without WithKVEvents it returns dst and 0.
func (p *Pool[R]) DrainKVEvents(dst []KVEvent) (events []KVEvent, dropped uint64) {
	c := &p.core
	if c.kv == nil {
		return dst, 0
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	k := c.kv
	for i := range k.n {
		j := (k.head + i) % len(k.ring)
		dst = append(dst, k.ring[j])
		k.ring[j] = KVEvent{}
	}
	k.head, k.n = 0, 0
	dropped, k.dropped = k.dropped, 0
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

// SnapshotKVCache returns every findable block hash and the sequence number
// of the last event that the snapshot includes. A consumer that lost events
// replaces its view with the snapshot and then applies only events with a
// larger Seq.
func (p *Pool[R]) SnapshotKVCache() (seq uint64, hashes []BlockHash) {
	c := &p.core
	c.mu.Lock()
	defer c.mu.Unlock()
	hashes = make([]BlockHash, 0, len(c.index))
	for h := range c.index {
		hashes = append(hashes, h)
	}
	slices.Sort(hashes)
	if c.kv != nil {
		seq = c.kv.seq
	}
	return seq, hashes
}

package events

// The publisher's loops: each pool's ready signal forwarded to one
// wake-up, the drain that turns a pool's KV events into wire events
// (merging a chain's stored blocks into one BlockStored), and the send loop.

import (
	"time"

	"github.com/kvlease/kvlease"
)

// forward turns one pool's ready signal into the shared wake-up, then
// waits to be re-armed before it listens again. While the drainer is
// busy (it polls the pools every Linger on its own), nobody waits on the
// pool's signal, so the allocator's send on it only fills the channel's
// buffer: it wakes no goroutine, a cost the allocator would otherwise pay
// on every first event after a drain.
func (p *Publisher) forward(ready <-chan struct{}, rearm <-chan struct{}) {
	defer p.wg.Done()
	for {
		select {
		case <-p.ctx.Done():
			return
		case <-ready:
		}
		select {
		case p.wake <- struct{}{}:
		default:
		}
		select {
		case <-p.ctx.Done():
			return
		case <-rearm:
		}
	}
}

// rearmAll lets every forward goroutine listen to its pool again.
func (p *Publisher) rearmAll() {
	for _, s := range p.srcs {
		select {
		case s.rearm <- struct{}{}:
		default:
		}
	}
}

// drainLoop is the only goroutine that drains the pools and encodes. It
// is idle (waiting for a pool's signal) or busy: a pass that found events
// is followed by another one Linger later, without waiting for a signal,
// until a pass finds nothing; then the forward goroutines are re-armed.
func (p *Publisher) drainLoop() {
	defer p.wg.Done()
	d := drainer{p: p, enc: newBatchEncoder(p.cfg.Encoding, p.cfg.DataParallelRank)}
	retry := time.NewTicker(20 * time.Millisecond)
	defer retry.Stop()
	linger := time.NewTimer(time.Hour)
	linger.Stop()
	defer linger.Stop()
	busy := false
	for {
		var flushed chan struct{}
		wake, poll := p.wake, (<-chan time.Time)(nil)
		if busy {
			wake, poll = nil, linger.C
		}
		select {
		case <-p.ctx.Done():
			return
		case <-wake:
			if p.cfg.Linger > 0 {
				linger.Reset(p.cfg.Linger)
				select {
				case <-p.ctx.Done():
					return
				case <-linger.C:
				case flushed = <-p.flushes:
					linger.Stop()
				}
			}
		case <-poll:
		case flushed = <-p.flushes:
		case <-p.resyncQ:
			d.resync = true
		case <-retry.C:
			if !d.resync {
				continue
			}
		}
		got := d.pass()
		if flushed != nil {
			close(flushed)
		}
		if got && p.cfg.Linger > 0 {
			busy = true
			linger.Reset(p.cfg.Linger)
		} else {
			busy = false
			linger.Stop()
			p.rearmAll()
		}
	}
}

// sendLoop numbers batches, sends them and keeps them for replay.
func (p *Publisher) sendLoop() {
	defer p.wg.Done()
	var seq uint64
	for {
		select {
		case <-p.ctx.Done():
			return
		case payload := <-p.q:
			p.send(seq, payload) // queues per subscriber, never blocks
			if p.replay != nil { // kept only for a replay socket
				p.ring.add(seq, payload)
			}
			seq++
			p.batches.Add(1) // also what Flush waits for
		}
	}
}

// drainer is drainLoop's state.
type drainer struct {
	p      *Publisher
	enc    *batchEncoder
	buf    []kvlease.KVEvent
	wire   []wireEvent
	resync bool // a loss happened: clear and re-announce before anything else
	// Arenas of one pass: the wire events' hashes and tokens are slices of
	// them, valid until the events are encoded (convert's callers encode
	// before the next convert resets them).
	hashArena []uint64
	tokArena  []int32
	spans     []span
}

// span is where one wire event's hashes and tokens lie in the arenas
// while convert still appends to them.
type span struct{ hashLo, hashHi, tokLo, tokHi int }

// pass drains every source once and reports whether it found anything.
func (d *drainer) pass() (got bool) {
	p := d.p
	if !d.resync {
		for _, s := range p.srcs {
			var dropped uint64
			d.buf, dropped = s.Pool.DrainKVEvents(d.buf[:0])
			got = got || len(d.buf) > 0 || dropped > 0
			if dropped > 0 {
				p.droppedEvents.Add(dropped)
				d.resync = true
			}
			if d.resync {
				continue // every source is re-announced below
			}
			d.wire = d.convert(s, d.buf, d.wire[:0], true)
			if !d.enqueueAll(d.wire, false) {
				d.resync = true
			}
		}
		if !d.resync {
			return got
		}
	}
	d.doResync()
	return true
}

// doResync sends AllBlocksCleared and every source's snapshot, when the
// queue has room for all of it; otherwise it is retried later.
func (d *drainer) doResync() {
	p := d.p
	d.hashArena, d.tokArena, d.spans = d.hashArena[:0], d.tokArena[:0], d.spans[:0]
	d.wire = append(d.wire[:0], wireEvent{tag: tagAllBlocksCleared})
	for _, s := range p.srcs {
		// Empty the ring (and its drop count) first: every event drained
		// here is older than the snapshot taken next.
		d.buf, _ = s.Pool.DrainKVEvents(d.buf[:0])
		var seq uint64
		seq, d.buf = s.Pool.SnapshotKVBlocks(d.buf[:0])
		s.skipTo = seq
		d.wire = d.convert(s, d.buf, d.wire, false)
	}
	// Queue it all when it fits; a re-announcement larger than the whole
	// queue waits for an empty queue and then for the socket, batch by
	// batch (the drainer waits, never the allocator: pools keep buffering
	// and count what their rings drop). Otherwise retry on the ticker with
	// a fresh snapshot.
	need := (len(d.wire) + p.cfg.BatchEvents - 1) / p.cfg.BatchEvents
	wait := need > cap(p.q) && len(p.q) == 0
	if !wait && cap(p.q)-len(p.q) < need {
		return
	}
	if d.enqueueAll(d.wire, wait) {
		d.resync = false
		p.resyncs.Add(1)
	}
}

// convert appends the wire events of evs to dst, merging chains; events
// covered by the last snapshot are skipped. live says whether stored
// events without tokens count as unpublishable. The events' hashes and
// tokens live in the drainer's arenas: a merge extends the last event,
// whose hashes and tokens are always the arenas' tails.
func (d *drainer) convert(s *source, evs []kvlease.KVEvent, dst []wireEvent, live bool) []wireEvent {
	p := d.p
	if len(dst) == 0 {
		d.hashArena, d.tokArena, d.spans = d.hashArena[:0], d.tokArena[:0], d.spans[:0]
	}
	base := len(dst)
	for i := range evs {
		e := &evs[i]
		if e.Seq != 0 && e.Seq <= s.skipTo {
			continue
		}
		var last *wireEvent
		var lastSpan *span
		if len(dst) > base {
			last, lastSpan = &dst[len(dst)-1], &d.spans[len(d.spans)-1]
		}
		switch e.Kind {
		case kvlease.KVBlockStored:
			if len(e.TokenIDs) == 0 {
				if live {
					p.unpublishable.Add(1)
				}
				continue
			}
			bs := e.BlockSize
			if bs == 0 {
				bs = len(e.TokenIDs)
			}
			loraName, loraID := s.LoraName, s.LoraID
			if e.LoraName != "" { // the sealing lease's adapter (Lease.SetAdapter)
				loraName, loraID = e.LoraName, e.LoraID
			}
			if last != nil && last.tag == tagBlockStored && e.HasParent && last.medium == s.Medium &&
				last.loraName == loraName && last.loraID == loraID &&
				d.hashArena[lastSpan.hashHi-1] == uint64(e.ParentBlockHash) && last.blockSize == bs &&
				lastSpan.hashHi-lastSpan.hashLo < maxMergedBlocks {
				// The next block of the chain: one more in the same event,
				// with or without extra keys, as vLLM sends the blocks a
				// request filled (extra_keys then holds one entry per
				// block, nil for a block without).
				if len(e.ExtraKeys) > 0 || last.extraKeys != nil {
					if last.extraKeys == nil {
						last.extraKeys = make([][]string, lastSpan.hashHi-lastSpan.hashLo, lastSpan.hashHi-lastSpan.hashLo+1)
					}
					last.extraKeys = append(last.extraKeys, nilIfEmpty(e.ExtraKeys))
				}
				d.hashArena = append(d.hashArena, uint64(e.BlockHash))
				d.tokArena = append(d.tokArena, e.TokenIDs...)
				lastSpan.hashHi, lastSpan.tokHi = len(d.hashArena), len(d.tokArena)
				continue
			}
			sp := span{hashLo: len(d.hashArena), tokLo: len(d.tokArena)}
			d.hashArena = append(d.hashArena, uint64(e.BlockHash))
			d.tokArena = append(d.tokArena, e.TokenIDs...)
			sp.hashHi, sp.tokHi = len(d.hashArena), len(d.tokArena)
			d.spans = append(d.spans, sp)
			we := wireEvent{tag: tagBlockStored,
				parent: uint64(e.ParentBlockHash), hasParent: e.HasParent, blockSize: bs,
				medium: s.Medium, loraName: loraName, loraID: loraID}
			if keys := chainStartKeys(e); len(keys) > 0 {
				we.extraKeys = [][]string{keys} // later blocks of the chain append theirs
			}
			dst = append(dst, we)
		case kvlease.KVBlockRemoved:
			if last != nil && last.tag == tagBlockRemoved && last.medium == s.Medium &&
				lastSpan.hashHi-lastSpan.hashLo < maxMergedBlocks {
				d.hashArena = append(d.hashArena, uint64(e.BlockHash))
				lastSpan.hashHi = len(d.hashArena)
				continue
			}
			sp := span{hashLo: len(d.hashArena), tokLo: len(d.tokArena)}
			d.hashArena = append(d.hashArena, uint64(e.BlockHash))
			sp.hashHi, sp.tokHi = len(d.hashArena), len(d.tokArena)
			d.spans = append(d.spans, sp)
			dst = append(dst, wireEvent{tag: tagBlockRemoved, medium: s.Medium})
		case kvlease.KVAllBlocksCleared:
			d.spans = append(d.spans, span{hashLo: len(d.hashArena), hashHi: len(d.hashArena),
				tokLo: len(d.tokArena), tokHi: len(d.tokArena)})
			dst = append(dst, wireEvent{tag: tagAllBlocksCleared})
		}
	}
	// The arenas are complete for these events: point them at their spans
	// (full slice expressions, so nothing can append into a neighbour).
	spans := d.spans[len(d.spans)-(len(dst)-base):]
	for j := range dst[base:] {
		sp, ev := spans[j], &dst[base+j]
		if sp.hashHi > sp.hashLo {
			ev.hashes = d.hashArena[sp.hashLo:sp.hashHi:sp.hashHi]
		}
		if sp.tokHi > sp.tokLo {
			ev.tokens = d.tokArena[sp.tokLo:sp.tokHi:sp.tokHi]
		}
	}
	return dst
}

// chainStartKeys is the extra keys a stored event's block goes on the
// wire with when it starts a wire event: its own, and, for the first
// block of a chain (no parent) of a tenant with a namespace, the
// namespace identifier last. That is where vLLM puts a request's
// cache_salt, and what llm-d's indexer mixes into the block's key: its
// keys for the whole chain then differ between tenants whose prompts
// are the same. A block with a parent needs none (its key follows its
// parent's); an event without a namespace is as it always was.
func chainStartKeys(e *kvlease.KVEvent) []string {
	if e.Namespace == "" || e.HasParent {
		return e.ExtraKeys
	}
	keys := make([]string, 0, len(e.ExtraKeys)+1)
	return append(append(keys, e.ExtraKeys...), e.Namespace)
}

// nilIfEmpty is keys, or nil when there are none: a block without extra
// keys is nil in extra_keys.
func nilIfEmpty(keys []string) []string {
	if len(keys) == 0 {
		return nil
	}
	return keys
}

// maxMergedBlocks bounds one merged event (and so one message).
const maxMergedBlocks = 1024

// enqueueAll encodes evs into batches of at most BatchEvents and queues
// them, without waiting unless wait; false if a batch found the queue
// full (it and the rest are dropped and counted) or the publisher closed.
func (d *drainer) enqueueAll(evs []wireEvent, wait bool) bool {
	p := d.p
	for len(evs) > 0 {
		n := min(len(evs), p.cfg.BatchEvents)
		chunk := evs[:n]
		evs = evs[n:]
		now := time.Now()
		ts := float64(now.UnixNano()) / 1e9
		payload := d.enc.encode(ts, chunk)
		queued := false
		if wait {
			select {
			case <-p.ctx.Done():
				return false
			case p.q <- payload:
				queued = true
			}
		} else {
			select {
			case p.q <- payload:
				queued = true
			default:
			}
		}
		if !queued {
			p.droppedBatches.Add(1 + uint64((len(evs)+p.cfg.BatchEvents-1)/p.cfg.BatchEvents))
			return false
		}
		p.enqueued.Add(1)
		p.events.Add(uint64(len(chunk)))
		blocks := 0
		for i := range chunk {
			blocks += len(chunk[i].hashes)
		}
		p.blocks.Add(uint64(blocks)) // one atomic add per batch, not per event
	}
	return true
}

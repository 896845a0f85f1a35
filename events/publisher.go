package events

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"go.uber.org/atomic"

	"github.com/kvlease/kvlease"
)

// ErrInvalidConfig is wrapped by NewPublisher's errors for a configuration
// it refuses (no endpoint, no source, a negative size). It wraps
// kvlease.ErrInvalidArgument, so either sentinel matches with errors.Is.
var ErrInvalidConfig = fmt.Errorf("events: invalid configuration: %w", kvlease.ErrInvalidArgument)

// ErrClosed is returned by Flush after Close.
var ErrClosed = errors.New("events: publisher closed")

// KVEventSource is what a Publisher reads from: a *kvlease.Pool of any
// region type created with kvlease.WithKVEvents.
type KVEventSource interface {
	DrainKVEvents(dst []kvlease.KVEvent) ([]kvlease.KVEvent, uint64)
	KVEventsReady() <-chan struct{}
	SnapshotKVBlocks(dst []kvlease.KVEvent) (uint64, []kvlease.KVEvent)
}

// Source is one pool whose KV events a Publisher forwards.
type Source struct {
	Pool KVEventSource
	// Medium is sent with every event of this pool: "GPU" when empty;
	// tiers use "GPU", "CPU" and "DISK".
	Medium string
	// LoraName, when set, is sent as lora_name with LoraID as lora_id
	// (llm-d then keys the blocks by the adapter's name instead of the
	// model's). A block sealed by a lease with an adapter
	// (kvlease.Lease.SetAdapter) is sent with that adapter's instead.
	LoraName string
	LoraID   int
}

// Defaults of Config.
const (
	DefaultHWM           = 100_000
	DefaultReplayBatches = 10_000
	DefaultQueue         = 4096
	DefaultBatchEvents   = 512
	DefaultLinger        = time.Millisecond
)

// Config configures a Publisher. Only Endpoint is required.
type Config struct {
	// Endpoint of the PUB socket. Following vLLM, the socket binds when the
	// endpoint contains "*" or "::" or is ipc:// or inproc://, and
	// connects otherwise (a router that binds and lets engines dial in).
	// tcp://*:PORT binds every interface; tcp://127.0.0.1:0 is not a bind
	// under that rule, use Bind to force one.
	Endpoint string
	// Bind forces binding (true) whatever the endpoint looks like.
	Bind bool
	// ReplayEndpoint, when set, is bound as a ROUTER socket that replays
	// the last ReplayBatches batches: a request [id, "", start_seq (8 bytes
	// big-endian)] is answered [id, "", topic, seq, payload] per batch
	// with seq ≥ start_seq, then [id, "", "", 0xFF×8, ""].
	ReplayEndpoint string
	// Topic of every message; "kv@<Pod>@<Model>" when empty.
	Topic      string
	Pod, Model string
	// Encoding of events: MapEncoding (default) or ArrayEncoding.
	Encoding Encoding
	// DataParallelRank is the batch's third field.
	DataParallelRank int
	// HWM is the PUB socket's high-water mark in messages (DefaultHWM).
	HWM int
	// ReplayBatches is how many batches the replay socket keeps
	// (DefaultReplayBatches).
	ReplayBatches int
	// Queue is how many encoded batches may wait for the socket
	// (DefaultQueue); a batch that finds it full is dropped and counted,
	// and the publisher resynchronises (see Publisher).
	Queue int
	// BatchEvents caps the events of one batch (DefaultBatchEvents).
	BatchEvents int
	// Linger is how long the publisher lets events gather after a pool
	// signals the first ones, before it drains the pools: fewer, larger
	// batches and fewer trips through the pools' locks, for at most this
	// much latency (DefaultLinger; negative: drain at once). Flush does
	// not wait for it.
	Linger time.Duration

	sendHook func(zmq4.Msg) error // tests: replaces the PUB socket's Send
}

// Stats counts what a Publisher did.
type Stats struct {
	Batches        uint64 // batches handed to the PUB socket
	Events         uint64 // events in those batches (merged chains count as one)
	Blocks         uint64 // block hashes announced stored or removed
	DroppedBatches uint64 // batches dropped because the queue to the socket was full
	DroppedEvents  uint64 // events the pools' rings dropped before they were drained
	Unpublishable  uint64 // stored events without tokens (routers key blocks by tokens)
	Resyncs        uint64 // AllBlocksCleared + snapshot re-announcements after a loss
}

// Publisher forwards the KV events of one or more pools to a ZeroMQ PUB
// socket in vLLM's wire format:
//
//	frames  [topic, seq, payload]       seq: 8 bytes big-endian, batches from 0
//	payload [ts float64, events, data_parallel_rank]
//
// Stored events of one chain that follow each other are merged into one
// BlockStored; removals that follow each other into one BlockRemoved.
//
// The publisher never blocks the allocator: pools buffer events in their
// own bounded rings (a full ring drops and counts), a goroutine drains
// them, and encoded batches wait in a bounded queue for the socket. When
// events are lost on the way, either because a pool's ring overflowed or
// because a slow socket filled the queue, the publisher sends
// AllBlocksCleared and then re-announces every findable block of every
// source from SnapshotKVBlocks, so a subscriber converges on the truth.
//
// Stored events without tokens (Seal rather than SealTokens) are not sent:
// routers compute their keys from tokens and drop such events. They are
// counted in Stats.Unpublishable.
type Publisher struct {
	cfg     Config
	topic   []byte
	srcs    []*source
	pub     zmq4.Socket
	replay  zmq4.Socket
	ctx     context.Context
	cancel  context.CancelFunc
	wake    chan struct{}
	q       chan []byte
	flushes chan chan struct{}
	resyncQ chan struct{}
	wg      sync.WaitGroup
	closeMu sync.Mutex
	closed  bool

	// send writes one message to the PUB socket (replaced in tests).
	send func(zmq4.Msg) error

	ring replayRing

	batches, events, blocks, droppedBatches, droppedEvents, unpublishable, resyncs atomic.Uint64
	enqueued, sent                                                                 atomic.Uint64
}

type source struct {
	Source
	skipTo uint64 // events with Seq ≤ skipTo are in the last snapshot sent
}

// NewPublisher opens the sockets and starts forwarding the sources' events
// until Close.
func NewPublisher(cfg Config, sources ...Source) (*Publisher, error) {
	if cfg.Endpoint == "" {
		return nil, fmt.Errorf("events: no endpoint: %w", ErrInvalidConfig)
	}
	if len(sources) == 0 {
		return nil, fmt.Errorf("events: no source: %w", ErrInvalidConfig)
	}
	if cfg.HWM < 0 || cfg.ReplayBatches < 0 || cfg.Queue < 0 || cfg.BatchEvents < 0 {
		return nil, fmt.Errorf("events: negative size in %+v: %w", cfg, ErrInvalidConfig)
	}
	if cfg.Encoding > ArrayEncoding {
		return nil, fmt.Errorf("events: %v: %w", cfg.Encoding, ErrInvalidConfig)
	}
	cfg.HWM = cmpOr(cfg.HWM, DefaultHWM)
	cfg.ReplayBatches = cmpOr(cfg.ReplayBatches, DefaultReplayBatches)
	cfg.Queue = cmpOr(cfg.Queue, DefaultQueue)
	cfg.BatchEvents = cmpOr(cfg.BatchEvents, DefaultBatchEvents)
	if cfg.Linger == 0 {
		cfg.Linger = DefaultLinger
	}
	if cfg.Topic == "" {
		cfg.Topic = "kv@" + cfg.Pod + "@" + cfg.Model
	}
	p := &Publisher{
		cfg:     cfg,
		topic:   []byte(cfg.Topic),
		wake:    make(chan struct{}, 1),
		q:       make(chan []byte, cfg.Queue),
		flushes: make(chan chan struct{}),
		resyncQ: make(chan struct{}, 1),
		ring:    replayRing{max: cfg.ReplayBatches},
	}
	for i, s := range sources {
		if s.Pool == nil || s.Pool.KVEventsReady() == nil {
			return nil, fmt.Errorf("events: source %d has no KV events (kvlease.WithKVEvents): %w", i, ErrInvalidConfig)
		}
		if s.Medium == "" {
			s.Medium = "GPU"
		}
		p.srcs = append(p.srcs, &source{Source: s})
	}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	p.pub = zmq4.NewPub(p.ctx)
	if err := p.pub.SetOption(zmq4.OptionHWM, cfg.HWM); err != nil {
		p.cancel()
		return nil, fmt.Errorf("events: set HWM: %w", err)
	}
	var err error
	if cfg.Bind || ShouldBind(cfg.Endpoint) {
		err = p.pub.Listen(cfg.Endpoint)
	} else {
		err = p.pub.Dial(cfg.Endpoint)
	}
	if err != nil {
		p.pub.Close()
		p.cancel()
		return nil, fmt.Errorf("events: open PUB %s: %w", cfg.Endpoint, err)
	}
	p.send = p.pub.Send
	if cfg.sendHook != nil {
		p.send = cfg.sendHook
	}
	if cfg.ReplayEndpoint != "" {
		p.replay = zmq4.NewRouter(p.ctx, zmq4.WithTimeout(time.Second))
		if err := p.replay.Listen(cfg.ReplayEndpoint); err != nil {
			p.pub.Close()
			p.cancel()
			return nil, fmt.Errorf("events: bind replay ROUTER %s: %w", cfg.ReplayEndpoint, err)
		}
		p.wg.Add(1)
		go p.serveReplay()
	}
	for _, s := range p.srcs {
		p.wg.Add(1)
		go p.forward(s.Pool.KVEventsReady())
	}
	p.wg.Add(2)
	go p.drainLoop()
	go p.sendLoop()
	return p, nil
}

func cmpOr(v, def int) int {
	if v == 0 {
		return def
	}
	return v
}

// ShouldBind reports vLLM's rule: bind when the endpoint contains "*" or
// "::" or is an ipc:// or inproc:// endpoint, connect otherwise.
func ShouldBind(endpoint string) bool {
	return strings.Contains(endpoint, "*") || strings.Contains(endpoint, "::") ||
		strings.HasPrefix(endpoint, "ipc://") || strings.HasPrefix(endpoint, "inproc://")
}

// Addr is the PUB socket's bound address (nil when it connected).
func (p *Publisher) Addr() net.Addr { return p.pub.Addr() }

// ReplayAddr is the replay socket's bound address (nil without one).
func (p *Publisher) ReplayAddr() net.Addr {
	if p.replay == nil {
		return nil
	}
	return p.replay.Addr()
}

// Subscriptions returns the topic prefixes that connected subscribers
// asked for (a subscriber that connected and subscribed is listed; a
// message published before that is lost to it, as with any PUB socket).
func (p *Publisher) Subscriptions() []string { return p.pub.(zmq4.Topics).Topics() }

// Topic is the topic frame of every message.
func (p *Publisher) Topic() string { return p.cfg.Topic }

// Stats returns the publisher's counters.
func (p *Publisher) Stats() Stats {
	return Stats{
		Batches: p.batches.Load(), Events: p.events.Load(), Blocks: p.blocks.Load(),
		DroppedBatches: p.droppedBatches.Load(), DroppedEvents: p.droppedEvents.Load(),
		Unpublishable: p.unpublishable.Load(), Resyncs: p.resyncs.Load(),
	}
}

// Flush drains every source now and waits until every batch queued so far
// was handed to the socket (which sends it asynchronously), or ctx ends.
func (p *Publisher) Flush(ctx context.Context) error {
	done := make(chan struct{})
	select {
	case p.flushes <- done:
	case <-p.ctx.Done():
		return ErrClosed
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-done:
	case <-p.ctx.Done():
		return ErrClosed
	case <-ctx.Done():
		return ctx.Err()
	}
	want := p.enqueued.Load()
	for p.sent.Load() < want {
		select {
		case <-p.ctx.Done():
			return ErrClosed
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
	return nil
}

// Resync asks for AllBlocksCleared followed by a re-announcement of every
// findable block of every source, as after a loss; for example when a
// router is known to have (re)subscribed after events it needed were
// sent. It does not wait; Flush after it waits for the re-announcement.
func (p *Publisher) Resync() {
	select {
	case p.resyncQ <- struct{}{}:
	default:
	}
}

// Close stops forwarding and closes the sockets. Events still buffered in
// the pools stay there. It is idempotent.
func (p *Publisher) Close() error {
	p.closeMu.Lock()
	defer p.closeMu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	p.cancel()
	var err error
	if p.replay != nil {
		err = p.replay.Close()
	}
	p.wg.Wait()
	if e := p.pub.Close(); err == nil {
		err = e
	}
	return err
}

// forward turns one pool's ready signal into the shared wake-up.
func (p *Publisher) forward(ready <-chan struct{}) {
	defer p.wg.Done()
	for {
		select {
		case <-p.ctx.Done():
			return
		case <-ready:
			select {
			case p.wake <- struct{}{}:
			default:
			}
		}
	}
}

// drainLoop is the only goroutine that drains the pools and encodes.
func (p *Publisher) drainLoop() {
	defer p.wg.Done()
	d := drainer{p: p, enc: newBatchEncoder(p.cfg.Encoding, p.cfg.DataParallelRank)}
	retry := time.NewTicker(20 * time.Millisecond)
	defer retry.Stop()
	linger := time.NewTimer(time.Hour)
	linger.Stop()
	defer linger.Stop()
	for {
		var flushed chan struct{}
		select {
		case <-p.ctx.Done():
			return
		case <-p.wake:
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
		case flushed = <-p.flushes:
		case <-p.resyncQ:
			d.resync = true
		case <-retry.C:
			if !d.resync {
				continue
			}
		}
		d.pass()
		if flushed != nil {
			close(flushed)
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
			var sb [8]byte
			binary.BigEndian.PutUint64(sb[:], seq)
			msg := zmq4.NewMsgFrom(p.topic, sb[:], payload)
			_ = p.send(msg)      // zmq4's PUB queues; errors only when closing
			if p.replay != nil { // kept only for a replay socket
				p.ring.add(seq, payload)
			}
			seq++
			p.batches.Add(1)
			p.sent.Add(1)
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

func (d *drainer) pass() {
	p := d.p
	if !d.resync {
		for _, s := range p.srcs {
			var dropped uint64
			d.buf, dropped = s.Pool.DrainKVEvents(d.buf[:0])
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
			return
		}
	}
	d.doResync()
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
				last.loraName == loraName && last.loraID == loraID && last.extraKeys == nil && e.ExtraKeys == nil &&
				d.hashArena[lastSpan.hashHi-1] == uint64(e.ParentBlockHash) && last.blockSize == bs &&
				lastSpan.hashHi-lastSpan.hashLo < maxMergedBlocks {
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
			if e.ExtraKeys != nil {
				we.extraKeys = [][]string{e.ExtraKeys} // never merged: one block
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
		for i := range chunk {
			p.blocks.Add(uint64(len(chunk[i].hashes)))
		}
	}
	return true
}

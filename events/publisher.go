package events

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	"go.uber.org/atomic"

	"github.com/kvlease/kvlease"
)

// ErrInvalidConfig is wrapped by NewPublisher's errors for a configuration
// it refuses (a malformed endpoint, no source, a negative size). It wraps
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
	// DefaultEndpoint is where a Publisher binds when Config.Endpoint is
	// empty: vLLM's port, on loopback only.
	DefaultEndpoint         = "tcp://127.0.0.1:5557"
	DefaultHWM              = 100_000
	DefaultReplayBatches    = 10_000
	DefaultQueue            = 4096
	DefaultBatchEvents      = 512
	DefaultLinger           = time.Millisecond
	DefaultHandshakeTimeout = 5 * time.Second
	DefaultMaxPeerMessage   = 1 << 20
	DefaultMaxSubscribers   = 64
	DefaultMaxHandshakes    = 32
	DefaultMaxPerAddress    = 8
	DefaultSendTimeout      = 30 * time.Second
	DefaultReplayIdle       = 30 * time.Second
)

// Config configures a Publisher. Every field has a default.
type Config struct {
	// Endpoint of the PUB socket, tcp://HOST:PORT or ipc://PATH
	// (DefaultEndpoint, bound, when empty). Following vLLM, the socket
	// binds when the endpoint contains "*" or "::" or is ipc://, and
	// connects otherwise (a router that binds and lets engines dial in);
	// Bind forces a bind. tcp://*:PORT binds every interface: anyone who
	// reaches the port reads the token ids of every cached block, so that
	// choice is logged (Logger, warning level).
	Endpoint string
	// Bind forces binding (true) whatever the endpoint looks like.
	Bind bool
	// ReplayEndpoint, when set, is bound as a ROUTER socket that replays
	// the last ReplayBatches batches: a request [id, "", start_seq (8 bytes
	// big-endian)] is answered [id, "", topic, seq, payload] per batch
	// with seq ≥ start_seq, at most ReplayPerRequest of them (a client
	// that got that many asks again from the last seq + 1), then
	// [id, "", "", 0xFF×8, ""]. A request of another shape is ignored.
	ReplayEndpoint string
	// ReplayPerRequest bounds the batches of one replay answer (default:
	// ReplayBatches, the whole ring, which clients that expect the whole
	// history in one answer, such as Dynamo's startup replay, need). A
	// smaller bound makes each request cheaper; such clients then miss
	// the rest.
	ReplayPerRequest int
	// Topic of every message; "kv@<Pod>@<Model>" when empty.
	Topic      string
	Pod, Model string
	// Encoding of events: MapEncoding (default) or ArrayEncoding.
	Encoding Encoding
	// DataParallelRank is the batch's third field.
	DataParallelRank int
	// HWM is the PUB socket's high-water mark (DefaultHWM): the messages
	// queued for one subscriber; a message that finds its queue full is
	// dropped for that subscriber only and counted (Stats.SubscriberDrops).
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
	// signals the first ones, before it drains the pools; while events
	// keep coming it drains every Linger without waiting for a signal.
	// Fewer, larger batches and fewer trips through the pools' locks, for
	// at most this much latency (DefaultLinger; negative: drain at once).
	// Flush does not wait for it.
	Linger time.Duration

	// What any one peer (subscriber or replay client) may cost, on both
	// sockets. HandshakeTimeout bounds a connection's ZMTP handshake
	// (DefaultHandshakeTimeout), and how long a subscriber may hold no
	// subscription (from its handshake or its last CANCEL): one that
	// subscribes to nothing is sent nothing, so only this ends it
	// (Stats.IdleDrops). MaxPeerMessage bounds the bytes of one message
	// or command a peer sends (DefaultMaxPeerMessage): a larger one ends
	// the connection before anything is allocated for it.
	//
	// MaxSubscribers caps the established connections of each socket
	// (DefaultMaxSubscribers), MaxHandshakes those still in their
	// handshake (DefaultMaxHandshakes), and MaxPerAddress those of one
	// remote address in each of the two (DefaultMaxPerAddress; an IPv6
	// address counts by its /64, an ipc:// peer is one address). When a
	// cap is full, a connection from an address that holds fewer than the
	// busiest address takes the place of that address's oldest, which is
	// closed: an address flooding the socket (or redialling as it is
	// closed) never locks out a router from another. A connection refused
	// or displaced is counted (Stats.Refused).
	//
	// SendTimeout ends a connection that accepts no byte for that long
	// (DefaultSendTimeout; negative: never); until then a subscriber that
	// does not read only loses messages to its HWM. ReplayIdleTimeout
	// ends a replay client that sends no request for that long after its
	// handshake or its last answer (DefaultReplayIdle; negative: never;
	// Stats.IdleDrops): a DEALER reconnects by itself when it next asks.
	HandshakeTimeout  time.Duration
	MaxPeerMessage    int
	MaxSubscribers    int
	MaxHandshakes     int
	MaxPerAddress     int
	SendTimeout       time.Duration
	ReplayIdleTimeout time.Duration

	// Logger receives the bind-all warning and connection errors
	// (slog.Default() when nil).
	Logger *slog.Logger

	sendHook func(seq uint64, payload []byte) // tests: replaces the PUB socket
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

	SubscriberDrops  uint64 // messages dropped for one subscriber whose queue was at its HWM
	Refused          uint64 // connections refused or displaced (caps, see Config) or closed in their handshake (timeout, protocol violation)
	IdleDrops        uint64 // subscribers dropped holding no subscription, replay clients dropped idle (see Config)
	MalformedReplays uint64 // replay requests of the wrong shape, ignored
}

// Publisher forwards the KV events of one or more pools to a ZeroMQ PUB
// socket in vLLM's wire format:
//
//	frames  [topic, seq, payload]       seq: 8 bytes big-endian, batches from 0
//	payload [ts float64, events, data_parallel_rank]
//
// Stored events of one chain that follow each other are merged into one
// BlockStored (with their extra keys, one entry per block, as vLLM sends
// the blocks a request filled); removals that follow each other into one
// BlockRemoved.
//
// The publisher never blocks the allocator: pools buffer events in their
// own bounded rings (a full ring drops and counts), a goroutine drains
// them, and encoded batches wait in a bounded queue for the socket. When
// events are lost on the way, either because a pool's ring overflowed or
// because a slow socket filled the queue, the publisher sends
// AllBlocksCleared and then re-announces every findable block of every
// source from SnapshotKVBlocks, so a subscriber converges on the truth.
//
// The drain follows the reuse pattern of kvlease's DrainKVEvents: one
// slice kept across drains and passed back emptied,
//
//	buf, dropped = pool.DrainKVEvents(buf[:0])
//
// so a drain appends into the room the last one left and allocates no
// event slice once the slice has grown to the ring's size. The tokens of
// the drained events are the caller's (one allocation per drain, never
// overwritten by the pool), so they stay valid after the next drain; a
// consumer that keeps events beyond the next drain copies the events,
// not their tokens.
//
// Stored events without tokens (Seal rather than SealTokens) are not sent:
// routers compute their keys from tokens and drop such events. They are
// counted in Stats.Unpublishable.
//
// The sockets are this package's own ZMTP 3.1 implementation (PUB and a
// replay ROUTER, NULL mechanism; see the package documentation for why),
// built so that no peer can crash or stall them: see Config for the
// limits. A Publisher is tied to the context given to Start: it stops
// when the context ends or at Close, whichever comes first.
type Publisher struct {
	cfg     Config
	topic   []byte
	srcs    []*source
	pub     *pubSocket
	replay  *replaySocket
	ctx     context.Context
	cancel  context.CancelFunc
	wake    chan struct{}
	q       chan []byte
	flushes chan chan struct{}
	resyncQ chan struct{}
	wg      sync.WaitGroup
	closeMu sync.Mutex
	closed  bool
	done    chan struct{} // closed at the end of Close
	stop    func() bool   // unregisters the context's AfterFunc

	// send hands one numbered batch to the PUB socket (replaced in tests).
	send func(seq uint64, payload []byte)

	ring replayRing

	batches, events, blocks, droppedBatches, droppedEvents, unpublishable, resyncs atomic.Uint64
	enqueued                                                                       atomic.Uint64
}

type source struct {
	Source
	skipTo uint64        // events with Seq ≤ skipTo are in the last snapshot sent
	rearm  chan struct{} // lets its forward goroutine listen again (drainLoop)
}

// NewPublisher is Start with context.Background(): the publisher runs
// until Close.
func NewPublisher(cfg Config, sources ...Source) (*Publisher, error) {
	return Start(context.Background(), cfg, sources...)
}

// Start opens the sockets (bound, or dialing in the background, before
// it returns) and forwards the sources' events until ctx ends or Close
// is called; either closes the sockets and stops every goroutine of the
// publisher (Done is closed then). Errors wrap ErrInvalidConfig for a
// configuration it refuses, or the network's error for an endpoint it
// cannot bind.
func Start(ctx context.Context, cfg Config, sources ...Source) (*Publisher, error) {
	if len(sources) == 0 {
		return nil, fmt.Errorf("events: no source: %w", ErrInvalidConfig)
	}
	if cfg.HWM < 0 || cfg.ReplayBatches < 0 || cfg.Queue < 0 || cfg.BatchEvents < 0 || cfg.ReplayPerRequest < 0 ||
		cfg.HandshakeTimeout < 0 || cfg.MaxPeerMessage < 0 || cfg.MaxSubscribers < 0 || cfg.MaxHandshakes < 0 || cfg.MaxPerAddress < 0 {
		return nil, fmt.Errorf("events: negative size in %+v: %w", cfg, ErrInvalidConfig)
	}
	if cfg.Encoding > ArrayEncoding {
		return nil, fmt.Errorf("events: %v: %w", cfg.Encoding, ErrInvalidConfig)
	}
	if cfg.Endpoint == "" {
		cfg.Endpoint, cfg.Bind = DefaultEndpoint, true
	}
	ep, err := parseEndpoint(cfg.Endpoint)
	if err != nil {
		return nil, err
	}
	var rep endpoint
	if cfg.ReplayEndpoint != "" {
		if rep, err = parseEndpoint(cfg.ReplayEndpoint); err != nil {
			return nil, err
		}
	}
	cfg.HWM = cmpOr(cfg.HWM, DefaultHWM)
	cfg.ReplayBatches = cmpOr(cfg.ReplayBatches, DefaultReplayBatches)
	cfg.ReplayPerRequest = min(cmpOr(cfg.ReplayPerRequest, cfg.ReplayBatches), cfg.ReplayBatches)
	cfg.Queue = cmpOr(cfg.Queue, DefaultQueue)
	cfg.BatchEvents = cmpOr(cfg.BatchEvents, DefaultBatchEvents)
	cfg.MaxPeerMessage = cmpOr(cfg.MaxPeerMessage, DefaultMaxPeerMessage)
	cfg.MaxSubscribers = cmpOr(cfg.MaxSubscribers, DefaultMaxSubscribers)
	cfg.MaxHandshakes = cmpOr(cfg.MaxHandshakes, DefaultMaxHandshakes)
	cfg.MaxPerAddress = cmpOr(cfg.MaxPerAddress, DefaultMaxPerAddress)
	if cfg.HandshakeTimeout == 0 {
		cfg.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if cfg.SendTimeout == 0 {
		cfg.SendTimeout = DefaultSendTimeout
	}
	if cfg.ReplayIdleTimeout == 0 {
		cfg.ReplayIdleTimeout = DefaultReplayIdle
	}
	if cfg.Linger == 0 {
		cfg.Linger = DefaultLinger
	}
	if cfg.Topic == "" {
		cfg.Topic = "kv@" + cfg.Pod + "@" + cfg.Model
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	p := &Publisher{
		cfg:     cfg,
		topic:   []byte(cfg.Topic),
		wake:    make(chan struct{}, 1),
		q:       make(chan []byte, cfg.Queue),
		flushes: make(chan chan struct{}),
		resyncQ: make(chan struct{}, 1),
		ring:    replayRing{max: cfg.ReplayBatches},
		done:    make(chan struct{}),
	}
	for i, s := range sources {
		if s.Pool == nil || s.Pool.KVEventsReady() == nil {
			return nil, fmt.Errorf("events: source %d has no KV events (kvlease.WithKVEvents): %w", i, ErrInvalidConfig)
		}
		if s.Medium == "" {
			s.Medium = "GPU"
		}
		p.srcs = append(p.srcs, &source{Source: s, rearm: make(chan struct{}, 1)})
	}
	lim := limits{handshake: cfg.HandshakeTimeout, maxMessage: cfg.MaxPeerMessage, maxConns: cfg.MaxSubscribers,
		maxPending: cfg.MaxHandshakes, perAddr: cfg.MaxPerAddress, sendTimeout: cfg.SendTimeout,
		idle: cfg.ReplayIdleTimeout, hwm: cfg.HWM}
	p.pub = newPubSocket(cfg.Topic, lim, cfg.Logger)
	if cfg.Bind || ShouldBind(cfg.Endpoint) {
		if err := p.pub.listen(ep); err != nil {
			return nil, fmt.Errorf("events: bind PUB %s: %w", cfg.Endpoint, err)
		}
		warnAll(cfg.Logger, "PUB", ep, p.pub.addr())
	} else {
		p.pub.connect(ep)
	}
	p.send = p.pub.send
	if cfg.sendHook != nil {
		p.send = cfg.sendHook
	}
	if cfg.ReplayEndpoint != "" {
		p.replay = newReplaySocket(cfg.Topic, &p.ring, cfg.ReplayPerRequest, lim, cfg.Logger)
		if err := p.replay.listen(rep); err != nil {
			_ = p.pub.close()
			return nil, fmt.Errorf("events: bind replay ROUTER %s: %w", cfg.ReplayEndpoint, err)
		}
		warnAll(cfg.Logger, "replay ROUTER", rep, p.replay.addr())
	}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	for _, s := range p.srcs {
		p.wg.Add(1)
		go p.forward(s.Pool.KVEventsReady(), s.rearm)
	}
	p.wg.Add(2)
	go p.drainLoop()
	go p.sendLoop()
	p.stop = context.AfterFunc(ctx, func() { _ = p.Close() })
	return p, nil
}

// warnAll logs a socket other hosts can reach: bound on every interface,
// or on an address that is not loopback. The NULL mechanism
// authenticates nobody, and the events carry the token ids of every
// cached block.
func warnAll(log *slog.Logger, what string, ep endpoint, addr net.Addr) {
	switch a, tcp := addr.(*net.TCPAddr); {
	case ep.all:
		log.Warn("events: socket bound on every interface: any host that reaches it reads the token ids of every cached block",
			"socket", what, "endpoint", ep.String(), "addr", addr.String())
	case tcp && !a.IP.IsLoopback():
		log.Warn("events: socket bound on a network address: any host that reaches it reads the token ids of every cached block",
			"socket", what, "endpoint", ep.String(), "addr", addr.String())
	}
}

func cmpOr(v, def int) int {
	if v == 0 {
		return def
	}
	return v
}

// ShouldBind reports vLLM's rule: bind when the endpoint contains "*" or
// "::" or is an ipc:// or inproc:// endpoint, connect otherwise (a
// Publisher serves tcp:// and ipc:// only).
func ShouldBind(endpoint string) bool {
	return strings.Contains(endpoint, "*") || strings.Contains(endpoint, "::") ||
		strings.HasPrefix(endpoint, "ipc://") || strings.HasPrefix(endpoint, "inproc://")
}

// Addr is the PUB socket's bound address (nil when it connects).
func (p *Publisher) Addr() net.Addr { return p.pub.addr() }

// ReplayAddr is the replay socket's bound address (nil without one).
func (p *Publisher) ReplayAddr() net.Addr {
	if p.replay == nil {
		return nil
	}
	return p.replay.addr()
}

// Subscriptions returns the subscriptions connected subscribers hold
// that match this publisher's topic (a prefix of it; the empty string
// for "everything"), one per subscriber and prefix. A message published
// before a subscriber subscribed is lost to it, as with any PUB socket.
func (p *Publisher) Subscriptions() []string { return p.pub.subscriptions() }

// Topic is the topic frame of every message.
func (p *Publisher) Topic() string { return p.cfg.Topic }

// Done is closed once the publisher stopped: its context ended or Close
// was called, and its goroutines are gone.
func (p *Publisher) Done() <-chan struct{} { return p.done }

// Stats returns the publisher's counters.
func (p *Publisher) Stats() Stats {
	st := Stats{
		Batches: p.batches.Load(), Events: p.events.Load(), Blocks: p.blocks.Load(),
		DroppedBatches: p.droppedBatches.Load(), DroppedEvents: p.droppedEvents.Load(),
		Unpublishable: p.unpublishable.Load(), Resyncs: p.resyncs.Load(),
		SubscriberDrops: p.pub.hwmDrops.Load(), Refused: p.pub.refused.Load(), IdleDrops: p.pub.idleDrops.Load(),
	}
	if p.replay != nil {
		st.Refused += p.replay.refused.Load()
		st.IdleDrops += p.replay.idleDrops.Load()
		st.MalformedReplays = p.replay.malformed.Load()
	}
	return st
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
	for p.batches.Load() < want {
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
	p.stop()
	p.cancel()
	var err error
	if p.replay != nil {
		err = p.replay.close()
	}
	p.wg.Wait()
	if e := p.pub.close(); err == nil {
		err = e
	}
	close(p.done)
	return err
}

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

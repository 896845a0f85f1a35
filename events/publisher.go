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

package ucx

import (
	"fmt"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// Config configures a Sender or a Receiver. The zero value is usable.
type Config struct {
	// Window bounds the gets one handoff has outstanding (16 when zero).
	Window int
	// MaxGet bounds the bytes of one get (pull) or one message (push):
	// blocks adjacent in memory (a run) are read with one get (pull:
	// adjacent on both sides) or sent as one message (push: adjacent in
	// the source's memory) up to this size (1 MiB when zero; a value
	// below the block size moves one block per get or message). Pushed,
	// the destination's value travels in its Accept bytes and the
	// source cuts its runs at the smaller of the two; it also bounds
	// what a cancel cannot withdraw (a receive a message already
	// matched).
	MaxGet int
	// ConnectSpins bounds the progress calls the destination spends
	// connecting to a handoff's source before it gives up (before
	// anything is attached; 1e6 when zero).
	ConnectSpins int
	// BeforeGet, if set, runs on the destination's worker thread before
	// the get that starts at block is posted (pull), or, for each block
	// of a message, before the message's receive is posted (push): fault
	// injection, tests stop or abort a handoff there. It must not call
	// into the plane.
	BeforeGet func(id handoff.PlaneID, block int)
	// BeforeSend, if set, runs on the source's worker thread, for each
	// block of a message, before the message is posted (push model;
	// fault injection). It must not call into the plane.
	BeforeSend func(id handoff.PlaneID, block int)
	// Pull selects the pull model (the destination reads the source's
	// registered pieces with ucp_get_nbx) instead of the default push
	// model (the source sends its pieces as tagged messages). Both sides
	// must agree: a sender refuses the other model's Accept bytes. Pull
	// trusts the destination with the source process's memory: UCX 1.13
	// serves, in software, a get (or a put) whose remote key names no
	// hardware registration, at any address the destination names, on
	// every transport (see Trust in DESIGN.md). Set it only when the
	// destination is as trusted as the source process itself.
	Pull bool
	// MaxIdle bounds the idle connections (push model) a side keeps per
	// control session for the handoffs that follow: a source's workers
	// each with its endpoint to a destination's worker, a destination's
	// workers (4 when zero; negative keeps none: a worker and a
	// connection per handoff). A connection serves one handoff at a time
	// and is kept only after a handoff that ended cleanly on its side.
	MaxIdle int
	// IdleTimeout is how long an idle connection is kept (zero: 30 s on
	// a Sender, 60 s on a Receiver). Keep the destination's longer than
	// the source's: the source then drops its endpoint before the
	// destination destroys the worker it is connected to.
	IdleTimeout time.Duration
	// StallTimeout is the transfers' progress timeout, on both sides: a
	// transfer that neither posts nor completes one of its sends
	// (source), receives or gets (destination) for that long ends
	// (ErrStalled; Stats.Stalled), whatever the handoff's Deadline, none
	// included, through the path a cancel takes: the source revokes (its
	// evidence), the destination withdraws its receives (or stops its
	// gets) and resolves once every one is done; a receive a message
	// already matched, or a get of a stopped source, still holds its
	// blocks, quarantined, until late evidence or Close. A frozen peer so
	// holds our blocks for at most StallTimeout past its last progress
	// (the source: plus the time its Config.Window posts took). The
	// source counts on from its last send to the destination's done: a
	// destination that holds its done longer is stalled too. A pulling
	// source sees no get complete: it counts the time its handoff worker
	// does nothing (on a hardware transport that serves the gets without
	// it, from the Start to the done). A streaming destination waits
	// while the source's prefill computes: StallTimeout must cover the
	// longest pause between the parts the prefill marks written (a
	// streaming source's own wait for its prefill, with nothing
	// outstanding, is not a stall). DefaultStallTimeout when zero or
	// negative: it cannot be turned off.
	StallTimeout time.Duration
}

func (c *Config) defaults() {
	if c.Window <= 0 {
		c.Window = 16
	}
	if c.MaxGet <= 0 {
		c.MaxGet = 1 << 20
	}
	if c.ConnectSpins <= 0 {
		c.ConnectSpins = 1_000_000
	}
	if c.MaxIdle == 0 {
		c.MaxIdle = defaultMaxIdle
	}
	if c.StallTimeout <= 0 {
		c.StallTimeout = DefaultStallTimeout
	}
}

// Stats counts what a plane did.
type Stats struct {
	// Started counts attached transfers; Completed those resolved with
	// every block delivered (destination) or with the destination's done
	// (source); Canceled those that stopped on a cancel with a completed
	// flush; Revoked those whose evidence is a revocation. Stalled
	// counts those Config.StallTimeout ended (a source's are revoked
	// too, and counted there).
	Started, Completed, Canceled, Revoked, Stalled int
	// Bytes counts bytes read by completed gets (destination).
	Bytes int64
	// Registrations counts the ucp_mem_map calls on region memory (one
	// per contiguous run of a handoff's pieces; a run table's copy is not
	// counted) and RegisteredBytes their bytes: exactly the pieces'.
	Registrations   int
	RegisteredBytes int64
	// Gets counts the gets posted (destination, pull model).
	Gets int
	// Messages counts the messages posted (push model): sends on the
	// source, receives on the destination; one per run of blocks
	// adjacent in the source's memory (cut at MaxGet), one per other
	// block. The sums table's message is not counted.
	Messages int
	// Keyed counts the started handoffs whose blocks carry sums keyed by
	// their authenticated session (a GMAC per block); the others carry
	// crc32c (an insecure session), or nothing (device memory, pull).
	Keyed int
	// Workers counts the UCX workers created for the push model's
	// connections (the pull model's per-handoff workers are not
	// counted); Connects the endpoints created to a peer's worker (the
	// source's with a handshake); Reuses the handoffs that took an idle
	// connection instead (source: an endpoint to the worker the
	// destination named; destination: a worker of the session); Expired
	// the idle connections destroyed after Config.IdleTimeout; Broken
	// the connections dropped because their endpoint failed (found idle
	// or checked out). Idle is the connections idle now. Strays counts
	// the destination's workers not kept after a handoff because a
	// message no receive asked for was waiting in them.
	Workers, Connects, Reuses, Expired, Broken, Idle, Strays int
}

type counters struct {
	mu sync.Mutex
	s  Stats
}

func (c *counters) add(f func(*Stats)) {
	c.mu.Lock()
	f(&c.s)
	c.mu.Unlock()
}

func (c *counters) get() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.s
}

// side is what a Sender and a Receiver share: their configuration, UCX
// context, the regions' pieces function, counters, the sessions' keys
// and the idle connections.
type side[R any] struct {
	cfg    Config
	ctx    *context
	pieces func(R, []Span) []Span
	stats  counters
	keys   sessionKeys
	pool   *pool
}

// init configures s in place (its pool counts into s.stats): cfg's
// defaults, an idle timeout of idle when cfg has none, and a UCX context
// for cfg's model. A nil pieces function wraps kvlease.ErrInvalidArgument.
func (s *side[R]) init(cfg Config, pieces func(R, []Span) []Span, idle time.Duration) error {
	if pieces == nil {
		return fmt.Errorf("ucx: nil pieces function: %w", kvlease.ErrInvalidArgument)
	}
	cfg.defaults()
	ctx, err := newContext(cfg.Pull)
	if err != nil {
		return err
	}
	if cfg.IdleTimeout > 0 {
		idle = cfg.IdleTimeout
	}
	s.cfg, s.ctx, s.pieces = cfg, ctx, pieces
	s.pool = newPool(cfg.MaxIdle, idle, &s.stats)
	return nil
}

// snapshot returns the side's counters with the connections idle now.
func (s *side[R]) snapshot() Stats {
	st := s.stats.get()
	st.Idle = s.pool.idleN()
	return st
}

// release destroys the idle connections and releases UCX: the last step
// of Close.
func (s *side[R]) release() {
	s.pool.close()
	s.ctx.close()
}

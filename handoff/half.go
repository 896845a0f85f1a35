package handoff

import (
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/internal/wire"

	"go.uber.org/atomic"
)

// peerErr turns a peer's text into an error wrapping ErrPeer (and
// wrapped, when sentinel is not nil, that too).
func peerErr(what, text string, sentinel error) error {
	if sentinel != nil {
		return fmt.Errorf("kvlease: handoff: peer %s: %s: %w (%w)", what, text, ErrPeer, sentinel)
	}
	return fmt.Errorf("kvlease: handoff: peer %s: %s: %w", what, text, ErrPeer)
}

// HalfConfig configures either half of a cross-process handoff.
type HalfConfig struct {
	// Envelope is the envelope both processes agreed on; its Fingerprint
	// travels in every proposal.
	Envelope Envelope
	// Name and Peer name this side and the other in History ("prefill",
	// "decode"). They default to "source"/"destination" by side.
	Name, Peer string
	// Deadline bounds how long an attached transfer may stay unresolved
	// (and, on the source, how long the destination may take to report)
	// before the half gives up on evidence: DefaultDeadline when zero, no
	// deadline when negative (a plane's own progress timeout,
	// tcp.Config.StallTimeout or ucx.Config.StallTimeout, still ends a
	// transfer whose peer stalls).
	Deadline time.Duration
	// FrameTimeout bounds a control frame that has begun and every control
	// write (10 s when zero).
	FrameTimeout time.Duration
	// Auth authenticates the control connection (and, through it, the
	// data plane): &PSK{...} or &TLS{...}. It is required unless Insecure
	// is set. See the package documentation's "Authentication".
	Auth Authenticator
	// Insecure runs without authentication, when Auth is nil: anyone who
	// can reach the other half can propose, accept or push blocks. Each
	// such session logs that it is unauthenticated (Logf). Both halves
	// must agree: a secure half refuses an insecure peer (a downgrade).
	Insecure bool
	// HandshakeTimeout bounds the authentication handshake
	// (DefaultHandshakeTimeout when zero).
	HandshakeTimeout time.Duration
	// Logf, if set, receives the half's log lines (an unauthenticated
	// session); log.Printf when nil.
	Logf func(format string, args ...any)
	// OnQuarantine, if set, is told every handoff that becomes
	// Quarantined (no evidence by the deadline) with the reason; the
	// handoff's later final state (Done) says when late evidence lifted
	// it. Called without the half's locks held, so the late evidence may
	// make the handoff final before or while it runs (HalfStats.Quarantined
	// counts it before that); must not block long.
	OnQuarantine func(handoff uint64, reason error)
	// OnError, if set, is told every protocol error that changed nothing
	// (an unknown id, a message the state does not allow) and, on the
	// destination, every delivered block its pool would not seal. It is
	// called without the half's locks held, and must not block long.
	OnError func(error)
}

func (c *HalfConfig) defaults(name, peer string, client bool) error {
	if err := c.Envelope.Validate(); err != nil {
		return err
	}
	switch {
	case c.Auth == nil && !c.Insecure:
		return fmt.Errorf("kvlease: handoff %s: no authenticator: set HalfConfig.Auth to &handoff.PSK{ID, Key} (a key from handoff.GenerateKey, shared with the peer) or &handoff.TLS{Config} (mutual TLS 1.3), or set Insecure: true to run unauthenticated: %w",
			name, kvlease.ErrInvalidArgument)
	case c.Auth != nil && c.Insecure:
		return fmt.Errorf("kvlease: handoff %s: both Auth and Insecure set: %w", name, kvlease.ErrInvalidArgument)
	case c.Auth != nil:
		if err := c.Auth.validate(client); err != nil {
			return err
		}
	}
	if c.HandshakeTimeout <= 0 {
		c.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if c.Logf == nil {
		c.Logf = log.Printf
	}
	if c.Name == "" {
		c.Name = name
	}
	if c.Peer == "" {
		c.Peer = peer
	}
	if c.Deadline == 0 {
		c.Deadline = DefaultDeadline
	}
	if c.FrameTimeout <= 0 {
		c.FrameTimeout = wire.DefaultFrameTimeout
	}
	return nil
}

// quarantined tells OnQuarantine.
func (c *HalfConfig) quarantined(id uint64, reason error) {
	if c.OnQuarantine != nil {
		c.OnQuarantine(id, reason)
	}
}

func (c *HalfConfig) report(err error) {
	if c.OnError != nil {
		c.OnError(err)
	}
}

// HalfStats counts what a half refused and why. Destination.Stats sums
// its sessions; Source.Stats is its one session's.
type HalfStats struct {
	// Sessions is the number of control sessions that authenticated (or,
	// Insecure, that began).
	Sessions int64
	// AuthRefused counts handshakes refused: a wrong key, an unknown key
	// id, an unknown or expired certificate, a malformed or timed-out
	// handshake. Nothing of such a session was acted on.
	AuthRefused int64
	// Downgrades counts peers that offered no authentication to a secure
	// half (counted in AuthRefused too).
	Downgrades int64
	// FramesRefused counts sessions ended by a control record that did
	// not verify: replayed, reordered, from another session, forged.
	FramesRefused int64
	// LimitRefused counts proposals refused by a per-session cap
	// (MaxHandoffs, MaxSessionBlocks, a full table of recent ids).
	LimitRefused int64
	// StartTimeouts counts Accepted handoffs aborted because no Start
	// came within StartTimeout.
	StartTimeouts int64
	// Duplicates counts proposals refused for an id in use or recently
	// used on their session.
	Duplicates int64
	// Quarantined counts handoffs that became Quarantined.
	Quarantined int64
	// Unauthorized counts proposals refused by Authorize.
	Unauthorized int64
	// AcceptErrors counts failed Accepts of Destination.Listen (retried
	// after a backoff).
	AcceptErrors int64
	// Busy counts control connections Listen closed in their handshake
	// to keep to its pending caps: one past maxPendingHandshakesPerHost
	// from one host, or one that gave way at maxPendingHandshakes.
	Busy int64
	// IdentityRefused counts proposals refused by a per-identity cap
	// (Limits.Blocks, Limits.Handoffs).
	IdentityRefused int64
	// SessionsRefused counts sessions refused at the end of their
	// handshake by MaxSessions or their identity's Limits.Sessions (on a
	// source: its session refused so).
	SessionsRefused int64
	// IdleClosed counts sessions the destination closed after
	// SessionIdleTimeout with nothing in flight.
	IdleClosed int64
	// Crossed counts messages that crossed this side's end of their
	// handoff (the destination's Accept, Reject or Done crossing the
	// source's Abort; the source's Start crossing the destination's
	// Abort or Reject): expected, dropped, not reported as protocol
	// errors.
	Crossed int64
}

// halfCounters are HalfStats, counted atomically.
type halfCounters struct {
	sessions, authRefused, downgrades, framesRefused, limitRefused,
	startTimeouts, duplicates, quarantined, unauthorized, acceptErrors, busy atomic.Int64
	identityRefused, sessionsRefused, idleClosed, crossed atomic.Int64
}

func (c *halfCounters) snapshot() HalfStats {
	return HalfStats{
		Sessions: c.sessions.Load(), AuthRefused: c.authRefused.Load(), Downgrades: c.downgrades.Load(),
		FramesRefused: c.framesRefused.Load(), LimitRefused: c.limitRefused.Load(), StartTimeouts: c.startTimeouts.Load(),
		Duplicates: c.duplicates.Load(), Quarantined: c.quarantined.Load(), Unauthorized: c.unauthorized.Load(),
		AcceptErrors: c.acceptErrors.Load(), Busy: c.busy.Load(),
		IdentityRefused: c.identityRefused.Load(), SessionsRefused: c.sessionsRefused.Load(), IdleClosed: c.idleClosed.Load(),
		Crossed: c.crossed.Load(),
	}
}

// authFailed counts a refused handshake: a session refused by a cap
// once authenticated, or a failed authentication.
func (c *halfCounters) authFailed(err error) {
	if errors.Is(err, ErrLimit) {
		c.sessionsRefused.Add(1)
		return
	}
	c.authRefused.Add(1)
	var ae *authError
	if errors.As(err, &ae) && ae.downgrade {
		c.downgrades.Add(1)
	}
}

// readFailed counts a session that ended on a record that did not verify.
func (c *halfCounters) readFailed(err error) {
	if errors.Is(err, ErrAuth) {
		c.framesRefused.Add(1)
	}
}

// retire moves handoff v (id), final in st, out of a half's table live
// into its recent ids, unless another handoff took the id meanwhile. The
// caller holds the lock that guards both.
func retire[T comparable](live map[uint64]T, recent *recentIDs, id uint64, v T, st State) {
	if live[id] == v {
		delete(live, id)
		recent.add(id, st)
	}
}

// answerAbsent answers message m for a handoff not in the side's table
// (side: "source" or "destination") as the final handoff would, when it
// left in st (recent): an Ack is dropped, an Abort acknowledged on c, a
// message that crossed this side's end dropped and counted (crossing),
// anything else
// reported; a message for an unknown handoff is reported.
func answerAbsent(c *wire.Conn, report func(error), stats *halfCounters, side string, m wire.Message, st State, recent bool) {
	switch {
	case recent && m.Type() == wire.MsgAck:
	case recent && m.Type() == wire.MsgAbort:
		_ = c.Send(&wire.AckMsg{ID: m.Handoff(), Of: wire.MsgAbort})
	case recent && stats.crossing(side == "source", m.Type(), st):
	case recent:
		report(fmt.Errorf("kvlease: handoff %d: %v while %v: %w", m.Handoff(), m.Type(), st, wire.ErrProtocolRefused))
	default:
		report(fmt.Errorf("kvlease: handoff %s: %v for unknown handoff %d: %w", side, m.Type(), m.Handoff(), wire.ErrProtocolRefused))
	}
}

// recentIDs remembers the last ids that left a session's table, so that a
// duplicate of a finished handoff is still refused while the table stays
// bounded: a ring of the last maxRecentIDs ids and a set over it.
type recentIDs struct {
	ring []uint64
	next int
	set  map[uint64]State // the final state each left in
}

// maxRecentIDs is how many finished handoff ids a session remembers to
// refuse their reuse.
const maxRecentIDs = 4096

func (r *recentIDs) has(id uint64) bool {
	_, ok := r.set[id]
	return ok
}

// state returns the state id left the table in, if it is remembered.
func (r *recentIDs) state(id uint64) (State, bool) {
	st, ok := r.set[id]
	return st, ok
}

func (r *recentIDs) add(id uint64, st State) {
	if r.set == nil {
		r.set = make(map[uint64]State, 64)
	}
	if _, ok := r.set[id]; ok {
		return
	}
	if len(r.ring) < maxRecentIDs {
		r.ring = append(r.ring, id)
	} else {
		delete(r.set, r.ring[r.next])
		r.ring[r.next] = id
		r.next = (r.next + 1) % maxRecentIDs
	}
	r.set[id] = st
}

// crossed reports whether a message of type t, for a handoff this side
// ended (or is ending: Aborting) in st, whether it is still in the
// side's table or not, is one the peer may have sent before it heard of that
// end: an honest crossing, not a protocol violation, so it is dropped
// without a report. On the source, the destination's Accept, Reject or
// Done crossing the source's Abort (or its Failed: its transfer failed,
// or the Done came after it stopped waiting); on the destination, the
// source's Start crossing the destination's Abort or its Reject after
// an Accept. A message that could not have been sent before the peer
// heard (a second Done after Delivered, anything after the peer's own
// Reject) is still reported. The record keeps only the final state, so
// the same messages after the peer's own Abort are dropped too: harmless,
// the handoff is final on both sides.
func crossed(source bool, t wire.MsgType, st State) bool {
	if source {
		return (st == Aborting || st == Aborted || st == Failed) && (t == wire.MsgAccept || t == wire.MsgReject || t == wire.MsgDone)
	}
	return (st == Aborting || st == Aborted || st == Rejected) && t == wire.MsgStart
}

// crossing reports crossed(source, t, st) and counts a crossing in
// HalfStats.Crossed.
func (c *halfCounters) crossing(source bool, t wire.MsgType, st State) bool {
	if crossed(source, t, st) {
		c.crossed.Add(1)
		return true
	}
	return false
}

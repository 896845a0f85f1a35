package handoff

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/internal/pending"
	"go.uber.org/atomic"
)

// Destination is the destination half (the decode side) of
// cross-process handoffs: it holds only its own pool, serves control
// connections from Sources (Serve) and answers each proposal. On a
// proposal it checks the envelope fingerprint and the policy (Decide),
// looks the proposed hashes up in its own prefix cache, takes the hits
// (shared, not copied), acquires the missing blocks, and asks the source
// for those alone. Delivered blocks are sealed on arrival, so the decode
// side's cache fills instead of holding private duplicates. A proposal
// with tokens (Source.ProposeTokens) is looked up with
// AcquirePrefixTokens and sealed with SealTokens: in verified mode
// (kvlease.WithVerifiedPrefix) every hit is checked against the tokens,
// and hash-only proposals simply miss.
//
// What makes the destination final: Delivered is its own transfer's
// Resolve(nil) (every wanted block arrived intact and nothing of ours
// writes them any more); the lease is then the OnDelivered callback's.
// Failed is its transfer's Resolve(err): the lease is released. Abort
// (either side) aborts the lease, whose blocks drain until the plane
// proves it stopped writing; a transfer with no evidence by the deadline
// is quarantined until late evidence. Losing the control connection
// aborts what had not started and asks a started transfer to stop: it
// is not evidence, so the plane's own decides (Failed when the data
// stopped short).
type Destination[R any] struct {
	pool     *kvlease.Pool[R]
	plane    RecvPlane[R]
	cfg      DestinationConfig[R]
	stats    halfCounters
	sessions sessionTable
	hooks    *hooks // the explorer's (hooks.go); nil in production
}

// DestinationConfig configures a Destination.
type DestinationConfig[R any] struct {
	HalfConfig
	// Decide, if set, is the destination's policy: a non-nil error
	// rejects the proposal (before anything is acquired) with that reason.
	Decide func(p *ProposeMsg) error
	// OnDelivered, if set, receives each delivered handoff; its lease
	// (Lease) is then the callee's to use and release. Without it the
	// lease is released at once (its sealed blocks stay cached).
	OnDelivered func(*Incoming[R])
	// OnFinal, if set, is called once for every handoff that becomes
	// final (after OnDelivered for a delivered one). A proposal refused
	// before it became a handoff (a duplicate id, a per-session cap) is
	// not one: the source is told, the Stats count it.
	OnFinal func(*Incoming[R])
	// OnAccept, if set, receives each accepted handoff before its Accept
	// is sent, so the caller holds the handle (to Abort it, say when the
	// client goes away) before any block can move. It runs on the
	// connection's read loop: it must not block.
	OnAccept func(*Incoming[R])
	// Authorize, if set, decides with the proposer's authenticated
	// identity (peer.Identity: "psk:<id>", a certificate's URI SAN or
	// subject): a non-nil error rejects the proposal before anything is
	// acquired, so an engine can allowlist its prefill fleet. It runs
	// before Decide, on the connection's read loop.
	Authorize func(peer *Peer, p *ProposeMsg) error
	// StartTimeout bounds how long an Accepted handoff waits for the
	// source's Start: then it is aborted (its lease released; nothing
	// was attached, so nothing can touch it) and the source told
	// (DefaultStartTimeout when zero, none when negative).
	StartTimeout time.Duration
	// MaxHandoffs caps the handoffs of one session that are not final
	// (DefaultMaxHandoffs when zero, no cap when negative); a proposal
	// past it is rejected with ErrLimit. It is also the default of
	// Limits.Handoffs, the same cap across all of an identity's sessions.
	MaxHandoffs int
	// MaxSessionBlocks caps the blocks one session's handoffs hold in
	// the pool until they are final, prefix hits included (half the
	// pool's capacity when zero; no cap when negative, for a destination
	// with one trusted source); a proposal past it is rejected with
	// ErrLimit. It is also the default of Limits.Blocks, the same cap
	// across all of an identity's sessions.
	MaxSessionBlocks int
	// IdentityLimits, if set, returns the caps of one identity across
	// all its sessions: blocks held, handoffs in flight, sessions (see
	// Limits; a zero field takes the default). The identity is
	// Peer.Identity, or for an insecure session "addr:" and the peer's
	// host. It is asked when a session of an identity that holds nothing
	// opens, on that session's goroutine, and must not block.
	IdentityLimits func(identity string) Limits
	// MaxSessions caps the control sessions served at once, every
	// identity together (DefaultMaxSessions when zero, no cap when
	// negative); one more is refused at the end of its handshake
	// (HalfStats.SessionsRefused; the source's NewSource fails with
	// ErrLimit).
	MaxSessions int
	// SessionIdleTimeout closes a session that has had no handoff in
	// flight for that long (DefaultSessionIdleTimeout when zero, never
	// when negative; HalfStats.IdleClosed): its source finds the session
	// lost (ErrConnLost) and dials again.
	SessionIdleTimeout time.Duration
}

// noCap stands for "no cap" (a negative MaxHandoffs or MaxSessionBlocks):
// more than any session can reach, with room to double on 32-bit ints.
const noCap = 1 << 29

// Defaults of DestinationConfig's per-session bounds.
const (
	DefaultStartTimeout = 10 * time.Second
	DefaultMaxHandoffs  = 256
)

// NewDestination returns the destination half over pool and plane. The
// envelope must be valid, its BlockBytes equal the pool's and its Layout
// name the pool's layout if the pool's memory describes one
// (ErrInvalidArgument).
func NewDestination[R any](pool *kvlease.Pool[R], plane RecvPlane[R], cfg DestinationConfig[R]) (*Destination[R], error) {
	if pool == nil || plane == nil {
		return nil, fmt.Errorf("kvlease: handoff destination: nil pool or plane: %w", kvlease.ErrInvalidArgument)
	}
	if err := cfg.defaults("destination", "source", false); err != nil {
		return nil, fmt.Errorf("kvlease: handoff destination: %w", err)
	}
	if cfg.StartTimeout == 0 {
		cfg.StartTimeout = DefaultStartTimeout
	}
	switch {
	case cfg.MaxHandoffs == 0:
		cfg.MaxHandoffs = DefaultMaxHandoffs
	case cfg.MaxHandoffs < 0:
		cfg.MaxHandoffs = noCap
	}
	switch {
	case cfg.MaxSessionBlocks == 0:
		cfg.MaxSessionBlocks = max(1, pool.Memory().Blocks()/2)
	case cfg.MaxSessionBlocks < 0:
		cfg.MaxSessionBlocks = noCap
	}
	switch {
	case cfg.MaxSessions == 0:
		cfg.MaxSessions = DefaultMaxSessions
	case cfg.MaxSessions < 0:
		cfg.MaxSessions = noCap
	}
	if cfg.SessionIdleTimeout == 0 {
		cfg.SessionIdleTimeout = DefaultSessionIdleTimeout
	}
	if pool.Memory().BlockBytes() != cfg.Envelope.BlockBytes {
		return nil, fmt.Errorf("kvlease: handoff destination: pool blocks of %d bytes, envelope %d: %w", pool.Memory().BlockBytes(), cfg.Envelope.BlockBytes, kvlease.ErrInvalidArgument)
	}
	if err := checkMemoryLayout("destination", pool.Memory(), cfg.Envelope); err != nil {
		return nil, err
	}
	return &Destination[R]{pool: pool, plane: plane, cfg: cfg}, nil
}

// session is one control connection served by a Destination.
type session[R any] struct {
	d    *Destination[R]
	c    *ctrl
	id   uint64
	peer *Peer
	who  *identity // the peer's share across its sessions

	// The session's share: handoffs not final, and the blocks they hold
	// or will. Counted down the moment a handoff becomes final (atomics:
	// under the handoff's lock, which comes after mu).
	inflight, held atomic.Int64
	idleSince      atomic.Int64               // when inflight last fell to 0 (UnixNano)
	closing        atomic.Pointer[closeCause] // set when the destination closes the session itself

	mu     sync.Mutex
	in     map[uint64]*Incoming[R] // the handoffs not final yet (and those about to leave)
	recent recentIDs               // ids that left in
	lost   error
	idle   *time.Timer // SessionIdleTimeout's
}

// Stats returns what the destination refused and why, over all its
// sessions.
func (d *Destination[R]) Stats() HalfStats { return d.stats.snapshot() }

// Serve authenticates one control connection (cfg.Auth; the handshake is
// bounded by HandshakeTimeout) and serves it until it ends, and returns
// why: an error wrapping ErrAuth for a peer that could not be
// authenticated (nothing of it was acted on), one wrapping ErrLimit for
// a session refused by MaxSessions or its identity's Limits.Sessions
// (the source is told in its handshake), io.EOF for a clean close, the
// idle timeout's error for a session closed idle (SessionIdleTimeout),
// an error wrapping ErrProtocolFatal (and ErrProtocol) for a malformed frame (and ErrAuth too
// for a record that does not verify). When it returns, every handoff of
// the connection that had not started is aborted (ErrConnLost); a
// started one is asked to stop and ends by its plane's evidence: Failed
// when its data stopped short.
func (d *Destination[R]) Serve(conn net.Conn) error { return d.serve(conn, nil) }

// serve is Serve; authenticated, if set, is called once the handshake
// has ended (either way) and reports false when the connection was
// closed meanwhile to make room for others (Listen's pending caps).
func (d *Destination[R]) serve(conn net.Conn, authenticated func() bool) error {
	var who *identity
	admit := func(p *Peer) (err error) {
		who, err = d.join(p)
		return err
	}
	h, err := authenticateAdmit(conn, false, d.cfg.Auth, d.cfg.Envelope.Fingerprint(), d.cfg.HandshakeTimeout, admit)
	if authenticated != nil && !authenticated() {
		// Given way to newer connections: counted (Busy) when it was.
		if err == nil {
			d.leave(who)
			err = fmt.Errorf("kvlease: handoff destination: handshake of %v closed to make room (MaxPendingHandshakesPerHost, MaxPendingHandshakes): %w", conn.RemoteAddr(), ErrAuth)
		}
		_ = conn.Close()
		return err
	}
	if err != nil {
		if who != nil { // admitted, then the confirm failed
			d.leave(who)
		}
		d.stats.authFailed(err)
		_ = conn.Close()
		return err
	}
	d.stats.sessions.Add(1)
	if d.cfg.Auth == nil {
		d.cfg.Logf("kvlease: handoff destination %s: session with %v is UNAUTHENTICATED (Insecure)", d.cfg.Name, conn.RemoteAddr())
	}
	s := &session[R]{d: d, c: newCtrl(h.conn2, d.cfg.FrameTimeout), id: sessions.Add(1), peer: h.peer, who: who, in: make(map[uint64]*Incoming[R])}
	s.c.ch = h.ch
	s.watchIdle()
	for {
		m, err := s.c.read()
		if err != nil {
			if cc := s.closing.Load(); cc != nil {
				err = fmt.Errorf("%w (%w)", cc.err, err)
			} else {
				d.stats.readFailed(err)
			}
			_ = s.c.c.Close()
			s.end(err)
			d.leave(who)
			return err
		}
		switch m := m.(type) {
		case *ProposeMsg:
			s.propose(m)
		case *StartMsg:
			if in := s.get(m); in != nil {
				go in.start(m) // Receive may wait for its data connection
			}
		case *AbortMsg:
			if in := s.get(m); in != nil {
				_ = in.abort(d.cfg.Peer, peerErr("abort", m.Cause, kvlease.ErrAborted), false)
				_ = s.c.send(&AckMsg{ID: m.ID, Of: MsgAbort})
			}
		case *AckMsg:
			_ = s.get(m)
		default:
			d.cfg.report(fmt.Errorf("kvlease: handoff destination: unexpected %v for handoff %d: %w", m.Type(), m.Handoff(), ErrProtocolRefused))
		}
	}
}

// MaxPendingHandshakes is how many control connections Listen
// authenticates at once (HalfStats.Busy counts those it closes to keep
// to it and to MaxPendingHandshakesPerHost).
const MaxPendingHandshakes = 64

// Listen accepts control connections on ln and serves each (Serve) on a
// goroutine of its own, until ln is closed; it then returns nil (the
// sessions it started go on until their connections end). Connections
// in their handshake are bounded per host and in all: one more from a
// host with MaxPendingHandshakesPerHost in their handshake is closed at
// once; when MaxPendingHandshakes are, the oldest handshake of the host
// with the most gives way to the new connection (unless that host is
// the new one's: then the new one is closed). A host with fewer
// handshakes pending than the busiest always gets in, however many
// connections another holds or redials. Each closed one counts in
// HalfStats.Busy. An Accept error other than a closed listener (EMFILE,
// a reset before accept) is counted (HalfStats.AcceptErrors) and
// retried after a backoff that doubles from 5 ms to 1 s.
func (d *Destination[R]) Listen(ln net.Listener) error {
	waiting := pending.New(MaxPendingHandshakes, MaxPendingHandshakesPerHost)
	backoff := time.Duration(0)
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			d.stats.acceptErrors.Add(1)
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		t, gaveWay := waiting.Admit(c.RemoteAddr(), c)
		if gaveWay {
			d.stats.busy.Add(1)
		}
		if t == nil {
			d.stats.busy.Add(1)
			_ = c.Close()
			continue
		}
		go func() { _ = d.serve(c, t.Release) }()
	}
}

// get returns the handoff m names, or nil. A message for a handoff that
// is final and left the table is answered as the final handoff would:
// an Ack is dropped, an Abort acknowledged, anything else reported.
func (s *session[R]) get(m Message) *Incoming[R] {
	s.mu.Lock()
	in := s.in[m.Handoff()]
	st, recent := s.recent.state(m.Handoff())
	s.mu.Unlock()
	if in == nil {
		answerAbsent(s.c, s.d.cfg.report, "destination", m, st, recent)
	}
	return in
}

func (s *session[R]) end(cause error) {
	s.mu.Lock()
	if s.idle != nil {
		s.idle.Stop()
	}
	s.lost = fmt.Errorf("%w: %w", ErrConnLost, cause)
	all := make([]*Incoming[R], 0, len(s.in))
	for _, in := range s.in {
		all = append(all, in)
	}
	s.mu.Unlock()
	for _, in := range all {
		in.connLost(s.lost)
	}
}

// connLost ends a handoff whose control connection is gone. One not yet
// started is aborted (its lease's blocks return at once). A started one
// is not: losing the source's word is not evidence about our memory. Its
// transfer is asked to stop, and the plane's evidence decides: Failed
// when it stopped short (a dead peer's data connection dies too), or
// Delivered when every block had already arrived intact.
func (in *Incoming[R]) connLost(lost error) {
	in.mu.Lock()
	if in.state == Transferring || in.state == Aborting || in.state == Quarantined {
		t := in.t
		in.unlock()
		t.Cancel()
		return
	}
	in.unlock()
	_ = in.abort(in.s.d.cfg.Name, lost, false)
}

// Incoming is one handoff seen from the destination. All methods are safe
// for concurrent use.
type Incoming[R any] struct {
	machine
	s       *session[R]
	id      uint64
	request string
	hashes  []kvlease.BlockHash
	seed    kvlease.BlockHash
	tokens  []int32
	n, from int
	lease   *kvlease.Lease[R]
	t       *kvlease.Transfer
	sealErr error // why a delivered block was left unsealed
}

func (in *Incoming[R]) pid() PlaneID {
	return PlaneID{Session: in.s.id, Handoff: in.id, Peer: in.s.peer}
}

// Peer returns the proposer as the session's handshake authenticated it.
func (in *Incoming[R]) Peer() *Peer { return in.s.peer }

// forget moves a handoff that became final (in st) out of the session's
// table into the recent ids. It runs as an effect of the final move,
// after in.mu is released (lock order: s.mu before in.mu).
func (s *session[R]) forget(in *Incoming[R], st State) {
	s.mu.Lock()
	retire(s.in, &s.recent, in.id, in, st)
	s.mu.Unlock()
}

// checkTokens refuses a proposal whose tokens do not match it: more
// tokens than its blocks hold, or hashes that are not their chain.
func checkTokens(m *ProposeMsg, bt int) error {
	if len(m.Tokens) > int(m.Blocks)*bt {
		return fmt.Errorf("kvlease: handoff %d: %d tokens for %d blocks of %d: %w", m.ID, len(m.Tokens), m.Blocks, bt, kvlease.ErrInvalidArgument)
	}
	want := kvlease.ChainHashes(m.Seed, m.Tokens, bt)
	if len(want) != len(m.Hashes) {
		return fmt.Errorf("kvlease: handoff %d: %d hashes for %d full blocks of tokens: %w", m.ID, len(m.Hashes), len(want), kvlease.ErrInvalidArgument)
	}
	for i, h := range m.Hashes {
		if h != want[i] {
			return fmt.Errorf("kvlease: handoff %d: hash %d is not the chain of its tokens: %w", m.ID, i, kvlease.ErrInvalidArgument)
		}
	}
	return nil
}

// acquire takes the destination lease: with tokens, AcquirePrefixTokens
// (in verified mode every hit is checked against them); a pool without a
// block size cannot, and takes the hash hits instead.
func acquire[R any](pool *kvlease.Pool[R], owner string, m *ProposeMsg, n int) (*kvlease.Lease[R], int, error) {
	if len(m.Tokens) > 0 {
		l, from, err := pool.AcquirePrefixTokens(owner, m.Seed, m.Tokens, n)
		if err == nil || !errors.Is(err, kvlease.ErrInvalidArgument) {
			return l, from, err
		}
	}
	return pool.AcquirePrefix(owner, m.Hashes, n)
}

// propose answers a proposal: Reject or Accept.
func (s *session[R]) propose(m *ProposeMsg) {
	d := s.d
	s.mu.Lock()
	if _, dup := s.in[m.ID]; dup || s.recent.has(m.ID) {
		s.mu.Unlock()
		// The first handoff with this id is untouched.
		d.stats.duplicates.Add(1)
		err := fmt.Errorf("kvlease: handoff destination: id %d already used on this connection: %w", m.ID, ErrState)
		d.cfg.report(err)
		_ = s.c.send(&RejectMsg{ID: m.ID, Code: RejectDuplicate, Reason: err.Error()})
		return
	}
	var limit error
	inflight, held := s.inflight.Load(), s.held.Load()
	switch {
	case inflight >= int64(d.cfg.MaxHandoffs) || len(s.in) >= 2*d.cfg.MaxHandoffs:
		limit = fmt.Errorf("kvlease: handoff %d: %d handoffs of this session in flight, at most %d: %w", m.ID, inflight, d.cfg.MaxHandoffs, ErrLimit)
	case held+int64(m.Blocks) > int64(d.cfg.MaxSessionBlocks):
		limit = fmt.Errorf("kvlease: handoff %d: %d more blocks would make this session hold %d, at most %d: %w", m.ID, m.Blocks, held+int64(m.Blocks), d.cfg.MaxSessionBlocks, ErrLimit)
	}
	counter := &d.stats.limitRefused
	if limit == nil {
		if limit = s.who.take(m.ID, int64(m.Blocks)); limit != nil {
			counter = &d.stats.identityRefused
		}
	}
	if limit != nil {
		// Refused before any state: nothing enters the table, so a peer
		// that keeps proposing costs no memory.
		s.recent.add(m.ID, Rejected)
		s.mu.Unlock()
		counter.Add(1)
		_ = s.c.send(&RejectMsg{ID: m.ID, Code: RejectLimit, Reason: limit.Error()})
		return
	}
	in := &Incoming[R]{machine: newMachine(), s: s, id: m.ID, request: m.Request, hashes: m.Hashes, seed: m.Seed, tokens: m.Tokens, n: int(m.Blocks)}
	in.hooks = d.hooks
	s.in[m.ID] = in
	s.inflight.Add(1)
	s.held.Add(int64(in.n))
	in.onFinal = func() {
		if s.inflight.Add(-1) == 0 {
			s.idleSince.Store(time.Now().UnixNano())
		}
		s.held.Add(-int64(in.n))
		d.done(s.who, int64(in.n))
		st := in.state
		in.later(func() { s.forget(in, st) })
	}
	in.mu.Lock()
	in.fire(d.cfg.Peer, EventPropose, nil)
	s.mu.Unlock()

	var err, aerr error
	if d.cfg.Authorize != nil {
		aerr = d.cfg.Authorize(s.peer, m)
	}
	switch {
	case aerr != nil:
		err = fmt.Errorf("kvlease: handoff %d: %v not authorized: %w (%w)", m.ID, s.peer, aerr, ErrRejected)
		d.stats.unauthorized.Add(1)
	case m.Envelope != d.cfg.Envelope.Fingerprint():
		err = envelopeMismatch(m.ID, m.Envelope, d.cfg.Envelope)
	case in.n > d.cfg.Envelope.BlocksFor(d.cfg.Envelope.MaxContextTokens):
		err = fmt.Errorf("kvlease: handoff %d: %d blocks exceed a maximum-context request: %w", m.ID, in.n, kvlease.ErrExceedsCapacity)
	case len(m.Tokens) > 0 && checkTokens(m, d.cfg.Envelope.BlockTokens) != nil:
		err = checkTokens(m, d.cfg.Envelope.BlockTokens)
	case d.cfg.Decide != nil:
		if derr := d.cfg.Decide(m); derr != nil {
			err = fmt.Errorf("kvlease: handoff %d: %w (%w)", m.ID, derr, ErrRejected)
		}
	}
	var accept []byte
	if err == nil {
		owner := m.Request
		if owner == "" {
			owner = fmt.Sprintf("handoff-%d", m.ID)
		}
		in.lease, in.from, err = acquire(d.pool, owner, m, in.n)
	}
	if err == nil && in.from < in.n {
		accept, err = d.plane.Prepare(in.pid(), in.n-in.from)
		if err == nil && len(accept) > MaxPlane {
			err = fmt.Errorf("kvlease: handoff %d: plane accept bytes %d exceed %d: %w", m.ID, len(accept), MaxPlane, kvlease.ErrInvalidArgument)
		}
	}
	if err != nil {
		if in.lease != nil {
			in.lease.Release()
			in.lease = nil
		}
		in.fire(d.cfg.Name, EventReject, err)
		in.unlock()
		in.final()
		_ = s.c.send(&RejectMsg{ID: m.ID, Code: rejectCode(err), Reason: err.Error()})
		return
	}
	in.fire(d.cfg.Name, EventAccept, nil)
	if st := d.cfg.StartTimeout; st > 0 {
		in.deadline(st, func() { in.startTimeout(st) })
	}
	in.unlock()
	if d.cfg.OnAccept != nil {
		d.cfg.OnAccept(in)
	}
	if err := s.c.send(&AcceptMsg{ID: m.ID, From: uint32(in.from), Plane: accept}); err != nil {
		_ = s.c.c.Close() // the read loop ends the session
	}
}

// startTimeout is the start timer's handler: it aborts the handoff if it
// is still Accepted after d (the source never started it). Nothing was
// attached, so the lease's blocks return at once.
func (in *Incoming[R]) startTimeout(d time.Duration) {
	err := fmt.Errorf("kvlease: handoff %d: no start within %v: %w", in.id, d, ErrLimit)
	in.mu.Lock()
	if in.state != Accepted {
		in.unlock()
		return
	}
	// Counted before the abort makes the handoff final (OnFinal, Done).
	in.s.d.stats.startTimeouts.Add(1)
	_ = in.abortLocked(in.s.d.cfg.Name, err, true)
}

// start takes the source's Start: the plane receives into the wanted
// blocks.
func (in *Incoming[R]) start(m *StartMsg) {
	d := in.s.d
	in.mu.Lock()
	if next(in.state, EventAttach).kind != edgeMove {
		st := in.state
		in.unlock()
		d.cfg.report(fmt.Errorf("kvlease: handoff %d: start while %v: %w", in.id, st, ErrProtocolRefused))
		return
	}
	regions := make([]R, 0, in.n-in.from)
	var err error
	for i := in.from; i < in.n && err == nil; i++ {
		var r R
		r, err = in.lease.Region(i)
		regions = append(regions, r)
	}
	in.unlock()
	if err == nil {
		if in.from == in.n {
			t := kvlease.NewTransfer(nil)
			if err = in.attach(t); err == nil {
				t.Resolve(nil)
			}
		} else {
			err = d.plane.Receive(in.pid(), regions, m.Plane, in.attach)
		}
	}
	if err != nil {
		in.mu.Lock()
		attached := in.t != nil
		var kind edgeKind
		if !attached {
			kind, _ = in.fire(d.cfg.Name, EventStartFail, err)
			if kind == edgeMove {
				in.lease.Release()
			}
		}
		in.unlock()
		if kind == edgeMove {
			in.final()
			_ = in.s.c.send(&DoneMsg{ID: in.id, Err: err.Error()})
		}
	}
}

// attach is the plane's attach callback: under in.mu, and only from
// Accepted, the transfer gates the wanted blocks as a Write. From then on
// the transfer's OnResolve callback (resolved) and the deadline's timer
// (expire) are the handlers of the evidence.
func (in *Incoming[R]) attach(t *kvlease.Transfer) error {
	if t == nil {
		return fmt.Errorf("kvlease: handoff attach: nil transfer: %w", kvlease.ErrInvalidArgument)
	}
	in.mu.Lock()
	if next(in.state, EventAttach).kind != edgeMove {
		err := fmt.Errorf("kvlease: handoff %d: attach while %v: %w", in.id, in.state, ErrState)
		in.unlock()
		return err
	}
	if err := in.lease.AttachRange(t, in.from, in.n, kvlease.Write); err != nil {
		in.unlock()
		return fmt.Errorf("kvlease: handoff %d: attach: %w", in.id, err)
	}
	in.t = t
	in.tid = t.ID()
	in.fire("transport", EventAttach, nil)
	if in.timer != nil { // the start timer: the start came
		in.timer.Stop()
		in.timer = nil
	}
	in.deadline(in.s.d.cfg.Deadline, in.expire)
	in.unlock()
	t.OnResolve(in.resolved)
	return nil
}

// resolved is the handler of the transfer's evidence: it runs once,
// inside the plane's Resolve, so State is current when Resolve returns.
// Telling the source and the callbacks (finish) run on a goroutine of
// their own, off the plane's.
func (in *Incoming[R]) resolved(err error) {
	if err, ok := in.arrive(err); ok {
		in.resolvedLocked(err)
		in.unlock()
	}
}

// resolvedLocked is resolved with in.mu held: what settle recorded is
// told and called back on a goroutine of its own, after unlock.
func (in *Incoming[R]) resolvedLocked(err error) {
	if msg, ok := in.settle(err); ok {
		in.later(func() { go in.finish(msg) })
	}
}

// expire is the deadline's handler: it gives up on evidence.
func (in *Incoming[R]) expire() {
	d := in.s.d
	in.mu.Lock()
	if in.state.Final() {
		in.unlock()
		return
	}
	if in.t.State() == kvlease.TransferResolved {
		// The evidence came; its callback waits for our lock.
		msg, ok := in.settle(in.t.Err())
		in.unlock()
		if ok {
			in.finish(msg)
		}
		return
	}
	reason := fmt.Errorf("kvlease: handoff %d: no evidence within %v: %w", in.id, d.cfg.Deadline, kvlease.ErrQuarantined)
	in.t.Quarantine(reason)
	kind, from := in.fire("deadline", EventExpire, reason)
	if kind == edgeMove {
		d.stats.quarantined.Add(1) // before the late evidence can make it final
	}
	if kind == edgeMove && from == Transferring {
		if err, ok := in.effect(func() { in.stop(reason) }); ok {
			in.resolvedLocked(err)
		}
	}
	in.unlock()
	if kind == edgeMove && d.hooks.is(mutantFreeOnTimeout) {
		in.t.Resolve(reason) // the mutant: time taken for evidence
	}
	if kind == edgeMove {
		// Without the lock: the late evidence may make the handoff final
		// meanwhile (Stats counted it already).
		d.cfg.quarantined(in.id, reason)
	}
	if kind == edgeMove && from == Transferring {
		_ = in.s.c.send(&AbortMsg{ID: in.id, Cause: "destination deadline passed"})
	}
}

// settle records the transfer's evidence (its outcome err) unless the
// handoff is final already: Delivered seals the wanted blocks, Failed
// releases the lease. It returns the Done message to send (nil when the
// source was not waiting for one) and whether it recorded anything; the
// caller then calls finish, without in.mu. Called with in.mu held.
func (in *Incoming[R]) settle(err error) (*DoneMsg, bool) {
	if in.state.Final() {
		return nil, false
	}
	from := in.state
	if (err == nil || in.s.d.hooks.is(mutantSealShort)) && from == Transferring {
		in.seal()
	}
	if err == nil {
		in.fire("transport", EventResolve, nil)
	} else {
		in.fire("transport", EventResolveError, err)
	}
	if in.state == Failed {
		in.lease.Release()
	}
	if from != Transferring {
		return nil, true
	}
	msg := &DoneMsg{ID: in.id}
	if err != nil {
		msg.Err = err.Error()
	}
	return msg, true
}

// finish tells the source the outcome (msg, if any) first, since it is
// waiting, then runs the final callbacks.
func (in *Incoming[R]) finish(msg *DoneMsg) {
	if msg != nil {
		_ = in.s.c.send(msg)
	}
	in.final()
}

// seal seals the delivered full blocks on arrival, so the decode side's
// cache fills: with their tokens when the proposal carried them (the
// only way in verified mode), else with their hashes. A block the pool
// refuses to seal (a pool without a block size given tokens, a verified
// pool given only hashes) ends the chain there and is reported: the
// blocks arrived intact all the same, so the handoff is still
// delivered. Called with in.mu held.
func (in *Incoming[R]) seal() {
	bt := in.s.d.cfg.Envelope.BlockTokens
	for i := in.from; i < min(in.n, len(in.hashes)); i++ {
		var err error
		if len(in.tokens) > 0 {
			parent := in.seed
			if i > 0 {
				parent = in.hashes[i-1]
			}
			_, err = in.lease.SealTokens(i, parent, in.tokens[i*bt:(i+1)*bt])
		}
		if len(in.tokens) == 0 || err != nil {
			if serr := in.lease.Seal(i, in.hashes[i]); serr == nil {
				err = nil
			} else if err == nil {
				err = serr
			}
		}
		if err != nil {
			// Reported by final, outside our lock.
			in.sealErr = fmt.Errorf("kvlease: handoff %d: delivered block %d left unsealed (and the %d after it): %w", in.id, i, min(in.n, len(in.hashes))-i-1, err)
			return
		}
	}
}

// final runs the callbacks of a final handoff, once.
func (in *Incoming[R]) final() {
	d := in.s.d
	in.mu.Lock()
	st, sealErr := in.state, in.sealErr
	in.unlock()
	if sealErr != nil {
		d.cfg.report(sealErr)
	}
	if st == Delivered {
		if d.cfg.OnDelivered != nil {
			d.cfg.OnDelivered(in)
		} else {
			in.lease.Release()
		}
	}
	if d.cfg.OnFinal != nil {
		d.cfg.OnFinal(in)
	}
}

// Reject refuses the handoff from the destination (by names the
// component) before a transfer is attached: the lease is released, the
// plane forgets it, the source is told, and a Start that crosses the
// reject is refused. ErrState once attached (use Abort).
func (in *Incoming[R]) Reject(by string, reason error) error {
	if reason == nil {
		reason = ErrRejected
	}
	in.mu.Lock()
	kind, from := in.fire(by, EventReject, reason)
	if kind == edgeRefuse {
		st := in.state
		in.unlock()
		return fmt.Errorf("kvlease: handoff %d: reject while %v: %w", in.id, st, ErrState)
	}
	if kind == edgeMove && in.lease != nil {
		in.lease.Release()
	}
	in.unlock()
	if kind == edgeMove {
		if from == Accepted {
			in.s.d.plane.Forget(in.pid())
		}
		_ = in.s.c.send(&RejectMsg{ID: in.id, Code: rejectCode(reason), Reason: reason.Error()})
		in.final()
	}
	return nil
}

// Abort gives up on the handoff from the destination: the lease is
// aborted and the transfer cancelled (its blocks drain until the plane's
// evidence) and the source is told. Idempotent; ErrState after Rejected, Delivered or Failed.
func (in *Incoming[R]) Abort(by string, cause error) error {
	if cause == nil {
		cause = kvlease.ErrAborted
	}
	return in.abort(by, cause, true)
}

func (in *Incoming[R]) abort(by string, cause error, tell bool) error {
	in.mu.Lock()
	return in.abortLocked(by, cause, tell)
}

// abortLocked is abort, called with in.mu held; it unlocks it.
func (in *Incoming[R]) abortLocked(by string, cause error, tell bool) error {
	kind, from := in.fire(by, EventAbort, cause)
	if kind == edgeRefuse {
		st := in.state
		in.unlock()
		return fmt.Errorf("kvlease: handoff %d: abort while %v: %w", in.id, st, ErrState)
	}
	if kind == edgeMove && in.lease != nil {
		// The transfer's cancel hook may resolve it at once: effect
		// takes that evidence.
		if err, ok := in.effect(func() { in.stop(cause) }); ok {
			in.resolvedLocked(err)
		}
	}
	in.unlock()
	if kind == edgeMove {
		if from == Accepted {
			in.s.d.plane.Forget(in.pid())
		}
		if tell {
			_ = in.s.c.send(&AbortMsg{ID: in.id, Cause: cause.Error()})
		}
		if from != Transferring {
			in.final()
		}
	}
	return nil
}

// stop is the effect of an abort or an expiry: the lease is aborted and
// the transfer, if one is attached, cancelled itself: a lease its caller
// released already is closed, and its Abort cancels nothing (see
// Outgoing.stop). Called inside effect, with in.mu held.
func (in *Incoming[R]) stop(cause error) {
	in.lease.Abort(cause)
	if in.t != nil {
		in.t.Cancel()
	}
}

// State returns the handoff's state. It only reads: the handlers of the
// source's messages, of the transfer's evidence (run inside its Resolve)
// and of the timers make every change.
func (in *Incoming[R]) State() State { return in.current() }

// Err returns the error of the step that entered the current state.
func (in *Incoming[R]) Err() error { return in.err() }

// History returns a copy of every step so far, oldest first.
func (in *Incoming[R]) History() []Step { return in.steps() }

// Done is closed when the handoff reaches a final state.
func (in *Incoming[R]) Done() <-chan struct{} { return in.done }

// ID returns the handoff id; Request the proposal's request name.
func (in *Incoming[R]) ID() uint64      { return in.id }
func (in *Incoming[R]) Request() string { return in.request }

// Blocks returns the number of blocks handed off; Hits how many of them
// were hits in this side's prefix cache (not transferred).
func (in *Incoming[R]) Blocks() int { return in.n }
func (in *Incoming[R]) Hits() int   { return in.from }

// Lease returns the destination lease (nil before Accept). It belongs to
// the handoff until Delivered, then to OnDelivered's callee.
func (in *Incoming[R]) Lease() *kvlease.Lease[R] {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.lease
}

// Transfer returns the destination's transfer, or nil before Start.
func (in *Incoming[R]) Transfer() *kvlease.Transfer {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.t
}

// Wait blocks until the handoff is final or d passes, and returns its state.
func (in *Incoming[R]) Wait(d time.Duration) State {
	select {
	case <-in.done:
	case <-time.After(d):
	}
	return in.State()
}

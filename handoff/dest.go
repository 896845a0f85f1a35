package handoff

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/internal/wire"
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

// ProposeMsg is a source's proposal as DestinationConfig's Decide and
// Authorize see it: the handoff's ID, its Request name, how many Blocks,
// the Envelope's fingerprint, the full blocks' chained Hashes and, when
// proposed with Source.ProposeTokens, the Tokens and their namespace
// Seed. Its wire form is the control protocol's business.
type ProposeMsg = wire.ProposeMsg

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
	// before Decide, on the connection's read loop. It sees the
	// proposal's tenant namespace (p.Namespace) too.
	Authorize func(peer *Peer, p *ProposeMsg) error
	// Tenant, if set, is the destination's tenant policy: given the
	// authenticated proposer and the namespace it proposes (p.Namespace,
	// "" for blocks of no tenant), it returns the tenant of the pool the
	// blocks are taken and sealed for (nil: no tenant), or an error that
	// rejects the proposal. It runs after Authorize, for every proposal.
	// The destination then refuses (ErrNamespace) a tenant whose
	// namespace is not the proposed one, and a proposal under a namespace
	// that carries no tokens or whose Seed is not the tenant's seed for
	// p.Salt (kvlease.Pool.TenantSeed): blocks are sealed only in the
	// namespace, and under the root, of a tenant the policy allows that
	// proposer. The tenant's lease takes the blocks under its quota.
	// Without a policy every proposal under a namespace is refused
	// (ErrNamespace); the others are served as before, for no tenant.
	Tenant func(peer *Peer, p *ProposeMsg) (*kvlease.Tenant[R], error)
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
	// when negative; HalfStats.IdleClosed): its source's Done closes
	// (Err wraps ErrConnLost), and its owner dials a new session.
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
	c    *wire.Conn
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
// an error wrapping ErrProtocol for a malformed frame (and ErrAuth too
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
			err = fmt.Errorf("kvlease: handoff destination: handshake of %v closed to make room (pending handshakes: 16 per host, 64 in all): %w", conn.RemoteAddr(), ErrAuth)
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
	s := &session[R]{d: d, c: wire.NewConn(h.conn2, h.ch, d.cfg.FrameTimeout), id: sessions.Add(1), peer: h.peer, who: who, in: make(map[uint64]*Incoming[R])}
	s.watchIdle()
	for {
		m, err := s.c.Read()
		if err != nil {
			if cc := s.closing.Load(); cc != nil {
				err = fmt.Errorf("%w (%w)", cc.err, err)
			} else {
				d.stats.readFailed(err)
			}
			_ = s.c.Close()
			s.end(err)
			d.leave(who)
			return err
		}
		switch m := m.(type) {
		case *ProposeMsg:
			s.propose(m)
		case *wire.StartMsg:
			if in := s.get(m); in != nil {
				go in.start(m) // Receive may wait for its data connection
			}
		case *wire.AbortMsg:
			if in := s.get(m); in != nil {
				_ = in.abort(d.cfg.Peer, peerErr("abort", m.Cause, kvlease.ErrAborted), false)
				_ = s.c.Send(&wire.AckMsg{ID: m.ID, Of: wire.MsgAbort})
			}
		case *wire.AckMsg:
			_ = s.get(m)
		default:
			d.cfg.report(fmt.Errorf("kvlease: handoff destination: unexpected %v for handoff %d: %w", m.Type(), m.Handoff(), wire.ErrProtocolRefused))
		}
	}
}

// maxPendingHandshakes is how many control connections Listen
// authenticates at once, a fixed bound (HalfStats.Busy counts those it
// closes to keep to it and to maxPendingHandshakesPerHost).
const maxPendingHandshakes = 64

// Listen accepts control connections on ln and serves each (Serve) on a
// goroutine of its own, until ln is closed; it then returns nil (the
// sessions it started go on until their connections end). Connections
// in their handshake are bounded per host and in all: one more from a
// host with maxPendingHandshakesPerHost in their handshake is closed at
// once; when maxPendingHandshakes are, the oldest handshake of the host
// with the most gives way to the new connection (unless that host is
// the new one's: then the new one is closed). A host with fewer
// handshakes pending than the busiest always gets in, however many
// connections another holds or redials. Each closed one counts in
// HalfStats.Busy. An Accept error other than a closed listener (EMFILE,
// a reset before accept) is counted (HalfStats.AcceptErrors) and
// retried after a backoff that doubles from 5 ms to 1 s.
func (d *Destination[R]) Listen(ln net.Listener) error {
	waiting := pending.New(maxPendingHandshakes, maxPendingHandshakesPerHost)
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
func (s *session[R]) get(m wire.Message) *Incoming[R] {
	s.mu.Lock()
	in := s.in[m.Handoff()]
	st, recent := s.recent.state(m.Handoff())
	s.mu.Unlock()
	if in == nil {
		answerAbsent(s.c, s.d.cfg.report, &s.d.stats, "destination", m, st, recent)
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

// ErrNamespace is wrapped by the rejection of a proposal whose tenant
// namespace the destination does not allow its proposer (see
// DestinationConfig.Tenant), on the destination and in the source's
// Outgoing.Err (the Reject carries its own code). It wraps ErrRejected.
var ErrNamespace = fmt.Errorf("kvlease: handoff namespace not allowed: %w", ErrRejected)

// tenantFor applies the destination's tenant policy to proposal m from
// peer: the tenant whose lease takes the blocks (nil: none), or the
// error that rejects it.
func tenantFor[R any](d *Destination[R], peer *Peer, m *ProposeMsg) (*kvlease.Tenant[R], error) {
	if d.cfg.Tenant == nil {
		if m.Namespace != "" {
			return nil, fmt.Errorf("kvlease: handoff %d: namespace %q proposed to a destination without a tenant policy: %w", m.ID, m.Namespace, ErrNamespace)
		}
		return nil, nil
	}
	t, err := d.cfg.Tenant(peer, m)
	if err != nil {
		return nil, fmt.Errorf("kvlease: handoff %d: %v may not propose namespace %q: %w (%w)", m.ID, peer, m.Namespace, err, ErrNamespace)
	}
	ns := ""
	if t != nil {
		ns = t.Namespace()
	}
	if ns != m.Namespace {
		return nil, fmt.Errorf("kvlease: handoff %d: namespace %q proposed, the tenant policy gave one of %q: %w", m.ID, m.Namespace, ns, ErrNamespace)
	}
	if ns == "" {
		return t, nil
	}
	// The chain's root must be the tenant's: a proposer allowed one
	// namespace cannot plant blocks findable under another's seed.
	if len(m.Tokens) == 0 {
		return nil, fmt.Errorf("kvlease: handoff %d: blocks of namespace %q proposed without tokens: their root cannot be checked: %w", m.ID, ns, ErrNamespace)
	}
	seed, err := d.pool.TenantSeed(t.Name(), m.Salt)
	if err != nil || seed != m.Seed {
		return nil, fmt.Errorf("kvlease: handoff %d: seed %016x is not the seed of namespace %q for salt %016x: %w", m.ID, uint64(m.Seed), ns, uint64(m.Salt), ErrNamespace)
	}
	return t, nil
}

// acquire takes the destination lease: with tokens, AcquirePrefixTokens
// (in verified mode every hit is checked against them); a pool without a
// block size cannot, and takes the hash hits instead. A tenant's lease
// (tn) takes the hash hits, its fresh blocks charged to it.
func acquire[R any](pool *kvlease.Pool[R], tn *kvlease.Tenant[R], owner string, m *ProposeMsg, n int) (*kvlease.Lease[R], int, error) {
	if tn != nil {
		return tn.AcquirePrefix(owner, m.Hashes, n)
	}
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
		_ = s.c.Send(&wire.RejectMsg{ID: m.ID, Code: wire.RejectDuplicate, Reason: err.Error()})
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
		_ = s.c.Send(&wire.RejectMsg{ID: m.ID, Code: wire.RejectLimit, Reason: limit.Error()})
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

	var err, aerr, terr error
	var tn *kvlease.Tenant[R]
	if d.cfg.Authorize != nil {
		aerr = d.cfg.Authorize(s.peer, m)
	}
	if aerr == nil {
		tn, terr = tenantFor(d, s.peer, m)
	}
	switch {
	case aerr != nil:
		err = fmt.Errorf("kvlease: handoff %d: %v not authorized: %w (%w)", m.ID, s.peer, aerr, ErrRejected)
		d.stats.unauthorized.Add(1)
	case terr != nil:
		err = terr
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
		in.lease, in.from, err = acquire(d.pool, tn, owner, m, in.n)
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
		_ = s.c.Send(&wire.RejectMsg{ID: m.ID, Code: rejectCode(err), Reason: err.Error()})
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
	if err := s.c.Send(&wire.AcceptMsg{ID: m.ID, From: uint32(in.from), Plane: accept}); err != nil {
		_ = s.c.Close() // the read loop ends the session
	}
}

package handoff

import (
	"errors"
	"fmt"
	"net"
	"sync"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/internal/wire"

	"go.uber.org/atomic"
)

var sessions atomic.Uint64 // local session numbers for PlaneIDs

// Source is the source half (the prefill side) of cross-process handoffs
// over one control connection: it holds only its own leases and speaks
// to a Destination in another process. Propose offers a lease; the
// destination's Accept starts the transfer over the SendPlane at once;
// the destination's Done, the source's own evidence and Abort (either
// side) move each Outgoing through the same states as the in-process
// Handoff.
//
// What makes the source final: Delivered needs both its own transfer's
// Resolve(nil) (no more reads of its blocks) and the destination's Done
// without error. Rejected and Failed leave the source lease open and the
// caller's. Abort (either side) aborts the source lease; its blocks drain
// until the plane proves it stopped reading. A transfer with no evidence
// by the deadline is quarantined with the lease's blocks until late
// evidence comes. Losing the control connection is not evidence: it
// rejects what had not started, and a started transfer still waits for
// its plane.
type Source[R any] struct {
	cfg     HalfConfig
	c       *wire.Conn
	plane   SendPlane[R]
	session uint64
	peer    *Peer
	stats   halfCounters

	mu     sync.Mutex
	out    map[uint64]*Outgoing[R] // handoffs not final yet
	recent recentIDs               // ids that left out
	lost   error                   // set once the connection ended
	closed chan struct{}
	hooks  *hooks // the explorer's (hooks.go); nil in production
}

// NewSource starts the source half on conn (a connected control
// connection): it authenticates the destination as cfg.Auth says (the
// handshake, bounded by HandshakeTimeout, runs before NewSource
// returns), then reads the connection on its own goroutine until it
// ends. Errors: ErrInvalidArgument for an invalid envelope or no
// authenticator (Auth, or Insecure to run without); ErrAuth when the
// destination could not be authenticated (conn is closed then, and
// nothing was sent but the handshake).
func NewSource[R any](conn net.Conn, plane SendPlane[R], cfg HalfConfig) (*Source[R], error) {
	if conn == nil || plane == nil {
		return nil, fmt.Errorf("kvlease: handoff source: nil connection or plane: %w", kvlease.ErrInvalidArgument)
	}
	if err := cfg.defaults("source", "destination", true); err != nil {
		return nil, fmt.Errorf("kvlease: handoff source: %w", err)
	}
	s := &Source[R]{cfg: cfg, plane: plane, session: sessions.Add(1),
		out: make(map[uint64]*Outgoing[R]), closed: make(chan struct{})}
	h, err := authenticate(conn, true, cfg.Auth, cfg.Envelope.Fingerprint(), cfg.HandshakeTimeout)
	if err != nil {
		s.stats.authFailed(err)
		_ = conn.Close()
		return nil, fmt.Errorf("kvlease: handoff source: %w", err)
	}
	s.stats.sessions.Add(1)
	s.peer = h.peer
	s.c = wire.NewConn(h.conn2, h.ch, cfg.FrameTimeout)
	if cfg.Auth == nil {
		cfg.Logf("kvlease: handoff source %s: session with %v is UNAUTHENTICATED (HalfConfig.Insecure)", cfg.Name, conn.RemoteAddr())
	}
	go s.readLoop()
	return s, nil
}

// Peer returns the destination as the handshake authenticated it.
func (s *Source[R]) Peer() *Peer { return s.peer }

// Stats returns what this source refused and why.
func (s *Source[R]) Stats() HalfStats { return s.stats.snapshot() }

// Done returns a channel that is closed once the session has ended: the
// destination closed it (its SessionIdleTimeout, a refusal, its
// shutdown), the connection failed, or Close was called. Err then says
// why. A Source is one session and never redials: a caller that keeps
// proposing dials a new one (NewSource) when Done closes, instead of
// learning it from a Propose that fails with ErrConnLost.
func (s *Source[R]) Done() <-chan struct{} { return s.closed }

// Err returns nil while the session is up and, once Done is closed, why
// it ended (wrapping ErrConnLost and the connection's error).
func (s *Source[R]) Err() error {
	select {
	case <-s.closed:
	default:
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lost
}

// forget moves a handoff that became final (in st) out of the table into
// the recent ids. It runs as an effect of the final move, after o.mu is
// released (lock order: s.mu before o.mu).
func (s *Source[R]) forget(o *Outgoing[R], st State) {
	s.mu.Lock()
	retire(s.out, &s.recent, o.id, o, st)
	s.mu.Unlock()
}

// ProposeOption is an option of Source.Propose and Source.ProposeTokens.
type ProposeOption func(*proposal) error

type proposal struct {
	progress  *Progress
	namespace string
	salt      kvlease.BlockHash
	named     bool // TenantNamespace given
}

// TenantNamespace says the lease's blocks are a tenant's: ns is the
// tenant's public namespace identifier (kvlease.Tenant.Namespace) and
// salt the public salt of its seed (the seed is
// kvlease.Pool.TenantSeed(tenant, salt), the one ProposeTokens is
// given). Both travel in the Propose, and the destination seals the
// blocks only under a tenant its policy allows this source, whose seed
// for salt is the proposal's (DestinationConfig.Tenant). Without it a
// lease whose first block is sealed under a namespace (its pool keeps
// seal records) is proposed under that namespace with salt 0: a hop
// never drops a block's namespace. A namespace longer than MaxText, or
// one that is not the first block's, is refused at propose
// (kvlease.ErrInvalidArgument).
func TenantNamespace(ns string, salt kvlease.BlockHash) ProposeOption {
	return func(o *proposal) error {
		if len(ns) > wire.MaxText {
			return fmt.Errorf("kvlease: handoff propose: namespace of %d bytes, at most %d: %w", len(ns), wire.MaxText, kvlease.ErrInvalidArgument)
		}
		o.namespace, o.salt, o.named = ns, salt, true
		return nil
	}
}

// namespaceOf returns the namespace src's blocks go under: the option's,
// else the first block's record's ("" when the pool keeps none or it is
// not sealed). An option that contradicts the record is refused.
func namespaceOf[R any](src *kvlease.Lease[R], pr *proposal) error {
	info, ok := src.Pool().SealInfo(src.Ref(0), nil)
	switch {
	case !ok:
	case !pr.named:
		pr.namespace = info.Namespace
	case info.Namespace != pr.namespace:
		return fmt.Errorf("namespace %q for blocks sealed under %q: %w", pr.namespace, info.Namespace, kvlease.ErrInvalidArgument)
	}
	return nil
}

// Streaming makes the handoff stream: the lease's blocks are still being
// written, and p (of as many blocks as the lease has) says how far. The
// plane sends what p marks written while the rest is computed (a
// StreamSendPlane), or once p is complete (any other SendPlane, which
// then sends its Start only after the prefill: the destination's
// StartTimeout must cover that). Nothing changes for the evidence: the
// source's transfer gates the whole lease from the start, the
// destination's Write resolves when its last write ends, an abort or a
// failure mid-stream ends both sides by their own evidence, and parts not
// yet marked are never read. The handoff's Deadline runs from the start,
// so it must cover the rest of the prefill too. A p whose layers do not
// split the envelope's blocks (BlockBytes, or the Layout's layers) is
// refused at propose (kvlease.ErrInvalidArgument).
func Streaming(p *Progress) ProposeOption {
	return func(o *proposal) error {
		if p == nil {
			return fmt.Errorf("kvlease: handoff propose: nil progress: %w", kvlease.ErrInvalidArgument)
		}
		o.progress = p
		return nil
	}
}

// checkProgress refuses a progress that does not fit the lease's n blocks
// or the envelope's geometry.
func (s *Source[R]) checkProgress(p *Progress, n int) error {
	if p == nil {
		return nil
	}
	e := s.cfg.Envelope
	switch {
	case p.Blocks() != n:
		return fmt.Errorf("progress of %d blocks for a lease of %d: %w", p.Blocks(), n, kvlease.ErrInvalidArgument)
	case e.HasLayout() && p.Layers() != 1 && p.Layers() != e.Layout.Layers:
		return fmt.Errorf("progress of %d layers for blocks of %d layers: %w", p.Layers(), e.Layout.Layers, kvlease.ErrInvalidArgument)
	case e.BlockBytes%p.Layers() != 0:
		return fmt.Errorf("progress of %d layers does not split %d-byte blocks: %w", p.Layers(), e.BlockBytes, kvlease.ErrInvalidArgument)
	}
	return nil
}

// Propose offers all blocks of src (as they are now) under handoff id id,
// with the chained hashes of its full blocks (at most src.Len()), which
// the destination uses to take its own cache hits. Errors, and no
// handoff: ErrInvalidArgument (nil lease, too many hashes, a pool whose
// layout the envelope does not name), ErrLeaseClosed,
// ErrExceedsCapacity (more blocks than a maximum-context request),
// ErrState (id already used on this connection), ErrConnLost.
func (s *Source[R]) Propose(id uint64, request string, src *kvlease.Lease[R], hashes []kvlease.BlockHash, opts ...ProposeOption) (*Outgoing[R], error) {
	return s.propose(id, request, src, hashes, 0, nil, opts)
}

// ProposeTokens is Propose for a lease whose blocks hold the KV of
// tokens (at most src.Len() blocks of the envelope's BlockTokens) under
// the namespace seed: the hashes are ChainHashes(seed, tokens), and the
// tokens travel too, so that a destination in verified mode
// (kvlease.WithVerifiedPrefix) checks its hits against them
// (AcquirePrefixTokens) and seals what arrives with them (SealTokens).
// Errors as Propose; ErrInvalidArgument also for no tokens, more tokens
// than the lease's blocks hold, or more than one frame carries.
func (s *Source[R]) ProposeTokens(id uint64, request string, src *kvlease.Lease[R], seed kvlease.BlockHash, tokens []int32, opts ...ProposeOption) (*Outgoing[R], error) {
	if src == nil {
		return nil, fmt.Errorf("kvlease: handoff propose: nil lease: %w", kvlease.ErrInvalidArgument)
	}
	bt := s.cfg.Envelope.BlockTokens
	hashes := kvlease.ChainHashes(seed, tokens, bt)
	// The payload: id, request, blocks, fingerprint, hashes, namespace
	// (at most wire.MaxText bytes) and salt, tokens.
	size := 8 + 2 + len(request) + 4 + 8 + 4 + 8*len(hashes) + 2 + wire.MaxText + 8 + 4 + 8 + 4*len(tokens)
	if len(tokens) == 0 || len(tokens) > src.Len()*bt || size > wire.MaxFrame {
		return nil, fmt.Errorf("kvlease: handoff propose %d: %d tokens for %d blocks of %d (a proposal of %d bytes, at most %d): %w",
			id, len(tokens), src.Len(), bt, size, wire.MaxFrame, kvlease.ErrInvalidArgument)
	}
	return s.propose(id, request, src, hashes, seed, tokens, opts)
}

func (s *Source[R]) propose(id uint64, request string, src *kvlease.Lease[R], hashes []kvlease.BlockHash, seed kvlease.BlockHash, tokens []int32, opts []ProposeOption) (*Outgoing[R], error) {
	if src == nil {
		return nil, fmt.Errorf("kvlease: handoff propose: nil lease: %w", kvlease.ErrInvalidArgument)
	}
	var pr proposal
	for _, opt := range opts {
		if err := opt(&pr); err != nil {
			return nil, err
		}
	}
	if _, err := src.Region(0); errors.Is(err, kvlease.ErrLeaseClosed) {
		return nil, fmt.Errorf("kvlease: handoff propose: %w", err)
	}
	if err := checkMemoryLayout("source", src.Pool().Memory(), s.cfg.Envelope); err != nil {
		return nil, fmt.Errorf("kvlease: handoff propose %d: %w", id, err)
	}
	n := src.Len()
	if limit := min(s.cfg.Envelope.BlocksFor(s.cfg.Envelope.MaxContextTokens), MaxBlocks); n > limit {
		return nil, fmt.Errorf("kvlease: handoff propose %d: %d blocks exceed the limit of %d: %w", id, n, limit, kvlease.ErrExceedsCapacity)
	}
	if len(hashes) > n || len(request) > wire.MaxText {
		return nil, fmt.Errorf("kvlease: handoff propose %d: %d hashes for %d blocks, request of %d bytes: %w", id, len(hashes), n, len(request), kvlease.ErrInvalidArgument)
	}
	if err := s.checkProgress(pr.progress, n); err != nil {
		return nil, fmt.Errorf("kvlease: handoff propose %d: %w", id, err)
	}
	if err := namespaceOf(src, &pr); err != nil {
		return nil, fmt.Errorf("kvlease: handoff propose %d: %w", id, err)
	}
	o := &Outgoing[R]{machine: newMachine(), s: s, id: id, src: src, n: n, prog: pr.progress}
	o.hooks = s.hooks
	o.onFinal = func() {
		st := o.state
		o.later(func() { s.forget(o, st) })
	}
	s.mu.Lock()
	if s.lost != nil {
		s.mu.Unlock()
		return nil, fmt.Errorf("kvlease: handoff propose %d: %w", id, s.lost)
	}
	if _, dup := s.out[id]; dup || s.recent.has(id) {
		s.mu.Unlock()
		s.stats.duplicates.Add(1)
		return nil, fmt.Errorf("kvlease: handoff propose: id %d already used on this connection: %w", id, ErrState)
	}
	s.out[id] = o
	o.mu.Lock()
	o.fire(s.cfg.Name, EventPropose, nil)
	o.unlock()
	s.mu.Unlock()
	msg := &ProposeMsg{ID: id, Request: request, Blocks: uint32(n), Envelope: s.cfg.Envelope.Fingerprint(), Hashes: hashes,
		Namespace: pr.namespace, Salt: pr.salt, Seed: seed, Tokens: tokens}
	if err := s.c.Send(msg); err != nil {
		s.connLost(err)
		return o, nil // the connection loss rejected it; History says so
	}
	return o, nil
}

// Close closes the control connection. Handoffs not yet started are
// rejected; started transfers keep waiting for their plane's evidence.
func (s *Source[R]) Close() error {
	err := s.c.Close()
	<-s.closed
	return err
}

// get returns the handoff m names, or nil. A message for a handoff that
// is final and left the table is answered as the final handoff would:
// an Ack is dropped, an Abort acknowledged, anything else reported.
func (s *Source[R]) get(m wire.Message) *Outgoing[R] {
	s.mu.Lock()
	o := s.out[m.Handoff()]
	st, recent := s.recent.state(m.Handoff())
	s.mu.Unlock()
	if o == nil {
		answerAbsent(s.c, s.cfg.report, &s.stats, "source", m, st, recent)
	}
	return o
}

func (s *Source[R]) readLoop() {
	defer close(s.closed)
	for {
		m, err := s.c.Read()
		if err != nil {
			s.stats.readFailed(err)
			s.connLost(err)
			return
		}
		switch m := m.(type) {
		case *wire.AcceptMsg:
			if o := s.get(m); o != nil {
				go o.accepted(m) // Send may dial: keep reading meanwhile
			}
		case *wire.RejectMsg:
			if o := s.get(m); o != nil {
				o.rejected(m)
			}
		case *wire.DoneMsg:
			if o := s.get(m); o != nil {
				o.doneMsg(m)
			}
		case *wire.AbortMsg:
			if o := s.get(m); o != nil {
				_ = o.abort(s.cfg.Peer, peerErr("abort", m.Cause, kvlease.ErrAborted), false)
				_ = s.c.Send(&wire.AckMsg{ID: m.ID, Of: wire.MsgAbort})
			}
		case *wire.AckMsg:
			_ = s.get(m)
		default:
			s.cfg.report(fmt.Errorf("kvlease: handoff source: unexpected %v for handoff %d: %w", m.Type(), m.Handoff(), wire.ErrProtocolRefused))
		}
	}
}

// connLost ends the session: what had not started is rejected, started
// transfers learn that the destination's word will never come.
func (s *Source[R]) connLost(cause error) {
	s.mu.Lock()
	if s.lost != nil {
		s.mu.Unlock()
		return
	}
	s.lost = fmt.Errorf("%w: %w", ErrConnLost, cause)
	lost := s.lost
	all := make([]*Outgoing[R], 0, len(s.out))
	for _, o := range s.out {
		all = append(all, o)
	}
	s.mu.Unlock()
	_ = s.c.Close()
	for _, o := range all {
		o.mu.Lock()
		kind, _ := o.fire(s.cfg.Name, EventReject, lost) // Proposed/Accepted only
		o.peerWord(s.cfg.Name, lost, kind == edgeMove)
		o.unlock()
	}
}

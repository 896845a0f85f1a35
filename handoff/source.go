package handoff

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvlease/kvlease"
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
	c       *ctrl
	plane   SendPlane[R]
	session uint64
	peer    *Peer
	stats   halfCounters

	mu     sync.Mutex
	out    map[uint64]*Outgoing[R] // handoffs not final yet
	recent recentIDs               // ids that left out
	lost   error                   // set once the connection ended
	closed chan struct{}
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
	s.c = newCtrl(h.conn2, cfg.FrameTimeout)
	s.c.ch = h.ch
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

// forget moves a final handoff out of the table into the recent ids.
func (s *Source[R]) forget(o *Outgoing[R]) {
	<-o.done
	s.mu.Lock()
	if s.out[o.id] == o {
		delete(s.out, o.id)
		s.recent.add(o.id, o.State())
	}
	s.mu.Unlock()
}

// Outgoing is one handoff seen from the source. All methods are safe for
// concurrent use.
type Outgoing[R any] struct {
	machine
	s      *Source[R]
	id     uint64
	src    *kvlease.Lease[R]
	n      int
	from   int
	t      *kvlease.Transfer
	peer   error // the destination's outcome, once known (see peerSet)
	peerOK bool  // the destination reported Done without error
	known  bool  // the destination's outcome is known
	wake   chan struct{}
}

// Propose offers all blocks of src (as they are now) under handoff id id,
// with the chained hashes of its full blocks (at most src.Len()), which
// the destination uses to take its own cache hits. Errors, and no
// handoff: ErrInvalidArgument (nil lease, too many hashes, a pool whose
// layout the envelope does not name), ErrLeaseClosed,
// ErrExceedsCapacity (more blocks than a maximum-context request),
// ErrState (id already used on this connection), ErrConnLost.
func (s *Source[R]) Propose(id uint64, request string, src *kvlease.Lease[R], hashes []kvlease.BlockHash) (*Outgoing[R], error) {
	return s.propose(id, request, src, hashes, 0, nil)
}

// ProposeTokens is Propose for a lease whose blocks hold the KV of
// tokens (at most src.Len() blocks of the envelope's BlockTokens) under
// the namespace seed: the hashes are ChainHashes(seed, tokens), and the
// tokens travel too, so that a destination in verified mode
// (kvlease.WithVerifiedPrefix) checks its hits against them
// (AcquirePrefixTokens) and seals what arrives with them (SealTokens).
// Errors as Propose; ErrInvalidArgument also for no tokens, more tokens
// than the lease's blocks hold, or more than one frame carries.
func (s *Source[R]) ProposeTokens(id uint64, request string, src *kvlease.Lease[R], seed kvlease.BlockHash, tokens []int32) (*Outgoing[R], error) {
	if src == nil {
		return nil, fmt.Errorf("kvlease: handoff propose: nil lease: %w", kvlease.ErrInvalidArgument)
	}
	bt := s.cfg.Envelope.BlockTokens
	hashes := kvlease.ChainHashes(seed, tokens, bt)
	// The payload: id, request, blocks, fingerprint, hashes, tokens.
	size := 8 + 2 + len(request) + 4 + 8 + 4 + 8*len(hashes) + 4 + 8 + 4*len(tokens)
	if len(tokens) == 0 || len(tokens) > src.Len()*bt || size > MaxFrame {
		return nil, fmt.Errorf("kvlease: handoff propose %d: %d tokens for %d blocks of %d (a proposal of %d bytes, at most %d): %w",
			id, len(tokens), src.Len(), bt, size, MaxFrame, kvlease.ErrInvalidArgument)
	}
	return s.propose(id, request, src, hashes, seed, tokens)
}

func (s *Source[R]) propose(id uint64, request string, src *kvlease.Lease[R], hashes []kvlease.BlockHash, seed kvlease.BlockHash, tokens []int32) (*Outgoing[R], error) {
	if src == nil {
		return nil, fmt.Errorf("kvlease: handoff propose: nil lease: %w", kvlease.ErrInvalidArgument)
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
	if len(hashes) > n || len(request) > MaxText {
		return nil, fmt.Errorf("kvlease: handoff propose %d: %d hashes for %d blocks, request of %d bytes: %w", id, len(hashes), n, len(request), kvlease.ErrInvalidArgument)
	}
	o := &Outgoing[R]{machine: newMachine(), s: s, id: id, src: src, n: n, wake: make(chan struct{}, 1)}
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
	go s.forget(o)
	o.mu.Lock()
	o.fire(s.cfg.Name, EventPropose, nil)
	o.mu.Unlock()
	s.mu.Unlock()
	msg := &ProposeMsg{ID: id, Request: request, Blocks: uint32(n), Envelope: s.cfg.Envelope.Fingerprint(), Hashes: hashes, Seed: seed, Tokens: tokens}
	if err := s.c.send(msg); err != nil {
		s.connLost(err)
		return o, nil // the connection loss rejected it; History says so
	}
	return o, nil
}

// Close closes the control connection. Handoffs not yet started are
// rejected; started transfers keep waiting for their plane's evidence.
func (s *Source[R]) Close() error {
	err := s.c.c.Close()
	<-s.closed
	return err
}

// get returns the handoff m names, or nil. A message for a handoff that
// is final and left the table is answered as the final handoff would:
// an Ack is dropped, an Abort acknowledged, anything else reported.
func (s *Source[R]) get(m Message) *Outgoing[R] {
	s.mu.Lock()
	o := s.out[m.Handoff()]
	st, recent := s.recent.state(m.Handoff())
	s.mu.Unlock()
	switch {
	case o != nil:
	case recent && m.Type() == MsgAck:
	case recent && m.Type() == MsgAbort:
		_ = s.c.send(&AckMsg{ID: m.Handoff(), Of: MsgAbort})
	case recent:
		s.cfg.report(fmt.Errorf("kvlease: handoff %d: %v while %v: %w", m.Handoff(), m.Type(), st, ErrProtocol))
	default:
		s.cfg.report(fmt.Errorf("kvlease: handoff source: %v for unknown handoff %d: %w", m.Type(), m.Handoff(), ErrProtocol))
	}
	return o
}

func (s *Source[R]) readLoop() {
	defer close(s.closed)
	for {
		m, err := s.c.read()
		if err != nil {
			s.stats.readFailed(err)
			s.connLost(err)
			return
		}
		switch m := m.(type) {
		case *AcceptMsg:
			if o := s.get(m); o != nil {
				go o.accepted(m) // Send may dial: keep reading meanwhile
			}
		case *RejectMsg:
			if o := s.get(m); o != nil {
				o.rejected(m)
			}
		case *DoneMsg:
			if o := s.get(m); o != nil {
				o.doneMsg(m)
			}
		case *AbortMsg:
			if o := s.get(m); o != nil {
				_ = o.abort(s.cfg.Peer, peerErr("abort", m.Cause, kvlease.ErrAborted), false)
				_ = s.c.send(&AckMsg{ID: m.ID, Of: MsgAbort})
			}
		case *AckMsg:
			_ = s.get(m)
		default:
			s.cfg.report(fmt.Errorf("kvlease: handoff source: unexpected %v for handoff %d: %w", m.Type(), m.Handoff(), ErrProtocol))
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
	_ = s.c.c.Close()
	for _, o := range all {
		o.mu.Lock()
		o.fire(s.cfg.Name, EventReject, lost) // Proposed/Accepted only
		o.setPeer(lost)
		o.mu.Unlock()
		o.poke()
	}
}

func (o *Outgoing[R]) pid() PlaneID {
	return PlaneID{Session: o.s.session, Handoff: o.id, Peer: o.s.peer}
}

// setPeer records the destination's outcome once. Called with o.mu held.
func (o *Outgoing[R]) setPeer(err error) {
	if o.known {
		return
	}
	o.known, o.peer, o.peerOK = true, err, err == nil
	if o.t != nil || err != nil {
		go o.s.plane.Finish(o.pid(), err)
	}
	if err != nil && o.t != nil && o.state == Transferring {
		// The destination gave up or vanished: ask our plane to stop.
		// Its evidence still decides.
		go o.t.Cancel()
	}
}

func (o *Outgoing[R]) poke() {
	select {
	case o.wake <- struct{}{}:
	default:
	}
}

// accepted runs the start: attach the source transfer via the plane and
// tell the destination.
func (o *Outgoing[R]) accepted(m *AcceptMsg) {
	s := o.s
	o.mu.Lock()
	if int(m.From) > o.n {
		o.mu.Unlock()
		s.cfg.report(fmt.Errorf("kvlease: handoff %d: accept wants blocks from %d of %d: %w", o.id, m.From, o.n, ErrProtocol))
		return
	}
	if kind, _ := o.fire(s.cfg.Peer, EventAccept, nil); kind != edgeMove {
		st := o.state
		o.mu.Unlock()
		s.cfg.report(fmt.Errorf("kvlease: handoff %d: accept while %v: %w", o.id, st, ErrProtocol))
		return
	}
	o.from = int(m.From)
	o.mu.Unlock()

	var start []byte
	var err error
	var attached atomic.Bool
	attach := func(t *kvlease.Transfer) error {
		err := o.attach(t)
		attached.Store(err == nil)
		return err
	}
	if o.from == o.n {
		// Every block was a hit on the destination: nothing moves.
		t := kvlease.NewTransfer(nil)
		if err = attach(t); err == nil {
			t.Resolve(nil)
		}
	} else {
		regions := make([]R, 0, o.n-o.from)
		for i := o.from; i < o.n && err == nil; i++ {
			var r R
			r, err = o.src.Pool().Region(o.src.Ref(i))
			regions = append(regions, r)
		}
		if err == nil {
			start, err = s.plane.Send(o.pid(), regions, m.Plane, attach)
		}
		if err == nil && len(start) > MaxPlane {
			err = fmt.Errorf("kvlease: handoff %d: plane start bytes %d exceed %d: %w", o.id, len(start), MaxPlane, kvlease.ErrInvalidArgument)
		}
	}
	if !attached.Load() {
		if err == nil {
			err = errors.New("plane returned without attaching a transfer")
		}
		err = fmt.Errorf("kvlease: handoff %d: start: %w", o.id, err)
		o.mu.Lock()
		kind, _ := o.fire(s.cfg.Name, EventStartFail, err)
		o.mu.Unlock()
		if kind == edgeMove {
			_ = s.c.send(&AbortMsg{ID: o.id, Cause: err.Error()})
		}
		return
	}
	if err != nil {
		// Attached, then the plane failed: its transfer still resolves,
		// and the watcher records that. Tell the destination.
		_ = s.c.send(&AbortMsg{ID: o.id, Cause: err.Error()})
		return
	}
	if err := s.c.send(&StartMsg{ID: o.id, Plane: start}); err != nil {
		s.connLost(err)
	}
}

// attach is the plane's attach callback: under o.mu, and only from
// Accepted, the transfer gates the source blocks as a Read.
func (o *Outgoing[R]) attach(t *kvlease.Transfer) error {
	if t == nil {
		return fmt.Errorf("kvlease: handoff attach: nil transfer: %w", kvlease.ErrInvalidArgument)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if next(o.state, EventAttach).kind != edgeMove {
		return fmt.Errorf("kvlease: handoff %d: attach while %v: %w", o.id, o.state, ErrState)
	}
	if err := o.src.AttachRange(t, o.from, o.n, kvlease.Read); err != nil {
		return fmt.Errorf("kvlease: handoff %d: attach: %w", o.id, err)
	}
	o.t = t
	o.tid = t.ID()
	o.fire("transport", EventAttach, nil)
	go o.watch(t)
	return nil
}

func (o *Outgoing[R]) rejected(m *RejectMsg) {
	err := peerErr("reject", m.Reason, m.Code.sentinel())
	o.mu.Lock()
	kind, _ := o.fire(o.s.cfg.Peer, EventReject, err)
	st := o.state
	if kind == edgeRefuse && st == Transferring {
		// A reject that crossed our Start: the destination will not
		// receive. Our transfer stops; its evidence makes us Failed.
		o.setPeer(err)
	}
	o.mu.Unlock()
	if kind == edgeRefuse && st != Transferring {
		o.s.cfg.report(fmt.Errorf("kvlease: handoff %d: reject while %v: %w", o.id, st, ErrProtocol))
	}
	o.poke()
}

func (o *Outgoing[R]) doneMsg(m *DoneMsg) {
	var err error
	if m.Err != "" {
		err = peerErr("done", m.Err, nil)
	}
	o.mu.Lock()
	st := o.state
	if st != Transferring && st != Aborting && st != Quarantined || o.known {
		o.mu.Unlock()
		o.s.cfg.report(fmt.Errorf("kvlease: handoff %d: done while %v: %w", o.id, st, ErrProtocol))
		return
	}
	o.setPeer(err)
	o.current() // final now if our own evidence is in: no hop to the watcher
	o.mu.Unlock()
	_ = o.s.c.send(&AckMsg{ID: o.id, Of: MsgDone})
	o.poke()
}

// watch waits for the evidence: our transfer resolved and the
// destination's word, or the deadline.
func (o *Outgoing[R]) watch(t *kvlease.Transfer) {
	expire, stop := deadlineTimer(o.s.cfg.Deadline)
	defer stop()
	resolved := t.Done()
	for {
		o.mu.Lock()
		final := o.current()
		o.mu.Unlock()
		if final {
			return
		}
		select {
		case <-resolved:
			resolved = nil // now only the destination's word is missing
		case <-o.wake:
		case <-expire:
			expire = nil
			o.expire()
		}
	}
}

// expire gives up on evidence at the deadline.
func (o *Outgoing[R]) expire() {
	o.mu.Lock()
	if o.current() {
		o.mu.Unlock()
		return
	}
	var send bool
	var quarantined error
	if o.t.State() == kvlease.TransferResolved {
		// Our memory is quiescent; only the destination's word is missing.
		o.fire("deadline", EventResolveError, ErrUnconfirmed)
		send = true
	} else {
		reason := fmt.Errorf("kvlease: handoff %d: no evidence within %v: %w", o.id, o.s.cfg.Deadline, kvlease.ErrQuarantined)
		o.t.Quarantine(reason)
		kind, from := o.fire("deadline", EventExpire, reason)
		if kind == edgeMove && from == Transferring {
			o.src.Abort(reason)
			send = true
		}
		if kind == edgeMove {
			quarantined = reason
		}
	}
	o.mu.Unlock()
	if quarantined != nil {
		o.s.stats.quarantined.Add(1)
		o.s.cfg.quarantined(o.id, quarantined)
	}
	if send {
		_ = o.s.c.send(&AbortMsg{ID: o.id, Cause: "source deadline passed"})
	}
}

// current records the outcome once the evidence is complete, so that
// State is current as soon as Resolve returns. It reports whether the
// handoff is final. Called with o.mu held.
func (o *Outgoing[R]) current() bool {
	if o.state.Final() {
		return true
	}
	if o.t == nil || o.t.State() != kvlease.TransferResolved {
		return false
	}
	local := o.t.Err()
	switch o.state {
	case Transferring:
		if !o.known {
			return false
		}
		switch {
		case local != nil:
			o.fire("transport", EventResolveError, local)
		case !o.peerOK:
			o.fire(o.s.cfg.Peer, EventResolveError, o.peer)
		default:
			o.fire("transport", EventResolve, nil)
		}
	case Aborting, Quarantined:
		if local != nil {
			o.fire("transport", EventResolveError, local)
		} else {
			o.fire("transport", EventResolve, nil)
		}
	}
	return o.state.Final()
}

// Abort gives up on the handoff from the source (by names the component).
// Before the transfer is attached it is Aborted at once; while
// transferring it becomes Aborting until the plane's evidence. Either way
// the source lease is aborted and the destination is told. A nil cause is
// recorded as kvlease.ErrAborted. Idempotent; ErrState after Rejected,
// Delivered or Failed.
func (o *Outgoing[R]) Abort(by string, cause error) error {
	if cause == nil {
		cause = kvlease.ErrAborted
	}
	return o.abort(by, cause, true)
}

func (o *Outgoing[R]) abort(by string, cause error, tell bool) error {
	o.mu.Lock()
	kind, _ := o.fire(by, EventAbort, cause)
	if kind == edgeRefuse {
		st := o.state
		o.mu.Unlock()
		return fmt.Errorf("kvlease: handoff %d: abort while %v: %w", o.id, st, ErrState)
	}
	if kind == edgeMove {
		o.src.Abort(cause) // cancels the transfer, if any
		if !tell {
			o.setPeer(cause)
		}
	}
	o.mu.Unlock()
	o.poke()
	if kind == edgeMove && tell {
		_ = o.s.c.send(&AbortMsg{ID: o.id, Cause: cause.Error()})
	}
	return nil
}

// State returns the handoff's state, current with the evidence.
func (o *Outgoing[R]) State() State {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.current()
	return o.state
}

// Err returns the error of the step that entered the current state.
func (o *Outgoing[R]) Err() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.current()
	return o.lastErr()
}

// History returns a copy of every step so far, oldest first.
func (o *Outgoing[R]) History() []Step {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.current()
	return append([]Step(nil), o.history...)
}

// Done is closed when the handoff reaches a final state.
func (o *Outgoing[R]) Done() <-chan struct{} { return o.done }

// ID returns the handoff id.
func (o *Outgoing[R]) ID() uint64 { return o.id }

// Source returns the source lease (the caller's; see Source's doc).
func (o *Outgoing[R]) Source() *kvlease.Lease[R] { return o.src }

// From returns the first block the destination asked for: blocks before
// it were hits in the destination's prefix cache and did not move.
func (o *Outgoing[R]) From() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.from
}

// Transfer returns the source's transfer, or nil before it is attached.
func (o *Outgoing[R]) Transfer() *kvlease.Transfer {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.t
}

// Wait blocks until the handoff is final or d passes, and returns its state.
func (o *Outgoing[R]) Wait(d time.Duration) State {
	select {
	case <-o.done:
	case <-time.After(d):
	}
	return o.State()
}

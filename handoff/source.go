package handoff

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
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

// forget moves a handoff that became final (in st) out of the table into
// the recent ids. It runs as an effect of the final move, after o.mu is
// released (lock order: s.mu before o.mu).
func (s *Source[R]) forget(o *Outgoing[R], st State) {
	s.mu.Lock()
	retire(s.out, &s.recent, o.id, o, st)
	s.mu.Unlock()
}

// Outgoing is one handoff seen from the source. All methods are safe for
// concurrent use.
type Outgoing[R any] struct {
	machine
	s    *Source[R]
	id   uint64
	src  *kvlease.Lease[R]
	n    int
	from int
	t    *kvlease.Transfer
	prog *Progress // a streaming handoff's progress (Streaming), or nil
}

// ProposeOption is an option of Source.Propose and Source.ProposeTokens.
type ProposeOption func(*proposal) error

type proposal struct{ progress *Progress }

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
	// The payload: id, request, blocks, fingerprint, hashes, tokens.
	size := 8 + 2 + len(request) + 4 + 8 + 4 + 8*len(hashes) + 4 + 8 + 4*len(tokens)
	if len(tokens) == 0 || len(tokens) > src.Len()*bt || size > MaxFrame {
		return nil, fmt.Errorf("kvlease: handoff propose %d: %d tokens for %d blocks of %d (a proposal of %d bytes, at most %d): %w",
			id, len(tokens), src.Len(), bt, size, MaxFrame, kvlease.ErrInvalidArgument)
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
	if len(hashes) > n || len(request) > MaxText {
		return nil, fmt.Errorf("kvlease: handoff propose %d: %d hashes for %d blocks, request of %d bytes: %w", id, len(hashes), n, len(request), kvlease.ErrInvalidArgument)
	}
	if err := s.checkProgress(pr.progress, n); err != nil {
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
	if o == nil {
		answerAbsent(s.c, s.cfg.report, "source", m, st, recent)
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
			s.cfg.report(fmt.Errorf("kvlease: handoff source: unexpected %v for handoff %d: %w", m.Type(), m.Handoff(), ErrProtocolRefused))
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
		kind, _ := o.fire(s.cfg.Name, EventReject, lost) // Proposed/Accepted only
		o.peerWord(s.cfg.Name, lost, kind == edgeMove)
		o.unlock()
	}
}

func (o *Outgoing[R]) pid() PlaneID {
	return PlaneID{Session: o.s.session, Handoff: o.id, Peer: o.s.peer}
}

// peerWord handles the destination's word on the handoff (its Done, a
// Reject or Abort, or the control connection's loss): on a started
// transfer it is noted once (EventPeerOutcome). The plane is told
// (Finish) when the word was noted or moved the handoff (moved); a bad
// word while our transfer still runs asks it to stop, and its evidence
// still decides. It reports whether the word was noted. Called with o.mu
// held.
func (o *Outgoing[R]) peerWord(by string, err error, moved bool) bool {
	kind, _ := o.fire(by, EventPeerOutcome, err)
	if kind != edgeNote && !moved {
		return false
	}
	go o.s.plane.Finish(o.pid(), err)
	if kind == edgeNote && err != nil && o.state == Transferring {
		go o.t.Cancel()
	}
	o.settle()
	return kind == edgeNote
}

// accepted runs the start: attach the source transfer via the plane and
// tell the destination.
func (o *Outgoing[R]) accepted(m *AcceptMsg) {
	s := o.s
	o.mu.Lock()
	if int(m.From) > o.n {
		o.unlock()
		s.cfg.report(fmt.Errorf("kvlease: handoff %d: accept wants blocks from %d of %d: %w", o.id, m.From, o.n, ErrProtocolRefused))
		return
	}
	if kind, _ := o.fire(s.cfg.Peer, EventAccept, nil); kind != edgeMove {
		st := o.state
		o.unlock()
		s.cfg.report(fmt.Errorf("kvlease: handoff %d: accept while %v: %w", o.id, st, ErrProtocolRefused))
		return
	}
	o.from = int(m.From)
	o.unlock()
	if o.prog != nil && !o.prog.Complete() && o.from < o.n {
		if _, ok := s.plane.(StreamSendPlane[R]); !ok {
			// A plane that cannot stream sends once the prefill is
			// done; an abort or the end of the handoff meanwhile ends
			// the wait (the start then finds the handoff moved on).
			go func() {
				o.waitComplete()
				if o.current() == Accepted {
					o.start(m.Plane)
				}
			}()
			return
		}
	}
	o.start(m.Plane)
}

// waitComplete blocks until the handoff's progress is complete or the
// handoff is final.
func (o *Outgoing[R]) waitComplete() {
	r, _ := o.prog.Ready(o.from)
	l, b := -1, -1
	for !r.Complete() {
		var ok bool
		if l, b, ok = r.Wait(l, b, o.done); !ok {
			return
		}
	}
}

// start sends the blocks past the destination's hits over the plane
// (streaming where the handoff and the plane do) and tells the
// destination.
func (o *Outgoing[R]) start(accept []byte) {
	s := o.s
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
		sp, streams := s.plane.(StreamSendPlane[R])
		switch {
		case err != nil:
		case o.prog != nil && streams:
			var ready Ready
			if ready, err = o.prog.Ready(o.from); err == nil {
				start, err = sp.SendStream(o.pid(), regions, ready, accept, attach)
			}
		default:
			start, err = s.plane.Send(o.pid(), regions, accept, attach)
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
		o.unlock()
		if kind == edgeMove {
			_ = s.c.send(&AbortMsg{ID: o.id, Cause: err.Error()})
		}
		return
	}
	if err != nil {
		// Attached, then the plane failed: its transfer still resolves,
		// and its OnResolve callback records that. Tell the destination.
		_ = s.c.send(&AbortMsg{ID: o.id, Cause: err.Error()})
		return
	}
	if err := s.c.send(&StartMsg{ID: o.id, Plane: start}); err != nil {
		s.connLost(err)
	}
}

// attach is the plane's attach callback: under o.mu, and only from
// Accepted, the transfer gates the source blocks as a Read. From then on
// the transfer's OnResolve callback (resolved) and the deadline's timer
// (expire) are the handlers of the evidence.
func (o *Outgoing[R]) attach(t *kvlease.Transfer) error {
	if t == nil {
		return fmt.Errorf("kvlease: handoff attach: nil transfer: %w", kvlease.ErrInvalidArgument)
	}
	o.mu.Lock()
	if next(o.state, EventAttach).kind != edgeMove && !(o.state == Rejected && o.s.hooks.is(mutantRejectStarts)) {
		err := fmt.Errorf("kvlease: handoff %d: attach while %v: %w", o.id, o.state, ErrState)
		o.unlock()
		return err
	}
	if err := o.src.AttachRange(t, o.from, o.n, kvlease.Read); err != nil {
		o.unlock()
		return fmt.Errorf("kvlease: handoff %d: attach: %w", o.id, err)
	}
	o.t = t
	o.tid = t.ID()
	o.fire("transport", EventAttach, nil)
	o.deadline(o.s.cfg.Deadline, o.expire)
	o.unlock()
	t.OnResolve(o.resolved)
	return nil
}

// resolved is the handler of our transfer's evidence: it runs once,
// inside the plane's Resolve. While Transferring it is noted
// (EventQuiescent) and the handoff waits for the destination's word;
// once aborted or quarantined it is final evidence.
func (o *Outgoing[R]) resolved(err error) {
	if err, ok := o.arrive(err); ok {
		o.resolvedLocked(err)
		o.unlock()
	}
}

// resolvedLocked is resolved with o.mu held.
func (o *Outgoing[R]) resolvedLocked(err error) {
	if kind, _ := o.fire("transport", EventQuiescent, err); kind == edgeRefuse {
		o.evidence(err)
	}
	o.settle()
}

// evidence records our transfer's outcome as a move (Aborting or
// Quarantined to Aborted); elsewhere it is refused and changes nothing.
// Called with o.mu held.
func (o *Outgoing[R]) evidence(err error) {
	if o.state != Aborting && o.state != Quarantined {
		return
	}
	if err != nil {
		o.fire("transport", EventResolveError, err)
	} else {
		o.fire("transport", EventResolve, nil)
	}
}

// settle makes the handoff final once its evidence is complete: in
// Transferring, our transfer's resolution and the destination's word,
// both noted (Delivered only when both are clean); once aborted or
// quarantined, our transfer's resolution alone. Called with o.mu held,
// by every handler after its own event.
func (o *Outgoing[R]) settle() {
	local, quiet := o.noted(EventQuiescent)
	if !quiet {
		return
	}
	switch o.state {
	case Transferring:
		peer, known := o.noted(EventPeerOutcome)
		switch {
		case !known:
		case local != nil:
			o.fire("transport", EventResolveError, local)
		case peer != nil:
			o.fire(o.s.cfg.Peer, EventResolveError, peer)
		default:
			o.fire("transport", EventResolve, nil)
		}
	case Aborting, Quarantined:
		o.evidence(local)
	}
}

func (o *Outgoing[R]) rejected(m *RejectMsg) {
	err := peerErr("reject", m.Reason, m.Code.sentinel())
	o.mu.Lock()
	kind, _ := o.fire(o.s.cfg.Peer, EventReject, err)
	st := o.state
	if kind == edgeRefuse && st == Transferring {
		// A reject that crossed our Start: the destination will not
		// receive. Our transfer stops; its evidence makes us Failed.
		o.peerWord(o.s.cfg.Peer, err, false)
	}
	o.unlock()
	if kind == edgeRefuse && st != Transferring {
		o.s.cfg.report(fmt.Errorf("kvlease: handoff %d: reject while %v: %w", o.id, st, ErrProtocolRefused))
	}
}

func (o *Outgoing[R]) doneMsg(m *DoneMsg) {
	var err error
	if m.Err != "" {
		err = peerErr("done", m.Err, nil)
	}
	o.mu.Lock()
	st := o.state
	noted := o.peerWord(o.s.cfg.Peer, err, false)
	o.unlock()
	if noted && o.s.hooks.is(mutantResolveOnAck) {
		o.Transfer().Resolve(err) // the mutant: the peer's word taken for evidence
	}
	if !noted {
		o.s.cfg.report(fmt.Errorf("kvlease: handoff %d: done while %v: %w", o.id, st, ErrProtocolRefused))
		return
	}
	_ = o.s.c.send(&AckMsg{ID: o.id, Of: MsgDone})
}

// expire is the deadline's handler: it gives up on evidence.
func (o *Outgoing[R]) expire() {
	o.mu.Lock()
	var send bool
	var quarantined error
	switch {
	case o.state.Final():
	case o.t.State() == kvlease.TransferResolved && o.state == Transferring:
		// Our memory is quiescent; only the destination's word is missing.
		o.fire("deadline", EventResolveError, ErrUnconfirmed)
		send = true
	case o.t.State() == kvlease.TransferResolved:
		// The evidence came; its callback waits for our lock.
		o.evidence(o.t.Err())
	default:
		reason := fmt.Errorf("kvlease: handoff %d: no evidence within %v: %w", o.id, o.s.cfg.Deadline, kvlease.ErrQuarantined)
		o.t.Quarantine(reason)
		kind, from := o.fire("deadline", EventExpire, reason)
		if kind == edgeMove {
			o.s.stats.quarantined.Add(1) // before the late evidence can make it final
			quarantined = reason
		}
		if kind == edgeMove && from == Transferring {
			if err, ok := o.effect(func() { o.stop(reason) }); ok {
				o.resolvedLocked(err)
			}
			send = true
		}
	}
	o.unlock()
	if quarantined != nil {
		// Without the lock: the late evidence may make the handoff final
		// meanwhile (Stats counted it already).
		o.s.cfg.quarantined(o.id, quarantined)
	}
	if send {
		_ = o.s.c.send(&AbortMsg{ID: o.id, Cause: "source deadline passed"})
	}
}

// stop is the effect of an abort or an expiry: the source lease is
// aborted and the transfer itself cancelled. Aborting the lease alone is
// not enough: a lease the caller released once the handoff was under way
// (rule 2 allows it) is closed, its Abort cancels nothing, and a plane
// blocked on a frozen peer would never return its evidence. Cancel runs
// the hook at most once, so the lease's own cancel and this one do not
// add up. Called inside effect, with o.mu held.
func (o *Outgoing[R]) stop(cause error) {
	o.src.Abort(cause)
	if o.t != nil && !o.hooks.is(mutantLeaseOnly) {
		o.t.Cancel()
	}
}

// Abort gives up on the handoff from the source (by names the component).
// Before the transfer is attached it is Aborted at once; while
// transferring it becomes Aborting, the transfer is cancelled (even when
// the source lease was released already) and the plane's evidence ends
// it. Either way the source lease is aborted and the destination is told. A nil cause is
// recorded as kvlease.ErrAborted. Idempotent; ErrState after Rejected,
// Delivered or Failed.
func (o *Outgoing[R]) Abort(by string, cause error) error {
	if cause == nil {
		cause = kvlease.ErrAborted
	}
	return o.abort(by, cause, true)
}

// abort is the handler of an abort, ours (tell: the destination is told)
// or the destination's.
func (o *Outgoing[R]) abort(by string, cause error, tell bool) error {
	o.mu.Lock()
	kind, _ := o.fire(by, EventAbort, cause)
	if kind == edgeRefuse {
		st := o.state
		o.unlock()
		return fmt.Errorf("kvlease: handoff %d: abort while %v: %w", o.id, st, ErrState)
	}
	if kind == edgeMove {
		// The transfer's cancel hook may resolve it at once: effect
		// takes that evidence.
		if err, ok := o.effect(func() { o.stop(cause) }); ok {
			o.resolvedLocked(err)
		}
		if !tell {
			o.peerWord(by, cause, true)
		}
	}
	o.settle()
	o.unlock()
	if kind == edgeMove && tell {
		_ = o.s.c.send(&AbortMsg{ID: o.id, Cause: cause.Error()})
	}
	return nil
}

// State returns the handoff's state. It only reads: the handlers of the
// destination's messages, of our transfer's evidence (run inside its
// Resolve) and of the deadline make every change.
func (o *Outgoing[R]) State() State { return o.current() }

// Err returns the error of the step that entered the current state.
func (o *Outgoing[R]) Err() error { return o.err() }

// History returns a copy of every step so far, oldest first, notes
// (EventQuiescent, EventPeerOutcome) included.
func (o *Outgoing[R]) History() []Step { return o.steps() }

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

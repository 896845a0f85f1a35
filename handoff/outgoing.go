package handoff

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/internal/wire"

	"go.uber.org/atomic"
)

// An outgoing handoff's transfer state: what the source does from the
// destination's Accept to a final state (the send, its evidence, the
// peer's words, the deadline), the abort, and the accessors of Outgoing.
// Proposing and the control connection are source.go's.

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
func (o *Outgoing[R]) accepted(m *wire.AcceptMsg) {
	s := o.s
	o.mu.Lock()
	if int(m.From) > o.n {
		o.unlock()
		s.cfg.report(fmt.Errorf("kvlease: handoff %d: accept wants blocks from %d of %d: %w", o.id, m.From, o.n, wire.ErrProtocolRefused))
		return
	}
	if kind, _ := o.fire(s.cfg.Peer, EventAccept, nil); kind != edgeMove {
		st := o.state
		o.unlock()
		if !s.stats.crossing(true, wire.MsgAccept, st) {
			s.cfg.report(fmt.Errorf("kvlease: handoff %d: accept while %v: %w", o.id, st, wire.ErrProtocolRefused))
		}
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
			_ = s.c.Send(&wire.AbortMsg{ID: o.id, Cause: err.Error()})
		}
		return
	}
	if err != nil {
		// Attached, then the plane failed: its transfer still resolves,
		// and its OnResolve callback records that. Tell the destination.
		_ = s.c.Send(&wire.AbortMsg{ID: o.id, Cause: err.Error()})
		return
	}
	if err := s.c.Send(&wire.StartMsg{ID: o.id, Plane: start}); err != nil {
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

func (o *Outgoing[R]) rejected(m *wire.RejectMsg) {
	err := peerErr("reject", m.Reason, rejectSentinel(m.Code))
	o.mu.Lock()
	kind, _ := o.fire(o.s.cfg.Peer, EventReject, err)
	st := o.state
	if kind == edgeRefuse && st == Transferring {
		// A reject that crossed our Start: the destination will not
		// receive. Our transfer stops; its evidence makes us Failed.
		o.peerWord(o.s.cfg.Peer, err, false)
	}
	o.unlock()
	if kind == edgeRefuse && st != Transferring && !o.s.stats.crossing(true, wire.MsgReject, st) {
		o.s.cfg.report(fmt.Errorf("kvlease: handoff %d: reject while %v: %w", o.id, st, wire.ErrProtocolRefused))
	}
}

func (o *Outgoing[R]) doneMsg(m *wire.DoneMsg) {
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
		if !o.s.stats.crossing(true, wire.MsgDone, st) {
			o.s.cfg.report(fmt.Errorf("kvlease: handoff %d: done while %v: %w", o.id, st, wire.ErrProtocolRefused))
		}
		return
	}
	_ = o.s.c.Send(&wire.AckMsg{ID: o.id, Of: wire.MsgDone})
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
		_ = o.s.c.Send(&wire.AbortMsg{ID: o.id, Cause: "source deadline passed"})
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
		_ = o.s.c.Send(&wire.AbortMsg{ID: o.id, Cause: cause.Error()})
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

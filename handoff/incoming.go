package handoff

import (
	"fmt"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/internal/wire"
)

// An incoming handoff's transfer state: what the destination does from
// Start to a final state (the transfer, its evidence, the deadline, the
// seal of what arrived, Done to the source), the peer's and the
// operator's abort, and the accessors of Incoming. Admission (Propose to
// Accept or Reject) is dest.go's.

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
func (in *Incoming[R]) start(m *wire.StartMsg) {
	d := in.s.d
	in.mu.Lock()
	if next(in.state, EventAttach).kind != edgeMove {
		st := in.state
		in.unlock()
		if !d.stats.crossing(false, wire.MsgStart, st) {
			d.cfg.report(fmt.Errorf("kvlease: handoff %d: start while %v: %w", in.id, st, wire.ErrProtocolRefused))
		}
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
			_ = in.s.c.Send(&wire.DoneMsg{ID: in.id, Err: err.Error()})
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
		_ = in.s.c.Send(&wire.AbortMsg{ID: in.id, Cause: "destination deadline passed"})
	}
}

// settle records the transfer's evidence (its outcome err) unless the
// handoff is final already: Delivered seals the wanted blocks, Failed
// releases the lease. It returns the Done message to send (nil when the
// source was not waiting for one) and whether it recorded anything; the
// caller then calls finish, without in.mu. Called with in.mu held.
func (in *Incoming[R]) settle(err error) (*wire.DoneMsg, bool) {
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
	msg := &wire.DoneMsg{ID: in.id}
	if err != nil {
		msg.Err = err.Error()
	}
	return msg, true
}

// finish tells the source the outcome (msg, if any) first, since it is
// waiting, then runs the final callbacks.
func (in *Incoming[R]) finish(msg *wire.DoneMsg) {
	if msg != nil {
		_ = in.s.c.Send(msg)
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
		_ = in.s.c.Send(&wire.RejectMsg{ID: in.id, Code: rejectCode(reason), Reason: reason.Error()})
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
			_ = in.s.c.Send(&wire.AbortMsg{ID: in.id, Cause: cause.Error()})
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

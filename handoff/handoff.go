package handoff

import (
	"context"
	"errors"
	"fmt"
	"go.uber.org/atomic"
	"time"

	"github.com/kvlease/kvlease"
)

// DefaultDeadline is the deadline a handoff uses when
// Config.Deadline is zero.
const DefaultDeadline = 30 * time.Second

// Config configures a handoff.
type Config struct {
	// Envelope is the envelope both sides agreed on (see AgreeEnvelopes).
	// It must be valid; both pools' BlockBytes must equal its BlockBytes,
	// and the source lease may not hold more blocks than a
	// maximum-context request needs.
	Envelope Envelope
	// Source and Destination name the two sides in History ("prefill",
	// "decode"); they default to "source" and "destination".
	Source, Destination string
	// Owner names the destination lease's owner; it defaults to the
	// source lease's owner.
	Owner string
	// Deadline bounds how long the transfer may stay unresolved once
	// attached (or once aborted) before the handoff gives up on evidence
	// and quarantines it (EventExpire, by "deadline"). Zero means
	// DefaultDeadline; a negative value means no deadline: a
	// transport that never resolves then leaves the handoff Transferring
	// until someone calls Expire. A transport that quarantines its own
	// transfer (it knows the peer vanished) is seen here too: the handoff
	// becomes Quarantined when the deadline passes.
	Deadline time.Duration
}

// Handoff moves a request's KV from a source lease (a prefill worker's)
// to a destination pool (a decode worker's) in two phases: the
// destination first accepts, holding a lease of its own, and only then
// does one transfer copy the blocks. It makes the two causes of the 2026
// incident impossible by construction: a rejected handoff can never start
// a transfer (Start attaches only from Accepted, and the check and the
// attach happen under one lock), and an aborted handoff's blocks return to
// their pools only when the transport proves the copy quiescent.
//
//	Propose ──▶ Proposed ──Reject, failed acquire──▶ Rejected ▣
//	               │  └──Abort──▶ Aborted ▣
//	             Accept (destination lease acquired)
//	               ▼
//	            Accepted ──Reject──▶ Rejected ▣
//	               │  ├──Abort──▶ Aborted ▣
//	               │  └──start failed (nothing attached)──▶ Failed ▣
//	             Start: transport attaches one transfer (Read src, Write dst)
//	               ▼
//	          Transferring ──Resolve(nil)──▶ Delivered ▣
//	               │  ├──Resolve(err)──▶ Failed ▣
//	               │  └──Expire──▶ Quarantined ──late Resolve──▶ Aborted ▣
//	             Abort (both leases aborted, transfer cancelled)    ▲
//	               ▼                                                │
//	            Aborting ──Resolve──▶ Aborted ▣                     │
//	               └──Expire────────▶ Quarantined ──────────────────┘
//
// ▣ marks the final states. What makes each one final, and so what the
// caller may rely on:
//
//   - Rejected: the destination's refusal (Reject, or its acquire failing
//     in Accept). No transfer was attached, and none can be: Start refuses
//     and a racing attach is refused under the same lock.
//   - Delivered: the transport's Resolve(nil), its proof that the copy is
//     complete and quiescent. The destination lease is now the caller's.
//   - Failed: the transport's Resolve(err), proof that the copy stopped;
//     or a Start that attached nothing. The destination lease is released.
//   - Aborted: an Abort before anything was attached, or, once a transfer
//     was attached, the transport's Resolve after the abort or the
//     quarantine. Time never makes it final.
//
// Quarantined is not final: Expire (the handoff's Deadline or a caller's
// give-up) found the transfer unresolved, so the transfer is quarantined,
// every block of both leases with it, and both leases are aborted. The
// blocks stay out of reuse until the transport's late Resolve lifts the
// quarantine and the handoff becomes Aborted.
//
// Ownership: the handoff owns the destination lease until it is
// delivered; the source lease stays the caller's, except that Abort and
// Expire abort it (the request is gone on both sides). Rejected, Failed
// and Delivered leave the source lease open: the caller may retry
// elsewhere or release it.
//
// Every transition is recorded with its evidence in History. A method
// called in a state that does not allow it changes nothing and returns an
// error wrapping ErrState; repeats that are already done (a second
// Abort, an Expire after the evidence came) return nil.
//
// All methods are safe for concurrent use. The handoff calls into its
// leases and its transfer with its own lock held (so a decision and its
// effect are one step), so a transport's cancel hook or a pool's observer
// must not call this handoff's methods synchronously; they may call any
// Pool, Lease or Transfer method, and a cancel hook may Resolve the
// transfer at once (the evidence is then recorded before Abort returns).
// The handoff learns of the transfer's evidence through
// kvlease.Transfer.OnResolve: no goroutine waits on it.
type Handoff[S, D any] struct {
	machine
	src  *kvlease.Lease[S]
	pool *kvlease.Pool[D]
	dst  *kvlease.Lease[D] // set by Accept
	t    *kvlease.Transfer // set by the winning attach
	n    int               // blocks handed off: src.Len() at Propose
	// accepting is set while one Accept acquires without the lock; a
	// concurrent Accept is refused instead of racing it.
	accepting bool
	cfg       Config
}

// Propose offers the blocks of src (all src.Len() of them, as they are
// now) to the pool dst. Nothing is acquired yet; the destination answers
// with Accept or Reject. Errors, and no handoff:
//
//   - ErrInvalidArgument: a nil lease or pool, an invalid envelope,
//     pools whose block sizes differ from each other or from the
//     envelope's BlockBytes, or whose per-layer layouts differ from each
//     other or from the envelope's Layout;
//   - ErrLeaseClosed: src is already released or aborted;
//   - ErrExceedsCapacity: src holds more blocks than a maximum-context
//     request under the envelope.
func Propose[S, D any](src *kvlease.Lease[S], dst *kvlease.Pool[D], cfg Config) (*Handoff[S, D], error) {
	if src == nil || dst == nil {
		return nil, fmt.Errorf("kvlease: propose handoff: nil source lease or destination pool: %w", kvlease.ErrInvalidArgument)
	}
	if err := cfg.Envelope.Validate(); err != nil {
		return nil, fmt.Errorf("kvlease: propose handoff of lease %d (%s): %w", src.ID(), src.Owner(), err)
	}
	if _, err := src.ReadRegion(0); err != nil {
		return nil, fmt.Errorf("kvlease: propose handoff: %w", err)
	}
	sb, db, eb := src.Pool().Memory().BlockBytes(), dst.Memory().BlockBytes(), cfg.Envelope.BlockBytes
	if sb != db || sb != eb {
		return nil, fmt.Errorf("kvlease: propose handoff of lease %d (%s): block sizes differ: source pool %d bytes, destination pool %d bytes, envelope %d bytes: %w",
			src.ID(), src.Owner(), sb, db, eb, kvlease.ErrInvalidArgument)
	}
	if err := checkLayouts("source", "destination", src.Pool().Memory(), dst.Memory(), cfg.Envelope); err != nil {
		return nil, fmt.Errorf("kvlease: propose handoff of lease %d (%s): %w", src.ID(), src.Owner(), err)
	}
	n := src.Len()
	if limit := cfg.Envelope.BlocksFor(cfg.Envelope.MaxContextTokens); n > limit {
		return nil, fmt.Errorf("kvlease: propose handoff of lease %d (%s): %d blocks exceed the %d blocks of a %d-token context: %w",
			src.ID(), src.Owner(), n, limit, cfg.Envelope.MaxContextTokens, kvlease.ErrExceedsCapacity)
	}
	if cfg.Source == "" {
		cfg.Source = "source"
	}
	if cfg.Destination == "" {
		cfg.Destination = "destination"
	}
	if cfg.Owner == "" {
		cfg.Owner = src.Owner()
	}
	if cfg.Deadline == 0 {
		cfg.Deadline = DefaultDeadline
	}
	h := &Handoff[S, D]{machine: newMachine(), src: src, pool: dst, n: n, cfg: cfg}
	h.mu.Lock()
	h.step(cfg.Source, EventPropose, nil)
	h.unlock()
	return h, nil
}

// step fires event e (machine.fire) and performs the effects of entering
// the new state. It returns the edge's kind; a refusal changes nothing.
// Called with h.mu held.
func (h *Handoff[S, D]) step(by string, e Event, err error) edgeKind {
	kind, from := h.fire(by, e, err)
	if kind != edgeMove {
		return kind
	}
	switch {
	case e == EventAbort || (e == EventExpire && from == Transferring):
		// The request is gone on both sides: both leases are aborted
		// and the transfer, if any, cancelled itself (a lease closed
		// already cancels nothing when aborted); their blocks drain
		// until it resolves (or stay quarantined, for Expire, until
		// late evidence). A cancel hook may resolve the transfer at
		// once: effect takes that evidence.
		cause := err
		if cause == nil {
			cause = kvlease.ErrAborted
		}
		if err, ok := h.effect(func() {
			if h.dst != nil {
				h.dst.Abort(cause)
			}
			h.src.Abort(cause)
			if h.t != nil {
				h.t.Cancel()
			}
		}); ok {
			h.evidence(err)
		}
	case h.state == Rejected || h.state == Failed:
		// Nothing is in flight (never attached, or resolved): the
		// destination lease's blocks return at once.
		if h.dst != nil {
			h.dst.Release()
		}
	}
	return edgeMove
}

// refused returns the ErrState error for a refused call.
func (h *Handoff[S, D]) refused(what string) error {
	return fmt.Errorf("kvlease: handoff of lease %d (%s): %s while %v: %w", h.src.ID(), h.src.Owner(), what, h.state, ErrState)
}

// Accept is the destination's acceptance: it acquires a lease of Blocks()
// blocks from the destination pool (Pool.Acquire: no waiting) and moves
// the handoff to Accepted. If the acquire fails, the handoff is Rejected
// with the acquire's error as evidence, and Accept returns that error
// (errors.Is works: ErrExhausted, ErrExceedsCapacity, ErrPoolClosed).
// Outside Proposed it changes nothing and returns ErrState; so does
// an Accept that loses a race with Reject, Abort or another Accept,
// whatever its own acquire did: a lease it got is released, and a failed
// acquire does not reject the handoff that another call accepted.
func (h *Handoff[S, D]) Accept() error { return h.accept(context.Background(), false) }

// AcceptWait is Accept with Pool.AcquireWait: it waits in the pool's queue
// until the blocks are free or ctx is done. A cancelled wait rejects the
// handoff with ctx's error. The wait holds no handoff lock: an Abort or
// Reject meanwhile wins, and the blocks the wait then gets go straight
// back (cancel ctx too, to stop waiting early).
func (h *Handoff[S, D]) AcceptWait(ctx context.Context) error {
	if ctx == nil {
		return fmt.Errorf("kvlease: handoff accept: nil context: %w", kvlease.ErrInvalidArgument)
	}
	return h.accept(ctx, true)
}

// accept is Accept (wait false: Pool.Acquire) and AcceptWait (wait
// true: Pool.AcquireWait on ctx).
func (h *Handoff[S, D]) accept(ctx context.Context, wait bool) error {
	h.mu.Lock()
	if next(h.state, EventAccept).kind != edgeMove {
		err := h.refused("accept")
		h.unlock()
		return err
	}
	if h.accepting {
		// Another Accept is acquiring: it decides. This one changes
		// nothing, acquires nothing (issue 11, bug 1).
		err := fmt.Errorf("kvlease: handoff of lease %d (%s): accept while another accept is in progress: %w", h.src.ID(), h.src.Owner(), ErrState)
		h.unlock()
		return err
	}
	h.accepting = true
	h.unlock()

	// Acquire without the lock: a waiting acquire must not block Abort.
	var l *kvlease.Lease[D]
	var err error
	if !wait {
		l, err = h.pool.Acquire(h.cfg.Owner, h.n)
	} else {
		l, err = h.pool.AcquireWait(ctx, h.cfg.Owner, h.n)
	}

	h.mu.Lock()
	defer h.unlock()
	h.accepting = false
	if next(h.state, EventAccept).kind != edgeMove {
		// Rejected, aborted or accepted by someone else meanwhile: this
		// call lost, whatever its acquire did. It must not reject the
		// winner's handoff (issue 11, bug 1); what it got goes back.
		if l != nil {
			l.Release()
		}
		return h.refused("accept")
	}
	if err != nil {
		err = fmt.Errorf("kvlease: handoff of lease %d (%s): destination acquire of %d blocks: %w", h.src.ID(), h.src.Owner(), h.n, err)
		h.step(h.cfg.Destination, EventReject, err)
		return err
	}
	h.dst = l
	h.step(h.cfg.Destination, EventAccept, nil)
	return nil
}

// Reject is a refusal by the component by (the destination, a
// scheduler): the handoff becomes Rejected and no transfer can ever start.
// A destination lease already acquired is released; the source lease is
// untouched. Allowed from Proposed and Accepted; a second Reject returns
// nil; once a transfer is attached it returns ErrState (use Abort).
// A nil reason is recorded as ErrRejected.
func (h *Handoff[S, D]) Reject(by string, reason error) error {
	if reason == nil {
		reason = ErrRejected
	}
	h.mu.Lock()
	defer h.unlock()
	if h.step(by, EventReject, reason) == edgeRefuse {
		return h.refused("reject")
	}
	return nil
}

// Start copies the source blocks into the destination lease with tr, from
// Accepted. It builds the copy pairs and calls tr.Start, whose attach
// callback is where the handoff moves: under the handoff's lock, and only
// if it is still Accepted, the transfer is attached to the source lease
// (Read) and the destination lease (Write) and the handoff becomes
// Transferring; from then on only the transfer's evidence, Abort or Expire
// move it: the transfer's OnResolve callback records its evidence, and a
// timer the deadline.
//
// If the handoff is not Accepted, Start calls nothing and returns
// ErrState: a rejected handoff never reaches a transport. If the
// attach fails (the source lease was closed meanwhile) or the transport
// fails without attaching, nothing moved: the handoff becomes Failed and
// Start returns the error. If it lost a race (an Abort or Reject came
// first, or another Start attached), the attach is refused, the transport
// resolves its transfer unstarted, and Start returns ErrState.
func (h *Handoff[S, D]) Start(tr kvlease.Transport[S, D]) error {
	if tr == nil {
		return fmt.Errorf("kvlease: handoff start: nil transport: %w", kvlease.ErrInvalidArgument)
	}
	h.mu.Lock()
	if next(h.state, EventAttach).kind != edgeMove {
		err := h.refused("start")
		h.unlock()
		return err
	}
	pairs := make([]kvlease.CopyPair[S, D], h.n)
	for i := range pairs {
		s, err := h.src.ReadRegion(i)
		if err == nil {
			pairs[i].Dst, err = h.dst.Region(i)
		}
		if err != nil {
			err = fmt.Errorf("kvlease: handoff start: %w", err)
			h.step(h.cfg.Source, EventStartFail, err)
			h.unlock()
			return err
		}
		pairs[i].Src = s
	}
	h.unlock()

	// attached is this call's attach outcome: 0 not called, 1 attached,
	// -1 refused. Atomic: a transport may call attach on its own goroutine
	// (it must still do so before Start returns).
	var attached atomic.Int32
	_, err := tr.Start(pairs, func(t *kvlease.Transfer) error {
		err := h.attach(t)
		if err != nil {
			attached.Store(-1)
		} else {
			attached.Store(1)
		}
		return err
	})
	switch attached.Load() {
	case 1:
		// The transfer is ours; its evidence decides. A transport that
		// reports an error after attaching must still resolve the
		// transfer, and its OnResolve callback records that.
		return err
	case -1:
		return err
	}
	if err == nil {
		err = errors.New("transport returned without attaching a transfer")
	}
	err = fmt.Errorf("kvlease: handoff start: %w", err)
	h.mu.Lock()
	kind := h.step("transport", EventStartFail, err)
	h.unlock()
	if kind == edgeRefuse {
		return fmt.Errorf("%w (%w)", err, ErrState)
	}
	return err
}

// attach is the callback a transport calls before any byte moves. The
// state check and both attachments happen under h.mu, so a Reject or
// Abort either comes before (and the attach is refused) or after (and
// sees the transfer). Once attached, the transfer's own completion
// (OnResolve) and the deadline's timer are the only evidence handlers.
func (h *Handoff[S, D]) attach(t *kvlease.Transfer) error {
	if t == nil {
		return fmt.Errorf("kvlease: handoff attach: nil transfer: %w", kvlease.ErrInvalidArgument)
	}
	h.mu.Lock()
	if next(h.state, EventAttach).kind != edgeMove {
		err := h.refused("attach")
		h.unlock()
		return err
	}
	err := h.src.AttachRange(t, 0, h.n, kvlease.Read)
	if err == nil {
		err = h.dst.AttachRange(t, 0, h.n, kvlease.Write)
	}
	if err != nil {
		// The transport resolves t with this error (nothing moved), which
		// also drops a source attachment that succeeded.
		err = fmt.Errorf("kvlease: handoff attach: %w", err)
		h.step(h.cfg.Source, EventStartFail, err)
		h.unlock()
		return err
	}
	h.t = t
	h.tid = t.ID()
	h.step("transport", EventAttach, nil)
	if d := h.cfg.Deadline; d > 0 {
		h.deadline(d, func() {
			_ = h.Expire("deadline", fmt.Errorf("kvlease: handoff: no evidence of quiescence within %v: %w", d, kvlease.ErrQuarantined))
		})
	}
	h.unlock()
	// Registered without h.mu: on a transfer already resolved the
	// callback runs at once.
	t.OnResolve(h.resolved)
	return nil
}

// resolved is the handler of the transfer's evidence (its OnResolve
// callback): it runs once, inside the transport's Resolve, so State is
// current when Resolve returns. The evidence may come much later than the
// deadline: it is what lifts a quarantine.
func (h *Handoff[S, D]) resolved(err error) {
	if err, ok := h.arrive(err); ok {
		h.evidence(err)
		h.unlock()
	}
}

// evidence records a resolved transfer's outcome. A repeat (Expire already
// recorded it) is refused and changes nothing. Called with h.mu held.
func (h *Handoff[S, D]) evidence(err error) {
	e := EventResolve
	if err != nil {
		e = EventResolveError
	}
	h.step("transport", e, err)
}

// Abort gives up on the request, from either side (by names it). Before a
// transfer is attached, the handoff becomes Aborted at once: the
// destination lease, if any, and the source lease are aborted, and a
// racing Start's attach is refused. While transferring, it becomes
// Aborting: both leases are aborted and the transfer cancelled (itself,
// so a lease its owner closed already does not stop the cancel), and
// their blocks drain until the transport resolves it, which makes the
// handoff Aborted. A nil cause is recorded as ErrAborted.
//
// Abort is idempotent: in Aborting, Aborted or Quarantined it returns nil.
// After Rejected, Delivered or Failed it changes nothing and returns
// ErrState: the handoff no longer holds anything (after delivery,
// abort the destination lease itself).
func (h *Handoff[S, D]) Abort(by string, cause error) error {
	if cause == nil {
		cause = kvlease.ErrAborted
	}
	h.mu.Lock()
	defer h.unlock()
	if h.step(by, EventAbort, cause) == edgeRefuse {
		return h.refused("abort")
	}
	return nil
}

// Expire gives up waiting for the transport's evidence: the give-up path
// of a deadline. The handoff's own timer (Config.Deadline) calls
// it; a supervisor may call it earlier, for instance when the transport
// reports that the copy stopped but its acknowledgement is lost. If the
// transfer has resolved after all, Expire records that evidence instead.
// Otherwise it quarantines the transfer (with reason; nil means
// ErrQuarantined) and the handoff becomes Quarantined; from Transferring
// both leases are aborted too. Only the transfer's late Resolve lifts the
// quarantine (the handoff then becomes Aborted).
//
// Before a transfer is attached it returns ErrState (nothing is in
// flight: use Abort or Reject); after evidence, or in Quarantined, it is a
// no-op returning nil.
func (h *Handoff[S, D]) Expire(by string, reason error) error {
	if reason == nil {
		reason = kvlease.ErrQuarantined
	}
	h.mu.Lock()
	defer h.unlock()
	switch next(h.state, EventExpire).kind {
	case edgeRefuse:
		return h.refused("expire")
	case edgeNoop:
		return nil
	}
	h.t.Quarantine(reason)
	if h.t.State() == kvlease.TransferResolved {
		// The evidence won the race (its callback waits for h.mu):
		// record it, not a quarantine.
		h.evidence(h.t.Err())
		return nil
	}
	h.step(by, EventExpire, reason)
	return nil
}

// State returns the handoff's state. It only reads: every change is made
// by the handler of an input (a method above, the transfer's evidence,
// the deadline). It is current with the evidence: the transfer's Resolve
// records it (through OnResolve) before returning.
func (h *Handoff[S, D]) State() State { return h.current() }

// Err returns the error recorded by the step that entered the current
// state: the rejection reason, the transfer's outcome, the abort cause or
// the quarantine reason; nil when that step carried none (Proposed,
// Accepted, Transferring, Delivered).
func (h *Handoff[S, D]) Err() error { return h.err() }

// History returns a copy of every step so far, oldest first. The first is
// the proposal (from "none").
func (h *Handoff[S, D]) History() []Step { return h.steps() }

// Done returns a channel closed when the handoff reaches a final state
// (Rejected, Delivered, Failed or Aborted). A quarantined handoff is not
// done until late evidence comes.
func (h *Handoff[S, D]) Done() <-chan struct{} { return h.done }

// Blocks returns the number of blocks handed off: the source lease's
// length at Propose.
func (h *Handoff[S, D]) Blocks() int { return h.n }

// Source returns the source lease.
func (h *Handoff[S, D]) Source() *kvlease.Lease[S] { return h.src }

// Destination returns the destination lease, or nil before Accept. Until
// the handoff is Delivered it belongs to the handoff: read its refs, but
// do not release, extend or attach to it. Once Delivered it is the
// caller's, to release when the request ends.
func (h *Handoff[S, D]) Destination() *kvlease.Lease[D] {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.dst
}

// Transfer returns the attached transfer, or nil before Start attached
// one.
func (h *Handoff[S, D]) Transfer() *kvlease.Transfer {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.t
}

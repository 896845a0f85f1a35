package kvlease

import (
	"fmt"
	"sync"

	"go.uber.org/atomic"
)

// TransferState is where a transfer is in its lifecycle:
//
//	Pending ──Resolve──▶ Resolved
//	   └──Quarantine──▶ Quarantined ──Resolve (late evidence)──▶ Resolved
//
// Cancel is a request to the transport, not a state.
type TransferState uint32

// The transfer states.
const (
	// TransferPending: the transport may still touch the memory.
	TransferPending TransferState = iota
	// TransferResolved: the transport proved it will never touch the
	// memory again. Terminal.
	TransferResolved
	// TransferQuarantined: the transfer ended without proof; its blocks
	// are quarantined until a late Resolve.
	TransferQuarantined
)

var transferStateNames = [...]string{"pending", "resolved", "quarantined"}

func (s TransferState) String() string {
	if int(s) < len(transferStateNames) {
		return transferStateNames[s]
	}
	return "invalid"
}

type transferEvent uint8

const (
	evResolve transferEvent = iota
	evQuarantine
)

// next is the transfer state machine's one transition function: the state
// an event leads to, and whether it changes anything. Resolve wins from any
// unresolved state (from Quarantined it is the late evidence); Quarantine
// only acts on a pending transfer; nothing leaves Resolved.
func (s TransferState) next(e transferEvent) (TransferState, bool) {
	switch {
	case s == TransferResolved:
		return s, false
	case e == evResolve:
		return TransferResolved, true
	case s == TransferPending:
		return TransferQuarantined, true
	}
	return s, false
}

var transferIDs atomic.Uint64

// Transfer is the future that gates reclamation: an asynchronous operation
// (a copy, a DMA, a remote registration) that may touch the blocks of the
// leases it is attached to. Those blocks return to the pool only after the
// transport resolves it, which is its statement that the memory is
// quiescent. A transfer may gate several leases in several pools (the
// source and the destination of a copy); a lease may have many transfers.
// All methods are safe for concurrent use.
type Transfer struct {
	mu     sync.Mutex
	state  atomicState
	id     uint64
	err    error
	cancel func() // the transport's hook; nil once run or resolved
	asked  bool   // Cancel was called
	done   chan struct{}
	// onResolve runs once, after Resolve, with no lock held (OnResolve);
	// several registrations are chained into one. Nil once run.
	onResolve func(error)

	// The leases this transfer gates: gates0 inline (a copy gates two),
	// more beyond. Cleared once resolved.
	ngates int
	gates0 [2]gateRef
	more   []gateRef
}

type atomicState struct{ v atomic.Uint32 }

func (a *atomicState) Load() TransferState   { return TransferState(a.v.Load()) }
func (a *atomicState) Store(s TransferState) { a.v.Store(uint32(s)) }

// gateRef names a lease this transfer gates (once per attachment: a
// transfer attached to a lease twice has two).
type gateRef struct {
	l *lease
}

// NewTransfer returns a pending transfer. cancel is the transport's hook
// (nil for none): Cancel runs it at most once, never after Resolve, with
// no lock held, so it may Resolve the transfer synchronously when the
// transport can prove the copy stopped. A transport whose transfer serves
// many leases (a batched copy) gives it a hook that cancels only what is
// safe, or none.
func NewTransfer(cancel func()) *Transfer {
	return &Transfer{id: transferIDs.Add(1), cancel: cancel}
}

// ID returns the transfer's process-wide id; observer events carry it.
func (t *Transfer) ID() uint64 { return t.id }

// gate records one more attachment to l. Called with t.mu held.
func (t *Transfer) gate(l *lease) {
	g := gateRef{l}
	if t.ngates < len(t.gates0) {
		t.gates0[t.ngates] = g
	} else {
		t.more = append(t.more, g)
	}
	t.ngates++
}

// gateAt returns the i-th gate recorded. Called with t.mu held.
func (t *Transfer) gateAt(i int) gateRef {
	if i < len(t.gates0) {
		return t.gates0[i]
	}
	return t.more[i-len(t.gates0)]
}

// Resolve is the transport's statement that the memory is quiescent: the
// copy finished, the DMA is fenced, the remote registration is revoked.
// err is the outcome (nil for success; an error when the copy failed but
// provably stopped). The first call wins and returns true; a Resolve after
// a Quarantine wins too (it is the late evidence that lifts the
// quarantine). When Resolve returns, every block it gated that nobody else
// holds is back in its pool.
func (t *Transfer) Resolve(err error) bool {
	var ev outbox
	t.mu.Lock()
	next, ok := t.state.Load().next(evResolve)
	if !ok {
		t.mu.Unlock()
		return false
	}
	t.err = err
	t.cancel = nil
	t.state.Store(next)
	t.applyAll(next, &ev)
	t.gates0 = [2]gateRef{}
	t.more = nil
	t.ngates = 0
	if t.done != nil {
		close(t.done)
	}
	hook := t.onResolve
	t.onResolve = nil
	t.mu.Unlock()
	ev.flush()
	if hook != nil {
		hook(err)
	}
	return true
}

// OnResolve registers f to run once the transfer resolves, with its
// outcome (Err after Resolve). f runs at most once, with no lock of the
// transfer or of any pool held, on the goroutine that calls the winning
// Resolve, after the blocks the transfer gated are back in their pools
// and after Done is closed, before that Resolve returns: so whoever
// waits for Resolve to return sees what f did. If the transfer has
// already resolved, f runs at once on the caller's goroutine. A
// Quarantine does not run f (it is not evidence); the late Resolve that
// lifts it does. Several registrations run in the order they were made.
// A nil f is ignored. f may call any Transfer, Lease or Pool method; it
// should not block, since the transport's Resolve waits for it.
//
// OnResolve is how a component that must act on the evidence (a
// handoff moving to Delivered) does so without a goroutine per transfer
// waiting on Done.
func (t *Transfer) OnResolve(f func(err error)) {
	if f == nil {
		return
	}
	t.mu.Lock()
	if t.state.Load() != TransferResolved {
		if prev := t.onResolve; prev != nil {
			t.onResolve = func(err error) { prev(err); f(err) }
		} else {
			t.onResolve = f
		}
		t.mu.Unlock()
		return
	}
	err := t.err
	t.mu.Unlock()
	f(err)
}

// Quarantine says the transfer ended without proof of quiescence: the peer
// vanished mid-write, the deadline passed, the device reported a sticky
// error. Every block of every lease it gates is quarantined: counted as
// Quarantined and never reused. Only a later Resolve lifts it. reason is
// recorded as Err (nil means ErrQuarantined). Quarantine after Resolve, or a
// second Quarantine, is a no-op.
func (t *Transfer) Quarantine(reason error) {
	if reason == nil {
		reason = ErrQuarantined
	}
	var ev outbox
	t.mu.Lock()
	next, ok := t.state.Load().next(evQuarantine)
	if !ok {
		t.mu.Unlock()
		return
	}
	t.err = reason
	t.state.Store(next)
	t.applyAll(next, &ev)
	t.mu.Unlock()
	ev.flush()
}

// applyAll brings every attachment to state to, pool by pool. Called with
// t.mu held; takes each pool's lock in turn (lock order: transfer, pool).
func (t *Transfer) applyAll(to TransferState, ev *outbox) {
	var locked *core
	for i := 0; i < t.ngates; i++ {
		g := t.gateAt(i)
		c := g.l.c
		if c != locked {
			if locked != nil {
				locked.serve(ev)
				locked.unlock()
			}
			c.mu.Lock()
			locked = c
		}
		c.apply(g.l, to, t, ev)
	}
	if locked != nil {
		locked.serve(ev)
		locked.unlock()
	}
}

// Cancel asks the transport to stop: it runs the cancel hook at most once,
// and never once the transfer has resolved. It changes no state: the
// blocks stay held until the transport resolves the transfer.
func (t *Transfer) Cancel() {
	t.mu.Lock()
	h := t.cancel
	t.cancel = nil
	t.asked = true
	t.mu.Unlock()
	if h != nil {
		h()
	}
}

// Done returns a channel closed when the transfer resolves. It is made on
// first call.
func (t *Transfer) Done() <-chan struct{} {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.state.Load() == TransferResolved {
		return closedChan
	}
	if t.done == nil {
		t.done = make(chan struct{})
	}
	return t.done
}

// Err returns the outcome once resolved (nil for success), the reason
// while quarantined, and nil while pending.
func (t *Transfer) Err() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.err
}

// State returns the transfer's state.
func (t *Transfer) State() TransferState { return t.state.Load() }

// CancelRequested reports whether Cancel has been called.
func (t *Transfer) CancelRequested() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.asked
}

func (t *Transfer) String() string {
	return fmt.Sprintf("transfer %d (%v)", t.id, t.State())
}

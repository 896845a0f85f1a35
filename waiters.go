package kvlease

import (
	"context"
	"fmt"
	"github.com/kvlease/kvlease/internal/slots"
)

// AcquireWait is Acquire that waits for blocks instead of failing with
// ErrExhausted. Waiters are served strictly in arrival order: a later
// waiter is never served while an earlier one still waits, so a large
// request is never starved by small ones. Argument errors come first, then
// ErrPoolClosed, then ErrExceedsCapacity (at once: waiting could never
// help). When ctx ends first, AcquireWait returns ctx's error and holds
// nothing; Close wakes every waiter with ErrPoolClosed.
//
// A request for more blocks than Stats.Usable (capacity minus
// quarantined blocks) could never be served while the quarantine lasts:
// it fails at once with ErrQuarantineBound (which wraps ErrExhausted), and
// a waiter already queued is failed with it as soon as quarantine shrinks
// the usable blocks below its request, so that it never blocks the
// waiters behind it forever.
func (p *Pool[R]) AcquireWait(ctx context.Context, owner string, n int) (*Lease[R], error) {
	return p.acquireWait(ctx, owner, 0, n)
}

// acquireWait is AcquireWait for tenant tn (0: none; see quota.go).
func (p *Pool[R]) acquireWait(ctx context.Context, owner string, tn uint16, n int) (*Lease[R], error) {
	c := &p.core
	if err := c.precheck(owner, n); err != nil {
		return nil, c.reject(owner, n, err)
	}
	if err := ctx.Err(); err != nil {
		return nil, c.reject(owner, n, err)
	}
	var ev outbox
	c.mu.Lock()
	if c.closed.Load() {
		c.unlock()
		return nil, c.reject(owner, n, closedErr(owner, n))
	}
	if tn != 0 {
		// Only the tenant's own releases could make room under its cap:
		// refused now rather than queued ahead of everyone else.
		if err := c.quotaErr("acquire", owner, tn, n, 0); err != nil {
			c.unlock()
			return nil, c.reject(owner, n, err)
		}
	}
	l := p.newLease(owner, n)
	l.ls.tenant = tn
	if c.queued() == 0 && c.availableFor(tn) >= n {
		c.fillFor(l.ls.blocks, tn, &ev)
		c.opened(&l.ls, 0, &ev)
		c.unlock()
		ev.flush()
		return l, nil
	}
	if err := c.boundErr(owner, n, 0); err != nil {
		// Waiting could not help while the quarantine lasts, and it would
		// block everyone queued behind it.
		c.unlock()
		return nil, c.reject(owner, n, err)
	}
	w := &waiter{l: &l.ls, n: n, ready: make(chan struct{})}
	c.waiters = append(c.waiters, w)
	c.unlock()

	select {
	case <-w.ready:
	case <-ctx.Done():
		c.mu.Lock()
		if !w.served && w.err == nil {
			c.dequeue(w)
			// The head may have changed: whoever is next may fit now.
			c.serve(&ev)
			c.unlock()
			ev.flush()
			return nil, c.reject(owner, n, ctx.Err())
		}
		c.unlock()
	}
	// Served or woken by Close. The lease (if served) was filled and its
	// events emitted by whoever served it.
	if w.err != nil {
		return nil, c.reject(owner, n, w.err)
	}
	return l, nil
}

// waiter is one queued AcquireWait. Its lease is allocated before it
// queues, so serving it under the pool's lock only fills in blocks.
type waiter struct {
	l      *lease
	n      int
	ready  chan struct{} // closed when served or failed
	served bool
	err    error
}

func (c *core) queued() int { return len(c.waiters) - c.whead }

func (c *core) dequeue(w *waiter) {
	for i := c.whead; i < len(c.waiters); i++ {
		if c.waiters[i] == w {
			copy(c.waiters[i:], c.waiters[i+1:])
			c.waiters[len(c.waiters)-1] = nil
			c.waiters = c.waiters[:len(c.waiters)-1]
			break
		}
	}
	c.compactWaiters()
}

func (c *core) compactWaiters() {
	if c.whead == len(c.waiters) {
		clear(c.waiters)
		c.waiters, c.whead = c.waiters[:0], 0
	} else if c.whead > 64 && c.whead*2 > len(c.waiters) {
		n := copy(c.waiters, c.waiters[c.whead:])
		clear(c.waiters[n:])
		c.waiters, c.whead = c.waiters[:n], 0
	}
}

// serve hands blocks to queued waiters in arrival order, stopping at the
// first that does not fit, and raises or clears the quarantine alert.
// Called with c.mu held after anything that may have returned blocks or
// changed the quarantine.
//
// serve itself is the test, small enough to inline into every release
// (BenchmarkLeaseCycle guards it: a call is one more per cycle); serveAll
// does the work.
func (c *core) serve(ev *outbox) {
	if c.whead != len(c.waiters) || c.tab.QuarantinedCount() > c.alertAt {
		c.serveAll(ev)
	}
}

func (c *core) serveAll(ev *outbox) {
	if (c.tab.Count(slots.Quarantined) > c.alertLimit) != c.alerted {
		c.quarantineAlert(ev)
	}
	if c.whead == len(c.waiters) {
		return
	}
	c.serveSlow(ev)
}

// usable is capacity minus quarantined blocks: the most that could ever
// be free while the current quarantine lasts.
func (c *core) usable() int { return c.tab.Len() - c.tab.Count(slots.Quarantined) }

// boundErr returns an error wrapping ErrQuarantineBound when n fresh
// blocks could never be free while the current quarantine lasts, given
// that held usable blocks are already the requester's own (an extending
// lease's unquarantined blocks, or prefix hits); nil otherwise.
func (c *core) boundErr(owner string, n, held int) error {
	if n <= c.usable()-held {
		return nil
	}
	return fmt.Errorf("kvlease: %d fresh blocks for %q: %d of %d blocks are quarantined, %d usable, %d of them held already: %w",
		n, owner, c.tab.Count(slots.Quarantined), c.tab.Len(), c.usable(), held, ErrQuarantineBound)
}

// quarantineAlert raises or clears the quarantine alert. Called with c.mu
// held.
func (c *core) quarantineAlert(ev *outbox) {
	c.alerted = !c.alerted
	c.alertAt = c.alertLimit
	if c.alerted {
		c.alertAt = -1
	}
	if c.obs == nil {
		return
	}
	q := c.tab.Count(slots.Quarantined)
	kind, verb := EventQuarantineAlert, "above"
	if !c.alerted {
		kind, verb = EventQuarantineRecovered, "back to or below"
	}
	ev.add(c.obs, Event{Kind: kind, Blocks: q,
		Err: fmt.Errorf("kvlease: %d of %d blocks quarantined (%d usable), %s the alert limit of %d",
			q, c.tab.Len(), c.tab.Len()-q, verb, c.alertLimit)})
}

// failBound fails a queued waiter that quarantine left unservable.
func failBound(w *waiter, err error) {
	w.err = err
	close(w.ready)
}

func (c *core) serveSlow(ev *outbox) {
	if u := c.usable(); u < c.scannedUsable {
		// Quarantine grew since the last scan: fail every queued waiter
		// that asks for more than could ever be free now.
		kept := c.waiters[:c.whead]
		for _, w := range c.waiters[c.whead:] {
			if err := c.boundErr(w.l.owner, w.n, 0); err != nil {
				failBound(w, err)
				continue
			}
			kept = append(kept, w)
		}
		clear(c.waiters[len(kept):])
		c.waiters = kept
	}
	c.scannedUsable = c.usable()
	for c.whead < len(c.waiters) {
		w := c.waiters[c.whead]
		tn := w.l.tenant
		if tn != 0 {
			// Its tenant's cap shrank below it while it waited: failed
			// at the head, so that it holds up nobody (quota.go).
			if err := c.quotaErr("acquire", w.l.owner, tn, w.n, 0); err != nil {
				failBound(w, err)
				c.waiters[c.whead] = nil
				c.whead++
				continue
			}
		}
		if c.availableFor(tn) < w.n {
			break
		}
		c.fillFor(w.l.blocks, tn, ev)
		c.opened(w.l, 0, ev)
		w.served = true
		close(w.ready)
		c.waiters[c.whead] = nil
		c.whead++
	}
	c.compactWaiters()
}

package audit

import (
	"fmt"
	"slices"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// settle brings the model up to date with what the last operation did to
// r: transfer evidence, leases a handoff closed, the handoff's outcome.
func (w *world) settle(r *request) {
	if r == nil {
		return
	}
	concurrent := w.cfg.Concurrent
	if concurrent {
		for _, j := range r.jobs {
			w.poll(j)
		}
	}
	if hr := r.h; hr != nil && !r.gone && concurrent {
		// Copies resolve and handoffs record it on their own. Done is
		// closed once a handoff's final state and its effects (a
		// released destination) are in place, and no final state comes
		// before the transfer's evidence: so look at Done first, then
		// bring the model up to date, then act on the final state.
		done := closed(hr.h.Done())
		if !done && hr.x != nil && hr.x.t.State() == kvlease.TransferResolved {
			// The watcher is about to record the evidence.
			if !w.await(hr.h.Done(), fmt.Sprintf("request %d: handoff to record its transfer's evidence", r.id)) {
				return
			}
			done = true
		}
		if done && hr.job != nil {
			w.finishJob(hr.job)
		}
		w.syncXfer(hr.x)
		w.syncLease(hr.src)
		w.syncLease(hr.dst)
		if done {
			w.settleHandoff(r, hr)
		}
	} else if hr != nil && !r.gone {
		if hr.x != nil && hr.x.t.State() == kvlease.TransferResolved {
			if hr.job != nil && !hr.job.ended && !hr.job.flagged {
				hr.job.flagged = true
				w.violate(EarlyResolve, "request %d: transfer %d resolved (%v) while its copy was still running (%d of %d blocks written)",
					r.id, hr.x.t.ID(), hr.x.t.Err(), hr.job.writes, hr.n)
			}
			// The handoff's watcher records the evidence; wait for it.
			if !w.await(hr.h.Done(), fmt.Sprintf("request %d: handoff to record its transfer's evidence", r.id)) {
				return
			}
		}
		w.syncXfer(hr.x)
		w.syncLease(hr.src)
		w.syncLease(hr.dst)
		w.settleHandoff(r, hr)
	}
	for _, j := range r.jobs {
		w.syncXfer(j.x)
	}
	if r.cur != nil {
		w.syncLease(r.cur)
	}
}

// refresh settles r between operations (concurrent runs): what its copy
// did meanwhile, and the waiters that freed blocks served.
func (w *world) refresh(r *request) {
	w.settle(r)
	for _, ps := range w.pools {
		w.serveWaiters(ps)
	}
	w.collectAsync()
}

// settleHandoff acts on a handoff's state after an operation.
func (w *world) settleHandoff(r *request, hr *handRec) {
	h := hr.h
	switch st := h.State(); st {
	case handoff.Rejected:
		if h.Transfer() != nil {
			w.violate(HandoffBroken, "request %d: rejected handoff has transfer %d", r.id, h.Transfer().ID())
		}
		if hr.dst != nil && hr.dst.open {
			w.violate(HandoffBroken, "request %d: rejected handoff left its destination lease open", r.id)
		}
		r.h = nil
	case handoff.Delivered:
		if w.cfg.Concurrent && hr.job != nil {
			w.finishJob(hr.job)
		}
		if hr.job == nil || !hr.job.ended || hr.x == nil || hr.x.state != kvlease.TransferResolved {
			w.violate(HandoffBroken, "request %d: handoff delivered before its copy ended", r.id)
		}
		dst := hr.dst
		if !dst.open {
			w.violate(HandoffBroken, "request %d: delivered destination lease is closed", r.id)
			r.h = nil
			return
		}
		for i := range dst.refs {
			dst.want[i], dst.known[i] = hr.src.want[i], hr.src.known[i]
		}
		w.rep.Delivered++
		w.checkLease(dst)
		// The source worker is done with the request.
		w.checkLease(hr.src)
		hr.src.l.Release()
		w.closeRec(hr.src)
		r.cur, r.at, r.h = dst, dst.ps, nil
		if w.cfg.hooks.delivered != nil {
			w.cfg.hooks.delivered(w, r)
		}
	case handoff.Failed:
		if hr.dst != nil && hr.dst.open {
			w.violate(HandoffBroken, "request %d: failed handoff left its destination lease open", r.id)
		}
		if hr.x != nil {
			w.rep.Failed++
		}
		r.h = nil
	case handoff.Aborted:
		if hr.src.open || (hr.dst != nil && hr.dst.open) {
			w.violate(HandoffBroken, "request %d: aborted handoff left a lease open", r.id)
		}
		if hr.x != nil && hr.x.state != kvlease.TransferResolved {
			w.violate(HandoffBroken, "request %d: handoff aborted while its transfer is %v", r.id, hr.x.state)
		}
		r.h = nil
		w.gone(r)
	case handoff.Accepted, handoff.Transferring, handoff.Aborting, handoff.Quarantined:
	default:
		w.violate(HandoffBroken, "request %d: handoff left in state %v", r.id, st)
	}
}

// serveWaiters hands the leases of waiters the pool served to their
// requests. The pool serves in arrival order, so they are the head of the
// queue.
func (w *world) serveWaiters(ps *poolState) {
	if len(ps.fifo) == 0 {
		return
	}
	if w.cfg.Concurrent {
		// Copies free blocks at any time: take the results that came.
		for _, r := range slices.Clone(ps.fifo) {
			select {
			case res := <-r.wait.ch:
				ps.fifo = removeReq(ps.fifo, r)
				r.wait = nil
				if res.err != nil {
					w.violate(Unexpected, "%s: served waiter %d got %v", ps.name, r.id, res.err)
					w.gone(r)
					continue
				}
				w.waited(r, ps, res.l)
			default:
			}
		}
		return
	}
	q := ps.p.Stats().Waiters
	if len(ps.fifo) > 0 && len(ps.fifo[0].wait.ch) > 0 {
		q = min(q, len(ps.fifo)-1) // served before the audit saw it queue
	}
	if q > len(ps.fifo) {
		w.violate(Unexpected, "%s: pool reports %d waiters, the audit queued %d", ps.name, q, len(ps.fifo))
		return
	}
	for len(ps.fifo) > q && !w.stopped {
		r := ps.fifo[0]
		ps.fifo = ps.fifo[1:]
		res, ok := w.result(r.wait)
		r.wait = nil
		if !ok {
			return
		}
		if res.err != nil {
			w.violate(Unexpected, "%s: served waiter %d got %v", ps.name, r.id, res.err)
			w.gone(r)
			continue
		}
		w.waited(r, ps, res.l)
	}
}

func (w *world) result(wr *waitRec) (waitResult, bool) {
	select {
	case res := <-wr.ch:
		return res, true
	default:
	}
	t := time.NewTimer(w.cfg.StallTimeout)
	defer t.Stop()
	select {
	case res := <-wr.ch:
		return res, true
	case <-t.C:
		w.stall("a served or cancelled waiter did not return")
		return waitResult{}, false
	}
}

func (w *world) waited(r *request, ps *poolState, l *kvlease.Lease[[]byte]) {
	lr := w.opened(ps, l, 0, r)
	w.rep.Waited++
	w.prefill(r, lr, 0)
}

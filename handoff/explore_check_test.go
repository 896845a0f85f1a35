package handoff

import (
	"errors"
	"fmt"
	"slices"
	"testing/synctest"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/internal/explore"
)

var _ explore.Instance = (*xworld)(nil)

// The properties the explorer checks: Check after every step (safety),
// Quiescent once nothing more can happen (liveness), Finish after the
// teardown (nothing leaked once the connection is gone and every plane
// has returned). EXPLORER.md states them.

// opsOf returns a snapshot of the ops with their state.
func (w *xworld) opsSnapshot() []xop {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]xop, len(w.ops))
	for i, op := range w.ops {
		out[i] = xop{name: op.name, side: op.side, id: op.id, refs: op.refs, pool: op.pool,
			attached: op.attached, st: op.st, canceled: op.canceled, moved: op.moved}
	}
	return out
}

func (w *xworld) handles(h *xh) (*Outgoing[[]byte], *Incoming[[]byte]) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return h.out, h.in
}

// Check is safety, after every step:
//
//   - both pools: Pool.Check is nil and the five counts sum to the
//     capacity;
//   - a rejected handoff moves no byte: no plane op of a side that is
//     Rejected ever attached (so it never read or wrote a region);
//   - a block a plane may still touch (its op attached and has not
//     returned) is neither free nor handed out again: its ref is not
//     stale;
//   - every sealed destination block holds the bytes of the source block
//     it came from (the accepted handoff that delivered it, or the warm
//     cache), and a delivered lease serves nothing else (checked in
//     onDelivered);
//   - the source is Delivered only if the destination is;
//   - the destination's callbacks run once per handoff.
func (w *xworld) Check() error {
	var errs []error
	w.mu.Lock()
	errs = append(errs, w.violations...)
	w.violations = nil
	w.mu.Unlock()
	for i, p := range []*kvlease.Pool[[]byte]{w.srcPool, w.dstPool} {
		side := [2]string{"source", "destination"}[i]
		if err := p.Check(); err != nil {
			errs = append(errs, fmt.Errorf("%s pool: %w", side, err))
		}
		if s := p.Stats(); s.Free+s.Cached+s.Leased+s.Draining+s.Quarantined != s.Capacity {
			errs = append(errs, fmt.Errorf("%s pool: counts %+v do not sum to the capacity", side, s))
		}
	}
	ops := w.opsSnapshot()
	for _, op := range ops {
		if !op.attached || op.st == opReturned || op.st == opRefused {
			continue
		}
		for i, ref := range op.refs {
			if _, err := op.pool.Region(ref); err != nil {
				errs = append(errs, fmt.Errorf("block %v (block %d of plane op %s) was freed or handed out again while the op may still touch it: %w", ref, i, op.name, err))
			}
		}
	}
	for _, h := range w.hs {
		out, in := w.handles(h)
		sst, dst := State(stateNone), State(stateNone)
		if out != nil {
			sst = out.State()
		}
		if in != nil {
			dst = in.State()
		}
		for _, op := range ops {
			if op.id != h.cfg.id || !op.attached {
				continue
			}
			if st := [2]State{sst, dst}[op.side]; st == Rejected {
				errs = append(errs, fmt.Errorf("handoff %d is rejected on the %s, yet its plane op %s attached (moved bytes: %v)", h.cfg.id, [2]string{"source", "destination"}[op.side], op.name, op.moved))
			}
		}
		if sst == Delivered && dst != Delivered {
			errs = append(errs, fmt.Errorf("handoff %d: the source is delivered, the destination %v", h.cfg.id, dst))
		}
		w.mu.Lock()
		finals, deliveries := h.finals, h.deliveries
		w.mu.Unlock()
		if finals > 1 || deliveries > 1 {
			errs = append(errs, fmt.Errorf("handoff %d: OnFinal ran %d times, OnDelivered %d", h.cfg.id, finals, deliveries))
		}
		if in != nil {
			errs = append(errs, w.checkSeals(in)...)
		}
	}
	return errors.Join(errs...)
}

// noteSeals records the origin of every block in's lease sealed past
// its hits: the source block of this handoff it came from. It runs after
// every step, replays included (settle).
func (w *xworld) noteSeals(in *Incoming[[]byte]) {
	l := in.Lease()
	if l == nil {
		return
	}
	for i := in.Hits(); i < l.Len(); i++ {
		ref := l.Ref(i)
		if _, sealed := w.dstPool.SealInfo(ref, nil); !sealed {
			continue
		}
		w.mu.Lock()
		if _, known := w.origin[ref]; !known {
			w.origin[ref] = xorigin{in.ID(), i}
		}
		w.mu.Unlock()
	}
}

// checkSeals checks that every sealed block of in's lease holds its
// origin's bytes: a block past the hits is this handoff's source block;
// a hit is what sealed it before.
func (w *xworld) checkSeals(in *Incoming[[]byte]) []error {
	l := in.Lease()
	if l == nil {
		return nil
	}
	var errs []error
	for i := range l.Len() {
		ref := l.Ref(i)
		if _, sealed := w.dstPool.SealInfo(ref, nil); !sealed {
			continue
		}
		w.mu.Lock()
		o, known := w.origin[ref]
		w.mu.Unlock()
		if !known {
			errs = append(errs, fmt.Errorf("handoff %d: block %d (%v) is a sealed hit nobody sealed", in.ID(), i, ref))
			continue
		}
		r, err := w.dstPool.Region(ref)
		if err != nil {
			errs = append(errs, fmt.Errorf("handoff %d: sealed block %d (%v): %w", in.ID(), i, ref, err))
			continue
		}
		if !slices.Equal(r, marker(o)) {
			errs = append(errs, fmt.Errorf("handoff %d: block %d (%v) is sealed (findable, served to prefix hits) but holds bytes not from handoff %d's block %d: % x", in.ID(), i, ref, o.id, o.index, r))
		}
	}
	return errs
}

// Quiescent is liveness, once nothing more can happen (every message
// delivered or lost, every deadline fired, every plane returned or
// stuck for good):
//
//   - no plane op is stalled without having been asked to stop: a
//     transfer that cannot end on its own must be cancelled by the half
//     that gave up on it (the deadline, an abort), or its blocks are
//     held for good;
//   - every handoff is final on both sides, except one Quarantined on a
//     side whose plane never returns (frozen), or a source still
//     Proposed after one of its messages was lost (the engine's own
//     timeout aborts it; the protocol has none);
//   - a final handoff's transfer is resolved; a destination handoff that
//     did not deliver has closed its lease;
//   - the pools: nothing draining; exactly the blocks of frozen ops
//     quarantined; no lease open but those the engines hold;
//   - the two sides agree, or differ only as documented (agree).
func (w *xworld) Quiescent() error {
	var errs []error
	ops := w.opsSnapshot()
	frozen := func(side int, id uint64) bool {
		for _, op := range ops {
			if op.side == side && op.id == id && op.st == opFrozen {
				return true
			}
		}
		return false
	}
	for _, op := range ops {
		switch op.st {
		case opStalled, opStallSync:
			errs = append(errs, fmt.Errorf("plane op %s stalled and nothing asked it to stop: its transfer never resolves, its blocks are held for good", op.name))
		case opWaitAttach, opRunning, opPushed:
			errs = append(errs, fmt.Errorf("plane op %s is %v at quiescence", op.name, op.st))
		}
	}
	open := [2]int{}
	for _, h := range w.hs {
		out, in := w.handles(h)
		id := h.cfg.id
		if !h.lease.Closed() {
			open[0]++
		}
		w.mu.Lock()
		if h.delivered != nil && !h.dstReleased {
			open[1]++
		}
		dropped := h.dropped
		w.mu.Unlock()
		sst, dst := State(stateNone), State(stateNone)
		if out != nil {
			sst = out.State()
			switch {
			case sst.Final():
				if t := out.Transfer(); t != nil && t.State() != kvlease.TransferResolved {
					errs = append(errs, fmt.Errorf("source handoff %d is %v with its transfer %v", id, sst, t.State()))
				}
			case sst == Quarantined && frozen(dirSD, id):
			case sst == Proposed && dropped:
			default:
				errs = append(errs, fmt.Errorf("source handoff %d is stuck %v", id, sst))
			}
		}
		if in != nil {
			dst = in.State()
			switch {
			case dst.Final():
				if t := in.Transfer(); t != nil && t.State() != kvlease.TransferResolved {
					errs = append(errs, fmt.Errorf("destination handoff %d is %v with its transfer %v", id, dst, t.State()))
				}
				if l := in.Lease(); dst != Delivered && l != nil && !l.Closed() {
					errs = append(errs, fmt.Errorf("destination handoff %d is %v with its lease open", id, dst))
				}
			case dst == Quarantined && frozen(dirDS, id):
			default:
				errs = append(errs, fmt.Errorf("destination handoff %d is stuck %v", id, dst))
			}
		}
		if err := agree(sst, dst, out, in); err != nil {
			errs = append(errs, fmt.Errorf("handoff %d: %w", id, err))
		}
	}
	for i, p := range []*kvlease.Pool[[]byte]{w.srcPool, w.dstPool} {
		side := [2]string{"source", "destination"}[i]
		quarantined := map[kvlease.BlockRef]bool{}
		for _, op := range ops {
			if op.side == i && op.st == opFrozen {
				for _, r := range op.refs {
					quarantined[r] = true
				}
			}
		}
		s := p.Stats()
		if s.Draining != 0 || s.Quarantined != len(quarantined) || s.OpenLeases != open[i] {
			errs = append(errs, fmt.Errorf("%s pool: %d draining, %d quarantined, %d leases open; want 0 draining, %d quarantined (the frozen planes' blocks), %d open (the engine's)",
				side, s.Draining, s.Quarantined, s.OpenLeases, len(quarantined), open[i]))
		}
	}
	return errors.Join(errs...)
}

// agree checks the two sides' outcomes of one handoff once settled.
// Each side ends by its own evidence, so they may differ, but only in
// the documented ways: the source is never Delivered unless the
// destination is (Check holds that at every step); a destination that
// delivered leaves the source Delivered, Failed (its Done never came:
// ErrUnconfirmed; the connection died first; its own plane failed after
// the last byte), Aborted (its abort crossed the delivery) or
// Quarantined (its plane never returned), never Rejected: a rejected
// source never sent, so its destination is Rejected, Aborted (its
// Accept crossed the source's abort or the connection's loss, or no
// Start came) or never heard of it.
func agree(src, dst State, out *Outgoing[[]byte], in *Incoming[[]byte]) error {
	switch {
	case src == Delivered && dst != Delivered:
		return fmt.Errorf("the source is delivered, the destination %v", dst)
	case dst == Delivered && (src == Rejected || src == stateNone || src == Proposed):
		return fmt.Errorf("the destination is delivered, the source %v: it never sent", src)
	case src == Rejected && dst != stateNone && dst != Rejected && dst != Aborted:
		return fmt.Errorf("the source is rejected (it never sent), the destination %v", dst)
	}
	return nil
}

// Finish tears the run down as a process exit would: the connection
// closes, every plane returns (the frozen ones as late evidence), every
// deadline fires, the engines release what they hold. Then nothing may
// be left: every handoff final on both sides, both pools all free or
// cached, no lease open.
func (w *xworld) Finish() error {
	w.mu.Lock()
	w.tearing = true
	w.mu.Unlock()
	w.link.close()
	for range 32 {
		var acts []func()
		w.mu.Lock()
		for _, op := range w.ops {
			switch op.st {
			case opWaitAttach:
				if !op.opened {
					acts = append(acts, op.open)
				}
			case opRunning, opPushed, opStalled, opStallSync, opFrozen:
				op.st = opReturned // taken here: no second finish
				acts = append(acts, func() { op.t.Resolve(errStopped) })
			}
		}
		for _, x := range w.timers {
			if !x.off {
				x.off, x.fired = true, true
				acts = append(acts, func() { x.tm.Stop(); x.f() })
			}
		}
		for _, h := range w.hs {
			if h.prog != nil && h.prefilled < h.cfg.blocks {
				acts = append(acts, func() {
					for h.prefilled < h.cfg.blocks {
						w.prefill(h)
					}
				})
			}
			if !h.lease.Closed() {
				acts = append(acts, h.lease.Release)
			}
			if h.delivered != nil && !h.dstReleased {
				h.dstReleased = true
				acts = append(acts, h.delivered.Release)
			}
		}
		w.mu.Unlock()
		if len(acts) == 0 {
			break
		}
		for _, f := range acts {
			go f()
		}
		synctest.Wait()
		w.settle()
	}
	<-w.served
	_ = w.src.Close()
	var errs []error
	for _, h := range w.hs {
		out, in := w.handles(h)
		if out != nil && !out.State().Final() {
			errs = append(errs, fmt.Errorf("source handoff %d is %v after the teardown", h.cfg.id, out.State()))
		}
		if in != nil && !in.State().Final() {
			errs = append(errs, fmt.Errorf("destination handoff %d is %v after the teardown", h.cfg.id, in.State()))
		}
		w.mu.Lock()
		finals := h.finals
		w.mu.Unlock()
		if in != nil && finals != 1 {
			errs = append(errs, fmt.Errorf("destination handoff %d: OnFinal ran %d times", h.cfg.id, finals))
		}
	}
	for i, p := range []*kvlease.Pool[[]byte]{w.srcPool, w.dstPool} {
		side := [2]string{"source", "destination"}[i]
		if err := p.Check(); err != nil {
			errs = append(errs, fmt.Errorf("%s pool: %w", side, err))
		}
		if s := p.Stats(); s.Free+s.Cached != s.Capacity || s.OpenLeases != 0 {
			errs = append(errs, fmt.Errorf("%s pool after the teardown: %+v: blocks leaked", side, s))
		}
	}
	w.mu.Lock()
	errs = append(errs, w.violations...)
	w.violations = nil
	w.mu.Unlock()
	return errors.Join(errs...)
}

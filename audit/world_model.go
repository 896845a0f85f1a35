package audit

import (
	"fmt"

	"github.com/kvlease/kvlease"
)

// opened records a lease just handed out: its first hits blocks are
// prefix hits (checked against what was sealed), the rest fresh
// (checked against every holder the model knows of).
func (w *world) opened(ps *poolState, l *kvlease.Lease[[]byte], hits int, r *request) *leaseRec {
	n := l.Len()
	lr := &leaseRec{ps: ps, l: l, r: r, refs: make([]kvlease.BlockRef, 0, n), want: make([]Marker, 0, n), known: make([]bool, 0, n), open: true}
	for i := range n {
		w.addBlock(lr, l.Ref(i), i < hits)
	}
	return lr
}

// addBlock appends block ref to lr's record, checking it.
func (w *world) addBlock(lr *leaseRec, ref kvlease.BlockRef, hit bool) {
	ps := lr.ps
	i := len(lr.refs)
	lr.refs = append(lr.refs, ref)
	lr.want = append(lr.want, Marker{})
	lr.known = append(lr.known, false)
	id := int(ref.ID)
	if id < 0 || id >= len(ps.held) {
		w.violate(Unexpected, "%s: lease %d block %d: slot %v outside the pool", ps.name, lr.l.ID(), i, ref)
		return
	}
	if hit {
		rec := ps.seal[id]
		var h kvlease.BlockHash
		if lr.r != nil && i < len(lr.r.hashes) {
			h = lr.r.hashes[i]
		}
		switch {
		case !rec.ok || rec.gen != ref.Gen:
			w.violate(BadHit, "%s: request %d block %d hit slot %v, which the audit never sealed at that generation", ps.name, lr.r.id, i, ref)
		case rec.hash != h:
			w.violate(BadHit, "%s: request %d block %d hit slot %v sealed with hash %016x, want %016x", ps.name, lr.r.id, i, ref, uint64(rec.hash), uint64(h))
		default:
			lr.want[i], lr.known[i] = rec.want, true
			w.checkBlock(lr, i)
		}
	} else {
		if w.cfg.Concurrent && (ps.held[id] > 0 || ps.pend[id] > 0 || ps.quar[id] > 0) {
			// The model may lag what copies and handoffs did meanwhile.
			w.resync()
		}
		if ps.held[id] > 0 || ps.pend[id] > 0 || ps.quar[id] > 0 {
			w.violate(DoubleLease, "%s: slot %v handed out fresh to %s while %d open leases, %d pending and %d quarantined transfers hold it",
				ps.name, ref, lr.l.Owner(), ps.held[id], ps.pend[id], ps.quar[id])
		}
		if ref.Gen == ps.gen[id] {
			w.violate(DoubleLease, "%s: slot %v handed out fresh to %s without a new generation", ps.name, ref, lr.l.Owner())
		}
		ps.gen[id] = ref.Gen
	}
	ps.held[id]++
}

// closeRec records that lr closed.
func (w *world) closeRec(lr *leaseRec) {
	if lr == nil || !lr.open {
		return
	}
	lr.open = false
	for _, ref := range lr.refs {
		if id := int(ref.ID); id >= 0 && id < len(lr.ps.held) {
			lr.ps.held[id]--
		}
	}
}

// syncLease notices that the library closed lr (a handoff does that).
func (w *world) syncLease(lr *leaseRec) {
	if lr != nil && lr.open && leaseClosed(lr.l) {
		w.closeRec(lr)
	}
}

func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

func leaseClosed(l *kvlease.Lease[[]byte]) bool { return l.Closed() }

func (w *world) attachRec(x *xferRec) {
	for _, a := range x.atts {
		for _, ref := range a.lr.refs[:a.n] {
			a.lr.ps.pend[ref.ID]++
		}
	}
}

// syncXfer brings the model's view of x to the transfer's state.
func (w *world) syncXfer(x *xferRec) {
	if x == nil {
		return
	}
	st := x.t.State()
	if st == x.state || x.state == kvlease.TransferResolved {
		return
	}
	if x.state == kvlease.TransferQuarantined && st == kvlease.TransferPending {
		w.violate(Unexpected, "transfer %d went from quarantined back to pending", x.t.ID())
		return
	}
	for _, a := range x.atts {
		ps := a.lr.ps
		for _, ref := range a.lr.refs[:a.n] {
			if x.state == kvlease.TransferPending {
				ps.pend[ref.ID]--
			} else {
				ps.quar[ref.ID]--
			}
			if st == kvlease.TransferQuarantined {
				ps.quar[ref.ID]++
			}
		}
	}
	x.state = st
}

// resync brings the model's lease and transfer records up to date with
// the library, for every request that holds anything (concurrent runs,
// where copies resolve and handoffs release on their own).
func (w *world) resync() {
	for _, r := range w.reqs {
		if hr := r.h; hr != nil {
			w.syncXfer(hr.x)
			w.syncLease(hr.src)
			w.syncLease(hr.dst)
		}
		for _, j := range r.jobs {
			w.syncXfer(j.x)
		}
		if r.cur != nil {
			w.syncLease(r.cur)
		}
	}
}

// stamp writes the request's own marker into block i of lr.
func (w *world) stamp(lr *leaseRec, i int) {
	b, err := lr.l.Region(i)
	if err != nil {
		w.violate(Unexpected, "%s: open lease %d refuses block %d: %v", lr.ps.name, lr.l.ID(), i, err)
		return
	}
	m := Marker{Request: uint64(lr.r.id), Block: uint32(i), Gen: lr.refs[i].Gen}
	Stamp(b, m)
	lr.want[i], lr.known[i] = m, true
}

// checkBlock checks block i of the open lease lr against what it must
// hold.
func (w *world) checkBlock(lr *leaseRec, i int) {
	if !lr.known[i] {
		return
	}
	b, err := lr.l.ReadRegion(i)
	if err != nil {
		w.violate(Unexpected, "%s: open lease %d refuses block %d: %v", lr.ps.name, lr.l.ID(), i, err)
		return
	}
	if err := Check(b, lr.want[i]); err != nil {
		me := err.(*MismatchError)
		me.Where = fmt.Sprintf("%s: request %d's lease %d block %d (slot %v)", lr.ps.name, lr.r.id, lr.l.ID(), i, lr.refs[i])
		w.violate(MarkerMix, "%v", me)
	}
}

func (w *world) checkLease(lr *leaseRec) {
	if lr == nil || !lr.open {
		return
	}
	for i := range lr.refs {
		w.checkBlock(lr, i)
	}
}

// sealFrom seals lr's unsealed full prompt blocks, from lr.sealedTo on.
func (w *world) sealFrom(lr *leaseRec) {
	r := lr.r
	bt := w.cfg.BlockTokens
	end := min(len(r.hashes), len(lr.refs))
	for i := lr.sealedTo; i < end; i++ {
		if !lr.known[i] {
			break
		}
		parent := namespace
		if i > 0 {
			parent = r.hashes[i-1]
		}
		h, err := lr.l.SealTokens(i, parent, r.tokens[i*bt:(i+1)*bt])
		if err != nil {
			w.violate(Unexpected, "%s: seal block %d of request %d: %v", lr.ps.name, i, r.id, err)
			return
		}
		if h != r.hashes[i] {
			w.violate(Unexpected, "%s: SealTokens hashed block %d of request %d to %016x, ChainHashes says %016x", lr.ps.name, i, r.id, uint64(h), uint64(r.hashes[i]))
		}
		ref := lr.refs[i]
		lr.ps.seal[ref.ID] = sealRec{gen: ref.Gen, hash: h, want: lr.want[i], ok: true}
		lr.sealedTo = i + 1
		w.rep.Seals++
	}
}

// prefill computes a new lease's KV: stamps its fresh blocks and seals its
// full prompt blocks.
func (w *world) prefill(r *request, lr *leaseRec, hits int) {
	for i := hits; i < len(lr.refs); i++ {
		w.stamp(lr, i)
	}
	lr.sealedTo = min(hits, len(r.hashes))
	w.sealFrom(lr)
	r.cur, r.at = lr, lr.ps
	w.rep.Admitted++
}

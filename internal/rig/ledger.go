package rig

// The ledger: the final account every run prints, what happened to every
// request, the pools at the end, and the isolation checks that must come
// out 0.

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/kvlease/kvlease"
)

// Ledger is what a run ends with.
type Ledger struct {
	Requests  int
	Delivered int
	// Rejections, by who refused: the envelope (CheckRequest), the prefill pool
	// (exhausted), the decode side's policy (too many running) and the
	// decode pool (exhausted).
	RejectedEnvelope, RejectedPrefill, RejectedPolicy, RejectedDecode int
	Failed                                                            int
	// Aborted counts every aborted handoff; AbortedLifted those whose
	// quarantine late evidence lifted.
	Aborted, AbortedLifted int
	// Quarantined handoffs never got their late evidence.
	Quarantined int

	Prefill, Decode kvlease.Stats // the pools at the end
	// Unsettled says, for each pool checked with Pool.CheckQuiescent
	// (Quiescent), what still holds blocks besides the quarantine a run
	// expects (closed leases whose evidence never came): an open lease,
	// a draining one, a waiter, an inconsistency. It must be empty. (A
	// string, not a slice: ledgers are compared with ==.)
	Unsettled string
	// MarkerMismatches counts delivered blocks whose content was not their
	// request's marker; LateWrites counts transfers that touched a block
	// after their evidence (after it was reclaimed, or a get posted into
	// a handoff already resolved). Both must be 0.
	MarkerMismatches, LateWrites int

	// Two processes only. Disagreements counts requests whose prefill and
	// decode sides ended in different states; ProtocolErrors the control
	// messages either side refused; Child is how the decode process ended
	// (the zero value where nobody tracks it).
	Disagreements, ProtocolErrors int
	Child                         ChildExit
	// Authenticated is how the two processes' control session was
	// authenticated: "psk", "tls" or "none" ("" for one process).
	Authenticated string
}

// Quiescent records pool's Pool.CheckQuiescent result in Unsettled:
// nothing when the pool is at rest or holds only closed quarantined
// leases.
func (l *Ledger) Quiescent(pool string, err error) {
	var qe *kvlease.QuiescenceError
	if errors.As(err, &qe) && qe.OpenLeases+qe.Leased+qe.Draining+qe.Waiters == 0 {
		quarantinedOnly := true
		for _, h := range qe.Holdings {
			quarantinedOnly = quarantinedOnly && h.State == kvlease.LeaseQuarantined
		}
		if quarantinedOnly {
			return
		}
	}
	if err != nil {
		if l.Unsettled != "" {
			l.Unsettled += "; "
		}
		l.Unsettled += pool + ": " + err.Error()
	}
}

// ChildExit is how the decode process of a two-process run ended.
type ChildExit struct {
	Ran    bool // a decode process was started
	Exited bool // it exited by itself and was reaped
	Code   int  // its exit status
}

// Rejected is the sum of all rejections.
func (l Ledger) Rejected() int {
	return l.RejectedEnvelope + l.RejectedPrefill + l.RejectedPolicy + l.RejectedDecode
}

// Problems lists the isolation failures the ledger shows: marker
// mismatches, late writes, blocks neither free nor quarantined at the end,
// requests unaccounted for, sides that disagree, refused control
// messages, a decode process that did not exit cleanly. Empty means the
// run was clean.
func (l Ledger) Problems() []string {
	var out []string
	if l.MarkerMismatches != 0 {
		out = append(out, fmt.Sprintf("%d marker mismatches", l.MarkerMismatches))
	}
	if l.LateWrites != 0 {
		out = append(out, fmt.Sprintf("%d transfers touched memory after their evidence", l.LateWrites))
	}
	for _, p := range []struct {
		name string
		s    kvlease.Stats
	}{{"prefill", l.Prefill}, {"decode", l.Decode}} {
		if p.s.Free+p.s.Quarantined != p.s.Capacity {
			out = append(out, fmt.Sprintf("%s pool: %d blocks neither free nor quarantined", p.name, p.s.Capacity-p.s.Free-p.s.Quarantined))
		}
	}
	if l.Unsettled != "" {
		out = append(out, "pools not at rest: "+l.Unsettled)
	}
	if n := l.Delivered + l.Rejected() + l.Failed + l.Aborted + l.Quarantined; n != l.Requests {
		out = append(out, fmt.Sprintf("%d of %d requests accounted for", n, l.Requests))
	}
	if l.Disagreements != 0 {
		out = append(out, fmt.Sprintf("%d requests whose two sides ended differently", l.Disagreements))
	}
	if l.ProtocolErrors != 0 {
		out = append(out, fmt.Sprintf("%d control messages refused", l.ProtocolErrors))
	}
	if l.Child.Ran && (!l.Child.Exited || l.Child.Code != 0) {
		out = append(out, fmt.Sprintf("decode process: exited %v, status %d", l.Child.Exited, l.Child.Code))
	}
	return out
}

// Ranges renders a set of block ids compactly: "3-7,9,12-13".
func Ranges(ids []kvlease.BlockID) string {
	ids = slices.Sorted(slices.Values(ids))
	var b strings.Builder
	for i := 0; i < len(ids); {
		j := i
		for j+1 < len(ids) && ids[j+1] == ids[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		if j > i {
			fmt.Fprintf(&b, "%d-%d", ids[i], ids[j])
		} else {
			fmt.Fprintf(&b, "%d", ids[i])
		}
		i = j + 1
	}
	return b.String()
}

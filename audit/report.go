package audit

import (
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/kvlease/kvlease"
)

// ViolationKind names an isolation or accounting failure the audit
// detects.
type ViolationKind uint8

// The violations.
const (
	// MarkerMix: a live lease's block does not hold its own marker (or
	// the sealed content its prefix hit): someone else's KV, or a torn
	// write.
	MarkerMix ViolationKind = iota + 1
	// LateWrite: a transfer wrote a block after it was reclaimed (its slot
	// is free or at another generation): the 2026 incident.
	LateWrite
	// LateRead: a transfer read a block after it was reclaimed, copying
	// whoever holds it now.
	LateRead
	// EarlyResolve: a transfer was resolved while its copy was still
	// running, or a copy wrote after its transfer resolved: evidence
	// without quiescence.
	EarlyResolve
	// DoubleLease: a block was handed out fresh while an open lease or an
	// unresolved transfer still held it, or without a new generation.
	DoubleLease
	// BadHit: a prefix hit returned a block that was not sealed with that
	// prefix at that generation.
	BadHit
	// CountMismatch: the state counts do not sum to capacity, or disagree
	// with the audit's model of leases and transfers.
	CountMismatch
	// PoolCheck: Pool.Check found an internal inconsistency.
	PoolCheck
	// HandoffBroken: a handoff broke its contract (a transfer after a
	// rejection, a lease left open by a final state, ...).
	HandoffBroken
	// Leak: after draining, a block is neither free, cached nor held by a
	// transfer still quarantined; or a lease became unreachable while
	// open.
	Leak
	// Unexpected: a call failed in a way the contract rules out here.
	Unexpected
	// Stall: a copy or a waiter did not reach its next step within
	// Config.StallTimeout.
	Stall

	numViolationKinds
)

var violationNames = [numViolationKinds]string{"", "marker-mix", "late-write", "late-read", "early-resolve",
	"double-lease", "bad-hit", "count-mismatch", "pool-check", "handoff", "leak", "unexpected", "stall"}

// String returns the kind's name as reports spell it ("late-write").
func (k ViolationKind) String() string {
	if k > 0 && k < numViolationKinds {
		return violationNames[k]
	}
	return fmt.Sprintf("violation(%d)", uint8(k))
}

// A Violation is one failure found, with where the run was.
type Violation struct {
	Kind ViolationKind
	// Op is the index of the operation after which it was found (the
	// trace up to and including it shows it); -1 while draining.
	Op     int
	Detail string
}

// String renders the violation with the operation it was found after.
func (v Violation) String() string {
	at := fmt.Sprintf("op %d", v.Op)
	if v.Op < 0 {
		at = "drain"
	}
	return fmt.Sprintf("%v at %s: %s", v.Kind, at, v.Detail)
}

// maxKept bounds the violations a report keeps in full; ByKind counts all.
const maxKept = 64

// Report is what a run found and did.
type Report struct {
	Seed    uint64
	Elapsed time.Duration

	// Ops counts every operation executed, steps included; Lifecycle the
	// lifecycle operations; ByOp splits Ops by kind. Skipped counts
	// operations that no longer applied (during replays).
	Ops, Lifecycle, Skipped int
	ByOp                    [numOpKinds]int

	// Admission. Arrivals are requests that came to a worker; Offers are
	// handoffs proposed. Rejections, by who refused: the envelope (at
	// admission, or a lease outgrowing it at Propose), an exhausted pool
	// (at acquire or at accept), the destination's policy (busy, or
	// revoking an accepted handoff), and waits that timed out.
	Arrivals, Offers, Admitted, Waited                       int
	RejectedEnvelope, RejectedExhausted, RejectedPolicy      int
	TimedOut, ExtendRejected, PrefixHits, Seals, Extends     int
	Started, Delivered, Failed, Cancelled, CancelsIgnored    int
	AbortedMidTransfer, AbortedEarly, AbortedIdle            int
	LostAcks, LateAcks, Deadlines, LeftQuarantined, Released int

	// Pools holds every worker's Stats at the end.
	Pools []kvlease.Stats

	// Violations keeps the first violations found in full; ByKind counts
	// every one.
	Violations []Violation
	ByKind     [numViolationKinds]int

	// Trace is the operation trace that shows the first violation:
	// minimised when Config.Minimise is on (TraceFrom is the length it had
	// before), replayable with Replay and the same seed and configuration.
	Trace     []Op
	TraceFrom int
	// Minimised says whether Trace was shortened.
	Minimised bool
}

// OK reports whether the run found no violation.
func (r *Report) OK() bool { return r.Total() == 0 }

// Total returns the number of violations found.
func (r *Report) Total() int {
	n := 0
	for _, c := range r.ByKind {
		n += c
	}
	return n
}

// Rejections returns every rejected admission or handoff.
func (r *Report) Rejections() int {
	return r.RejectedEnvelope + r.RejectedExhausted + r.RejectedPolicy + r.TimedOut
}

// RejectionRate is Rejections over arrivals and offers.
func (r *Report) RejectionRate() float64 { return ratio(r.Rejections(), r.Arrivals+r.Offers) }

// AbortRate is transfers aborted mid-transfer over transfers started.
func (r *Report) AbortRate() float64 { return ratio(r.AbortedMidTransfer, r.Started) }

// FailRate is failed transfers over transfers started.
func (r *Report) FailRate() float64 { return ratio(r.Failed, r.Started) }

// LostAckRate is lost acknowledgements over transfers started.
func (r *Report) LostAckRate() float64 { return ratio(r.LostAcks, r.Started) }

// The target of issue 6, for a run of at least 10⁶ lifecycle operations:
// these rates or more, and no marker mix, late write or leak.
const (
	TargetRejections = 0.10
	TargetAborts     = 0.10
	TargetFailures   = 0.05
	TargetLostAcks   = 0.01
)

// MeetsTargetRates reports whether the run's fault rates reach the
// target's (Target*); the run's size and violations are reported apart.
func (r *Report) MeetsTargetRates() bool {
	return r.RejectionRate() >= TargetRejections && r.AbortRate() >= TargetAborts &&
		r.FailRate() >= TargetFailures && r.LostAckRate() >= TargetLostAcks
}

// Throughput is lifecycle operations per second.
func (r *Report) Throughput() float64 {
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.Lifecycle) / r.Elapsed.Seconds()
}

func ratio(a, b int) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

func (r *Report) violate(v Violation) {
	if v.Kind == 0 || v.Kind >= numViolationKinds {
		v.Kind = Unexpected
	}
	r.ByKind[v.Kind]++
	if len(r.Violations) < maxKept {
		r.Violations = append(r.Violations, v)
	}
}

// Write prints the report: operations by kind, the rates the audit's
// target is stated in, violations by kind, blocks by state, throughput,
// and the trace of the first violation.
func (r *Report) Write(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "kvaudit: seed %d, %d operations (%d lifecycle, %d copy steps) in %v: %.0f lifecycle ops/s\n",
		r.Seed, r.Ops, r.Lifecycle, r.ByOp[OpStep], r.Elapsed.Round(time.Millisecond), r.Throughput())
	b.WriteString("operations:")
	for k := OpKind(1); k < numOpKinds; k++ {
		fmt.Fprintf(&b, " %v=%d", k, r.ByOp[k])
	}
	if r.Skipped > 0 {
		fmt.Fprintf(&b, " (skipped %d)", r.Skipped)
	}
	b.WriteByte('\n')
	fmt.Fprintf(&b, "requests: %d arrived, %d admitted (%d waited), %d prefix-hit blocks, %d seals, %d extends (%d refused), %d released\n",
		r.Arrivals, r.Admitted, r.Waited, r.PrefixHits, r.Seals, r.Extends, r.ExtendRejected, r.Released)
	fmt.Fprintf(&b, "rejections: %d of %d arrivals+offers = %.1f%% (envelope %d, exhausted %d, policy %d, wait timed out %d)\n",
		r.Rejections(), r.Arrivals+r.Offers, 100*r.RejectionRate(), r.RejectedEnvelope, r.RejectedExhausted, r.RejectedPolicy, r.TimedOut)
	fmt.Fprintf(&b, "transfers: %d started, %d delivered, %d failed = %.1f%%, %d aborted mid-transfer = %.1f%% (cancel honoured %d, ignored %d), %d lost acks = %.2f%% (%d acknowledged late, %d left quarantined), %d deadlines\n",
		r.Started, r.Delivered, r.Failed, 100*r.FailRate(), r.AbortedMidTransfer, 100*r.AbortRate(),
		r.Cancelled, r.CancelsIgnored, r.LostAcks, 100*r.LostAckRate(), r.LateAcks, r.LeftQuarantined, r.Deadlines)
	fmt.Fprintf(&b, "aborts: %d mid-transfer, %d after accept, %d holding a lease\n", r.AbortedMidTransfer, r.AbortedEarly, r.AbortedIdle)
	var total kvlease.Stats
	for i, s := range r.Pools {
		fmt.Fprintf(&b, "pool w%d: capacity %d: free %d, cached %d, leased %d, draining %d, quarantined %d\n",
			i, s.Capacity, s.Free, s.Cached, s.Leased, s.Draining, s.Quarantined)
		total.Capacity += s.Capacity
		total.Free += s.Free
		total.Cached += s.Cached
		total.Leased += s.Leased
		total.Draining += s.Draining
		total.Quarantined += s.Quarantined
	}
	fmt.Fprintf(&b, "blocks: capacity %d: free %d, cached %d, leased %d, draining %d, quarantined %d\n",
		total.Capacity, total.Free, total.Cached, total.Leased, total.Draining, total.Quarantined)
	met := "met"
	if !r.MeetsTargetRates() {
		met = "not met"
	}
	fmt.Fprintf(&b, "target rates: rejections %.1f%% (≥%.0f%%), aborts mid-transfer %.1f%% (≥%.0f%%), failed transfers %.1f%% (≥%.0f%%), lost acks %.2f%% (≥%.0f%%): %s; marker mixes %d, late writes %d, leaks %d\n",
		100*r.RejectionRate(), 100*TargetRejections, 100*r.AbortRate(), 100*TargetAborts,
		100*r.FailRate(), 100*TargetFailures, 100*r.LostAckRate(), 100*TargetLostAcks, met,
		r.ByKind[MarkerMix], r.ByKind[LateWrite], r.ByKind[Leak])
	b.WriteString("violations:")
	for k := ViolationKind(1); k < numViolationKinds; k++ {
		fmt.Fprintf(&b, " %v=%d", k, r.ByKind[k])
	}
	b.WriteByte('\n')
	for _, v := range r.Violations {
		fmt.Fprintf(&b, "  %v\n", v)
	}
	if r.Trace != nil {
		how := "trace"
		if r.Minimised {
			how = fmt.Sprintf("minimised trace (from %d operations)", r.TraceFrom)
		}
		fmt.Fprintf(&b, "%s of the first violation, seed %d, %d operations (then the drain):\n", how, r.Seed, len(r.Trace))
		b.WriteString(FormatTrace(r.Trace))
		fmt.Fprintf(&b, "replay: save the trace lines to a file and run kvaudit -seed %d -replay FILE with the same flags (or audit.Replay)\n", r.Seed)
	}
	if r.OK() {
		b.WriteString("OK\n")
	} else {
		fmt.Fprintf(&b, "FAIL: %d violations\n", r.Total())
	}
	_, err := io.WriteString(w, b.String())
	return err
}

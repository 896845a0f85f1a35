package audit

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/kvlease/kvlease/handoff/inproc"
)

// OpKind names one step of the synthetic workload.
type OpKind uint8

// The operations. Every kind but OpStep is a lifecycle operation: it calls
// the library to acquire, grow, seal, hand off, abort, expire, acknowledge
// or release. OpStep lets one in-flight copy write one block: the driver
// decides when each copy makes progress, which is how transfers get their
// random latency while the run stays deterministic.
const (
	// OpArrive: request Req arrives at worker Pool with a prompt of Tokens
	// tokens (sharing the prefix of document Doc, or none if Doc < 0) that
	// will generate MaxNew more. The envelope admits it or not; then it
	// acquires its prompt's blocks with AcquirePrefixTokens, or with
	// AcquireWait when Wait is set. Prefill stamps its fresh blocks and
	// seals its full prompt blocks.
	OpArrive OpKind = iota + 1
	// OpExtend: the request's lease grows by Tokens blocks (decode).
	OpExtend
	// OpSeal: the request seals the full prompt blocks of its lease that
	// are not sealed yet (a decode worker caching a delivered prefix).
	OpSeal
	// OpOffer: the request's worker proposes a handoff to worker Pool,
	// which rejects it by policy (Reject) or accepts it (its acquire may
	// fail: a rejection by exhaustion).
	OpOffer
	// OpRevoke: the destination rejects an accepted handoff before the
	// transfer starts.
	OpRevoke
	// OpStart: the accepted handoff starts its transfer, whose fate is
	// Fate (failing before pair FailAt, for FateFail) and which honours a
	// cancel if Honour is set.
	OpStart
	// OpStep: the request's copy number Job writes its next block.
	OpStep
	// OpAbort: the client goes away: the handoff is aborted (cancelling
	// the transfer), or the lease, or the wait.
	OpAbort
	// OpDeadline: the handoff's transfer has been unresolved too long: the
	// supervisor gives up on evidence (Handoff.Expire): quarantine.
	OpDeadline
	// OpAck: a lost acknowledgement arrives late: the transport resolves
	// the transfer (inproc's Acknowledge).
	OpAck
	// OpRelease: the request finishes: its markers are checked and its
	// lease released.
	OpRelease
	// OpTimeout: the request's AcquireWait times out (its context is
	// cancelled).
	OpTimeout

	numOpKinds
)

var opNames = [numOpKinds]string{"", "arrive", "extend", "seal", "offer", "revoke", "start", "step",
	"abort", "deadline", "ack", "release", "timeout"}

// String returns the kind's name as traces spell it ("arrive", "step").
func (k OpKind) String() string {
	if k > 0 && k < numOpKinds {
		return opNames[k]
	}
	return fmt.Sprintf("op(%d)", uint8(k))
}

// Lifecycle reports whether k is a lifecycle operation (every kind but
// OpStep).
func (k OpKind) Lifecycle() bool { return k != OpStep && k > 0 && k < numOpKinds }

// An Op is one operation of a run. A run's operations, with its seed and
// configuration, determine it completely: Replay runs them again. Fields
// that do not apply to the kind are zero. An operation that no longer
// applies (its request never arrived, its transfer already ended, as
// happens while a trace is being minimised) does nothing.
type Op struct {
	Kind   OpKind
	Pool   uint8       // OpArrive: the worker; OpOffer: the destination
	Fate   inproc.Fate // OpStart
	Wait   bool        // OpArrive: acquire with AcquireWait
	Reject bool        // OpOffer: the destination refuses by policy
	Honour bool        // OpStart: the copy honours a cancel
	Req    int32       // the request
	Tokens int32       // OpArrive: prompt tokens; OpExtend: blocks
	MaxNew int32       // OpArrive
	Doc    int16       // OpArrive: shared document, -1 for none
	Job    int16       // OpStep: the request's copy, from 0
	FailAt int16       // OpStart
}

// String renders the operation in the form ParseOp reads: the kind, then
// key=value fields.
func (o Op) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%v r=%d", o.Kind, o.Req)
	switch o.Kind {
	case OpArrive:
		fmt.Fprintf(&b, " pool=%d doc=%d tokens=%d new=%d", o.Pool, o.Doc, o.Tokens, o.MaxNew)
		if o.Wait {
			b.WriteString(" wait")
		}
	case OpExtend:
		fmt.Fprintf(&b, " blocks=%d", o.Tokens)
	case OpOffer:
		fmt.Fprintf(&b, " to=%d", o.Pool)
		if o.Reject {
			b.WriteString(" reject")
		}
	case OpStart:
		fmt.Fprintf(&b, " fate=%v failat=%d", o.Fate, o.FailAt)
		if o.Honour {
			b.WriteString(" honour")
		}
	case OpStep:
		fmt.Fprintf(&b, " job=%d", o.Job)
	}
	return b.String()
}

// ParseOp reads an operation written by Op.String.
func ParseOp(s string) (Op, error) {
	f := strings.Fields(s)
	if len(f) == 0 {
		return Op{}, fmt.Errorf("audit: parse op: empty")
	}
	var o Op
	for k := OpKind(1); k < numOpKinds; k++ {
		if opNames[k] == f[0] {
			o.Kind = k
		}
	}
	if o.Kind == 0 {
		return Op{}, fmt.Errorf("audit: parse op %q: unknown kind %q", s, f[0])
	}
	for _, kv := range f[1:] {
		key, val, hasVal := strings.Cut(kv, "=")
		if !hasVal {
			switch key {
			case "wait":
				o.Wait = true
			case "reject":
				o.Reject = true
			case "honour":
				o.Honour = true
			default:
				return Op{}, fmt.Errorf("audit: parse op %q: unknown flag %q", s, key)
			}
			continue
		}
		if key == "fate" {
			switch val {
			case "complete":
				o.Fate = inproc.FateComplete
			case "fail":
				o.Fate = inproc.FateFail
			case "lose-ack":
				o.Fate = inproc.FateLoseAck
			default:
				return Op{}, fmt.Errorf("audit: parse op %q: unknown fate %q", s, val)
			}
			continue
		}
		n, err := strconv.ParseInt(val, 10, 32)
		if err != nil {
			return Op{}, fmt.Errorf("audit: parse op %q: %s: %w", s, key, err)
		}
		switch key {
		case "r":
			o.Req = int32(n)
		case "pool", "to":
			o.Pool = uint8(n)
		case "doc":
			o.Doc = int16(n)
		case "tokens", "blocks":
			o.Tokens = int32(n)
		case "new":
			o.MaxNew = int32(n)
		case "job":
			o.Job = int16(n)
		case "failat":
			o.FailAt = int16(n)
		default:
			return Op{}, fmt.Errorf("audit: parse op %q: unknown field %q", s, key)
		}
	}
	return o, nil
}

// ParseTrace reads a trace: one operation per line as Op.String writes
// it. Blank lines and lines starting with # are skipped, as is a leading
// index ("12: arrive ...") as FormatTrace writes it.
func ParseTrace(s string) ([]Op, error) {
	var ops []Op
	for _, line := range strings.Split(s, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if i := strings.Index(line, ": "); i > 0 {
			if _, err := strconv.Atoi(line[:i]); err == nil {
				line = line[i+2:]
			}
		}
		o, err := ParseOp(line)
		if err != nil {
			return nil, err
		}
		ops = append(ops, o)
	}
	return ops, nil
}

// FormatTrace writes ops one per line, each prefixed by its index.
func FormatTrace(ops []Op) string {
	var b strings.Builder
	for i, o := range ops {
		fmt.Fprintf(&b, "%d: %v\n", i, o)
	}
	return b.String()
}

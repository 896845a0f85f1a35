package rig

// What crosses the process boundary (the decode side's report), and what
// every run prints: the timelines and the ledger.

import (
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// Report is what the decode process tells the prefill process at the
// end.
type Report struct {
	Handoffs []View
	Decode   kvlease.Stats // the pool at the end
	// MarkerMismatches counts delivered blocks that did not hold their
	// request's marker; LateWrites the transfers that wrote a block no
	// longer theirs.
	MarkerMismatches, LateWrites int
	Errors                       []string // protocol errors, and anything that went wrong
}

// View is one handoff as the decode side saw it.
type View struct {
	ID    uint64
	State handoff.State
	// Final: the handoff ended; a quarantined one whose evidence never
	// came is not.
	Final   bool
	Blocks  []kvlease.BlockID // the decode lease's blocks, nil if none was acquired
	Steps   []Step
	Checked int // block markers checked
	// Mismatches counts the checked blocks without their marker; Late
	// says the transfer wrote a block no longer its lease's.
	Mismatches int
	Late       bool
	// Arrived (-stream) is when each layer's last byte arrived (Unix
	// ns; 0 if it never did).
	Arrived []int64 `json:",omitempty"`
}

// Step is a handoff.Step as it crosses the process boundary.
type Step struct {
	From, To handoff.State
	Event    handoff.Event
	By, Err  string
	Transfer uint64
}

// Steps is a history as it crosses the process boundary.
func Steps(h []handoff.Step) []Step {
	out := make([]Step, len(h))
	for i, s := range h {
		out[i] = Step{From: s.From, To: s.To, Event: s.Event, By: s.By, Transfer: s.Transfer}
		if s.Err != nil {
			out[i].Err = s.Err.Error()
		}
	}
	return out
}

// Quarantined reports whether a history passed through Quarantined.
func Quarantined(h []Step) bool {
	for _, s := range h {
		if s.To == handoff.Quarantined {
			return true
		}
	}
	return false
}

// Count counts one request in l: refused before any handoff (the
// envelope's refusals start "envelope"), or ended in st (policy: a
// rejection by the decode side's policy, not its pool; lifted: an abort
// whose quarantine late evidence lifted).
func (l *Ledger) Count(refused string, st handoff.State, policy, lifted bool) {
	switch {
	case strings.HasPrefix(refused, "envelope"):
		l.RejectedEnvelope++
	case refused != "":
		l.RejectedPrefill++
	default:
		switch st {
		case handoff.Delivered:
			l.Delivered++
		case handoff.Rejected:
			if policy {
				l.RejectedPolicy++
			} else {
				l.RejectedDecode++
			}
		case handoff.Failed:
			l.Failed++
		case handoff.Aborted:
			l.Aborted++
			if lifted {
				l.AbortedLifted++
			}
		case handoff.Quarantined:
			l.Quarantined++
		}
	}
}

// Side is one process's history of a handoff, for a timeline.
type Side struct {
	Name  string // "" in process: the one history
	Steps []Step
}

// Timeline is one request's ownership timeline: its blocks on each side,
// then each side's history with the evidence of every step, then notes.
type Timeline struct {
	Req             Request
	Refused         string
	Prefill, Decode []kvlease.BlockID
	Sides           []Side
	Notes           []string
	// Note, if set, annotates a step of a side: what proved it.
	Note func(side string, s Step) string
}

// Print writes the timeline.
func (t Timeline) Print(out io.Writer) {
	r := t.Req
	fmt.Fprintf(out, "%s %4d+%-3d tokens", r.Name, r.Prompt, r.MaxNew)
	if t.Refused != "" {
		fmt.Fprintf(out, "  rejected by %s\n", t.Refused)
		return
	}
	fmt.Fprintf(out, "  prefill p[%s]", Ranges(t.Prefill))
	if len(t.Decode) > 0 {
		fmt.Fprintf(out, "  decode d[%s]", Ranges(t.Decode))
	}
	fmt.Fprintln(out)
	for _, side := range t.Sides {
		if side.Name != "" {
			fmt.Fprintf(out, "    %s process\n", side.Name)
		}
		for _, s := range side.Steps {
			fmt.Fprintf(out, "      %-13v by %-10s %v", s.To, s.By, s.Event)
			if t.Note != nil {
				fmt.Fprint(out, t.Note(side.Name, s))
			}
			if s.Err != "" {
				fmt.Fprintf(out, ": %s", s.Err)
			}
			fmt.Fprintln(out)
		}
	}
	for _, n := range t.Notes {
		fmt.Fprintf(out, "      (%s)\n", n)
	}
}

// LedgerText is what a run's ledger says beyond the counts.
type LedgerText struct {
	Over        string // after the seed: ", over UCX (tcp)"
	Quarantined string // why the quarantined handoffs never got their evidence
	LateWrites  string // what a late write is on this plane
	Insecure    string // what -insecure means on this plane
}

// PrintLedger writes the ledger of a run of seed.
func PrintLedger(out io.Writer, seed uint64, l Ledger, text LedgerText) {
	fmt.Fprintf(out, "\nledger: %d requests, seed %d%s\n", l.Requests, seed, text.Over)
	fmt.Fprintf(out, "  delivered          %4d\n", l.Delivered)
	fmt.Fprintf(out, "  rejected           %4d  (envelope %d, prefill pool %d, decode policy %d, decode pool %d)\n",
		l.Rejected(), l.RejectedEnvelope, l.RejectedPrefill, l.RejectedPolicy, l.RejectedDecode)
	fmt.Fprintf(out, "  failed             %4d\n", l.Failed)
	fmt.Fprintf(out, "  aborted            %4d  (%d after a quarantine lifted by late evidence)\n", l.Aborted, l.AbortedLifted)
	fmt.Fprintf(out, "  quarantined        %4d  (%s)\n", l.Quarantined, text.Quarantined)
	for _, p := range []struct {
		name string
		s    kvlease.Stats
	}{{"prefill", l.Prefill}, {"decode", l.Decode}} {
		fmt.Fprintf(out, "  %-7s blocks free %4d of %d, quarantined %d, other %d\n",
			p.name, p.s.Free, p.s.Capacity, p.s.Quarantined, p.s.Capacity-p.s.Free-p.s.Quarantined)
	}
	if l.Child.Ran {
		note := "both halves proved the key; every control frame and every block bound to the session"
		if l.Authenticated == "none" {
			note = text.Insecure
		}
		fmt.Fprintf(out, "  authenticated %s  (%s)\n", l.Authenticated, note)
		fmt.Fprintf(out, "  sides disagree     %4d  (requests whose prefill and decode histories end differently)\n", l.Disagreements)
		fmt.Fprintf(out, "  protocol errors    %4d  (control messages either side refused)\n", l.ProtocolErrors)
		fmt.Fprintf(out, "  decode process     exit %d (a child of this process, reaped)\n", l.Child.Code)
	}
	if l.Unsettled != "" { // Pool.CheckQuiescent found leases still open or draining
		fmt.Fprintf(out, "  not at rest        %s\n", l.Unsettled)
	}
	fmt.Fprintf(out, "  marker mismatches  %4d\n", l.MarkerMismatches)
	fmt.Fprintf(out, "  late writes        %4d  (%s)\n", l.LateWrites, text.LateWrites)
}

// Fail prints a run's error, or the isolation failures its ledger shows,
// on stderr, and returns the exit status: 0 clean, 1 an error, 2
// isolation failures.
func Fail(name string, l Ledger, err error) int {
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		return 1
	}
	problems := l.Problems()
	for _, p := range problems {
		fmt.Fprintf(os.Stderr, "%s: ISOLATION FAILURE: %s\n", name, p)
	}
	if len(problems) > 0 {
		return 2
	}
	return 0
}

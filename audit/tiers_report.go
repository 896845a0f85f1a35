package audit

import (
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/kvlease/kvlease/tiers"
)

// TiersReport is the outcome of RunTiers.
type TiersReport struct {
	Seed     uint64
	Requests int // requests admitted
	Refused  int // requests the device pool refused (exhausted): nothing held
	Aborted  int // requests aborted, most with copies in flight
	Elapsed  time.Duration

	// Queried blocks and the hits of each tier, as the driver saw them in
	// every Onboard; Checked is how many onboarded or hit blocks had their
	// content checked (every valid block of every request, and the sweeps).
	Queried uint64
	Hits    [3]uint64
	Checked uint64

	// Faults injected.
	CopyFails, Stalls, Quarantines, DiskFails, Corruptions, Cancels int

	// On a GPU (TiersConfig.GPU): the device's name and how many copies
	// each path carried (submissions: kernel launches, and batched or
	// looped copy-engine submissions).
	Device                       string
	KernelSubmits, EngineSubmits int64

	// Stats is the cache's own counters at the end.
	Stats tiers.Stats

	// Mismatches: a block served as valid (a hit, or an onboarded block
	// within Onboard.Valid) held another block's content. UnknownReads: it
	// held content no completed copy wrote (junk of a failed or
	// quarantined copy, or nothing yet). Other: accounting, settling,
	// Pool.Check, counters that disagree with the driver's.
	Mismatches, UnknownReads, Other int
	Violations                      []string // the first few, described

	// Events is how many KV events the tiers published (every tier's pool
	// has them on); EventDrops how many their rings dropped (the view
	// resynchronised from a snapshot then). Every stored event is checked
	// (a block of the workload, its tokens, its parent when it names one)
	// and, at rest, each tier's replayed events must match what its pool
	// serves; failures count in Other.
	Events, EventDrops int
}

// Total returns the number of violations.
func (r *TiersReport) Total() int { return r.Mismatches + r.UnknownReads + r.Other }

// OK reports whether the run found no violation.
func (r *TiersReport) OK() bool { return r.Total() == 0 }

// Write prints the report; its last line starts with OK or FAIL.
func (r *TiersReport) Write(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "kvaudit tiers: seed %d, %d requests (%d refused, %d aborted) in %v\n",
		r.Seed, r.Requests, r.Refused, r.Aborted, r.Elapsed.Round(time.Millisecond))
	fmt.Fprintf(&b, "blocks queried %d, hits device %d host %d disk %d, content checked %d\n",
		r.Queried, r.Hits[0], r.Hits[1], r.Hits[2], r.Checked)
	fmt.Fprintf(&b, "faults: copy failures %d, stalls %d, quarantines %d, disk failures %d, corruptions %d, cancels %d\n",
		r.CopyFails, r.Stalls, r.Quarantines, r.DiskFails, r.Corruptions, r.Cancels)
	if r.Device != "" {
		fmt.Fprintf(&b, "device %s: copies by the kernel %d, by the copy engine %d (submissions)\n", r.Device, r.KernelSubmits, r.EngineSubmits)
	}
	for t := tiers.TierDevice; t <= tiers.TierDisk; t++ {
		s := r.Stats.Tiers[t]
		fmt.Fprintf(&b, "tier %s: hits %d offloaded %d onboarded %d copy failures %d dropped %d\n",
			t, s.Hits, s.Offloaded, s.Onboarded, s.CopyFailures, s.Dropped)
	}
	fmt.Fprintf(&b, "KV events %d (dropped %d), checked against each tier's index\n", r.Events, r.EventDrops)
	fmt.Fprintf(&b, "marker mismatches %d\nunknown reads %d\nother violations %d\n", r.Mismatches, r.UnknownReads, r.Other)
	for _, v := range r.Violations {
		fmt.Fprintf(&b, "  %s\n", v)
	}
	if r.OK() {
		b.WriteString("OK\n")
	} else {
		fmt.Fprintf(&b, "FAIL: %d violations\n", r.Total())
	}
	_, err := io.WriteString(w, b.String())
	return err
}

package tiers

import "go.uber.org/atomic"

// Tier names a level of the cache.
type Tier uint8

// The tiers, fastest first.
const (
	TierDevice Tier = iota // G1: device memory
	TierHost               // G2: pinned host memory
	TierDisk               // G3: local disk
	numTiers
)

var tierNames = [numTiers]string{"device", "host", "disk"}

// String returns "device", "host" or "disk".
func (t Tier) String() string {
	if t < numTiers {
		return tierNames[t]
	}
	return "tier(?)"
}

// Medium returns the medium KV events carry for the tier, as vLLM names
// them: "GPU", "CPU" or "DISK".
func (t Tier) Medium() string {
	switch t {
	case TierDevice:
		return "GPU"
	case TierHost:
		return "CPU"
	case TierDisk:
		return "DISK"
	}
	return ""
}

// TierStats counts one tier's traffic in blocks.
type TierStats struct {
	// Hits: blocks of Acquire's lookups served from this tier (a block
	// counts in the fastest tier that had it).
	Hits uint64
	// Offloaded: blocks copied into this tier from the tier above
	// (written and sealed: findable here from then on).
	Offloaded uint64
	// Onboarded: blocks copied from this tier towards the device for a
	// lookup that hit here, whose copy succeeded.
	Onboarded uint64
	// CopyFailures: copies into or out of this tier that failed (resolved
	// with an error, or a disk slot that failed its checksum), counted in
	// blocks; their destination blocks were never sealed.
	CopyFailures uint64
	// Dropped: blocks offered for offload into this tier but not copied
	// (already there, or no room).
	Dropped uint64
}

// Stats is a snapshot of a cache's counters. Queried is the number of
// blocks Acquire looked up; the hit rate of tier t is Tiers[t].Hits /
// Queried, and of the whole cache the sum over tiers.
type Stats struct {
	Queried uint64
	Tiers   [numTiers]TierStats
}

type tierCounters struct {
	hits, offloaded, onboarded, failures, dropped atomic.Uint64
}

type counters struct {
	queried atomic.Uint64
	tiers   [numTiers]tierCounters
}

// Stats returns the cache's counters.
func (c *Cache[D]) Stats() Stats {
	s := Stats{Queried: c.stats.queried.Load()}
	for i := range s.Tiers {
		t := &c.stats.tiers[i]
		s.Tiers[i] = TierStats{
			Hits: t.hits.Load(), Offloaded: t.offloaded.Load(), Onboarded: t.onboarded.Load(),
			CopyFailures: t.failures.Load(), Dropped: t.dropped.Load(),
		}
	}
	return s
}

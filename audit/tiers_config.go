package audit

import (
	"fmt"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/gpu"
	"github.com/kvlease/kvlease/tiers"
)

// TiersConfig describes a run of the tiers audit (RunTiers): a tiered
// cache (package tiers) over a device pool, a host pool and a disk tier,
// driven by requests with shared prefixes, with faults injected into every
// copy between the tiers. Start from DefaultTiersConfig.
type TiersConfig struct {
	// Seed draws the workload and the faults. Copies run on their own
	// goroutines, so a run is not replayable step by step; what it checks
	// holds whatever the interleaving.
	Seed uint64
	// Requests is the number of requests to run.
	Requests int
	// DeviceBlocks, HostBlocks and DiskSlots size the tiers (DiskSlots 0:
	// no disk tier); BlockBytes is the size of one block (at least 64).
	DeviceBlocks, HostBlocks, DiskSlots int
	BlockBytes                          int
	// Docs documents of DocBlocks blocks are the shared prefixes; a
	// request asks for a leading part of one of them plus up to two
	// blocks of its own. MaxLive requests are in flight at once.
	Docs, DocBlocks int
	MaxLive         int
	// Policy is the cache's offload policy (zero: write-back).
	Policy tiers.Policy
	// Faults are the probabilities of the injected faults.
	Faults TiersFaults
	// SweepEvery is how many requests pass between sweeps: every tier's
	// findable blocks of every document are read back and checked, and
	// every pool is checked (Pool.Check).
	SweepEvery int
	// Dir holds the disk tier's files; empty means a temporary directory
	// removed at the end.
	Dir string
	// GPU, when set, runs the audit on that device (gpu.Open, or the CPU
	// fallback gpu.OpenHost): the device tier in a DeviceArena, the host
	// tier in a PinnedArena, every copy between them through the device's
	// real copy engines, one forced onto the kernel and one onto the copy
	// engine, used alternately; device blocks are written and checked
	// through synchronous copies. The copies are real, so the faults that
	// fake a copy (CopyFail, Stall, Quarantine) do not apply; Cancel,
	// Abort, DiskFail and Corrupt do. BlockBytes must be a multiple of
	// gpu.Alignment. RunTiers does not close the device.
	GPU *gpu.Device

	lieOnFail bool // tests: a failed copy reports success (the audit must catch it)
	// tests: the share of device hits whose block is overwritten with junk
	// behind the cache's back before the audit reads it (it must catch it)
	corruptHits float64
}

// TiersFaults are the faults of a tiers audit, as probabilities.
type TiersFaults struct {
	// CopyFail: a device↔host copy writes part of its blocks and junk
	// into the rest, then resolves with an error.
	CopyFail float64
	// Stall: a copy, or one disk slot's I/O, waits until the driver lets
	// it go (many requests later, or at the drain).
	Stall float64
	// Quarantine: a device↔host copy writes junk, is quarantined (ended
	// without proof), and resolves only when the driver delivers late
	// evidence (half of them having finished the copy, half not).
	Quarantine float64
	// DiskFail: one disk slot's read or write fails before it touches the
	// file (the job stops there and resolves with the error).
	DiskFail float64
	// Corrupt: per request, a few bytes of a disk slot file are
	// overwritten at rest, behind the tier's back.
	Corrupt float64
	// Abort: per step on a live request, it is aborted, whether or not
	// its onboarding copies have resolved.
	Abort float64
	// Cancel: a device↔host copy is canceled right after it started (a
	// copy the device already holds finishes anyway; one it has not begun
	// may be skipped, and must then never be served).
	Cancel float64
}

// DefaultTiersConfig returns a small, fault-heavy configuration that runs
// in about a second: a device pool a quarter of the documents' working
// set, a host pool that holds the rest, a disk tier below.
func DefaultTiersConfig() TiersConfig {
	return TiersConfig{
		Seed:         1,
		Requests:     2000,
		DeviceBlocks: 48, HostBlocks: 96, DiskSlots: 256,
		BlockBytes: 512,
		Docs:       24, DocBlocks: 8,
		MaxLive: 4,
		Policy:  tiers.WriteBack,
		Faults: TiersFaults{
			CopyFail: 0.04, Stall: 0.08, Quarantine: 0.03,
			DiskFail: 0.04, Corrupt: 0.01, Abort: 0.05, Cancel: 0.03,
		},
		SweepEvery: 50,
	}
}

func (c *TiersConfig) validate() error {
	f := c.Faults
	probs := []float64{f.CopyFail, f.Stall, f.Quarantine, f.DiskFail, f.Corrupt, f.Abort, f.Cancel}
	for _, p := range probs {
		if p < 0 || p > 1 {
			return fmt.Errorf("audit: tiers fault probability %v outside [0, 1]: %w", p, kvlease.ErrInvalidArgument)
		}
	}
	switch {
	case c.Requests <= 0, c.DeviceBlocks <= 0, c.HostBlocks <= 0, c.DiskSlots < 0,
		c.BlockBytes < 64, c.BlockBytes%8 != 0, c.Docs <= 0, c.DocBlocks <= 0, c.MaxLive <= 0, c.SweepEvery < 0:
		return fmt.Errorf("audit: tiers config %+v: sizes must be positive (block bytes a multiple of 8, at least 64): %w", *c, kvlease.ErrInvalidArgument)
	case c.MaxLive*(c.DocBlocks+2) > c.DeviceBlocks:
		return fmt.Errorf("audit: %d live requests of up to %d blocks do not fit %d device blocks: %w",
			c.MaxLive, c.DocBlocks+2, c.DeviceBlocks, kvlease.ErrInvalidArgument)
	case f.CopyFail+f.Stall+f.Quarantine > 1 || f.Stall+f.DiskFail > 1:
		return fmt.Errorf("audit: copy fault probabilities sum over 1: %w", kvlease.ErrInvalidArgument)
	}
	return nil
}

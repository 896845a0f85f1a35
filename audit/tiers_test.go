package audit

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/gpu"
	"github.com/kvlease/kvlease/tiers"
)

func runTiers(t *testing.T, cfg TiersConfig) *TiersReport {
	t.Helper()
	cfg.Dir = t.TempDir()
	rep, err := RunTiers(cfg)
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	if err := rep.Write(&b); err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + b.String())
	return rep
}

// TestTiersAudit runs the tiers audit with every fault on, for both
// policies, and needs no violation; it also needs the faults and the
// tiers to have been exercised at all.
func TestTiersAudit(t *testing.T) {
	for _, pol := range []tiers.Policy{tiers.WriteBack, tiers.WriteThrough} {
		t.Run(pol.String(), func(t *testing.T) {
			cfg := DefaultTiersConfig()
			cfg.Policy = pol
			cfg.Requests = 1200
			rep := runTiers(t, cfg)
			if !rep.OK() {
				t.Fatalf("%d violations: %q", rep.Total(), rep.Violations)
			}
			if rep.CopyFails == 0 || rep.Stalls == 0 || rep.Quarantines == 0 || rep.DiskFails == 0 || rep.Corruptions == 0 || rep.Aborted == 0 || rep.Cancels == 0 {
				t.Errorf("a fault was never injected: %+v", rep)
			}
			if rep.Hits[tiers.TierHost] == 0 || rep.Hits[tiers.TierDisk] == 0 ||
				rep.Stats.Tiers[tiers.TierHost].Onboarded == 0 || rep.Stats.Tiers[tiers.TierDisk].Onboarded == 0 {
				t.Errorf("the lower tiers never served: %+v", rep.Stats)
			}
			if rep.Stats.Tiers[tiers.TierHost].CopyFailures == 0 || rep.Checked == 0 || rep.Events == 0 {
				t.Errorf("no copy failure counted or nothing checked: %+v", rep)
			}
		})
	}
}

// TestTiersAuditCatchesLyingCopy breaks the transport (a failed copy
// reports success, leaving junk in the destination): the audit must see
// reads of unknown content.
func TestTiersAuditCatchesLyingCopy(t *testing.T) {
	cfg := DefaultTiersConfig()
	cfg.Requests = 500
	cfg.Faults = TiersFaults{CopyFail: 0.2}
	cfg.lieOnFail = true
	rep := runTiers(t, cfg)
	if rep.UnknownReads == 0 || rep.OK() {
		t.Fatalf("a copy that lies went unnoticed: %+v", rep)
	}
}

func TestTiersConfigRefused(t *testing.T) {
	for _, mod := range []func(*TiersConfig){
		func(c *TiersConfig) { c.Requests = 0 },
		func(c *TiersConfig) { c.BlockBytes = 60 },
		func(c *TiersConfig) { c.Faults.Stall = 1.5 },
		func(c *TiersConfig) { c.DeviceBlocks = 8 },
		func(c *TiersConfig) { c.Faults.CopyFail, c.Faults.Quarantine = 0.6, 0.6 },
	} {
		cfg := DefaultTiersConfig()
		mod(&cfg)
		if _, err := RunTiers(cfg); !errors.Is(err, kvlease.ErrInvalidArgument) {
			t.Errorf("config %+v: %v, want ErrInvalidArgument", cfg, err)
		}
	}
}

// TestTiersAuditGPU runs the device mode on the gpu package's CPU
// fallback (a GPU in the device check, the fake driver in CI): device
// and pinned arenas, real copies through two engines, one on the kernel
// and one on the copy engine, with cancels, aborts, disk faults and
// corruption, for both policies. No violation, both paths used, the lower
// tiers served, the device's memory and engines freed.
func TestTiersAuditGPU(t *testing.T) {
	for _, pol := range []tiers.Policy{tiers.WriteBack, tiers.WriteThrough} {
		t.Run(pol.String(), func(t *testing.T) {
			d := gpu.OpenHost()
			cfg := DefaultTiersConfig()
			cfg.Policy = pol
			cfg.Requests = 600
			cfg.GPU = d
			rep := runTiers(t, cfg)
			if !rep.OK() {
				t.Fatalf("%d violations: %q", rep.Total(), rep.Violations)
			}
			if rep.Device != "CPU fallback" || rep.KernelSubmits == 0 || rep.EngineSubmits == 0 {
				t.Errorf("device %q, kernel %d, copy engine %d submissions", rep.Device, rep.KernelSubmits, rep.EngineSubmits)
			}
			if rep.Cancels == 0 || rep.Aborted == 0 || rep.DiskFails == 0 || rep.CopyFails+rep.Stalls+rep.Quarantines != rep.Stalls {
				t.Errorf("faults: %+v", rep)
			}
			if rep.Hits[tiers.TierHost] == 0 || rep.Stats.Tiers[tiers.TierHost].Onboarded == 0 || rep.Checked == 0 {
				t.Errorf("the host tier never served: %+v", rep.Stats)
			}
			var b strings.Builder
			_ = rep.Write(&b)
			if !strings.Contains(b.String(), "device CPU fallback: copies by the kernel") {
				t.Errorf("report lacks the device line:\n%s", b.String())
			}
			if err := d.Close(); err != nil {
				t.Fatalf("the audit left device memory or engines open: %v", err)
			}
		})
	}
}

// TestTiersAuditGPUCatchesCorruption: device blocks the audit reads back
// from the device are what it checks; junk written into device hits
// behind the cache's back is caught.
func TestTiersAuditGPUCatchesCorruption(t *testing.T) {
	d := gpu.OpenHost()
	defer d.Close()
	cfg := DefaultTiersConfig()
	cfg.Requests = 300
	cfg.GPU = d
	cfg.corruptHits = 0.2
	rep := runTiers(t, cfg)
	if rep.UnknownReads == 0 || rep.OK() {
		t.Fatalf("junk in device hits went unnoticed: %+v", rep)
	}
}

func TestTiersAuditGPURefusesBlockSize(t *testing.T) {
	d := gpu.OpenHost()
	defer d.Close()
	cfg := DefaultTiersConfig()
	cfg.BlockBytes = 520 // a multiple of 8, not of gpu.Alignment
	cfg.GPU = d
	if _, err := RunTiers(cfg); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("block size 520 on a device: %v", err)
	}
}

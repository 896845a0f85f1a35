package audit

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvlease/kvlease"
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
			if rep.CopyFails == 0 || rep.Stalls == 0 || rep.Quarantines == 0 || rep.DiskFails == 0 || rep.Corruptions == 0 || rep.Aborted == 0 {
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

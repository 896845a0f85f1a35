package main

import (
	"os"
	"strings"
	"testing"

	"github.com/kvlease/kvlease/internal/rig"
)

// TestMain makes the test binary the decode process when a test starts
// it again (rig.StartChild).
func TestMain(m *testing.M) {
	if rig.IsChild() {
		os.Exit(rig.ChildMain(os.Stdin, os.Stdout, os.Stderr, serveDecode))
	}
	os.Exit(m.Run())
}

// TestRunClean runs the default burst and a few seeds with every fault,
// and checks the ledger: nothing overwritten, nothing leaked, every
// request accounted for.
func TestRunClean(t *testing.T) {
	for _, seed := range []uint64{75, 1, 7} {
		cfg := DefaultConfig()
		cfg.Seed = seed
		var out strings.Builder
		l, err := Run(cfg, &out)
		if err != nil {
			t.Fatal(err)
		}
		if p := l.Problems(); len(p) > 0 {
			t.Fatalf("seed %d: %v\n%s", seed, p, out.String())
		}
		for _, line := range []string{"marker mismatches     0", "late writes           0", "\n  authenticated psk  ("} {
			if !strings.Contains(out.String(), line) {
				t.Fatalf("seed %d: no line %q in\n%s", seed, line, out.String())
			}
		}
		if l.Delivered == 0 {
			t.Fatalf("seed %d: nothing delivered\n%s", seed, out.String())
		}
	}
}

// TestRunShowsEveryOutcome checks that the README's run (seed 75) shows
// the outcomes the example is there to teach.
func TestRunShowsEveryOutcome(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Requests = 60
	cfg.Quiet = true
	var out strings.Builder
	l, err := Run(cfg, &out)
	if err != nil {
		t.Fatal(err)
	}
	if l.Delivered == 0 || l.Failed == 0 || l.Aborted == 0 || l.Quarantined == 0 || l.Rejected() == 0 {
		t.Fatalf("not every outcome: %+v\n%s", l, out.String())
	}
}

// TestRunInsecure: -insecure runs the halves unauthenticated, and the
// ledger says so; the default run is authenticated (TestRunClean).
func TestRunInsecure(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Insecure = true
	cfg.Requests = 8
	var out strings.Builder
	l, err := Run(cfg, &out)
	if err != nil {
		t.Fatal(err)
	}
	if p := l.Problems(); len(p) > 0 || l.Authenticated != "none" || !strings.Contains(out.String(), "\n  authenticated none  (") {
		t.Fatalf("problems %v, authenticated %q\n%s", p, l.Authenticated, out.String())
	}
}

// TestRunManySeeds runs bigger bursts with harsher faults: whatever the
// interleaving, both sides end on their own evidence, nothing either side
// refused but the crossings the run expects, and a clean ledger.
func TestRunManySeeds(t *testing.T) {
	for _, seed := range []uint64{2, 4, 6} {
		cfg := DefaultConfig()
		cfg.Seed, cfg.Requests, cfg.Quiet = seed, 40, true
		cfg.FailRate, cfg.LostAckRate, cfg.AbortRate, cfg.EarlyAbortRate = 0.2, 0.2, 0.4, 0.1
		var out strings.Builder
		l, err := Run(cfg, &out)
		if err != nil {
			t.Fatal(err)
		}
		if p := l.Problems(); len(p) > 0 || l.Requests != 40 || l.Child.Code != 0 {
			t.Fatalf("seed %d: %v\n%s", seed, p, out.String())
		}
	}
}

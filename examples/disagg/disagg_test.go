package main

import (
	"bytes"
	"regexp"
	"strings"
	"testing"

	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/inproc"
)

// TestDefaultRun runs the README's command with its fixed seed and checks
// the ledger: every request accounted for, 0 marker mismatches, 0 late
// writes, every block free or quarantined, and the mix of outcomes the
// seed was chosen for.
func TestDefaultRun(t *testing.T) {
	var out bytes.Buffer
	l, err := Run(DefaultConfig(), &out)
	if err != nil {
		t.Fatal(err)
	}
	if p := l.Problems(); len(p) > 0 {
		t.Fatalf("problems: %v\n%s", p, out.String())
	}
	if l.MarkerMismatches != 0 || l.LateWrites != 0 {
		t.Fatalf("mismatches %d, late writes %d", l.MarkerMismatches, l.LateWrites)
	}
	for _, s := range []struct {
		name                 string
		free, quar, capacity int
	}{{"prefill", l.Prefill.Free, l.Prefill.Quarantined, l.Prefill.Capacity}, {"decode", l.Decode.Free, l.Decode.Quarantined, l.Decode.Capacity}} {
		if s.free+s.quar != s.capacity {
			t.Errorf("%s pool: %d free + %d quarantined of %d", s.name, s.free, s.quar, s.capacity)
		}
	}
	// The quarantined blocks are exactly those of the handoffs still
	// quarantined, on both sides.
	if (l.Quarantined == 0) != (l.Decode.Quarantined == 0) || l.Prefill.Quarantined != l.Decode.Quarantined {
		t.Errorf("%d handoffs quarantined, %d/%d blocks", l.Quarantined, l.Prefill.Quarantined, l.Decode.Quarantined)
	}
	want := Ledger{Requests: 24, Delivered: 5, RejectedEnvelope: 4, RejectedPrefill: 2, RejectedPolicy: 2, RejectedDecode: 1,
		Failed: 1, Aborted: 7, AbortedLifted: 1, Quarantined: 2}
	got := l
	got.Prefill, got.Decode = want.Prefill, want.Decode
	if got != want {
		t.Fatalf("ledger\n got %+v\nwant %+v", got, want)
	}
	text := out.String()
	for _, s := range []string{"rejected by envelope", "rejected by prefill pool", "running-request limit", "destination acquire",
		"aborting      by frontend", "quarantined   by supervisor", "late acknowledgement", "no acknowledgement ever came",
		"failed        by transport", "delivered     by transport", "aborted       by frontend", "kvlease: canceled", "marker mismatches     0", "late writes           0"} {
		if !strings.Contains(text, s) {
			t.Errorf("output lacks %q", s)
		}
	}
}

// TestDeterministic: the same seed prints the same timeline (transfer ids
// aside: they count up through the process).
func TestDeterministic(t *testing.T) {
	ids := regexp.MustCompile(`transfer \d+`)
	var texts []string
	for range 3 {
		var out bytes.Buffer
		if _, err := Run(DefaultConfig(), &out); err != nil {
			t.Fatal(err)
		}
		texts = append(texts, ids.ReplaceAllString(out.String(), "transfer N"))
	}
	if texts[0] != texts[1] || texts[1] != texts[2] {
		t.Fatalf("same seed, different output:\n%s\n---\n%s", texts[0], texts[1])
	}
}

// TestManySeeds runs bigger bursts with harsher faults: the ledger must
// stay clean whatever the interleaving.
func TestManySeeds(t *testing.T) {
	for seed := uint64(1); seed <= 12; seed++ {
		cfg := DefaultConfig()
		cfg.Seed, cfg.Requests, cfg.Quiet = seed, 40, true
		cfg.FailRate, cfg.LostAckRate, cfg.AbortRate, cfg.EarlyAbortRate = 0.2, 0.3, 0.4, 0.1
		var out bytes.Buffer
		l, err := Run(cfg, &out)
		if err != nil {
			t.Fatal(err)
		}
		if p := l.Problems(); len(p) > 0 {
			t.Fatalf("seed %d: %v\n%s", seed, p, out.String())
		}
	}
}

// TestAuditCatchesALyingTransport makes the transport lie (it resolves a
// transfer while still copying) and checks that the ledger reports the
// writes into reclaimed memory: a clean ledger means something.
func TestAuditCatchesALyingTransport(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Quiet = true
	cfg.AbortRate, cfg.IgnoreCancelRate, cfg.FailRate, cfg.LostAckRate = 1, 1, 0, 0
	sabotage := func(w inproc.Write, s handoff.State) {
		if s == handoff.Aborting {
			w.Transfer.Resolve(nil) // "quiescent", says the transport, mid-copy
		}
	}
	var out bytes.Buffer
	l, err := run(cfg, &out, sabotage)
	if err != nil {
		t.Fatal(err)
	}
	if l.LateWrites == 0 || len(l.Problems()) == 0 {
		t.Fatalf("a lying transport went unnoticed: %+v\n%s", l, out.String())
	}
}

func TestBadConfig(t *testing.T) {
	for _, cfg := range []Config{{Requests: -1}, {AbortRate: 2}, {LateAckRate: -1}, {FailRate: 3}} {
		if _, err := Run(cfg, &bytes.Buffer{}); err == nil {
			t.Errorf("Run(%+v) succeeded", cfg)
		}
	}
	l, err := Run(Config{Seed: 1}, &bytes.Buffer{})
	if err != nil || l.Requests != 0 || len(l.Problems()) != 0 {
		t.Fatalf("empty burst: %+v %v", l, err)
	}
}

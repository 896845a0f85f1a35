package handoff

import (
	"strings"
	"testing"

	"github.com/kvlease/kvlease/handoff/internal/explore"
)

// The mutation suite: the explorer runs against deliberately broken
// variants of the halves (hooks.go) and must report a counterexample for
// each, at the smallest depth that has one (Deepen: exhaustive at depth
// 1, 2, …), naming the rule the variant breaks.
var xmutants = []struct {
	m      mutant
	name   string
	config string // the configuration it runs in (whose real halves pass)
	want   string // the violation the explorer must report
	depth  int    // the smallest depth that catches it (Deepen finds it there)
}{
	{mutantResolveOnAck, "resolve on the peer's acknowledgement", "early",
		"freed or handed out again while the op may still touch it", 7},
	{mutantFreeOnTimeout, "free on a timeout", "engines",
		"freed or handed out again while the op may still touch it", 5},
	{mutantLeaseOnly, "the deadline aborting only the lease", "early",
		"stalled and nothing asked it to stop", 10},
	{mutantRejectStarts, "a rejection that still starts a transfer", "attach",
		"is rejected on the source, yet its plane op src 1 attached", 5},
	{mutantSealShort, "a seal before the last byte", "engines",
		"is sealed (findable, served to prefix hits) but holds bytes not from handoff 1", 5},
}

// TestExploreMutants: every mutant is caught, with the rule it breaks,
// at the smallest depth recorded for it (a deeper one would mean the
// explorer lost sight of the shorter run). Under the race detector the
// deepest is left to .ci/steps/55-explore.sh.
func TestExploreMutants(t *testing.T) {
	for _, x := range xmutants {
		t.Run(x.name, func(t *testing.T) {
			if raceEnabled && x.depth > 7 {
				t.Logf("depth %d: explored without the race detector (.ci/steps/55-explore.sh)", x.depth)
				return
			}
			cfg := *xconfig(x.config)
			cfg.name += "+" + strings.ReplaceAll(x.name, " ", "-")
			cfg.mutant = x.m
			r := explore.Deepen(cfg.runner(t), x.depth)
			if r.Fail == nil {
				t.Fatalf("mutant %q in %s: no counterexample up to depth %d: %v", x.name, x.config, x.depth, r)
			}
			if len(r.Fail.Path) != x.depth {
				t.Fatalf("mutant %q in %s: caught at depth %d, recorded %d: %v", x.name, x.config, len(r.Fail.Path), x.depth, r.Fail)
			}
			if !strings.Contains(r.Fail.Error(), x.want) {
				t.Fatalf("mutant %q in %s: a counterexample, but not the one wanted (%q): %v", x.name, x.config, x.want, r.Fail)
			}
			t.Logf("%s (in %s): caught at depth %d after %v\n  path: %s", x.name, x.config, len(r.Fail.Path), r, explore.FormatPath(r.Fail.Path))
		})
	}
}

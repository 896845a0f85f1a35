package handoff

import (
	"flag"
	"strings"
	"testing"

	"github.com/kvlease/kvlease/handoff/internal/explore"
)

// The schedule explorer's tests: every interleaving of the two halves,
// up to the bounds EXPLORER.md lists. CI explores the small
// configurations whole and the larger ones to a depth and by random
// walks (.ci/steps/55-explore.sh, without the race detector);
// -explore.long goes deeper and walks longer; under -race (the root
// suite) every configuration is explored to a small depth only.

var (
	exploreLong   = flag.Bool("explore.long", false, "explore the larger configurations deeper and walk longer (minutes)")
	exploreReplay = flag.String("explore.replay", "", "replay a printed counterexample: 'config: choice; choice; ...' (TestExploreReplay)")
	exploreOnly   = flag.String("explore.only", "", "explore only the configurations whose name contains this")
	exploreDepth  = flag.Int("explore.depth", -1, "explore every configuration to this depth (0: whole) instead of its own bound")
)

// xconfigs are the explorer's configurations.
var xconfigs = []*xcfg{
	// One handoff, the engines' calls on both sides and failing planes.
	{name: "engines", srcBlocks: 4, dstBlocks: 4, fail: true,
		srcAbort: true, leaseAbort: true, cancel: true, dstAbort: true, dstReject: true,
		handoffs: []xho{{id: 1, blocks: 2, hashes: 2}}},
	// Planes that stall, return inside the cancel or never return, with
	// aborts and a dying connection.
	{name: "stalls", srcBlocks: 4, dstBlocks: 4, stall: true, stallSync: true, freeze: true,
		srcAbort: true, dstAbort: true, crash: true,
		handoffs: []xho{{id: 1, blocks: 2, hashes: 2}}},
	// Attaches as steps of their own: a Reject, an abort or the
	// connection's loss may come between Accept and attach.
	{name: "attach", srcBlocks: 4, dstBlocks: 4, slowAttach: true, fail: true,
		srcAbort: true, dstAbort: true, dstReject: true, crash: true,
		handoffs: []xho{{id: 1, blocks: 2, hashes: 2}}},
	// The source releases its lease right after Propose (rule 2), its
	// plane may stall, return inside the cancel or freeze.
	{name: "early", srcBlocks: 4, dstBlocks: 4, stall: true, stallSync: true, freeze: true, fail: true,
		srcAbort: true, dstAbort: true,
		handoffs: []xho{{id: 1, blocks: 2, hashes: 2, early: true}}},
	// Lost, duplicated and reordered messages.
	{name: "messages", srcBlocks: 4, dstBlocks: 4, drop: 1, dup: 1, reorder: true, fail: true,
		handoffs: []xho{{id: 1, blocks: 2, hashes: 2}}},
	// Prefix hits: one block of two (released early, the delivered lease
	// held), and every block (nothing moves).
	{name: "hits", srcBlocks: 4, dstBlocks: 4, fail: true, stall: true, srcAbort: true, dstAbort: true, keepDelivered: true,
		handoffs: []xho{{id: 1, blocks: 2, hashes: 2, warm: 1, early: true}}},
	{name: "allhits", srcBlocks: 4, dstBlocks: 4, fail: true, srcAbort: true, dstAbort: true, dstReject: true, crash: true,
		handoffs: []xho{{id: 1, blocks: 2, hashes: 2, warm: 2}}},
	// Four blocks in pools of 8: two of them hits, the last one unsealed
	// (a partial block: no hash), released early.
	{name: "wide", srcBlocks: 8, dstBlocks: 8, fail: true, stall: true, freeze: true, dstAbort: true, srcAbort: true,
		handoffs: []xho{{id: 1, blocks: 4, hashes: 3, warm: 2, early: true}}},
	// Streaming: the prefill writes as the plane sends, and over a plane
	// that cannot stream (the source starts once the prefill is done).
	{name: "stream", srcBlocks: 4, dstBlocks: 4, fail: true, srcAbort: true, dstAbort: true, slowAttach: true,
		handoffs: []xho{{id: 1, blocks: 2, hashes: 2, stream: 1}}},
	{name: "stream-wait", srcBlocks: 4, dstBlocks: 4, fail: true, srcAbort: true, dstAbort: true, crash: true,
		handoffs: []xho{{id: 1, blocks: 2, hashes: 2, stream: 2}}},
	// Two handoffs with a common prefix into a destination pool they
	// fill: the second may hit the first's sealed blocks, or find them
	// evicted; the second releases early.
	{name: "two", srcBlocks: 4, dstBlocks: 4, keepDelivered: true,
		depth: 12, long: 16, walks: 3000,
		handoffs: []xho{{id: 1, blocks: 2, hashes: 2}, {id: 2, blocks: 2, hashes: 2, shared: true, early: true}}},
	// Everything at once, two handoffs of which one releases early and
	// one finds a block cached.
	{name: "everything", srcBlocks: 4, dstBlocks: 4, drop: 1, dup: 1, reorder: true, crash: true, slowAttach: true,
		fail: true, stall: true, stallSync: true, freeze: true,
		srcAbort: true, leaseAbort: true, cancel: true, dstAbort: true, dstReject: true, keepDelivered: true,
		depth: 7, long: 9, walks: 20000,
		handoffs: []xho{{id: 1, blocks: 2, hashes: 2, early: true}, {id: 2, blocks: 2, hashes: 2, shared: true, warm: 1}}},
}

func xconfig(name string) *xcfg {
	for _, c := range xconfigs {
		if c.name == name {
			return c
		}
	}
	return nil
}

// bounds returns the depth bound of cfg's exhaustive run in this mode
// (0: the whole space).
func (cfg *xcfg) bounds() explore.Bounds {
	switch {
	case *exploreDepth >= 0:
		return explore.Bounds{Depth: *exploreDepth}
	case raceEnabled:
		return explore.Bounds{Depth: 5}
	case *exploreLong:
		return explore.Bounds{Depth: cfg.long}
	}
	return explore.Bounds{Depth: cfg.depth}
}

// failCounterexample reports a counterexample with the command that
// replays it.
func failCounterexample(t *testing.T, cfg *xcfg, ce *explore.Counterexample) {
	t.Helper()
	t.Fatalf("configuration %s: %v\nreplay: go test ./handoff -run 'TestExploreReplay$' -explore.replay='%s: %s'",
		cfg.name, ce, cfg.name, explore.FormatPath(ce.Path))
}

// TestExplore explores every configuration exhaustively to its bound:
// safety after every step, liveness wherever only the engines' calls and
// faults are left, nothing leaked after the teardown.
func TestExplore(t *testing.T) {
	for _, cfg := range xconfigs {
		if *exploreOnly != "" && !strings.Contains(cfg.name, *exploreOnly) {
			continue
		}
		t.Run(cfg.name, func(t *testing.T) {
			r := explore.Exhaustive(cfg.runner(t), cfg.bounds())
			t.Logf("%s (depth bound %d): %v", cfg.name, cfg.bounds().Depth, r)
			if r.Fail != nil {
				failCounterexample(t, cfg, r.Fail)
			}
		})
	}
}

// TestExploreWalks takes seeded random walks through the larger
// configurations, faults drawn rarely and progress often.
func TestExploreWalks(t *testing.T) {
	for _, cfg := range xconfigs {
		if cfg.walks == 0 || *exploreOnly != "" && !strings.Contains(cfg.name, *exploreOnly) {
			continue
		}
		t.Run(cfg.name, func(t *testing.T) {
			walks := cfg.walks
			switch {
			case raceEnabled:
				walks = 20
			case *exploreLong:
				walks *= 50
			}
			r := explore.Walk(cfg.runner(t), 33, walks, 80)
			t.Logf("%s: %d walks: %v", cfg.name, walks, r)
			if r.Fail != nil {
				failCounterexample(t, cfg, r.Fail)
			}
		})
	}
}

// bug30Path is the shortest run the explorer found on issue 30's item 1
// before its fix (Deepen, depth 10): the destination aborts, the source
// releases its lease after Propose and its plane stalls (a frozen peer):
// the peer's Abort and then the deadline abort the already closed lease,
// nothing cancels the transfer, and its two blocks stay quarantined for
// good. With the fix (net-a: the abort and the deadline cancel the
// transfer itself) the stall at step 9 is no longer possible: the
// peer's Abort has already asked the plane to stop.
const bug30Path = "propose 1; s>d propose 1; dst abort 1; d>s accept 1 from 0; src release 1; s>d start 1; d>s abort 1; s>d ack 1 of abort; stall src 1; deadline src 1"

// bug30Stalled is the same run with the plane stalled before the peer's
// Abort arrives, and the rest of what must happen: the Abort now cancels
// the transfer, the plane stops, and the handoff ends Aborted with its
// blocks back.
const bug30Stalled = "propose 1; s>d propose 1; dst abort 1; d>s accept 1 from 0; src release 1; s>d start 1; stall src 1; d>s abort 1; stop src 1; s>d ack 1 of abort"

// TestExploreReleasedLeaseQuarantine is the regression test of issue
// 30's item 1: the recorded counterexample no longer replays (its stall
// comes after the cancel), and the stalled run settles with the source
// Aborted and its pool free.
func TestExploreReleasedLeaseQuarantine(t *testing.T) {
	cfg := xconfig("early")
	err := explore.Replay(cfg.runner(t), explore.ParsePath(bug30Path))
	if err == nil || !strings.Contains(err.Error(), `step 9: "stall src 1" is not enabled`) {
		t.Fatalf("issue 30's item 1: %v", err)
	}
	var end string
	run := func(body func(explore.Instance)) {
		cfg.runner(t)(func(in explore.Instance) { body(&describeAtFinish{Instance: in, end: &end}) })
	}
	if err := explore.Replay(run, explore.ParsePath(bug30Stalled)); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(end, "src aborted") || !strings.Contains(end, "op src 1 returned canceled") ||
		!strings.Contains(end, "source pool: free 4 cached 0 leased 0 draining 0 quarantined 0") {
		t.Fatalf("after the stalled run:\n%s", end)
	}
}

// happyPath delivers one handoff: every message delivered, every plane
// completing.
const happyPath = "propose 1; s>d propose 1; d>s accept 1 from 0; s>d start 1; push src 1; write dst 1; return src 1; d>s done 1; s>d ack 1 of done"

// TestExploreReplay replays -explore.replay (a printed counterexample),
// or else the happy path, which must end delivered on both sides with
// both delivered blocks sealed.
func TestExploreReplay(t *testing.T) {
	name, path := "engines", happyPath
	if *exploreReplay != "" {
		name, path, _ = strings.Cut(*exploreReplay, ":")
	}
	cfg := xconfig(strings.TrimSpace(name))
	if cfg == nil {
		t.Fatalf("no configuration %q", name)
	}
	var end string
	run := func(body func(explore.Instance)) {
		cfg.runner(t)(func(in explore.Instance) {
			body(&describeAtFinish{Instance: in, end: &end})
		})
	}
	if err := explore.Replay(run, explore.ParsePath(path)); err != nil {
		t.Fatal(err)
	}
	if *exploreReplay == "" && (!strings.Contains(end, "src delivered") || !strings.Contains(end, "dst delivered") || !strings.Contains(end, "sealed0 sealed1")) {
		t.Fatalf("the happy path ended:\n%s", end)
	}
}

// describeAtFinish keeps the state an instance ends in.
type describeAtFinish struct {
	explore.Instance
	end *string
}

func (d *describeAtFinish) Finish() error {
	*d.end = d.Describe()
	return d.Instance.Finish()
}

// TestExploreDeterministic: a run is a function of its choices, so two
// explorations of one configuration cover the same states and steps (and
// Exhaustive compares every replay's fingerprint with the first run's).
func TestExploreDeterministic(t *testing.T) {
	cfg := xconfig("allhits")
	a := explore.Exhaustive(cfg.runner(t), explore.Bounds{})
	b := explore.Exhaustive(cfg.runner(t), explore.Bounds{})
	if a.Fail != nil || b.Fail != nil {
		t.Fatal(a.Fail, b.Fail)
	}
	if a.States != b.States || a.Transitions != b.Transitions || a.Runs != b.Runs || a.Terminal != b.Terminal {
		t.Fatalf("two explorations differ:\n%v\n%v", a, b)
	}
}

// TestExploreWriters checks what lets the explorer order the frames of
// one step by their bytes: no goroutine of the halves writes two frames
// in one step (xlink.writers tells the writers apart).
func TestExploreWriters(t *testing.T) {
	cfg := *xconfig("everything")
	cfg.writers = true
	walks := 300
	if raceEnabled {
		walks = 20
	}
	r := explore.Walk(cfg.runner(t), 7, walks, 80)
	t.Logf("%d walks: %v", walks, r)
	if r.Fail != nil {
		failCounterexample(t, &cfg, r.Fail)
	}
}

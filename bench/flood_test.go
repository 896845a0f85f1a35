package bench_test

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/bench/replay"
	"github.com/kvlease/kvlease/bench/trace"
)

// The KV cache flood (issue 32): tenant B replays a prefix-heavy
// Mooncake-style workload while tenant A sends unique prompts at ten
// times B's rate through the same pool. Without quotas A's fresh blocks
// evict B's cached prefixes before B comes back to them; with a cap on A
// (its flood evicts its own blocks) and a reservation for B, B's hit rate
// stays that of B alone.

// floodConfig sizes the flood: block tokens, pool, the two workloads.
type floodConfig struct {
	blockTokens, blocks, maxRunning int
	b, a                            trace.MooncakeGenConfig
	quotaA, quotaB                  kvlease.Quota
}

func defaultFlood() floodConfig {
	b := trace.MooncakeGenConfig{Seed: 32, Requests: 200, InputMean: 3072, OutputMean: 16,
		Prefixes: 6, SharedFrac: 0.8, IntervalMean: 40}
	a := trace.MooncakeGenConfig{Seed: 33, Requests: 10 * b.Requests, InputMean: 3072, OutputMean: 16,
		Prefixes: 1, SharedFrac: 0, IntervalMean: b.IntervalMean / 10}
	return floodConfig{blockTokens: 64, blocks: 1536, maxRunning: 32, b: b, a: a,
		quotaA: kvlease.Quota{Cap: 768}, quotaB: kvlease.Quota{Reserve: 384}}
}

// aIDs offsets A's request ids (and so its owners) from B's.
const aIDs = 1 << 20

// floodTrace merges B's trace with A's (when flood), in arrival order:
// A's hash ids are moved above all of B's, so that none of its prompts
// shares a block with B's or with another of A's.
func floodTrace(cfg floodConfig, flood bool) *trace.Trace {
	tr := trace.FromMooncake(trace.GenerateMooncake(cfg.b), 1)
	if !flood {
		return tr
	}
	am := trace.GenerateMooncake(cfg.a)
	for i := range am {
		for k := range am[i].HashIDs {
			am[i].HashIDs[k] += 1 << 40
		}
	}
	at := trace.FromMooncake(am, 1)
	for i := range at.Requests {
		at.Requests[i].ID += aIDs
		at.Requests[i].Prompt.Seed += aIDs
	}
	tr.Requests = append(tr.Requests, at.Requests...)
	slices.SortStableFunc(tr.Requests, func(x, y trace.Request) int { return x.Arrival - y.Arrival })
	return tr
}

// floodRow is one replay's outcome for the two tenants.
type floodRow struct {
	name       string
	b, a       kvlease.TenantStats
	evictions  uint64
	exhausted  int64
	wallMillis float64
}

func (r floodRow) hitRate(s kvlease.TenantStats) float64 {
	if s.PrefixQueries == 0 {
		return 0
	}
	return float64(s.PrefixHits) / float64(s.PrefixQueries)
}

// runFlood replays B alone (flood false) or B and A, with their quotas
// when quotas is set.
func runFlood(tb testing.TB, cfg floodConfig, flood, quotas bool) floodRow {
	al, err := replay.NewTenants(cfg.blocks, 64)
	if err != nil {
		tb.Fatal(err)
	}
	ta, _ := al.Pool.Tenant("a")
	tbn, _ := al.Pool.Tenant("b")
	if quotas {
		if err := ta.SetQuota(cfg.quotaA); err != nil {
			tb.Fatal(err)
		}
		if err := tbn.SetQuota(cfg.quotaB); err != nil {
			tb.Fatal(err)
		}
	}
	al.Of = func(owner string) *kvlease.Tenant[[]byte] {
		id, err := strconv.Atoi(strings.TrimPrefix(owner, "req-"))
		if err != nil {
			tb.Fatalf("owner %q", owner)
		}
		if id >= aIDs {
			return ta
		}
		return tbn
	}
	res, err := replay.Run(floodTrace(cfg, flood), replay.Config{BlockTokens: cfg.blockTokens, Blocks: cfg.blocks,
		MaxRunning: cfg.maxRunning}, al)
	if err != nil {
		tb.Fatal(err)
	}
	if res.Finished+res.Aborted+res.Rejected != res.Requests {
		tb.Fatalf("%d of %d requests finished", res.Finished, res.Requests)
	}
	st := al.Pool.Stats()
	if st.Leased+st.Draining+st.Quarantined != 0 {
		tb.Fatalf("the pool ends holding %+v", st)
	}
	lines := al.Pool.TenantStats(nil) // a, b, then no tenant
	return floodRow{b: lines[1], a: lines[0], evictions: st.Evictions, exhausted: res.Exhausted,
		wallMillis: float64(res.Wall.Microseconds()) / 1000}
}

// floodRows replays the three cases in one run.
func floodRows(tb testing.TB, cfg floodConfig) []floodRow {
	alone := runFlood(tb, cfg, false, false)
	alone.name = "B alone"
	none := runFlood(tb, cfg, true, false)
	none.name = "B + A's flood, no quotas"
	q := runFlood(tb, cfg, true, true)
	q.name = fmt.Sprintf("B + A's flood, A cap %d, B reserve %d", cfg.quotaA.Cap, cfg.quotaB.Reserve)
	return []floodRow{alone, none, q}
}

// floodParts replays the flood with each half of the quota alone: A's
// cap without B's reservation, and B's reservation without A's cap.
func floodParts(tb testing.TB, cfg floodConfig) []floodRow {
	capOnly := cfg
	capOnly.quotaB = kvlease.Quota{}
	c := runFlood(tb, capOnly, true, true)
	c.name = fmt.Sprintf("B + A's flood, A cap %d only", cfg.quotaA.Cap)
	resOnly := cfg
	resOnly.quotaA = kvlease.Quota{}
	r := runFlood(tb, resOnly, true, true)
	r.name = fmt.Sprintf("B + A's flood, B reserve %d only", cfg.quotaB.Reserve)
	return []floodRow{c, r}
}

func floodTable(rows []floodRow) string {
	var b strings.Builder
	fmt.Fprintf(&b, "| case | B hit rate | A hit rate | B blocks evicted by others | A's own evictions | evictions | refused (ErrExhausted) | wall ms |\n")
	fmt.Fprintf(&b, "| --- | --- | --- | --- | --- | --- | --- | --- |\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "| %s | %.3f | %.3f | %d | %d | %d | %d | %.0f |\n", r.name, r.hitRate(r.b), r.hitRate(r.a),
			r.b.Evicted, r.a.EvictedOwn, r.evictions, r.exhausted, r.wallMillis)
	}
	return b.String()
}

// TestFlood is issue 32's target, asserted on the deterministic replay:
// B's hit rate with quotas is within 5 points of B alone, and without
// quotas it collapses (at least 20 points lower); A's flood never evicts
// one of B's blocks with quotas on.
func TestFlood(t *testing.T) {
	cfg := defaultFlood()
	if testing.Short() || raceEnabled {
		cfg.b.Requests, cfg.a.Requests = 100, 1000
	}
	rows := floodRows(t, cfg)
	t.Logf("\n%s", floodTable(rows))
	alone, none, q := rows[0], rows[1], rows[2]
	ra, rn, rq := alone.hitRate(alone.b), none.hitRate(none.b), q.hitRate(q.b)
	if ra < 0.3 {
		t.Fatalf("B alone hits %.3f: not a prefix-heavy workload", ra)
	}
	if rq < ra-0.05 {
		t.Errorf("B's hit rate with quotas %.3f, alone %.3f: more than 5 points apart", rq, ra)
	}
	if rn > ra-0.20 {
		t.Errorf("B's hit rate under the flood without quotas %.3f, alone %.3f: no collapse to show", rn, ra)
	}
	if q.b.Evicted != 0 && q.b.Cached < cfg.quotaB.Reserve {
		t.Errorf("with quotas A evicted %d of B's blocks and B ends with %d cached", q.b.Evicted, q.b.Cached)
	}
	if none.b.Evicted == 0 {
		t.Error("no flood: A never evicted B's blocks")
	}
}

// BenchmarkFlood replays the three cases once per op and reports B's hit
// rates (points: hit rate × 100) and the rows (go test -v prints them).
func BenchmarkFlood(b *testing.B) {
	cfg := defaultFlood()
	var rows []floodRow
	for range b.N {
		rows = floodRows(b, cfg)
	}
	b.ReportMetric(100*rows[0].hitRate(rows[0].b), "B-alone-pts")
	b.ReportMetric(100*rows[1].hitRate(rows[1].b), "B-flood-pts")
	b.ReportMetric(100*rows[2].hitRate(rows[2].b), "B-quota-pts")
	b.Logf("\n%s", floodTable(append(rows, floodParts(b, cfg)...)))
}

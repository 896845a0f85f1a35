package audit

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
)

// small returns the default configuration bounded to ops lifecycle
// operations.
func small(seed uint64, ops int) Config {
	cfg := DefaultConfig()
	cfg.Seed = seed
	cfg.Ops = ops
	return cfg
}

func requireClean(t *testing.T, rep *Report) {
	t.Helper()
	if !rep.OK() {
		var b strings.Builder
		_ = rep.Write(&b)
		t.Fatalf("violations:\n%s", b.String())
	}
}

func TestRunIsClean(t *testing.T) {
	for _, seed := range []uint64{1, 2} {
		rep, err := Run(small(seed, 2000))
		require.NoError(t, err)
		requireClean(t, rep)
		require.GreaterOrEqual(t, rep.Lifecycle, 2000)
		for _, s := range rep.Pools {
			require.Zero(t, s.Leased+s.Draining, "seed %d: %+v", seed, s)
			require.Equal(t, s.Capacity, s.Free+s.Cached+s.Quarantined)
		}
	}
}

// The default configuration meets the target rates.
func TestDefaultConfigMeetsTargetRates(t *testing.T) {
	rep, err := Run(small(11, 8000))
	require.NoError(t, err)
	requireClean(t, rep)
	require.GreaterOrEqual(t, rep.RejectionRate(), 0.10, "rejections")
	require.GreaterOrEqual(t, rep.AbortRate(), 0.10, "aborts mid-transfer")
	require.GreaterOrEqual(t, rep.FailRate(), 0.05, "failed transfers")
	require.GreaterOrEqual(t, rep.LostAckRate(), 0.01, "lost acknowledgements")
	// Every path is exercised.
	for k := OpKind(1); k < numOpKinds; k++ {
		require.Positive(t, rep.ByOp[k], "no %v", k)
	}
	for name, n := range map[string]int{
		"envelope rejections": rep.RejectedEnvelope, "exhaustion rejections": rep.RejectedExhausted,
		"policy rejections": rep.RejectedPolicy, "waits": rep.Waited, "timeouts": rep.TimedOut,
		"prefix hits": rep.PrefixHits, "deliveries": rep.Delivered, "honoured cancels": rep.Cancelled,
		"ignored cancels": rep.CancelsIgnored, "late acks": rep.LateAcks, "deadlines": rep.Deadlines,
		"early aborts": rep.AbortedEarly,
	} {
		require.Positive(t, n, name)
	}
}

// zeroTime clears what differs between two runs of the same seed.
func zeroTime(r *Report) *Report {
	c := *r
	c.Elapsed = 0
	return &c
}

func TestSameSeedSameRun(t *testing.T) {
	a, err := Run(small(5, 2000))
	require.NoError(t, err)
	b, err := Run(small(5, 2000))
	require.NoError(t, err)
	require.Equal(t, zeroTime(a), zeroTime(b))
	c, err := Run(small(6, 2000))
	require.NoError(t, err)
	require.NotEqual(t, zeroTime(a).ByOp, zeroTime(c).ByOp)
}

// Replaying the operations a run drew gives the same run.
func TestReplayReproducesRun(t *testing.T) {
	cfg := small(7, 2000)
	rep, err := Run(cfg)
	require.NoError(t, err)
	requireClean(t, rep)

	w, err := newWorld(&cfg)
	require.NoError(t, err)
	ops, n := w.drive(newGen(w, nil), time.Now(), recordLimit)
	w.finish()
	require.Len(t, ops, n)

	again, err := Replay(cfg, ops)
	require.NoError(t, err)
	require.Equal(t, zeroTime(rep), zeroTime(again))

	// Through the text form too.
	parsed, err := ParseTrace(FormatTrace(ops))
	require.NoError(t, err)
	require.Equal(t, ops, parsed)
}

// Operations that no longer apply, as in a trace being minimised, are
// skipped, never a failure.
func TestReplaySkipsWhatNoLongerApplies(t *testing.T) {
	cfg := small(8, 600)
	w, err := newWorld(&cfg)
	require.NoError(t, err)
	ops, _ := w.drive(newGen(w, nil), time.Now(), recordLimit)
	w.finish()
	// Drop every arrival but one in three: most later operations name
	// requests that never came.
	var thin []Op
	for i, o := range ops {
		if o.Kind != OpArrive || i%3 == 0 {
			thin = append(thin, o)
		}
	}
	rep, err := Replay(cfg, thin)
	require.NoError(t, err)
	requireClean(t, rep)
	require.Positive(t, rep.Skipped)
}

func TestConfigValidation(t *testing.T) {
	for name, mod := range map[string]func(*Config){
		"no bound":          func(c *Config) { c.Ops, c.Duration = 0, 0 },
		"no workers":        func(c *Config) { c.Workers = 0 },
		"pool too small":    func(c *Config) { c.Blocks = 8 },
		"rate above 1":      func(c *Config) { c.Faults.Abort = 1.5 },
		"fates above 1":     func(c *Config) { c.Faults.Fail, c.Faults.LostAck = 0.6, 0.6 },
		"pool blocks count": func(c *Config) { c.PoolBlocks = []int{256} },
		"prompt range":      func(c *Config) { c.MinPrompt, c.MaxPrompt = 10, 5 },
		"bad envelope":      func(c *Config) { c.MaxPrefillTokens = 4096 },
		"check every":       func(c *Config) { c.CheckEvery = 0 },
	} {
		t.Run(name, func(t *testing.T) {
			cfg := DefaultConfig()
			mod(&cfg)
			_, err := Run(cfg)
			require.ErrorIs(t, err, kvlease.ErrInvalidArgument)
		})
	}
}

// Workers of different sizes, one worker (handoffs to itself), verified
// prefix mode and bigger blocks all run clean.
func TestRunVariants(t *testing.T) {
	for name, mod := range map[string]func(*Config){
		"uneven pools": func(c *Config) { c.Workers, c.PoolBlocks = 3, []int{96, 512, 200} },
		"one worker":   func(c *Config) { c.Workers = 1 },
		"verified": func(c *Config) {
			c.PoolOptions = func(int) []kvlease.Option { return []kvlease.Option{kvlease.WithVerifiedPrefix(c.BlockTokens)} }
		},
		"big blocks":     func(c *Config) { c.BlockBytes, c.Blocks = 1024, 128 },
		"tiny blocks":    func(c *Config) { c.BlockBytes = 16 },
		"no faults":      func(c *Config) { c.Faults = Faults{} },
		"all lost":       func(c *Config) { c.Faults.Fail, c.Faults.LostAck, c.Faults.LateAck = 0, 1, 0.5 },
		"crowded":        func(c *Config) { c.MaxLive, c.Blocks = 200, 128 },
		"no shared docs": func(c *Config) { c.Docs = 0 },
	} {
		t.Run(name, func(t *testing.T) {
			cfg := small(9, 1200)
			mod(&cfg)
			rep, err := Run(cfg)
			require.NoError(t, err)
			requireClean(t, rep)
		})
	}
}

// TestProgressAndDuration: on a clock that moves 1 ms each time the
// driver reads it (at the start, every 64 operations, at the end), a
// 300 ms run with progress every 50 ms reports at 50, 100, 150, 200 and
// 250 ms, stops at its 300 ms check, and reports once more at the end.
func TestProgressAndDuration(t *testing.T) {
	cfg := small(10, 0)
	cfg.Duration = 300 * time.Millisecond
	cfg.ProgressEvery = 50 * time.Millisecond
	var ticks time.Duration
	base := time.Unix(0, 0)
	cfg.now = func() time.Time { ticks += time.Millisecond; return base.Add(ticks) }
	var seen []Progress
	cfg.Progress = func(p Progress) { seen = append(seen, p) }
	rep, err := Run(cfg)
	require.NoError(t, err)
	requireClean(t, rep)
	var elapsed []time.Duration
	for k, p := range seen {
		elapsed = append(elapsed, p.Elapsed)
		if k > 0 {
			require.Greater(t, p.Ops, seen[k-1].Ops, "progress %d", k)
		}
	}
	ms := time.Millisecond
	require.Equal(t, []time.Duration{50 * ms, 100 * ms, 150 * ms, 200 * ms, 250 * ms, 301 * ms}, elapsed)
	require.Equal(t, 302*ms, rep.Elapsed)
	require.Positive(t, rep.Lifecycle)
}

// TestProgressShortRun: a run that ends before its first period still
// reports once, at its end.
func TestProgressShortRun(t *testing.T) {
	cfg := small(11, 50)
	cfg.ProgressEvery = time.Hour
	var seen []Progress
	cfg.Progress = func(p Progress) { seen = append(seen, p) }
	rep, err := Run(cfg)
	require.NoError(t, err)
	requireClean(t, rep)
	require.Len(t, seen, 1)
	require.Equal(t, 50, seen[0].Lifecycle) // before the drain
}

func TestReportWrite(t *testing.T) {
	rep, err := Run(small(12, 1000))
	require.NoError(t, err)
	var b strings.Builder
	require.NoError(t, rep.Write(&b))
	out := b.String()
	for _, want := range []string{"seed 12", "lifecycle ops/s", "rejections:", "aborted mid-transfer", "lost acks", "target rates:", ": met;", "blocks: capacity", "violations:", "OK"} {
		require.Contains(t, out, want)
	}
}

func TestConcurrentRunIsClean(t *testing.T) {
	for _, seed := range []uint64{21, 22} {
		cfg := small(seed, 3000)
		cfg.Concurrent = true
		rep, err := Run(cfg)
		require.NoError(t, err)
		requireClean(t, rep)
		require.Positive(t, rep.Delivered)
		require.Positive(t, rep.AbortedMidTransfer)
		require.Zero(t, rep.ByOp[OpStep])
	}
}

// The pools' own drain deadline (wall time, so only in a concurrent run)
// quarantines transfers that outlive it; late evidence lifts them.
func TestConcurrentDrainDeadline(t *testing.T) {
	cfg := small(31, 3000)
	cfg.Concurrent = true
	cfg.Latency = 200 * time.Microsecond
	cfg.PoolOptions = func(int) []kvlease.Option {
		return []kvlease.Option{kvlease.WithDrainDeadline(150 * time.Microsecond)}
	}
	rep, err := Run(cfg)
	require.NoError(t, err)
	requireClean(t, rep)
	require.Positive(t, rep.Delivered)
}

package audit

import (
	"fmt"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// Config describes one audit run: the deployment under test (workers,
// pool sizes, the envelope), the workload, and the faults to inject. The
// zero value is not usable; start from DefaultConfig and change what your
// deployment differs in.
type Config struct {
	// Seed determines the run: the same seed and configuration give the
	// same operations, the same block assignments and the same report
	// (throughput aside).
	Seed uint64
	// Ops is the number of lifecycle operations to run (copy steps are not
	// counted). Zero means until Duration.
	Ops int
	// Duration bounds the run's wall time when Ops is zero (or as well as
	// Ops, whichever ends first). A run bounded by time is still
	// replayable: the report gives its operation count.
	Duration time.Duration

	// Workers is the number of pools, each standing for one worker
	// (prefill or decode); requests arrive at any of them and are handed
	// off between them.
	Workers int
	// Blocks is the block count of each pool; PoolBlocks, if set, gives
	// one count per worker instead.
	Blocks     int
	PoolBlocks []int
	// The envelope every component agrees on: tokens and bytes per block,
	// the context limit, the prefill budget and the number of requests a
	// worker runs at once (beyond which it rejects handoffs by policy).
	BlockTokens, BlockBytes            int
	MaxContextTokens, MaxPrefillTokens int
	MaxRunningRequests                 int
	// PoolOptions, if set, returns extra options for worker i's pool
	// (WithVerifiedPrefix, WithKVEvents...). The driver's own options come
	// first (block tokens, an observer counting leaked leases, the leak
	// check), so yours override them. Options that act on wall time
	// (WithDrainDeadline) belong in a Concurrent run: a stepped run's
	// model would not see their timers fire.
	PoolOptions func(worker int) []kvlease.Option

	// The workload. MaxLive bounds the requests in flight at once. Docs
	// shared documents of up to DocTokens tokens give prompts their common
	// prefixes (DocShare of the requests start with one). Prompts have
	// MinPrompt..MaxPrompt tokens and generate 0..MaxNew more.
	MaxLive              int
	Docs, DocTokens      int
	DocShare             float64
	MinPrompt, MaxPrompt int
	MaxNew               int

	// Faults and decisions, as probabilities.
	Faults Faults

	// Concurrent lets copies run on their own, each block taking up to
	// Latency, racing the driver's aborts, deadlines and acknowledgements,
	// instead of the driver stepping them one block at a time. It tests
	// what the stepped run cannot (an abort racing a copy's completion),
	// but the run is no longer a function of its seed: it cannot be
	// replayed or minimised, and the state counts are compared with the
	// model only once the drain has brought everything to rest.
	Concurrent bool
	Latency    time.Duration

	// CheckEvery is how many operations pass between full checks (every
	// live lease's markers, Pool.Check, the state counts against the
	// audit's model). Cheap checks run after every operation.
	CheckEvery int
	// StopAfter stops the run once this many violations were found (0:
	// never stop; the report counts them all).
	StopAfter int
	// Minimise, when a violation stops the run, searches for a shorter
	// trace that still shows a violation of the same kind, replaying at
	// most MinimiseRuns candidates.
	Minimise     bool
	MinimiseRuns int
	// StallTimeout is how long the driver waits for a copy or a waiter to
	// reach its next step before it reports a stall.
	StallTimeout time.Duration
	// Progress, if set, is called about every ProgressEvery with the run's
	// counts so far, and once more when the operations end (so a run
	// reports at least once, however short or starved it was), on the
	// driver's goroutine: keep it quick.
	Progress      func(Progress)
	ProgressEvery time.Duration

	hooks hooks            // test-only broken variants
	now   func() time.Time // test-only clock of Duration and Progress (nil: time.Now)
}

// clock returns the time Duration and Progress are measured on.
func (c *Config) clock() time.Time {
	if c.now != nil {
		return c.now()
	}
	return time.Now()
}

// Faults are the probabilities of the transitions the audit exercises.
type Faults struct {
	// Transport fates, per transfer: the copy fails (resolves with an
	// error) or loses its acknowledgement (never resolves by itself).
	Fail, LostAck float64
	// IgnoreCancel: the copy does not honour a cancel; it runs on.
	IgnoreCancel float64
	// Abort: the client goes away while the transfer is in flight.
	// EarlyAbort: it goes away after the handoff was accepted, before the
	// transfer starts. Leave: it goes away while it holds a lease.
	Abort, EarlyAbort, Leave float64
	// Deadline: a slow transfer passes its deadline mid-copy (quarantine;
	// the copy's completion later lifts it).
	Deadline float64
	// LateAck: a lost acknowledgement still pending when the run drains is
	// delivered late; the others stay quarantined.
	LateAck float64
	// PolicyReject: the destination refuses a handoff by policy (besides
	// refusing when it runs MaxRunningRequests). Revoke: it rejects an
	// accepted handoff before the transfer starts. OverContext: a prompt
	// and its generation exceed the envelope's context limit.
	PolicyReject, Revoke, OverContext float64
	// Wait: a request waits for blocks (AcquireWait) instead of failing
	// when the pool is exhausted; Timeout: at each chance, a waiting
	// request gives up.
	Wait, Timeout float64
}

// DefaultConfig is a small deployment under heavy fault injection: four
// workers of 256 blocks, 48 requests in flight, and rates that meet the
// audit's target (at least 10% rejections, 10% aborts mid-transfer, 5%
// failed transfers, 1% lost acknowledgements).
func DefaultConfig() Config {
	return Config{
		Seed:               1,
		Ops:                20000,
		Workers:            4,
		Blocks:             384,
		BlockTokens:        16,
		BlockBytes:         64,
		MaxContextTokens:   1024,
		MaxPrefillTokens:   512,
		MaxRunningRequests: 12,
		MaxLive:            48,
		Docs:               6,
		DocTokens:          384,
		DocShare:           0.7,
		MinPrompt:          8,
		MaxPrompt:          480,
		MaxNew:             256,
		Faults: Faults{
			Fail: 0.08, LostAck: 0.03, IgnoreCancel: 0.35,
			Abort: 0.16, EarlyAbort: 0.04, Leave: 0.05,
			Deadline: 0.03, LateAck: 0.5,
			PolicyReject: 0.06, Revoke: 0.04, OverContext: 0.04,
			Wait: 0.15, Timeout: 0.1,
		},
		Latency:       20 * time.Microsecond,
		CheckEvery:    128,
		StopAfter:     1,
		Minimise:      true,
		MinimiseRuns:  120,
		StallTimeout:  30 * time.Second,
		ProgressEvery: time.Second,
	}
}

// Progress is what Config.Progress sees while a run goes on.
type Progress struct {
	Elapsed    time.Duration
	Ops        int // operations so far, steps included
	Lifecycle  int // lifecycle operations so far
	Live       int // requests in flight
	Violations int
}

// envelope returns the shared envelope; PoolBlocks is the smallest pool.
func (c *Config) envelope() handoff.Envelope {
	return handoff.Envelope{
		BlockTokens: c.BlockTokens, BlockBytes: c.BlockBytes, PoolBlocks: c.poolBlocks(0),
		MaxContextTokens: c.MaxContextTokens, MaxPrefillTokens: c.MaxPrefillTokens,
		MaxRunningRequests: c.MaxRunningRequests,
	}
}

func (c *Config) poolBlocks(i int) int {
	if len(c.PoolBlocks) > 0 {
		if i < len(c.PoolBlocks) {
			return c.PoolBlocks[i]
		}
		return 0
	}
	return c.Blocks
}

// validate names the first thing wrong with the configuration.
func (c *Config) validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("audit: config: "+format+": %w", append(args, kvlease.ErrInvalidArgument)...)
	}
	switch {
	case c.Ops < 0 || c.Duration < 0:
		return bad("negative Ops %d or Duration %v", c.Ops, c.Duration)
	case c.Ops == 0 && c.Duration == 0:
		return bad("neither Ops nor Duration bounds the run")
	case c.Workers < 1 || c.Workers > 64:
		return bad("Workers %d outside 1..64", c.Workers)
	case len(c.PoolBlocks) > 0 && len(c.PoolBlocks) != c.Workers:
		return bad("%d PoolBlocks for %d workers", len(c.PoolBlocks), c.Workers)
	case c.MaxLive < 1:
		return bad("MaxLive %d must be positive", c.MaxLive)
	case c.Docs < 0 || c.DocTokens < 0 || (c.Docs > 0 && c.DocTokens == 0) || c.Docs > 1<<15:
		return bad("Docs %d of %d tokens", c.Docs, c.DocTokens)
	case c.MinPrompt < 1 || c.MaxPrompt < c.MinPrompt || c.MaxNew < 0:
		return bad("prompts of %d..%d tokens generating up to %d", c.MinPrompt, c.MaxPrompt, c.MaxNew)
	case c.CheckEvery < 1:
		return bad("CheckEvery %d must be positive", c.CheckEvery)
	case c.StopAfter < 0 || c.MinimiseRuns < 0:
		return bad("negative StopAfter %d or MinimiseRuns %d", c.StopAfter, c.MinimiseRuns)
	case c.StallTimeout <= 0:
		return bad("StallTimeout %v must be positive", c.StallTimeout)
	case c.Latency < 0:
		return bad("negative Latency %v", c.Latency)
	}
	f := c.Faults
	for _, r := range []struct {
		name string
		v    float64
	}{
		{"Fail", f.Fail}, {"LostAck", f.LostAck}, {"IgnoreCancel", f.IgnoreCancel},
		{"Abort", f.Abort}, {"EarlyAbort", f.EarlyAbort}, {"Leave", f.Leave}, {"Deadline", f.Deadline},
		{"LateAck", f.LateAck}, {"PolicyReject", f.PolicyReject}, {"Revoke", f.Revoke},
		{"OverContext", f.OverContext}, {"Wait", f.Wait}, {"Timeout", f.Timeout}, {"DocShare", c.DocShare},
	} {
		if !(r.v >= 0 && r.v <= 1) {
			return bad("rate %s %v outside [0, 1]", r.name, r.v)
		}
	}
	if f.Fail+f.LostAck > 1 {
		return bad("Fail %v + LostAck %v exceed 1", f.Fail, f.LostAck)
	}
	env := c.envelope()
	if err := env.Validate(); err != nil {
		return fmt.Errorf("audit: config: %w", err)
	}
	var named []handoff.NamedEnvelope
	for i := range c.Workers {
		e := env
		e.PoolBlocks = c.poolBlocks(i)
		named = append(named, handoff.NamedEnvelope{Name: fmt.Sprintf("w%d", i), Envelope: e})
	}
	if err := handoff.AgreeEnvelopes(named...); err != nil {
		return fmt.Errorf("audit: config: %w", err)
	}
	if env.BlocksFor(c.MaxPrompt) > 1<<15 {
		return bad("MaxPrompt %d needs more than %d blocks", c.MaxPrompt, 1<<15)
	}
	return nil
}

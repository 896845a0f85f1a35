// Package rig is the test rig the disaggregation examples share:
// examples/disagg (in process, and with -net and -stream as two processes
// over TCP) and the ucx module's examples/disagg (two processes over
// UCX). It holds what does not teach the library but every run needs:
// the run's configuration and flags, the deployment's envelope, the
// seeded burst of requests and its faults, the block markers, the decode
// child process (started, handed its key, told and heard, reaped), the
// histories and reports that cross the process boundary, the timelines
// and the ledger.
//
// The examples keep what they teach: the pools, the handoffs, the
// planes and the evidence.
package rig

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/audit"
	"github.com/kvlease/kvlease/handoff"
)

// Config is one run.
type Config struct {
	Requests int
	Seed     uint64
	// The faults, per transfer. FailRate: the transfer fails; LostAckRate:
	// its evidence never comes (in process: the acknowledgement is lost;
	// over a network: the sender or reader stalls past both deadlines);
	// LateAckRate: a lost acknowledgement or a stall ends late, lifting
	// the quarantine; IgnoreCancelRate: the in-process transport ignores
	// a cancel (the network planes honour every one).
	FailRate, LostAckRate, LateAckRate, IgnoreCancelRate float64
	// AbortRate and EarlyAbortRate are the probabilities that a client
	// goes away mid-transfer, or after its proposal but before the
	// transfer starts.
	AbortRate, EarlyAbortRate float64
	// BlockLatency (in process) is the transport's time per block (plus
	// up to as much jitter).
	BlockLatency time.Duration
	// Deadline (two processes) is how long a side lets a started transfer
	// go without proof before it quarantines it.
	Deadline time.Duration
	// Quiet prints only the ledger.
	Quiet bool
	// Insecure (two processes) runs the halves without authentication; by
	// default they authenticate with a pre-shared key the prefill process
	// draws and hands to its child through an inherited pipe.
	Insecure bool
	// Stream (-net -stream) hands every request off streaming and after
	// its prefill, LayerDelay the compute time of one layer.
	Stream     bool
	LayerDelay time.Duration
	// Lie (tests) makes the decode process's plane lie: it resolves an
	// aborting transfer while still receiving. The audit must notice.
	Lie bool `json:",omitempty"`
}

// DefaultConfig is the README's run: a seed whose burst shows every
// outcome.
func DefaultConfig() Config {
	return Config{
		Requests: 24, Seed: 75,
		FailRate: 0.1, LostAckRate: 0.2, IgnoreCancelRate: 0.5, LateAckRate: 0.5,
		AbortRate: 0.2, EarlyAbortRate: 0.05,
		BlockLatency: 100 * time.Microsecond,
		Deadline:     2 * time.Second,
		LayerDelay:   2 * time.Millisecond,
	}
}

// Flags registers the flags every run takes on fs.
func (cfg *Config) Flags(fs *flag.FlagSet) {
	fs.IntVar(&cfg.Requests, "requests", cfg.Requests, "requests in the burst")
	fs.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed for the requests and their faults")
	fs.Float64Var(&cfg.FailRate, "fail", cfg.FailRate, "probability a transfer fails (in process: the copy errors; -net: its data connection is cut; UCX: its Start bytes arrive corrupted)")
	fs.Float64Var(&cfg.LostAckRate, "lost-ack", cfg.LostAckRate, "probability a transfer's evidence never comes (in process: its acknowledgement is lost; -net: its sender stalls; UCX: its reader stalls, past both deadlines)")
	fs.Float64Var(&cfg.LateAckRate, "late-ack", cfg.LateAckRate, "probability a lost acknowledgement or a stall ends late, lifting the quarantine")
	fs.Float64Var(&cfg.IgnoreCancelRate, "ignore-cancel", cfg.IgnoreCancelRate, "probability the in-process transport ignores a cancel (the network planes honour every one)")
	fs.Float64Var(&cfg.AbortRate, "abort", cfg.AbortRate, "probability the client goes away mid-transfer")
	fs.Float64Var(&cfg.EarlyAbortRate, "early-abort", cfg.EarlyAbortRate, "probability the client goes away before the transfer starts")
	fs.DurationVar(&cfg.Deadline, "deadline", cfg.Deadline, "two processes: how long a side waits for a started transfer's evidence before quarantining it")
	fs.BoolVar(&cfg.Quiet, "quiet", cfg.Quiet, "print only the ledger")
	fs.BoolVar(&cfg.Insecure, "insecure", cfg.Insecure, "two processes: run the halves without authentication (the ledger says \"authenticated none\")")
}

// Check refuses a bad run, and checks once, at startup, that every
// component runs with the same envelope (only the pool sizes differ).
func (cfg Config) Check() error {
	if cfg.Requests < 0 {
		return fmt.Errorf("requests %d must not be negative", cfg.Requests)
	}
	for _, r := range []float64{cfg.FailRate, cfg.LostAckRate, cfg.IgnoreCancelRate, cfg.LateAckRate, cfg.AbortRate, cfg.EarlyAbortRate} {
		if !(r >= 0 && r <= 1) {
			return fmt.Errorf("rate %v outside [0, 1]", r)
		}
	}
	if cfg.LayerDelay < 0 {
		return fmt.Errorf("layer delay %v must not be negative", cfg.LayerDelay)
	}
	return handoff.AgreeEnvelopes(
		handoff.NamedEnvelope{Name: "frontend", Envelope: Envelope},
		handoff.NamedEnvelope{Name: "prefill", Envelope: Envelope},
		handoff.NamedEnvelope{Name: "decode", Envelope: DecodeEnvelope()},
	)
}

// Envelope is the deployment's one envelope: 16-token blocks of 16 bytes
// per token, a 1024-token context (64 blocks), 256-token prefill chunks.
// The prefill and decode pools differ only in size.
var Envelope = handoff.Envelope{
	BlockTokens: 16, BlockBytes: 256, PoolBlocks: 512,
	MaxContextTokens: 1024, MaxPrefillTokens: 256, MaxRunningRequests: 14,
}

// DecodeBlocks is the decode pool's size.
const DecodeBlocks = 384

// DecodeEnvelope is the decode side's envelope: the deployment's, with
// its own pool size.
func DecodeEnvelope() handoff.Envelope {
	e := Envelope
	e.PoolBlocks = DecodeBlocks
	return e
}

// NewPool is a host-memory pool of blocks of blockBytes.
func NewPool(blocks, blockBytes int) (*kvlease.Pool[[]byte], error) {
	mem, err := kvlease.NewHostMemory(blocks, blockBytes)
	if err != nil {
		return nil, err
	}
	return kvlease.NewPool[[]byte](mem)
}

// Request is one synthetic request of the burst: what the seed decides
// about it. Both processes of a run draw the same burst.
type Request struct {
	ID             int
	Name           string
	Prompt, MaxNew int
	// AbortAt: the client goes away as block AbortAt is being moved; -1
	// for never.
	AbortAt int
	// EarlyAbort: the client goes away after the proposal, before the
	// transfer starts.
	EarlyAbort bool
	// LateAck: a lost acknowledgement (a stall) ends late.
	LateAck bool
	// Two processes only (NetBurst): the transfer stalls, or fails (its
	// connection cut, its Start corrupted), at this block; -1 for never.
	StallAt, FailAt int
}

// Burst draws the in-process burst. Every request draws the same number
// of values, so request k is the same for a seed whatever the rates.
func Burst(cfg Config) []Request {
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x646973616767))
	reqs := make([]Request, cfg.Requests)
	for k := range reqs {
		r := Request{ID: k + 1, Name: fmt.Sprintf("r%02d", k+1), AbortAt: -1, StallAt: -1, FailAt: -1}
		r.Prompt = 16 + rng.IntN(960)
		r.MaxNew = 16 + rng.IntN(240)
		abort, at, early, late := rng.Float64(), rng.Float64(), rng.Float64(), rng.Float64()
		if abort < cfg.AbortRate {
			r.AbortAt = int(at * float64(Envelope.BlocksFor(r.Prompt)))
		}
		r.EarlyAbort = early < cfg.EarlyAbortRate
		r.LateAck = late < cfg.LateAckRate
		reqs[k] = r
	}
	return reqs
}

// NetBurst draws the two-process burst: Burst's, with the network's
// faults drawn from a stream of their own. A request gets at most one:
// an early abort, else a stall (LostAckRate), else a failure (FailRate),
// else its mid-transfer abort (if Burst drew one).
func NetBurst(cfg Config) []Request {
	reqs := Burst(cfg)
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x6e6574666c74))
	for i := range reqs {
		r := &reqs[i]
		fail, lost, at := rng.Float64(), rng.Float64(), rng.Float64()
		k := int(at * float64(Envelope.BlocksFor(r.Prompt)))
		switch {
		case r.EarlyAbort:
			r.AbortAt = -1 // the transfer never starts
		case lost < cfg.LostAckRate:
			r.StallAt, r.AbortAt = k, -1
		case fail < cfg.FailRate:
			r.FailAt, r.AbortAt = k, -1
		}
	}
	return reqs
}

// Stamp fills block i of request id with the audit package's marker for
// (request id, block i): the same bytes in both processes, whatever slot
// holds them (generation 0 stands for "any": the prefill and decode pools
// number their slots independently).
func Stamp(b []byte, id, i int) {
	audit.Stamp(b, audit.Marker{Request: uint64(id), Block: uint32(i)})
}

// MarkerOK reports whether b holds block i of request id's marker.
func MarkerOK(b []byte, id, i int) bool {
	return audit.Check(b, audit.Marker{Request: uint64(id), Block: uint32(i)}) == nil
}

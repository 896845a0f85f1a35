// Package inproc is an in-process kvlease.Transport over host memory
// ([]byte regions) that misbehaves on purpose. It copies asynchronously on
// goroutines and can inject, per transfer, latency, failures, cancels that
// are or are not honoured, and lost acknowledgements: the copy stops but
// the transfer is never resolved, which must end in quarantine, never in
// reuse. Tests, the isolation audit and examples/disagg drive the handoff
// through it.
//
// Decisions are deterministic: each transfer's plan (its fate, where it
// fails, whether it honours a cancel, its latency) is drawn at Start from
// a random source seeded by Config.Seed, so the same sequence of Start
// calls gets the same plans. When the copies' goroutines run is up to the
// scheduler (or to testing/synctest's fake clock).
//
// Evidence is honest: a transfer is resolved only after its goroutine
// has made its last write, so a Resolve is always proof of quiescence.
package inproc

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
)

var (
	// ErrInjected is the outcome of a copy that failed by injection
	// (Config.FailRate or a Plan with FateFail).
	ErrInjected = errors.New("inproc: injected copy failure")
)

// Fate is how a transfer ends.
type Fate uint8

const (
	// FateComplete: every block is copied and the transfer resolved with
	// nil (or kvlease.ErrCanceled, when a cancel was honoured first).
	FateComplete Fate = iota
	// FateFail: the copy stops before block Plan.FailAt and the transfer
	// resolves with ErrInjected.
	FateFail
	// FateLoseAck: the copy runs as FateComplete would, but its
	// acknowledgement is lost: the transfer is never resolved. The
	// transport remembers the outcome; Acknowledge delivers it late.
	FateLoseAck
)

func (f Fate) String() string {
	switch f {
	case FateComplete:
		return "complete"
	case FateFail:
		return "fail"
	case FateLoseAck:
		return "lose-ack"
	}
	return "fate(?)"
}

// A Plan is what the transport does with one transfer.
type Plan struct {
	Fate Fate
	// FailAt is the pair before whose write a FateFail copy stops
	// (clamped to the last pair).
	FailAt int
	// HonourCancel says whether a cancel stops the copy. If false the copy
	// runs to its fate as if nobody had asked.
	HonourCancel bool
	// Latency is the time each block takes, before it is written.
	Latency time.Duration
}

// A Write is one block about to be (or just) written, for the audit hooks.
type Write struct {
	Transfer *kvlease.Transfer
	Seq      uint64 // the transfer's start sequence number, from 0
	Pair     int    // the index into the pairs given to Start
	Src, Dst []byte
}

// Config configures a Transport. The zero value copies instantly and
// never misbehaves.
type Config struct {
	// Seed seeds the plan draws.
	Seed uint64
	// BlockLatency is the base time each block takes to copy; each
	// transfer adds a draw in [0, Jitter) to it.
	BlockLatency, Jitter time.Duration
	// FailRate, LostAckRate and IgnoreCancelRate are the probabilities,
	// per transfer, of FateFail, of FateLoseAck, and of a cancel not being
	// honoured. FailRate + LostAckRate must not exceed 1.
	FailRate, LostAckRate, IgnoreCancelRate float64

	// Decide, if set, replaces the random draw: it returns the plan of the
	// seq-th transfer (from 0) of pairs blocks. Tests use it to pin fates.
	Decide func(seq uint64, pairs int) Plan

	// BeforeWrite, if set, is called on the copy goroutine before each
	// block is written: an auditor checks there that the destination is
	// still owned by the transfer's lease. An error stops the copy, which
	// resolves with it (or loses it, for FateLoseAck).
	BeforeWrite func(Write) error
	// AfterWrite, if set, is called after each block is written.
	AfterWrite func(Write)
}

// Transport is an in-process kvlease.Transport[[]byte, []byte]. It is
// safe for concurrent use.
type Transport struct {
	cfg Config

	mu    sync.Mutex
	rng   *rand.Rand
	seq   uint64
	lost  map[*kvlease.Transfer]error // copy stopped, ack lost: the outcome to deliver late
	stats Stats
	wg    sync.WaitGroup
}

var _ kvlease.Transport[[]byte, []byte] = (*Transport)(nil)

// Stats counts what a transport did.
type Stats struct {
	Started        int // transfers attached and started
	Refused        int // attach refused: nothing started
	Completed      int // resolved with nil
	Failed         int // resolved with an error other than kvlease.ErrCanceled (injected, hook)
	Canceled       int // resolved with kvlease.ErrCanceled
	Lost           int // stopped without acknowledgement (FateLoseAck)
	Acknowledged   int // lost acknowledgements delivered late by Acknowledge
	CancelsIgnored int // cancels requested of a copy that does not honour them
}

// New returns a transport. Rates outside [0, 1], FailRate + LostAckRate
// above 1, or a negative latency are refused (the error wraps
// kvlease.ErrInvalidArgument).
func New(cfg Config) (*Transport, error) {
	for _, r := range []struct {
		name string
		v    float64
	}{{"FailRate", cfg.FailRate}, {"LostAckRate", cfg.LostAckRate}, {"IgnoreCancelRate", cfg.IgnoreCancelRate}} {
		if !(r.v >= 0 && r.v <= 1) {
			return nil, fmt.Errorf("inproc: %s %v outside [0, 1]: %w", r.name, r.v, kvlease.ErrInvalidArgument)
		}
	}
	if cfg.FailRate+cfg.LostAckRate > 1 {
		return nil, fmt.Errorf("inproc: FailRate %v + LostAckRate %v exceeds 1: %w", cfg.FailRate, cfg.LostAckRate, kvlease.ErrInvalidArgument)
	}
	if cfg.BlockLatency < 0 || cfg.Jitter < 0 {
		return nil, fmt.Errorf("inproc: negative latency %v or jitter %v: %w", cfg.BlockLatency, cfg.Jitter, kvlease.ErrInvalidArgument)
	}
	return &Transport{
		cfg:  cfg,
		rng:  rand.New(rand.NewPCG(cfg.Seed, 0x6b766c65617365)),
		lost: make(map[*kvlease.Transfer]error),
	}, nil
}

// plan draws the next transfer's plan. Every draw consumes the same
// number of random values, so plans depend only on the seed and the order
// of Start calls. Called with t.mu held.
func (t *Transport) plan(seq uint64, n int) Plan {
	if t.cfg.Decide != nil {
		return t.cfg.Decide(seq, n)
	}
	fate, failAt, ignore, jitter := t.rng.Float64(), t.rng.IntN(max(n, 1)), t.rng.Float64(), t.rng.Float64()
	p := Plan{FailAt: failAt, HonourCancel: ignore >= t.cfg.IgnoreCancelRate,
		Latency: t.cfg.BlockLatency + time.Duration(jitter*float64(t.cfg.Jitter))}
	switch {
	case fate < t.cfg.FailRate:
		p.Fate = FateFail
	case fate < t.cfg.FailRate+t.cfg.LostAckRate:
		p.Fate = FateLoseAck
	}
	return p
}

// copyJob is one started copy.
type copyJob struct {
	t      *Transport
	tr     *kvlease.Transfer
	seq    uint64
	pairs  []kvlease.CopyPair[[]byte, []byte]
	plan   Plan
	cancel chan struct{} // closed by the cancel hook
}

// Start implements kvlease.Transport. It checks the pairs (equal-length
// regions), draws the transfer's plan, creates the transfer with a cancel
// hook and calls attach before any byte moves. If attach fails, the
// transfer is resolved with attach's error and nothing starts.
func (t *Transport) Start(pairs []kvlease.CopyPair[[]byte, []byte], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	if attach == nil {
		return nil, fmt.Errorf("inproc: start: nil attach: %w", kvlease.ErrInvalidArgument)
	}
	for i, p := range pairs {
		if len(p.Src) != len(p.Dst) {
			return nil, fmt.Errorf("inproc: start: pair %d copies %d bytes into %d: %w", i, len(p.Src), len(p.Dst), kvlease.ErrInvalidArgument)
		}
	}
	j := &copyJob{t: t, pairs: pairs, cancel: make(chan struct{})}
	j.tr = kvlease.NewTransfer(j.cancelled) // Cancel runs it at most once

	t.mu.Lock()
	j.seq = t.seq
	t.seq++
	j.plan = t.plan(j.seq, len(pairs))
	t.mu.Unlock()

	if err := attach(j.tr); err != nil {
		j.tr.Resolve(err) // nothing touched the memory: that is evidence
		t.count(func(s *Stats) { s.Refused++ })
		return nil, err
	}
	t.wg.Add(1)
	t.count(func(s *Stats) { s.Started++ })
	go j.run()
	return j.tr, nil
}

func (j *copyJob) cancelled() {
	if j.plan.HonourCancel {
		close(j.cancel)
		return
	}
	j.t.count(func(s *Stats) { s.CancelsIgnored++ })
}

func (t *Transport) count(f func(*Stats)) {
	t.mu.Lock()
	f(&t.stats)
	t.mu.Unlock()
}

// run copies the pairs, then resolves the transfer (or loses the
// acknowledgement). The Resolve comes after the last write: it is
// evidence.
func (j *copyJob) run() {
	defer j.t.wg.Done()
	outcome := j.copy()
	t := j.t
	if j.plan.Fate == FateLoseAck {
		t.mu.Lock()
		t.lost[j.tr] = outcome
		t.stats.Lost++
		t.mu.Unlock()
		return
	}
	j.tr.Resolve(outcome)
	t.count(func(s *Stats) {
		switch {
		case outcome == nil:
			s.Completed++
		case errors.Is(outcome, kvlease.ErrCanceled):
			s.Canceled++
		default:
			s.Failed++
		}
	})
}

func (j *copyJob) copy() error {
	cfg := &j.t.cfg
	failAt := min(j.plan.FailAt, len(j.pairs)-1)
	for i, p := range j.pairs {
		if j.plan.Latency > 0 {
			timer := time.NewTimer(j.plan.Latency)
			select {
			case <-timer.C:
			case <-j.cancel:
				timer.Stop()
			}
		}
		select {
		case <-j.cancel:
			return fmt.Errorf("inproc: transfer %d: copy canceled before block %d of %d: %w", j.tr.ID(), i, len(j.pairs), kvlease.ErrCanceled)
		default:
		}
		if j.plan.Fate == FateFail && i == failAt {
			return fmt.Errorf("inproc: transfer %d failed before block %d of %d: %w", j.tr.ID(), i, len(j.pairs), ErrInjected)
		}
		w := Write{Transfer: j.tr, Seq: j.seq, Pair: i, Src: p.Src, Dst: p.Dst}
		if cfg.BeforeWrite != nil {
			if err := cfg.BeforeWrite(w); err != nil {
				return fmt.Errorf("inproc: transfer %d: before block %d: %w", j.tr.ID(), i, err)
			}
		}
		copy(p.Dst, p.Src)
		if cfg.AfterWrite != nil {
			cfg.AfterWrite(w)
		}
	}
	return nil
}

// Wait blocks until every started copy has stopped: each transfer is
// resolved or has lost its acknowledgement (see Lost). A supervisor that
// knows this can Expire the handoffs still waiting.
func (t *Transport) Wait() { t.wg.Wait() }

// Lost returns the transfers whose copy stopped but whose acknowledgement
// was lost and has not been delivered: the transport knows they are
// quiescent, their owners do not. The order is unspecified.
func (t *Transport) Lost() []*kvlease.Transfer {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]*kvlease.Transfer, 0, len(t.lost))
	for tr := range t.lost {
		out = append(out, tr)
	}
	return out
}

// Acknowledge delivers the late evidence for a transfer that lost its
// acknowledgement: it resolves it with the outcome its copy had. It
// reports whether tr was such a transfer (false for one that resolved
// normally, or was already acknowledged).
func (t *Transport) Acknowledge(tr *kvlease.Transfer) bool {
	t.mu.Lock()
	outcome, ok := t.lost[tr]
	delete(t.lost, tr)
	if ok {
		t.stats.Acknowledged++
	}
	t.mu.Unlock()
	if ok {
		tr.Resolve(outcome)
	}
	return ok
}

// Stats returns what the transport did so far.
func (t *Transport) Stats() Stats {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.stats
}

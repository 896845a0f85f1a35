package audit

import (
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// hooks are the unexported test hooks through which the package's tests
// build the broken variants the audit must catch. All nil in a real run.
type hooks struct {
	// transport wraps the transport each handoff starts with.
	transport func(kvlease.Transport[[]byte, []byte]) kvlease.Transport[[]byte, []byte]
	// deadline replaces the supervisor's policy when a transfer passes its
	// deadline; it returns false to fall back to Expire.
	deadline func(w *world, r *request) bool
	// revoked runs after the destination revoked an accepted handoff.
	revoked func(w *world, r *request, hr *handRec)
	// delivered runs after a handoff delivered.
	delivered func(w *world, r *request)
}

// recordLimit bounds the operations a run keeps for its trace; a longer
// run that finds a violation regenerates its trace from the seed.
const recordLimit = 1 << 18

// Run runs the audit: operations drawn from cfg.Seed until cfg.Ops
// lifecycle operations (or cfg.Duration) have run or cfg.StopAfter
// violations were found, then, if it was not stopped, the drain and the
// final accounting. The error reports an invalid configuration; what the
// audit found is in the report (Report.OK).
func Run(cfg Config) (*Report, error) {
	return run(cfg, nil)
}

// run is Run with the generator's random source (nil: the seed's).
func run(cfg Config, src rand.Source) (*Report, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	w, err := newWorld(&cfg)
	if err != nil {
		return nil, err
	}
	start := cfg.clock()
	trace, main := w.drive(newGen(w, src), start, recordLimit)
	if !w.halt() {
		w.drain()
	}
	w.finish()
	rep := w.rep
	rep.Elapsed = cfg.clock().Sub(start)
	if rep.OK() {
		return rep, nil
	}
	// The trace that shows the first violation: every operation up to it
	// (or all of them, when the drain found it).
	first := rep.Violations[0]
	n := main
	if first.Op >= 0 {
		n = first.Op + 1
	}
	if cfg.Concurrent {
		// Not a function of the seed: the operations as drawn, for
		// reading, not for replaying.
		rep.Trace, rep.TraceFrom = trace[:min(n, len(trace))], n
		return rep, nil
	}
	if n > len(trace) {
		if src != nil {
			return rep, nil // a source that cannot be rewound: no trace
		}
		trace = regenerate(cfg, n)
	}
	rep.Trace, rep.TraceFrom = trace[:n:n], n
	if cfg.Minimise && !w.stopped {
		rep.Trace, rep.Minimised = minimise(cfg, rep.Trace, first.Kind)
	}
	return rep, nil
}

// drive runs the operations g draws until the run's bounds, recording the
// first keep of them. It returns them and how many ran.
func (w *world) drive(g *gen, start time.Time, keep int) ([]Op, int) {
	cfg := w.cfg
	var trace []Op
	lastProgress := start
	progress := func(now time.Time) {
		cfg.Progress(Progress{Elapsed: now.Sub(start), Ops: w.rep.Ops, Lifecycle: w.rep.Lifecycle,
			Live: len(w.live), Violations: w.rep.Total()})
	}
	i := 0
	for ; ; i++ {
		if cfg.Ops > 0 && w.rep.Lifecycle >= cfg.Ops {
			break
		}
		if w.halt() {
			break
		}
		if i&63 == 0 && (cfg.Duration > 0 || cfg.Progress != nil) {
			now := cfg.clock()
			if cfg.Duration > 0 && now.Sub(start) >= cfg.Duration {
				break
			}
			if cfg.Progress != nil && now.Sub(lastProgress) >= cfg.ProgressEvery {
				lastProgress = now
				progress(now)
			}
		}
		o := g.next()
		if len(trace) < keep {
			trace = append(trace, o)
		}
		w.op = i
		w.exec(o)
	}
	if cfg.Progress != nil {
		progress(cfg.clock()) // the last word: a run reports at least once
	}
	return trace, i
}

// halt reports whether the run must stop: a stall, or enough violations.
func (w *world) halt() bool {
	return w.stopped || (w.cfg.StopAfter > 0 && w.rep.Total() >= w.cfg.StopAfter)
}

// Replay runs ops, as Run recorded them, with the seed and configuration
// of the run that found them, then drains and does the final accounting.
// (Only cfg.Ops, Duration and Progress are ignored.) It is how a printed
// trace is reproduced, and what minimisation runs.
func Replay(cfg Config, ops []Op) (*Report, error) {
	cfg.Ops = max(cfg.Ops, 1)
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return replay(cfg, ops, 0), nil
}

// replay runs ops; it stops at the first violation of kind stopAt (0:
// at StopAfter as usual).
func replay(cfg Config, ops []Op, stopAt ViolationKind) *Report {
	w, err := newWorld(&cfg)
	if err != nil {
		rep := &Report{Seed: cfg.Seed}
		rep.violate(Violation{Kind: Unexpected, Op: -1, Detail: err.Error()})
		return rep
	}
	w.fullEach = len(ops) <= 256
	start := time.Now()
	stop := func() bool {
		if stopAt != 0 {
			return w.stopped || w.rep.ByKind[stopAt] > 0
		}
		return w.halt()
	}
	for i, o := range ops {
		if stop() {
			break
		}
		w.op = i
		w.exec(o)
	}
	if !stop() {
		w.drain()
	}
	w.finish()
	w.rep.Elapsed = time.Since(start)
	return w.rep
}

// regenerate draws the first n operations of cfg's run again.
func regenerate(cfg Config, n int) []Op {
	cfg.Progress = nil
	cfg.Duration = 0
	cfg.Ops = 0
	cfg.StopAfter = 0
	w, err := newWorld(&cfg)
	if err != nil {
		return nil
	}
	g := newGen(w, nil)
	ops := make([]Op, 0, n)
	for i := 0; i < n && !w.stopped; i++ {
		o := g.next()
		ops = append(ops, o)
		w.op = i
		w.exec(o)
	}
	w.finish()
	return ops
}

// minimise looks for a shorter trace that still shows a violation of
// kind k: delta debugging (drop chunks of halving size while the
// violation persists), cutting each success at the operation where the
// replay found it, within cfg.MinimiseRuns replays.
func minimise(cfg Config, ops []Op, k ViolationKind) ([]Op, bool) {
	cfg.Progress = nil
	cfg.StopAfter = 0
	runs := 0
	test := func(cand []Op) ([]Op, bool) {
		runs++
		rep := replay(cfg, cand, k)
		if rep.ByKind[k] == 0 {
			return nil, false
		}
		for _, v := range rep.Violations {
			if v.Kind == k && v.Op >= 0 && v.Op+1 < len(cand) {
				return cand[:v.Op+1], true
			}
			if v.Kind == k {
				break
			}
		}
		return cand, true
	}
	orig := len(ops)
	// The prefix first: the violation may show earlier with full checks
	// after every operation.
	if runs < cfg.MinimiseRuns {
		if c, ok := test(ops); ok {
			ops = c
		}
	}
	for parts := 2; len(ops) > 1 && runs < cfg.MinimiseRuns; {
		size := (len(ops) + parts - 1) / parts
		reduced := false
		for at := 0; at < len(ops) && runs < cfg.MinimiseRuns; at += size {
			cand := append(append([]Op(nil), ops[:at]...), ops[min(at+size, len(ops)):]...)
			if c, ok := test(cand); ok {
				ops, reduced = c, true
				parts = max(parts-1, 2)
				break
			}
		}
		if !reduced {
			if size == 1 {
				break
			}
			parts = min(parts*2, len(ops))
		}
	}
	return ops, len(ops) < orig
}

// drain brings the run to rest (see drainOps), then checks the final
// accounting.
func (w *world) drain() {
	w.op = -1
	if w.cfg.Concurrent {
		// Let every copy stop and every handoff record its evidence.
		for len(w.jobs) > 0 && !w.stopped {
			w.finishJob(w.jobs[0])
		}
		for _, r := range w.reqs {
			if hr := r.h; hr != nil && hr.x != nil && hr.x.t.State() == kvlease.TransferResolved {
				w.await(hr.h.Done(), fmt.Sprintf("request %d: handoff to record its transfer's evidence", r.id))
			}
			w.settle(r)
		}
		for _, ps := range w.pools {
			w.serveWaiters(ps)
		}
		w.collectAsync()
		if w.stopped {
			return
		}
	}
	for round := 0; ; round++ {
		ops := drainOps(w)
		if len(ops) == 0 {
			break
		}
		if round > 1<<16 {
			w.violate(Stall, "the drain did not come to rest after %d rounds", round)
			return
		}
		for _, o := range ops {
			w.exec(o)
			if w.stopped {
				return
			}
		}
	}
	w.finalCheck()
}

// finalCheck is the accounting after the drain: nothing leased or
// draining, every block free or cached unless a transfer still
// quarantined holds it, and those match the audit's model.
func (w *world) finalCheck() {
	w.fullCheck()
	for _, r := range w.reqs {
		if !r.gone && r.h != nil && r.h.h.State() == handoff.Quarantined {
			w.rep.LeftQuarantined++
		}
	}
	for _, ps := range w.pools {
		s := ps.p.Stats()
		q := 0
		for id := range ps.held {
			if ps.held[id] != 0 || ps.pend[id] != 0 {
				w.violate(Leak, "%s: after the drain the audit still counts slot %d held by %d leases and %d pending transfers", ps.name, id, ps.held[id], ps.pend[id])
			}
			if ps.quar[id] > 0 {
				q++
			}
		}
		if s.Leased != 0 || s.Draining != 0 || s.OpenLeases != 0 || s.Waiters != 0 {
			w.violate(Leak, "%s: after the drain: %d blocks leased, %d draining, %d leases open, %d waiters", ps.name, s.Leased, s.Draining, s.OpenLeases, s.Waiters)
		}
		if s.Free+s.Cached+s.Quarantined != s.Capacity {
			w.violate(Leak, "%s: %d blocks neither free, cached nor quarantined", ps.name, s.Capacity-s.Free-s.Cached-s.Quarantined)
		}
		if s.Quarantined != q {
			w.violate(Leak, "%s: %d blocks quarantined, but transfers still quarantined hold %d", ps.name, s.Quarantined, q)
		}
	}
	if len(w.jobs) > 0 {
		w.violate(Leak, "%d copies still running after the drain", len(w.jobs))
	}
}

// finish ends the run: parked copies run free, waits are cancelled, and
// every goroutine the run started is waited for (briefly: a stalled one is
// left behind). The report gets the pools' final counts.
func (w *world) finish() {
	w.collectAsync()
	w.mu.Lock()
	w.closed = true
	w.mu.Unlock()
	close(w.quit)
	for _, ps := range w.pools {
		for _, r := range ps.fifo {
			r.wait.cancel()
		}
	}
	deadline := time.After(w.cfg.StallTimeout)
	for _, j := range w.jobs {
		select {
		case <-j.exited:
		case <-deadline:
		}
	}
	for _, ps := range w.pools {
		for _, r := range ps.fifo {
			select {
			case res := <-r.wait.ch:
				if res.err == nil {
					res.l.Release()
				}
			case <-deadline:
			}
		}
	}
	w.rep.Pools = w.rep.Pools[:0]
	for _, ps := range w.pools {
		w.rep.Pools = append(w.rep.Pools, ps.p.Stats())
	}
}

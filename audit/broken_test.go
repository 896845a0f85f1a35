package audit

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/inproc"
)

// The broken variants: each reintroduces one cause of the 2026 incident
// through a test hook, and the driver must catch it within a bounded run.

// cancelFrees is a transport whose cancel frees at once: its cancel hook
// resolves the transfer the leases wait on while the copy underneath
// keeps writing. A cancel request is not evidence (rule 3).
type cancelFrees struct {
	base kvlease.Transport[[]byte, []byte]
}

func (c cancelFrees) Start(pairs []kvlease.CopyPair[[]byte, []byte], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	var outer *kvlease.Transfer
	_, err := c.base.Start(pairs, func(inner *kvlease.Transfer) error {
		outer = kvlease.NewTransfer(func() {
			inner.Cancel()
			outer.Resolve(kvlease.ErrCanceled) // BROKEN: frees the blocks at cancel
		})
		if err := attach(outer); err != nil {
			return err
		}
		go func() {
			<-inner.Done()
			outer.Resolve(inner.Err())
		}()
		return nil
	})
	return outer, err
}

func brokenCancel(cfg *Config) {
	cfg.hooks.transport = func(t kvlease.Transport[[]byte, []byte]) kvlease.Transport[[]byte, []byte] {
		return cancelFrees{t}
	}
}

// brokenRejection ignores a rejection: when the destination revokes an
// accepted handoff, it copies into the blocks the destination had
// accepted with anyway, through raw memory, without a lease (rule 1).
func brokenRejection(cfg *Config) {
	cfg.hooks.revoked = func(w *world, r *request, hr *handRec) {
		src := r.cur
		n := hr.n
		pairs := make([]kvlease.CopyPair[[]byte, []byte], n)
		srcRefs := make([]slotRef, n)
		dstRefs := make([]slotRef, n)
		for i := range n {
			s, err := src.l.Region(i)
			if err != nil {
				return
			}
			pairs[i] = kvlease.CopyPair[[]byte, []byte]{Src: s, Dst: hr.dst.ps.mem.Region(hr.dst.refs[i].ID)} // BROKEN: no lease
			srcRefs[i] = slotRef{src.ps, src.refs[i]}
			dstRefs[i] = slotRef{hr.dst.ps, hr.dst.refs[i]}
		}
		j, err := w.newJob(r, inproc.Plan{Fate: inproc.FateComplete, HonourCancel: true}, srcRefs, dstRefs)
		if err != nil {
			return
		}
		tr, err := j.tp.Start(pairs, func(t *kvlease.Transfer) error {
			j.inner = t
			return src.l.AttachRange(t, 0, n, kvlease.Read)
		})
		if err != nil {
			return
		}
		j.outer.Store(tr)
		j.x = &xferRec{t: tr, state: kvlease.TransferPending, atts: []attRec{{src, n}}}
		w.attachRec(j.x)
		w.launched(j)
	}
}

// deadlineAsEvidence treats a passed deadline as evidence: it resolves
// the transfer instead of quarantining it (rule 4).
func deadlineAsEvidence(cfg *Config) {
	cfg.hooks.deadline = func(w *world, r *request) bool {
		r.h.x.t.Resolve(kvlease.ErrDrainDeadline) // BROKEN: time is not evidence
		return true
	}
}

var brokenVariants = []struct {
	name  string
	apply func(*Config)
	// The kinds that must be found when the run keeps going.
	must []ViolationKind
}{
	{"cancel-frees", brokenCancel, []ViolationKind{EarlyResolve, LateWrite}},
	{"ignores-rejection", brokenRejection, []ViolationKind{LateWrite}},
	{"deadline-as-evidence", deadlineAsEvidence, []ViolationKind{EarlyResolve, LateWrite}},
}

// brokenOps bounds each broken run.
const brokenOps = 2500

func TestBrokenVariantsAreCaught(t *testing.T) {
	for _, bv := range brokenVariants {
		t.Run(bv.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Seed = 3
			cfg.Ops = brokenOps
			cfg.MinimiseRuns = 60
			bv.apply(&cfg)
			rep, err := Run(cfg)
			require.NoError(t, err)
			require.False(t, rep.OK(), "the driver missed the broken variant in %d operations", brokenOps)
			first := rep.Violations[0]
			t.Logf("caught after %d operations (%d lifecycle): %v", first.Op+1, rep.Lifecycle, first)
			t.Logf("minimised trace: %d of %d operations", len(rep.Trace), rep.TraceFrom)
			require.NotEmpty(t, rep.Trace)
			require.LessOrEqual(t, len(rep.Trace), rep.TraceFrom)

			// The trace replays to the same kind of violation.
			again, err := Replay(cfg, rep.Trace)
			require.NoError(t, err)
			require.Positive(t, again.ByKind[first.Kind], "replaying the trace does not show %v:\n%s", first.Kind, FormatTrace(rep.Trace))

			// Kept going, the run finds every kind the variant causes.
			cfg.StopAfter = 0
			cfg.Minimise = false
			all, err := Run(cfg)
			require.NoError(t, err)
			for _, k := range bv.must {
				require.Positive(t, all.ByKind[k], "no %v in %d operations; found %v", k, brokenOps, all.ByKind)
				for _, v := range all.Violations {
					if v.Kind == k {
						t.Logf("first %v after %d operations", k, v.Op+1)
						break
					}
				}
			}
			t.Logf("kept going: %d violations: %v", all.Total(), all.ByKind)
			t.Logf("minimised trace:\n%s", FormatTrace(rep.Trace))
		})
	}
}

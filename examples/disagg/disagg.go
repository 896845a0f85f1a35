package main

import (
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/inproc"
	"github.com/kvlease/kvlease/internal/rig"
)

// Config is one run of the example (its flags: rig.Config.Flags).
type Config = rig.Config

// DefaultConfig is the README's run: a seed whose burst shows every
// outcome.
func DefaultConfig() Config { return rig.DefaultConfig() }

// Ledger is what a run ends with (shared with the -net run and the ucx
// module's example).
type Ledger = rig.Ledger

// The deployment's one envelope: 16-token blocks of 16 bytes per token,
// a 1024-token context (64 blocks), 256-token prefill chunks. The prefill
// and decode pools differ only in size (rig.DecodeBlocks); Config.Check
// has every component agree on it (handoff.AgreeEnvelopes) once, at
// startup.
var envelope = rig.Envelope

// request is one synthetic request (what the seed decided: its size, and
// whether its client goes away, and when) and what happened to it.
type request struct {
	rig.Request

	refused string // why the request never reached a handoff
	src     *kvlease.Lease[[]byte]
	srcIDs  []kvlease.BlockID
	h       *handoff.Handoff[[]byte, []byte]
	dstIDs  []kvlease.BlockID
	lost    bool // its transfer's acknowledgement was lost
	late    bool // ...and delivered late
}

var (
	errClientGone = errors.New("client went away")
	errBusy       = errors.New("decode worker at its running-request limit")
	errNoAck      = errors.New("transport idle, transfer unacknowledged")
)

// Run runs the burst and writes the timeline (unless cfg.Quiet) and the
// ledger to out. Read it top to bottom: each request is admitted against
// the envelope and prefilled into a lease of the prefill pool (admit);
// proposed to the decode pool, which accepts (a lease of its own) or
// rejects; then one transfer copies the blocks; the transport's evidence
// (or a late acknowledgement, or none: quarantine) ends each handoff;
// decode checks what it got and releases it; the ledger says nothing
// leaked and nothing was overwritten.
func Run(cfg Config, out io.Writer) (Ledger, error) { return run(cfg, out, nil) }

// run is Run; sabotage, if set, runs on the copy goroutine before each
// write, after the audit: the test uses it to make the transport lie and
// checks that the ledger catches it.
func run(cfg Config, out io.Writer, sabotage func(inproc.Write, handoff.State)) (Ledger, error) {
	if err := cfg.Check(); err != nil {
		return Ledger{}, err
	}

	w := &world{cfg: cfg, sabotage: sabotage, byTransfer: map[*kvlease.Transfer]*request{}, lateWrites: map[*kvlease.Transfer]bool{}}
	var err error
	if w.prefill, err = rig.NewPool(envelope.PoolBlocks, envelope.BlockBytes); err != nil {
		return Ledger{}, err
	}
	if w.decode, err = rig.NewPool(rig.DecodeBlocks, envelope.BlockBytes); err != nil {
		return Ledger{}, err
	}
	var reqs []*request
	for _, r := range rig.Burst(cfg) {
		reqs = append(reqs, &request{Request: r})
	}
	w.tp, err = inproc.New(inproc.Config{
		Seed: cfg.Seed, BlockLatency: cfg.BlockLatency, Jitter: cfg.BlockLatency,
		FailRate: cfg.FailRate, LostAckRate: cfg.LostAckRate, IgnoreCancelRate: cfg.IgnoreCancelRate,
		BeforeWrite: func(wr inproc.Write) error {
			w.audit(wr)
			w.mu.Lock()
			req := w.byTransfer[wr.Transfer]
			w.mu.Unlock()
			if wr.Pair == req.AbortAt {
				// The client goes away while the copy is writing.
				_ = req.h.Abort("frontend", fmt.Errorf("%w while block %d of %d was being written", errClientGone, wr.Pair, req.h.Blocks()))
			}
			if w.sabotage != nil {
				w.sabotage(wr, req.h.State())
			}
			return nil
		},
		AfterWrite: w.audit,
	})
	if err != nil {
		return Ledger{}, err
	}

	// The burst. Admission, prefill and acceptance happen in request
	// order on this goroutine, before any transfer starts (and so before
	// any block goes back to a pool): which blocks each request gets is
	// deterministic. Then every accepted handoff starts.
	running := 0
	for _, r := range reqs {
		w.admit(r, &running)
	}
	for _, r := range reqs {
		if r.h != nil && r.h.State() == handoff.Accepted {
			_ = r.h.Start(tagged{w, r}) // a failed start is in the history
		}
	}

	// A supervisor waits for the transport to go idle, then gives up on
	// every transfer still unacknowledged: its copy stopped, but nobody
	// can prove it. (In production, handoff.Config.Deadline does this.)
	w.tp.Wait()
	for _, r := range reqs {
		if r.h == nil {
			continue
		}
		if tr := r.h.Transfer(); tr != nil && tr.State() == kvlease.TransferPending {
			r.lost = true
			_ = r.h.Expire("supervisor", errNoAck)
		}
	}
	// Some lost acknowledgements turn up late: the evidence that lifts
	// the quarantine.
	for _, r := range reqs {
		if r.lost && r.LateAck {
			r.late = w.tp.Acknowledge(r.h.Transfer())
		}
	}
	for _, r := range reqs {
		if r.h != nil && (!r.lost || r.late) {
			<-r.h.Done() // the rest stay quarantined
		}
	}

	// Decode: every delivered request checks its markers, then finishes.
	var l Ledger
	l.Requests = len(reqs)
	for _, r := range reqs {
		if r.h != nil && r.h.State() == handoff.Delivered {
			d := r.h.Destination()
			for i := range d.Len() {
				b, err := d.Region(i)
				if err != nil || !rig.MarkerOK(b, r.ID, i) {
					l.MarkerMismatches++
				}
			}
			d.Release()
		}
		if r.src != nil {
			r.src.Release() // the prefill side is done with it, whatever happened
		}
	}

	for _, r := range reqs {
		if r.refused != "" {
			l.Count(r.refused, 0, false, false)
		} else {
			l.Count("", r.h.State(), errors.Is(r.h.Err(), errBusy), r.late)
		}
		if !cfg.Quiet {
			printTimeline(out, r)
		}
	}
	l.Prefill, l.Decode = w.prefill.Stats(), w.decode.Stats()
	l.Quiescent("prefill", w.prefill.CheckQuiescent())
	l.Quiescent("decode", w.decode.CheckQuiescent())
	w.mu.Lock()
	l.LateWrites = len(w.lateWrites)
	w.mu.Unlock()
	rig.PrintLedger(out, cfg.Seed, l, rig.LedgerText{Quarantined: "acknowledgement never came", LateWrites: "transfers that touched reclaimed memory"})
	return l, nil
}

// admit takes one request from the front door to an accepted handoff, or
// to its rejection.
func (w *world) admit(r *request, running *int) {
	if err := envelope.CheckRequest(r.Prompt, r.MaxNew); err != nil {
		r.refused = "envelope: " + err.Error()
		return
	}
	src, err := w.prefill.Acquire(r.Name, envelope.BlocksFor(r.Prompt))
	if err != nil {
		r.refused = "prefill pool: " + err.Error()
		return
	}
	r.src = src
	r.srcIDs = src.AppendBlockIDs(nil, 0)
	for i := range src.Len() { // prefill: the request's KV is its marker
		b, _ := src.Region(i)
		rig.Stamp(b, r.ID, i)
	}
	r.h, err = handoff.Propose(src, w.decode, handoff.Config{
		Envelope: envelope, Source: "prefill", Destination: "decode", Deadline: 10 * time.Second,
	})
	if err != nil {
		r.refused = "propose: " + err.Error()
		return
	}
	if *running >= envelope.MaxRunningRequests {
		_ = r.h.Reject("decode", errBusy)
		return
	}
	if err := r.h.Accept(); err != nil {
		return // rejected: the decode pool is exhausted
	}
	*running++
	r.dstIDs = r.h.Destination().AppendBlockIDs(nil, 0)
	if r.EarlyAbort {
		_ = r.h.Abort("frontend", errClientGone)
		*running--
	}
}

// world is the shared state of one run.
type world struct {
	cfg             Config
	sabotage        func(inproc.Write, handoff.State) // tests: makes the transport lie
	prefill, decode *kvlease.Pool[[]byte]
	tp              *inproc.Transport

	mu         sync.Mutex
	byTransfer map[*kvlease.Transfer]*request
	lateWrites map[*kvlease.Transfer]bool
}

// tagged is the transport as one request sees it: it records which
// request a transfer belongs to in attach, before any byte moves, so the
// audit hooks can find it.
type tagged struct {
	w   *world
	req *request
}

func (t tagged) Start(pairs []kvlease.CopyPair[[]byte, []byte], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	return t.w.tp.Start(pairs, func(tr *kvlease.Transfer) error {
		t.w.mu.Lock()
		t.w.byTransfer[tr] = t.req
		t.w.mu.Unlock()
		return attach(tr)
	})
}

// audit checks, at the moment of a write, that both blocks of the pair
// are still at the generation the request's leases got: a draining block
// still is (its transfer is pending), a reclaimed one is not.
func (w *world) audit(wr inproc.Write) {
	w.mu.Lock()
	req := w.byTransfer[wr.Transfer]
	w.mu.Unlock()
	dst := req.h.Destination()
	s, serr := w.prefill.Region(req.src.Ref(wr.Pair))
	d, derr := w.decode.Region(dst.Ref(wr.Pair))
	if serr != nil || derr != nil || &s[0] != &wr.Src[0] || &d[0] != &wr.Dst[0] {
		w.mu.Lock()
		w.lateWrites[wr.Transfer] = true
		w.mu.Unlock()
	}
}

// printTimeline writes one request's timeline: which blocks it held on
// each side, and the evidence for every transition.
func printTimeline(out io.Writer, r *request) {
	t := rig.Timeline{Req: r.Request, Refused: r.refused, Prefill: r.srcIDs, Decode: r.dstIDs}
	if r.h != nil {
		t.Sides = []rig.Side{{Steps: rig.Steps(r.h.History())}}
	}
	t.Note = func(_ string, s rig.Step) string {
		if s.Event == handoff.EventAttach {
			return fmt.Sprintf(" transfer %d (reads p, writes d)", s.Transfer)
		}
		return ""
	}
	if r.late {
		t.Notes = append(t.Notes, "late acknowledgement: the quarantined blocks are back in their pools")
	} else if r.lost && r.h.State() == handoff.Quarantined {
		t.Notes = append(t.Notes, "no acknowledgement ever came: its blocks stay quarantined, never reused")
	}
	t.Print(out)
}

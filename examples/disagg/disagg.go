package main

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/audit"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/inproc"
	"github.com/kvlease/kvlease/internal/ledger"
)

// Config is one run of the example.
type Config struct {
	Requests int
	Seed     uint64
	// Transport faults, per transfer.
	FailRate, LostAckRate, IgnoreCancelRate float64
	// LateAckRate is the probability that a lost acknowledgement is
	// delivered late, lifting the quarantine.
	LateAckRate float64
	// AbortRate and EarlyAbortRate are the probabilities that a client
	// goes away mid-transfer, or after acceptance but before the transfer
	// starts.
	AbortRate, EarlyAbortRate float64
	// BlockLatency is the transport's time per block (plus up to as much
	// jitter).
	BlockLatency time.Duration
	// Deadline (-net only) is how long the prefill side lets a started
	// transfer go without proof before it quarantines it; the decode side
	// uses half of it. The in-process run uses the handoff's own 10 s.
	Deadline time.Duration
	Quiet    bool
	// Insecure (-net only) runs the two halves without authentication;
	// by default they authenticate with a pre-shared key the prefill
	// process draws and hands to its child through an inherited pipe.
	Insecure bool
	// Stream (-net -stream) runs the streaming demonstration instead of
	// the faulty burst: every request handed off streaming and after its
	// prefill, a prefill of streamLayers layers of LayerDelay each.
	Stream     bool
	LayerDelay time.Duration

	// sabotage, if set, runs on the copy goroutine before each write,
	// after the audit: the test uses it to make the transport lie and
	// checks that the ledger catches it.
	sabotage func(inproc.Write, handoff.State)
	// lie (-net only) makes the decode process's transport lie the same
	// way: it resolves an aborting transfer while still receiving.
	lie bool
}

// DefaultConfig is the README's run.
func DefaultConfig() Config {
	return Config{
		Requests: 24, Seed: 75, // a seed whose burst shows every outcome
		FailRate: 0.1, LostAckRate: 0.2, IgnoreCancelRate: 0.5, LateAckRate: 0.5,
		AbortRate: 0.2, EarlyAbortRate: 0.05,
		BlockLatency: 100 * time.Microsecond,
		Deadline:     2 * time.Second,
		LayerDelay:   2 * time.Millisecond,
	}
}

// The deployment's one envelope: 16-token blocks of 16 bytes per token,
// a 1024-token context (64 blocks), 256-token prefill chunks. The prefill
// and decode pools differ only in size.
var envelope = handoff.Envelope{
	BlockTokens: 16, BlockBytes: 256, PoolBlocks: 512,
	MaxContextTokens: 1024, MaxPrefillTokens: 256, MaxRunningRequests: 14,
}

const decodeBlocks = 384

// Ledger is what a run ends with (shared with the ucx module's example).
type Ledger = ledger.Ledger

// ChildExit is how the decode process of a -net run ended.
type ChildExit = ledger.ChildExit

// request is one synthetic request and what happened to it.
type request struct {
	id             int
	name           string
	prompt, maxNew int
	abortAt        int  // abort mid-transfer before writing this block; -1 for never
	earlyAbort     bool // abort after acceptance, before the transfer starts
	lateAck        bool // a lost acknowledgement arrives late
	// -net only (netFaults): the data connection stalls, or is cut,
	// before this block; -1 for never.
	stallAt, cutAt int

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

// marker fills block i of request id with the audit package's marker
// for (request id, block i): the same bytes in both processes, whatever
// slot holds them (generation 0 stands for "any": the prefill and decode
// pools number their slots independently).
func marker(b []byte, id, i int) {
	audit.Stamp(b, audit.Marker{Request: uint64(id), Block: uint32(i)})
}

func markerOK(b []byte, id, i int) bool {
	return audit.Check(b, audit.Marker{Request: uint64(id), Block: uint32(i)}) == nil
}

// world is the shared state of one run.
type world struct {
	cfg             Config
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

// Run runs the burst and writes the timeline (unless cfg.Quiet) and the
// ledger to out.
func Run(cfg Config, out io.Writer) (Ledger, error) {
	if err := checkConfig(cfg); err != nil {
		return Ledger{}, err
	}

	w := &world{cfg: cfg, byTransfer: map[*kvlease.Transfer]*request{}, lateWrites: map[*kvlease.Transfer]bool{}}
	var err error
	if w.prefill, err = newPool(envelope.PoolBlocks); err != nil {
		return Ledger{}, err
	}
	if w.decode, err = newPool(decodeBlocks); err != nil {
		return Ledger{}, err
	}
	reqs := generate(cfg)
	w.tp, err = inproc.New(inproc.Config{
		Seed: cfg.Seed, BlockLatency: cfg.BlockLatency, Jitter: cfg.BlockLatency,
		FailRate: cfg.FailRate, LostAckRate: cfg.LostAckRate, IgnoreCancelRate: cfg.IgnoreCancelRate,
		BeforeWrite: func(wr inproc.Write) error {
			w.audit(wr)
			w.mu.Lock()
			req := w.byTransfer[wr.Transfer]
			w.mu.Unlock()
			if wr.Pair == req.abortAt {
				// The client goes away while the copy is writing.
				_ = req.h.Abort("frontend", fmt.Errorf("%w while block %d of %d was being written", errClientGone, wr.Pair, req.h.Blocks()))
			}
			if cfg.sabotage != nil {
				cfg.sabotage(wr, req.h.State())
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
		if r.lost && r.lateAck {
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
				if err != nil || !markerOK(b, r.id, i) {
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
		count(&l, r)
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
	printLedger(out, cfg, l, "acknowledgement never came")
	return l, nil
}

// checkConfig refuses a bad run, and checks once, at startup, that every
// component runs with the same envelope (only the pool sizes differ).
func checkConfig(cfg Config) error {
	if cfg.Requests < 0 {
		return fmt.Errorf("requests %d must not be negative", cfg.Requests)
	}
	for _, r := range []float64{cfg.FailRate, cfg.LostAckRate, cfg.IgnoreCancelRate, cfg.LateAckRate, cfg.AbortRate, cfg.EarlyAbortRate} {
		if !(r >= 0 && r <= 1) {
			return fmt.Errorf("rate %v outside [0, 1]", r)
		}
	}
	return handoff.AgreeEnvelopes(
		handoff.NamedEnvelope{Name: "frontend", Envelope: envelope},
		handoff.NamedEnvelope{Name: "prefill", Envelope: envelope},
		handoff.NamedEnvelope{Name: "decode", Envelope: decodeEnvelope()},
	)
}

// decodeEnvelope is the decode side's envelope: the deployment's, with
// its own pool size.
func decodeEnvelope() handoff.Envelope {
	e := envelope
	e.PoolBlocks = decodeBlocks
	return e
}

func newPool(blocks int) (*kvlease.Pool[[]byte], error) {
	mem, err := kvlease.NewHostMemory(blocks, envelope.BlockBytes)
	if err != nil {
		return nil, err
	}
	return kvlease.NewPool[[]byte](mem)
}

// generate draws the burst. Every request draws the same number of
// values, so request k is the same for a seed whatever the rates.
func generate(cfg Config) []*request {
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x646973616767))
	reqs := make([]*request, cfg.Requests)
	for k := range reqs {
		r := &request{id: k + 1, name: fmt.Sprintf("r%02d", k+1), abortAt: -1, stallAt: -1, cutAt: -1}
		r.prompt = 16 + rng.IntN(960)
		r.maxNew = 16 + rng.IntN(240)
		abort, at, early, late := rng.Float64(), rng.Float64(), rng.Float64(), rng.Float64()
		if abort < cfg.AbortRate {
			r.abortAt = int(at * float64(envelope.BlocksFor(r.prompt)))
		}
		r.earlyAbort = early < cfg.EarlyAbortRate
		r.lateAck = late < cfg.LateAckRate
		reqs[k] = r
	}
	return reqs
}

// admit takes one request from the front door to an accepted handoff, or
// to its rejection.
func (w *world) admit(r *request, running *int) {
	if err := envelope.CheckRequest(r.prompt, r.maxNew); err != nil {
		r.refused = "envelope: " + err.Error()
		return
	}
	src, err := w.prefill.Acquire(r.name, envelope.BlocksFor(r.prompt))
	if err != nil {
		r.refused = "prefill pool: " + err.Error()
		return
	}
	r.src = src
	r.srcIDs = src.AppendBlockIDs(nil, 0)
	for i := range src.Len() { // prefill: the request's KV is its marker
		b, _ := src.Region(i)
		marker(b, r.id, i)
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
	if r.earlyAbort {
		_ = r.h.Abort("frontend", errClientGone)
		*running--
	}
}

func count(l *Ledger, r *request) {
	if r.refused != "" {
		tally(l, r.refused, 0, false, false)
		return
	}
	tally(l, "", r.h.State(), errors.Is(r.h.Err(), errBusy), r.late)
}

// tally counts one request: refused before any handoff, or ended in st
// (policy: a rejection by the decode side's policy, not its pool; lifted:
// an abort whose quarantine late evidence lifted).
func tally(l *Ledger, refused string, st handoff.State, policy, lifted bool) {
	switch {
	case refused != "" && strings.HasPrefix(refused, "envelope"):
		l.RejectedEnvelope++
	case refused != "":
		l.RejectedPrefill++
	default:
		switch st {
		case handoff.Delivered:
			l.Delivered++
		case handoff.Rejected:
			if policy {
				l.RejectedPolicy++
			} else {
				l.RejectedDecode++
			}
		case handoff.Failed:
			l.Failed++
		case handoff.Aborted:
			l.Aborted++
			if lifted {
				l.AbortedLifted++
			}
		case handoff.Quarantined:
			l.Quarantined++
		}
	}
}

// ranges renders a set of block ids compactly: "3-7,9,12-13".
var ranges = ledger.Ranges

func printTimeline(out io.Writer, r *request) {
	fmt.Fprintf(out, "%s %4d+%-3d tokens", r.name, r.prompt, r.maxNew)
	if r.refused != "" {
		fmt.Fprintf(out, "  rejected by %s\n", r.refused)
		return
	}
	fmt.Fprintf(out, "  prefill p[%s]", ranges(r.srcIDs))
	if r.dstIDs != nil {
		fmt.Fprintf(out, "  decode d[%s]", ranges(r.dstIDs))
	}
	fmt.Fprintln(out)
	for _, s := range r.h.History() {
		fmt.Fprintf(out, "      %-13v by %-10s %v", s.To, s.By, s.Event)
		if s.Event == handoff.EventAttach {
			fmt.Fprintf(out, " transfer %d (reads p, writes d)", s.Transfer)
		}
		if s.Err != nil {
			fmt.Fprintf(out, ": %v", s.Err)
		}
		fmt.Fprintln(out)
	}
	if r.late {
		fmt.Fprintln(out, "      (late acknowledgement: the quarantined blocks are back in their pools)")
	} else if r.lost && r.h.State() == handoff.Quarantined {
		fmt.Fprintln(out, "      (no acknowledgement ever came: its blocks stay quarantined, never reused)")
	}
}

// printLedger writes the ledger; quarantined says why the quarantined
// handoffs never got their evidence.
func printLedger(out io.Writer, cfg Config, l Ledger, quarantined string) {
	fmt.Fprintf(out, "\nledger: %d requests, seed %d\n", l.Requests, cfg.Seed)
	fmt.Fprintf(out, "  delivered          %4d\n", l.Delivered)
	fmt.Fprintf(out, "  rejected           %4d  (envelope %d, prefill pool %d, decode policy %d, decode pool %d)\n",
		l.Rejected(), l.RejectedEnvelope, l.RejectedPrefill, l.RejectedPolicy, l.RejectedDecode)
	fmt.Fprintf(out, "  failed             %4d\n", l.Failed)
	fmt.Fprintf(out, "  aborted            %4d  (%d after a quarantine lifted by late evidence)\n", l.Aborted, l.AbortedLifted)
	fmt.Fprintf(out, "  quarantined        %4d  (%s)\n", l.Quarantined, quarantined)
	for _, p := range []struct {
		name string
		s    kvlease.Stats
	}{{"prefill", l.Prefill}, {"decode", l.Decode}} {
		fmt.Fprintf(out, "  %-7s blocks free %4d of %d, quarantined %d, other %d\n",
			p.name, p.s.Free, p.s.Capacity, p.s.Quarantined, p.s.Capacity-p.s.Free-p.s.Quarantined)
	}
	if l.Child.Ran {
		fmt.Fprintf(out, "  authenticated %s  (%s)\n", l.Authenticated, authNote(l.Authenticated))
		fmt.Fprintf(out, "  sides disagree     %4d  (requests whose prefill and decode histories end differently)\n", l.Disagreements)
		fmt.Fprintf(out, "  protocol errors    %4d  (control messages either side refused)\n", l.ProtocolErrors)
		fmt.Fprintf(out, "  decode process     exit %d (a child of this process, reaped)\n", l.Child.Code)
	}
	if l.Unsettled != "" { // Pool.CheckQuiescent found leases still open or draining
		fmt.Fprintf(out, "  not at rest        %s\n", l.Unsettled)
	}
	fmt.Fprintf(out, "  marker mismatches  %4d\n", l.MarkerMismatches)
	fmt.Fprintf(out, "  late writes        %4d  (transfers that touched reclaimed memory)\n", l.LateWrites)
}

// authNote says what the authentication mode of a two-process run means.
func authNote(mode string) string {
	if mode == "none" {
		return "-insecure: anyone who reaches the ports could propose or push blocks"
	}
	return "both halves proved the key; every control frame and every block bound to the session"
}

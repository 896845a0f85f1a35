// Package overtcp is examples/disagg's two-process runs, -net and -net
// -stream: the in-process example's burst, with the decode side in
// another process and every handoff over TCP on 127.0.0.1. It runs on the
// rig the ucx module's example shares (internal/rig).
package overtcp

// The -net run: the same burst, but the decode side is another process (a
// child of this one) and each handoff crosses 127.0.0.1 as the halves of
// package handoff (a Source here, a Destination there) over one control
// connection, with blocks on handoff/tcp data connections.
//
// The faults are the network's own, injected on the data connections:
//
//   - rejections, by the envelope and prefill pool here and by the decode
//     side's policy and pool there (its answer travels as Reject);
//   - the client going away after acceptance, before the transfer starts
//     (told to this side, which aborts: the decode side follows its Abort);
//   - the client going away mid-transfer (told to the decode side, which
//     aborts while block k is being written: this side follows);
//   - the data connection cut as block k is about to go out (both sides
//     fail, each on its own evidence: its own goroutine stopped);
//   - the prefill sender stalling at block k past both deadlines (stuck in
//     this process, not in the kernel): each side quarantines what it
//     cannot prove. The decode side's receiver is blocked on a stalled
//     peer: its quarantine asks it to stop, which ends its own read, and
//     that return is its evidence: its quarantine lifts at once. The
//     prefill side cannot end its own stuck sender: its blocks stay
//     quarantined until the sender resumes, stops at the next block, and
//     that late evidence lifts them. A sender that never resumes leaves
//     its blocks quarantined on the prefill side alone.
//
// -fail sets the cut rate, -lost-ack the stall rate and -late-ack how many
// stalls resume; -ignore-cancel does not apply (the tcp planes honour a
// cancel at the next block boundary).

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
	"github.com/kvlease/kvlease/internal/rig"
)

// A data connection of package handoff/tcp starts with a hello ("KD",
// version, the 16-byte token of the Accept's plane bytes, block count,
// block bytes): the decode side's audit reads the token to know whose
// stream it is. The blocks themselves are recognised by their regions:
// the planes move them straight between the regions and the socket, so a
// write or read whose buffer starts at a block's region is that block.
const (
	tcpHello   = 2 + 1 + 1 + 16 + 4 + 4 + 32
	tcpTokenAt = 4
)

// envelope is the deployment's one envelope (the in-process run's).
var envelope = rig.Envelope

var (
	errClientGone = errors.New("client went away")
	errBusy       = errors.New("decode worker at its running-request limit")
	errCut        = errors.New("data connection cut (injected fault)")
	errNotStarted = errors.New("handoff ended before its transfer started")
	errStopped    = errors.New("run over: the stalled sender gives up")
)

// netReq is one request as the prefill process runs it.
type netReq struct {
	rig.Request
	refused string                 // why the request never reached a handoff
	src     *kvlease.Lease[[]byte] // its prefill lease
	srcIDs  []kvlease.BlockID
	refs    []kvlease.BlockRef // the source lease's blocks, at Propose
	out     *handoff.Outgoing[[]byte]
	arrived chan struct{} // closed when the accept reached our plane
	start   chan bool     // true: stream; false: the handoff ended first
	resume  chan struct{} // closed when a stalled sender may go on
	started bool          // its transfer was let start
	view    *rig.View     // the decode process's side, from its report
}

// prefillWorld is the prefill process of a -net run.
type prefillWorld struct {
	cfg     rig.Config
	prefill *kvlease.Pool[[]byte]
	pre     *rig.Prefill[[]byte] // the decode child, and the source on its control connection
	src     *handoff.Source[[]byte]
	stop    chan struct{} // closed at teardown: stalled senders give up

	mu      sync.Mutex
	byID    map[uint64]*netReq
	senders []*tcp.Sender
	late    map[int]bool // requests whose sender touched reclaimed memory
}

// prefillPlane is the source side's data plane: handoff/tcp, one Sender
// per handoff so that its connection knows its request, held back until
// the start phase (as the in-process run starts every transfer only after
// every request was admitted).
type prefillPlane struct{ w *prefillWorld }

func (p prefillPlane) Send(id handoff.PlaneID, regions [][]byte, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	w := p.w
	w.mu.Lock()
	r := w.byID[id.Handoff]
	w.mu.Unlock()
	if r == nil {
		return nil, fmt.Errorf("no request for handoff %d", id.Handoff)
	}
	close(r.arrived)
	select {
	case ok := <-r.start:
		if !ok {
			return nil, errNotStarted
		}
	case <-w.stop:
		return nil, errStopped
	}
	s := tcp.NewSender(tcp.Config{WrapConn: func(c net.Conn) net.Conn { return &sendConn{Conn: c, w: w, r: r, regions: regions} }})
	w.mu.Lock()
	w.senders = append(w.senders, s)
	w.mu.Unlock()
	return s.Send(id, regions, accept, attach)
}

func (prefillPlane) Finish(handoff.PlaneID, error) {}

// sendConn is one data connection as the prefill side writes it. Before
// a block's bytes go out it injects the request's cut or stall, and it
// audits every block it sends, before and after: the source block must
// still be the lease's (leased or draining), never reclaimed.
type sendConn struct {
	net.Conn
	w       *prefillWorld
	r       *netReq
	regions [][]byte // the stream's blocks, in order
	next    int      // the next of them to go out
}

func (c *sendConn) Write(p []byte) (int, error) {
	i := -1
	if c.next < len(c.regions) && len(p) > 0 && &p[0] == &c.regions[c.next][0] {
		i, c.next = c.next, c.next+1
		switch c.r.out.From() + i {
		case c.r.FailAt:
			_ = c.Conn.Close()
			return 0, errCut
		case c.r.StallAt:
			select {
			case <-c.r.resume:
			case <-c.w.stop:
				return 0, errStopped
			}
		}
		c.w.audit(c.r, i, p)
	}
	n, err := c.Conn.Write(p)
	if i >= 0 && n == len(p) {
		c.w.audit(c.r, i, p)
	}
	return n, err
}

// audit checks that the region the sender reads for block i of r's
// stream is still r's source block at the generation it proposed.
func (w *prefillWorld) audit(r *netReq, i int, p []byte) {
	ref := r.refs[r.out.From()+i]
	s, err := w.prefill.Region(ref)
	if err != nil || &s[0] != &p[0] {
		w.mu.Lock()
		w.late[r.ID] = true
		w.mu.Unlock()
	}
}

// RunNet runs the burst with the decode side in a child process (this
// program re-executed: rig.StartChild) and writes the timeline (unless
// cfg.Quiet) and the ledger to out. The child is killed if RunNet returns
// before it exited; it exits by itself when the control connection or
// its stdin closes.
func RunNet(cfg rig.Config, out io.Writer) (rig.Ledger, error) {
	return runNet(cfg, out, os.Stderr)
}

func runNet(cfg rig.Config, out, childErr io.Writer) (l rig.Ledger, err error) {
	if err := cfg.Check(); err != nil {
		return rig.Ledger{}, err
	}
	w := &prefillWorld{cfg: cfg, stop: make(chan struct{}), byID: map[uint64]*netReq{}, late: map[int]bool{}}
	if w.prefill, err = rig.NewPool(envelope.PoolBlocks, envelope.BlockBytes); err != nil {
		return rig.Ledger{}, err
	}
	if w.pre, err = rig.StartPrefill[[]byte](cfg, envelope, prefillPlane{w}, childErr); err != nil {
		return rig.Ledger{}, err
	}
	w.src = w.pre.Src
	defer w.teardown()

	burst := rig.NetBurst(cfg)
	nrs := make([]*netReq, len(burst))
	w.mu.Lock()
	for k, r := range burst {
		nrs[k] = &netReq{Request: r, arrived: make(chan struct{}), start: make(chan bool, 1), resume: make(chan struct{})}
		w.byID[uint64(r.ID)] = nrs[k]
	}
	w.mu.Unlock()

	// Admission, in request order: each proposal is answered before the
	// next is made, so what the decode side decides is the same every run.
	answer := 10*time.Second + cfg.Deadline
	for _, r := range nrs {
		if err := w.admit(r, answer); err != nil {
			return rig.Ledger{}, err
		}
	}
	// Start every accepted transfer.
	for _, r := range nrs {
		if r.out != nil && r.out.State() == handoff.Accepted {
			r.started = true
			r.start <- true
		}
	}
	// Wait for the evidence. A stalled transfer has none: it waits until
	// its deadline quarantined it; then some stalled senders resume, and
	// their late evidence lifts the quarantine.
	settle := 30*time.Second + 4*cfg.Deadline
	for _, r := range nrs {
		if r.stalls() {
			if st := waitState(r.out, handoff.Quarantined, settle); st != handoff.Quarantined {
				return rig.Ledger{}, fmt.Errorf("%s: stalled transfer is %v, want quarantined", r.Name, st)
			}
		}
	}
	for _, r := range nrs {
		if r.stalls() && r.LateAck {
			close(r.resume)
		}
	}
	for _, r := range nrs {
		if r.out != nil && !(r.stalls() && !r.LateAck) {
			if st := r.out.Wait(settle); !st.Final() {
				return rig.Ledger{}, fmt.Errorf("%s: no evidence within %v: %v: %v", r.Name, settle, st, r.out.History())
			}
		}
	}
	for _, r := range nrs {
		if r.src != nil {
			r.src.Release() // the prefill side is done with it, whatever happened
		}
	}
	l.Prefill = w.prefill.Stats()
	l.Quiescent("prefill", w.prefill.CheckQuiescent())

	// The end of the control connection ends the decode process: it
	// checks and releases what it holds, reports, and exits.
	_ = w.src.Close()
	rep, err := w.pre.Child.Finish(settle)
	if err != nil {
		l.Child = w.pre.Child.Exit()
		return l, err
	}
	views := map[uint64]*rig.View{}
	for i := range rep.Handoffs {
		views[rep.Handoffs[i].ID] = &rep.Handoffs[i]
	}

	l.Requests = len(nrs)
	for _, r := range nrs {
		if r.out != nil {
			r.view = views[uint64(r.ID)]
			if r.view == nil || (r.view.State != r.out.State() && !stuckHere(r)) {
				l.Disagreements++
			}
			st := r.out.State()
			l.Count("", st, errors.Is(r.out.Err(), handoff.ErrRejected), st == handoff.Aborted && rig.Quarantined(rig.Steps(r.out.History())))
		} else {
			l.Count(r.refused, 0, false, false)
		}
		if !cfg.Quiet {
			printNetTimeline(out, r)
		}
	}
	w.mu.Lock()
	l.LateWrites = len(w.late)
	w.mu.Unlock()
	w.pre.Settle(&l, rep, out)
	rig.PrintLedger(out, cfg.Seed, l, netLedger("the stalled sender never resumed"))
	return l, nil
}

// netLedger is what the ledger of a run over TCP says.
func netLedger(quarantined string) rig.LedgerText {
	return rig.LedgerText{Quarantined: quarantined, LateWrites: "transfers that touched reclaimed memory",
		Insecure: "-insecure: anyone who reaches the ports could propose or push blocks"}
}

// stuckHere reports whether r's sender stalled for good in this process:
// this side's transfer stays quarantined, while the decode side ended its
// own reader and lifted its quarantine (Aborted): the two sides differ,
// each on its own evidence.
func stuckHere(r *netReq) bool {
	return r.stalls() && !r.LateAck && r.out.State() == handoff.Quarantined && r.view.State == handoff.Aborted
}

// stalls reports whether r's transfer was started and stalls.
func (r *netReq) stalls() bool { return r.StallAt >= 0 && r.started }

// admit takes one request to its decode side's answer (or refuses it
// here), and aborts it before its start if its client goes away then.
func (w *prefillWorld) admit(r *netReq, answer time.Duration) error {
	if err := envelope.CheckRequest(r.Prompt, r.MaxNew); err != nil {
		r.refused = "envelope: " + err.Error()
		return nil
	}
	src, err := w.prefill.Acquire(r.Name, envelope.BlocksFor(r.Prompt))
	if err != nil {
		r.refused = "prefill pool: " + err.Error()
		return nil
	}
	r.src = src
	r.srcIDs = src.AppendBlockIDs(nil, 0)
	for i := range src.Len() { // prefill: the request's KV is its marker
		b, _ := src.Region(i)
		rig.Stamp(b, r.ID, i)
		r.refs = append(r.refs, src.Ref(i))
	}
	r.out, err = w.src.Propose(uint64(r.ID), r.Name, src, nil)
	if err != nil {
		r.refused = "propose: " + err.Error()
		return nil
	}
	select {
	case <-r.out.Done(): // rejected: the history says by whom
		return nil
	case <-r.arrived:
	case <-time.After(answer):
		return fmt.Errorf("%s: no answer from the decode process within %v", r.Name, answer)
	}
	if r.EarlyAbort {
		_ = r.out.Abort("frontend", errClientGone)
		r.start <- false
	}
	return nil
}

// waitState polls o until it is in want or final, at most d.
func waitState(o *handoff.Outgoing[[]byte], want handoff.State, d time.Duration) handoff.State {
	end := time.Now().Add(d)
	for {
		st := o.State()
		if st == want || st.Final() || time.Now().After(end) {
			return st
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// teardown ends the run: stalled senders give up (their late evidence
// comes now, after the ledger), the data connections close.
func (w *prefillWorld) teardown() {
	close(w.stop)
	w.pre.Close()
	w.mu.Lock()
	senders := slices.Clone(w.senders)
	w.mu.Unlock()
	for _, s := range senders {
		_ = s.Close()
	}
}

// printNetTimeline writes one request's timeline: its blocks on each
// side, then each side's history with the evidence of every step.
func printNetTimeline(out io.Writer, r *netReq) {
	t := rig.Timeline{Req: r.Request, Refused: r.refused, Prefill: r.srcIDs, Note: proof}
	if r.out != nil {
		t.Sides = append(t.Sides, rig.Side{Name: "prefill", Steps: rig.Steps(r.out.History())})
	}
	if v := r.view; v != nil {
		t.Decode = v.Blocks
		t.Sides = append(t.Sides, rig.Side{Name: "decode", Steps: v.Steps})
		if v.Checked > 0 {
			t.Notes = append(t.Notes, fmt.Sprintf("decode checked %d block markers: after delivery and before release; %d mismatched", v.Checked, v.Mismatches))
		}
	}
	switch {
	case r.stalls() && r.LateAck:
		t.Notes = append(t.Notes, fmt.Sprintf("the sender stalled as block %d was about to go out, past both deadlines, then resumed: each side's own goroutine stopped, that late evidence returned its blocks", r.StallAt))
	case r.stalls():
		t.Notes = append(t.Notes, fmt.Sprintf("the sender stalled as block %d was about to go out and never resumed: no evidence ever came here, its blocks stay quarantined, never reused; the decode side ended its own reader at its deadline, and that return lifted its quarantine", r.StallAt))
	case r.FailAt >= 0 && r.started:
		t.Notes = append(t.Notes, fmt.Sprintf("the data connection was cut as block %d was about to go out: each side failed on its own goroutine's exit", r.FailAt))
	}
	t.Print(out)
}

// proof says what proved step s of side's history ("prefill" or
// "decode").
func proof(side string, s rig.Step) string {
	note := ""
	if s.Event == handoff.EventAttach {
		if side == "prefill" {
			note = fmt.Sprintf(" transfer %d (tcp sender reads p)", s.Transfer)
		} else {
			note = fmt.Sprintf(" transfer %d (tcp receiver writes d)", s.Transfer)
		}
	}
	peer := map[string]string{"prefill": "decode", "decode": "prefill"}[side]
	switch {
	case s.By == "transport" && (s.Event == handoff.EventResolve || s.Event == handoff.EventResolveError):
		if side == "prefill" {
			return note + " [proof: our sender goroutine's last read of p returned]"
		}
		return note + " [proof: our receiver goroutine writing d exited]"
	case s.Event == handoff.EventQuiescent:
		return note + " [noted: our sender goroutine's last read of p returned; the decode side's word is still due]"
	case s.Event == handoff.EventPeerOutcome:
		return note + " [noted: the decode side's word; our own evidence decides with it]"
	case s.By == "deadline" && s.Event == handoff.EventExpire:
		return note + " [no proof by the deadline: quarantined, never reused]"
	case s.By == "deadline":
		return note + " [our reads had stopped; the decode side's word never came]"
	case s.By == peer && s.Event == handoff.EventAbort && s.To == handoff.Aborting:
		return note + " [told over the control connection; our own evidence still decides]"
	case s.By == peer && s.Event == handoff.EventAbort:
		return note + " [told over the control connection; nothing had moved]"
	case s.By == peer && s.Event == handoff.EventResolveError:
		return note + " [our reads had stopped; the outcome is the decode side's report]"
	}
	return note
}

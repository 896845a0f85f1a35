package main

// The prefill process: it admits and prefills the burst, proposes each
// request to the decode process over the control connection, serves the
// UCX sender, aborts a request when the decode side says its client went
// away, and prints the timelines and the ledger from both sides' words.
// The process harness (the child, its key, its report, the ledger) is
// the root module's internal/rig, shared with examples/disagg -net.

import (
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/internal/rig"
	"github.com/kvlease/kvlease/ucx"
)

// Config is one run (its flags: rig.Config.Flags). Its faults are real
// ones here, injected at the decode side: FailRate corrupts a transfer's
// Start bytes in transit (the decode plane refuses them before touching
// any block); LostAckRate stalls the decode reader in the middle of a
// transfer past both deadlines (the prefill side revokes its
// registration, its evidence; the decode side's blocks are quarantined);
// LateAckRate resumes a stalled reader later (it finds the registration
// revoked, revokes its own side, and that late evidence lifts the
// quarantine). IgnoreCancelRate changes nothing: the UCX plane stops
// posting receives and withdraws the ones no message matched.
type Config = rig.Config

// DefaultConfig is the README's run; both halves' deadline is a second.
func DefaultConfig() Config {
	cfg := rig.DefaultConfig()
	cfg.Deadline = time.Second
	return cfg
}

// Ledger is what a run ends with: the root example's.
type Ledger = rig.Ledger

// The deployment's one envelope (the root example's).
var envelope = rig.Envelope

var (
	errClientGone = errors.New("client went away")
	errBusy       = errors.New("decode worker at its running-request limit")
	errNotStarted = errors.New("handoff ended before its transfer started")
)

// frontDoor is the prefill side's plane: the UCX sender, but the
// transfer of a request whose client goes away early is held at its
// start until the front end aborted it (as examples/disagg -net does), so
// it never starts. (An abort sent before the decode side's answer could
// cross it on the wire, and the answer would be refused.)
type frontDoor struct {
	*ucx.Sender[[]byte]
	early map[uint64]*earlyAbort // set before the first proposal
}

// earlyAbort is one such request: its accept arrived, the front end
// aborted it.
type earlyAbort struct{ arrived, aborted chan struct{} }

func (f frontDoor) Send(id handoff.PlaneID, regions [][]byte, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	if e := f.early[id.Handoff]; e != nil {
		close(e.arrived)
		<-e.aborted
		return nil, errNotStarted
	}
	return f.Sender.Send(id, regions, accept, attach)
}

// request is one request seen from the prefill process.
type request struct {
	rig.Request
	refused string
	src     *kvlease.Lease[[]byte]
	srcIDs  []kvlease.BlockID
	o       *handoff.Outgoing[[]byte]
	dst     *rig.View // the decode side's account
}

// ucxEnv defaults UCX to TCP on loopback: the example injects peer
// failures, which UCX's shared-memory transports do not handle.
func ucxEnv() {
	if os.Getenv("UCX_TLS") == "" {
		os.Setenv("UCX_TLS", "tcp")
		if os.Getenv("UCX_NET_DEVICES") == "" {
			os.Setenv("UCX_NET_DEVICES", "lo")
		}
	}
	if os.Getenv("UCX_LOG_LEVEL") == "" {
		os.Setenv("UCX_LOG_LEVEL", "fatal") // the injected failures are expected
	}
}

// Run runs the burst as the prefill process, with the decode process as
// its child, and writes the timeline (unless cfg.Quiet) and the ledger to
// out.
func Run(cfg Config, out io.Writer) (l Ledger, err error) {
	if err := cfg.Check(); err != nil {
		return Ledger{}, err
	}
	ucxEnv()
	prefill, err := rig.NewPool(envelope.PoolBlocks, envelope.BlockBytes)
	if err != nil {
		return Ledger{}, err
	}
	sender, err := ucx.NewSender(ucx.Config{}, ucx.HostBytes)
	if err != nil {
		return Ledger{}, err
	}
	defer sender.Close()
	var mu sync.Mutex // r.o, as the abort handler reads it
	plane := frontDoor{Sender: sender, early: map[uint64]*earlyAbort{}}
	pre, err := rig.StartPrefill[[]byte](cfg, envelope, plane, os.Stderr)
	if err != nil {
		return Ledger{}, err
	}
	defer pre.Close()
	src, child := pre.Src, pre.Child

	var reqs []*request
	byID := map[int]*request{}
	for _, p := range rig.NetBurst(cfg) {
		r := &request{Request: p}
		reqs = append(reqs, r)
		byID[r.ID] = r
		if r.EarlyAbort {
			plane.early[uint64(r.ID)] = &earlyAbort{arrived: make(chan struct{}), aborted: make(chan struct{})}
		}
	}
	// The decode process asks the front end to abort a request when its
	// reader reaches the block the seed chose; it waits for the word.
	outgoing := func(id int) *handoff.Outgoing[[]byte] {
		for range 10000 {
			mu.Lock()
			o := byID[id].o
			mu.Unlock()
			if o != nil {
				return o
			}
			time.Sleep(time.Millisecond)
		}
		return nil
	}
	go func() {
		for line := range child.Lines() {
			verb, arg, _ := strings.Cut(line, " ")
			id, _ := strconv.Atoi(arg)
			if r := byID[id]; verb == "abort" && r != nil {
				go func() {
					if o := outgoing(id); o != nil {
						_ = o.Abort("frontend", fmt.Errorf("%w while block %d was being read", errClientGone, r.AbortAt))
						o.Wait(30 * time.Second)
					}
					child.Tell("go %d", id)
				}()
			}
		}
	}()

	// The burst, in request order: admission, prefill (the marker), the
	// proposal. The decode process answers them in the same order.
	for _, r := range reqs {
		if err := envelope.CheckRequest(r.Prompt, r.MaxNew); err != nil {
			r.refused = "envelope: " + err.Error()
			continue
		}
		if r.src, err = prefill.Acquire(r.Name, envelope.BlocksFor(r.Prompt)); err != nil {
			r.refused = "prefill pool: " + err.Error()
			continue
		}
		r.srcIDs = r.src.AppendBlockIDs(nil, 0)
		for i := range r.src.Len() {
			b, _ := r.src.Region(i)
			rig.Stamp(b, r.ID, i)
		}
		o, err := src.Propose(uint64(r.ID), r.Name, r.src, nil)
		if err != nil {
			r.refused = "propose: " + err.Error()
			continue
		}
		mu.Lock()
		r.o = o
		mu.Unlock()
		if e := plane.early[uint64(r.ID)]; e != nil {
			select {
			case <-o.Done(): // rejected
			case <-e.arrived:
				_ = o.Abort("frontend", errClientGone)
				close(e.aborted)
			case <-time.After(10*time.Second + cfg.Deadline):
				return Ledger{}, fmt.Errorf("%s: no answer from the decode process", r.Name)
			}
		}
	}
	// Every prefill handoff becomes final: the decode side's done, or
	// the revocation that the deadline or the decode side's word brings.
	// A stalled reader that resumes late is told so once its prefill side
	// gave up.
	for _, r := range reqs {
		if r.o == nil {
			continue
		}
		r.o.Wait(cfg.Deadline + 30*time.Second)
		if r.StallAt >= 0 && r.LateAck {
			child.Tell("resume %d", r.ID)
		}
	}
	child.Tell("report")
	rep, err := child.Report(2*cfg.Deadline + 60*time.Second)
	_ = src.Close()
	_ = sender.Close() // before the decode process goes
	if werr := child.Wait(); err == nil {
		err = werr
	}
	if err != nil {
		l.Child = child.Exit()
		return l, err
	}
	for i := range rep.Handoffs {
		if r := byID[int(rep.Handoffs[i].ID)]; r != nil {
			r.dst = &rep.Handoffs[i]
		}
	}

	l.Requests = len(reqs)
	for _, r := range reqs {
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
	l.Prefill = prefill.Stats()
	l.Quiescent("prefill", prefill.CheckQuiescent())
	pre.Settle(&l, rep, out)
	rig.PrintLedger(out, cfg.Seed, l, rig.LedgerText{
		Over:        fmt.Sprintf(", over UCX (%s)", os.Getenv("UCX_TLS")),
		Quarantined: "evidence never came",
		LateWrites:  "receives posted into handoffs already resolved",
		Insecure:    "-insecure: crc32c block sums; anyone who reaches the ports could propose, or send blocks",
	})
	return l, nil
}

// count counts one request from both sides' words: a handoff is
// quarantined while either side still waits for its evidence, delivered
// when both delivered, aborted when either aborted, failed otherwise.
func count(l *Ledger, r *request) {
	if r.refused != "" {
		l.Count(r.refused, 0, false, false)
		return
	}
	src := r.o.State()
	var dst rig.View
	if r.dst != nil {
		dst = *r.dst
	}
	if dst.Final && src.Final() && dst.State != src && src != handoff.Rejected && !deliveredAnyway(r) {
		l.Disagreements++
	}
	switch {
	case src == handoff.Rejected:
		l.Count("", handoff.Rejected, !errors.Is(r.o.Err(), kvlease.ErrExhausted), false)
	case !dst.Final || !src.Final():
		l.Count("", handoff.Quarantined, false, false)
	case src == handoff.Delivered && dst.State == handoff.Delivered:
		l.Count("", handoff.Delivered, false, false)
	case src == handoff.Aborted || dst.State == handoff.Aborted:
		l.Count("", handoff.Aborted, false, rig.Quarantined(rig.Steps(r.o.History())) || rig.Quarantined(dst.Steps))
	default:
		l.Count("", handoff.Failed, false, false)
	}
}

// deliveredAnyway reports whether r's decode side received every block
// it wanted although the prefill side aborted: the prefill side had sent
// them all (messages the decode side's receives match later, a stalled
// reader once it resumes, an aborting one before it stops) when its abort
// or its deadline ended its transfer (its own evidence: Aborted); the
// decode side got them (its own: Delivered, every marker checked). Each
// side is right on its evidence; the decode side's Done crosses the
// prefill side's abort on the wire, and is refused there ("done while
// aborted"), as any Done that crosses an abort is.
func deliveredAnyway(r *request) bool {
	return r.o != nil && r.o.State() == handoff.Aborted && r.dst != nil && r.dst.Final && r.dst.State == handoff.Delivered
}

// printTimeline writes one request's timeline: its blocks on each side,
// then each side's history.
func printTimeline(out io.Writer, r *request) {
	t := rig.Timeline{Req: r.Request, Refused: r.refused, Prefill: r.srcIDs, Note: func(side string, s rig.Step) string {
		switch {
		case s.Event != handoff.EventAttach:
			return ""
		case side == "prefill":
			return fmt.Sprintf(" transfer %d (registers p, the decode side reads it)", s.Transfer)
		}
		return fmt.Sprintf(" transfer %d (gets into d)", s.Transfer)
	}}
	if r.o != nil {
		t.Sides = append(t.Sides, rig.Side{Name: "prefill", Steps: rig.Steps(r.o.History())})
	}
	if v := r.dst; v != nil {
		t.Decode = v.Blocks
		t.Sides = append(t.Sides, rig.Side{Name: "decode", Steps: v.Steps})
		switch {
		case !v.Final:
			t.Notes = append(t.Notes, "the stalled reader never resumed: its decode blocks stay quarantined, never reused")
		case r.StallAt >= 0 && r.LateAck && slices.ContainsFunc(v.Steps, func(s rig.Step) bool { return s.To == handoff.Transferring }):
			t.Notes = append(t.Notes, "the stalled reader resumed late: its evidence put the quarantined blocks back")
		}
	}
	t.Print(out)
}

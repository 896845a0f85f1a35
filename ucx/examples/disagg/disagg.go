package main

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/internal/ledger"
	"github.com/kvlease/kvlease/ucx"
	"github.com/kvlease/kvlease/internal/keypipe"
)

// Config is one run of the example. The flags are the root example's;
// their faults are real ones here, injected at the decode side.
type Config struct {
	Requests int
	Seed     uint64
	// FailRate is the probability a transfer fails: its Start bytes
	// arrive corrupted, and the decode plane refuses them before
	// touching any block.
	FailRate float64
	// LostAckRate is the probability the decode side's reader stalls in
	// the middle of a transfer, past both sides' deadlines: no evidence
	// comes from it. The prefill side revokes its registration (its
	// evidence); the decode side's blocks are quarantined.
	LostAckRate float64
	// LateAckRate is the probability a stalled reader resumes later: it
	// finds the registration revoked, revokes its own side, and that late
	// evidence lifts the quarantine.
	LateAckRate float64
	// IgnoreCancelRate is accepted for the root example's command lines:
	// the UCX plane cannot ignore a cancel (it stops posting receives and
	// withdraws the ones no message matched), so it changes nothing here.
	IgnoreCancelRate float64
	// AbortRate and EarlyAbortRate are the probabilities that a client
	// goes away while its blocks are being read, or right after its
	// proposal.
	AbortRate, EarlyAbortRate float64
	// Deadline is both halves' deadline.
	Deadline time.Duration
	Quiet    bool
	// Insecure runs the control session unauthenticated (and the blocks
	// with crc32c sums). By default the prefill process draws a
	// pre-shared key and hands it to the decode process through an
	// inherited pipe (never the command line or the environment); the
	// session is authenticated with it and every block carries a MAC
	// under the session.
	Insecure bool
}

// DefaultConfig is the README's run.
func DefaultConfig() Config {
	return Config{
		Requests: 24, Seed: 75,
		FailRate: 0.1, LostAckRate: 0.2, IgnoreCancelRate: 0.5, LateAckRate: 0.5,
		AbortRate: 0.2, EarlyAbortRate: 0.05,
		Deadline: time.Second,
	}
}

// Flags registers the command-line flags on fs.
func (cfg *Config) Flags(fs *flag.FlagSet) {
	fs.IntVar(&cfg.Requests, "requests", cfg.Requests, "requests in the burst")
	fs.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed for the requests and the faults")
	fs.Float64Var(&cfg.FailRate, "fail", cfg.FailRate, "probability a transfer fails (its Start bytes arrive corrupted)")
	fs.Float64Var(&cfg.LostAckRate, "lost-ack", cfg.LostAckRate, "probability the decode reader stalls mid-transfer past the deadlines (no evidence from it)")
	fs.Float64Var(&cfg.LateAckRate, "late-ack", cfg.LateAckRate, "probability a stalled reader resumes later (late evidence lifting the quarantine)")
	fs.Float64Var(&cfg.IgnoreCancelRate, "ignore-cancel", cfg.IgnoreCancelRate, "accepted for compatibility: the UCX plane cannot ignore a cancel")
	fs.Float64Var(&cfg.AbortRate, "abort", cfg.AbortRate, "probability the client goes away while its blocks are read")
	fs.Float64Var(&cfg.EarlyAbortRate, "early-abort", cfg.EarlyAbortRate, "probability the client goes away right after its proposal")
	fs.DurationVar(&cfg.Deadline, "deadline", cfg.Deadline, "both halves' deadline for evidence")
	fs.BoolVar(&cfg.Quiet, "quiet", cfg.Quiet, "print only the ledger")
	fs.BoolVar(&cfg.Insecure, "insecure", cfg.Insecure, "run the control session unauthenticated (blocks with crc32c, not MACs)")
	fs.Bool("net", true, "accepted for the root example's command lines: this example always runs two processes")
}

func (cfg Config) validate() error {
	if cfg.Requests < 0 {
		return fmt.Errorf("requests %d must not be negative", cfg.Requests)
	}
	for _, r := range []float64{cfg.FailRate, cfg.LostAckRate, cfg.LateAckRate, cfg.IgnoreCancelRate, cfg.AbortRate, cfg.EarlyAbortRate} {
		if !(r >= 0 && r <= 1) {
			return fmt.Errorf("rate %v outside [0, 1]", r)
		}
	}
	if cfg.Deadline <= 0 {
		return fmt.Errorf("deadline %v must be positive", cfg.Deadline)
	}
	return nil
}

// The deployment's one envelope (the root example's): 16-token blocks of
// 16 bytes per token, a 1024-token context (64 blocks), 256-token prefill
// chunks. The prefill and decode pools differ only in size.
var envelope = handoff.Envelope{
	BlockTokens: 16, BlockBytes: 256, PoolBlocks: 512,
	MaxContextTokens: 1024, MaxPrefillTokens: 256, MaxRunningRequests: 14,
}

const decodeBlocks = 384

// plan is what the seed decides about one request; both processes draw
// it from the same seed.
type plan struct {
	id             int
	name           string
	prompt, maxNew int
	abortAt        int // the client goes away before the get of this block; -1 never
	earlyAbort     bool
	fail           bool // its Start bytes arrive corrupted
	stallAt        int  // the reader stalls before the get of this block; -1 never
	late           bool // ...and resumes after the prefill side gave up
}

// generate draws the burst. Every request draws the same number of
// values, so request k is the same for a seed whatever the rates.
func generate(cfg Config) []plan {
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x646973616767))
	out := make([]plan, cfg.Requests)
	for k := range out {
		p := plan{id: k + 1, name: fmt.Sprintf("r%02d", k+1), abortAt: -1, stallAt: -1}
		p.prompt = 16 + rng.IntN(960)
		p.maxNew = 16 + rng.IntN(240)
		abort, at, early, fail, stall, stallAt, late := rng.Float64(), rng.Float64(), rng.Float64(), rng.Float64(), rng.Float64(), rng.Float64(), rng.Float64()
		blocks := envelope.BlocksFor(p.prompt)
		switch {
		case fail < cfg.FailRate:
			p.fail = true
		case stall < cfg.LostAckRate:
			p.stallAt = int(stallAt * float64(blocks))
			p.late = late < cfg.LateAckRate
		case abort < cfg.AbortRate:
			p.abortAt = int(at * float64(blocks))
		}
		p.earlyAbort = early < cfg.EarlyAbortRate
		out[k] = p
	}
	return out
}

// marker fills block i of request id: the request's id and the block's
// index, then the id's low byte repeated.
func marker(b []byte, id, i int) {
	binary.LittleEndian.PutUint32(b[0:], uint32(id))
	binary.LittleEndian.PutUint32(b[4:], uint32(i))
	for j := 8; j < len(b); j++ {
		b[j] = byte(id)
	}
}

func markerOK(b []byte, id, i int) bool {
	if binary.LittleEndian.Uint32(b[0:]) != uint32(id) || binary.LittleEndian.Uint32(b[4:]) != uint32(i) {
		return false
	}
	for _, c := range b[8:] {
		if c != byte(id) {
			return false
		}
	}
	return true
}

// Ledger is what a run ends with: the root example's ledger (its
// two-process fields stay zero here but for the counts it shares).
type Ledger = ledger.Ledger

// step is one History step as the decode process reports it.
type step struct {
	To, By, Event, Err string
	Transfer           uint64
}

func steps(h []handoff.Step) []step {
	out := make([]step, 0, len(h))
	for _, s := range h {
		e := ""
		if s.Err != nil {
			e = s.Err.Error()
		}
		out = append(out, step{To: s.To.String(), By: s.By, Event: s.Event.String(), Err: e, Transfer: s.Transfer})
	}
	return out
}

// report is the decode process's account of one request.
type report struct {
	ID       int
	State    string // "" when the handoff never became final (no evidence)
	History  []step
	Blocks   []kvlease.BlockID
	Mismatch int
}

// summary is the decode process's last word.
type summary struct {
	Pool       kvlease.Stats
	LateWrites int
}

// request is one request seen from the prefill process.
type request struct {
	plan
	refused string
	src     *kvlease.Lease[[]byte]
	srcIDs  []kvlease.BlockID
	o       *handoff.Outgoing[[]byte]
	dst     *report
}

// child is the decode process, seen from the prefill process.
type child struct {
	cmd   *exec.Cmd
	in    io.WriteCloser
	mu    sync.Mutex
	lines chan string
	done  chan struct{}
}

func (c *child) tell(format string, args ...any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, _ = fmt.Fprintf(c.in, format+"\n", args...)
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

const roleEnv, configEnv, ctrlEnv = "KVLEASE_UCX_DISAGG_ROLE", "KVLEASE_UCX_DISAGG_CONFIG", "KVLEASE_UCX_DISAGG_CTRL"

// pskID names the example's pre-shared key.
const pskID = "ucx-disagg"

// auth is a half config's authentication with key (nil: insecure).
func auth(hc handoff.HalfConfig, key []byte) handoff.HalfConfig {
	if key == nil {
		hc.Insecure = true
	} else {
		hc.Auth = &handoff.PSK{ID: pskID, Key: key}
	}
	return hc
}

// startChild re-executes this program as the decode process, which dials
// back the control listener ln. key, unless nil, goes down a pipe the
// child inherits (keypipe): never its command line or environment.
func startChild(cfg Config, ln net.Listener, key []byte) (*child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	js, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), roleEnv+"=decode", configEnv+"="+string(js), ctrlEnv+"="+ln.Addr().String())
	cmd.Stderr = os.Stderr
	sendKey := func() error { return nil }
	if key != nil {
		if sendKey, err = keypipe.Attach(cmd, key); err != nil {
			return nil, err
		}
	}
	c := &child{cmd: cmd, lines: make(chan string, 256), done: make(chan struct{})}
	if c.in, err = cmd.StdinPipe(); err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	err = cmd.Start()
	if kerr := sendKey(); err == nil && kerr != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		err = kerr
	}
	if err != nil {
		return nil, err
	}
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
		close(c.lines)
		_ = cmd.Wait()
		close(c.done)
	}()
	return c, nil
}

// Run runs the burst as the prefill process, with the decode process as
// its child, and writes the timeline (unless cfg.Quiet) and the ledger to
// out.
func Run(cfg Config, out io.Writer) (Ledger, error) {
	if err := cfg.validate(); err != nil {
		return Ledger{}, err
	}
	decodeEnv := envelope
	decodeEnv.PoolBlocks = decodeBlocks
	if err := handoff.AgreeEnvelopes(
		handoff.NamedEnvelope{Name: "frontend", Envelope: envelope},
		handoff.NamedEnvelope{Name: "prefill", Envelope: envelope},
		handoff.NamedEnvelope{Name: "decode", Envelope: decodeEnv},
	); err != nil {
		return Ledger{}, err
	}
	ucxEnv()
	mem, err := kvlease.NewHostMemory(envelope.PoolBlocks, envelope.BlockBytes)
	if err != nil {
		return Ledger{}, err
	}
	prefill, err := kvlease.NewPool[[]byte](mem)
	if err != nil {
		return Ledger{}, err
	}
	sender, err := ucx.NewSender(ucx.Config{})
	if err != nil {
		return Ledger{}, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return Ledger{}, err
	}
	var key []byte
	if !cfg.Insecure {
		if key, err = handoff.GenerateKey(); err != nil {
			_ = ln.Close()
			return Ledger{}, err
		}
	}
	c, err := startChild(cfg, ln, key)
	if err != nil {
		_ = ln.Close()
		return Ledger{}, err
	}
	defer func() {
		_ = c.in.Close()
		select {
		case <-c.done:
		case <-time.After(10 * time.Second):
			_ = c.cmd.Process.Kill()
			<-c.done
		}
	}()
	_ = ln.(*net.TCPListener).SetDeadline(time.Now().Add(20 * time.Second))
	conn, err := ln.Accept()
	_ = ln.Close()
	if err != nil {
		return Ledger{}, fmt.Errorf("the decode process never connected: %w", err)
	}
	src, err := handoff.NewSource(conn, sender, auth(handoff.HalfConfig{Envelope: envelope, Name: "prefill", Peer: "decode", Deadline: cfg.Deadline}, key))
	if err != nil {
		return Ledger{}, err
	}

	plans := generate(cfg)
	reqs := make([]*request, len(plans))
	byID := map[int]*request{}
	for i, p := range plans {
		reqs[i] = &request{plan: p}
		byID[p.id] = reqs[i]
	}
	// The decode process asks the front end to abort a request when its
	// reader reaches the block the seed chose; it waits for the word.
	var omu sync.Mutex // r.o, as the abort handler reads it
	outgoing := func(id int) *handoff.Outgoing[[]byte] {
		for range 10000 {
			omu.Lock()
			o := byID[id].o
			omu.Unlock()
			if o != nil {
				return o
			}
			time.Sleep(time.Millisecond)
		}
		return nil
	}
	reports := make(chan string, len(reqs)+2)
	go func() {
		for line := range c.lines {
			verb, arg, _ := strings.Cut(line, " ")
			switch verb {
			case "abort":
				id, _ := strconv.Atoi(arg)
				if r := byID[id]; r != nil {
					go func() {
						if o := outgoing(id); o != nil {
							_ = o.Abort("frontend", fmt.Errorf("%w while block %d was being read", errClientGone, r.abortAt))
							o.Wait(30 * time.Second)
						}
						c.tell("go %d", id)
					}()
				}
			case "report", "summary":
				reports <- line
			}
		}
		close(reports)
	}()

	// The burst, in request order: admission, prefill (the marker), the
	// proposal. The decode process answers them in the same order.
	for _, r := range reqs {
		if err := envelope.CheckRequest(r.prompt, r.maxNew); err != nil {
			r.refused = "envelope: " + err.Error()
			continue
		}
		if r.src, err = prefill.Acquire(r.name, envelope.BlocksFor(r.prompt)); err != nil {
			r.refused = "prefill pool: " + err.Error()
			continue
		}
		r.srcIDs = r.src.AppendBlockIDs(nil, 0)
		for i := range r.src.Len() {
			b, _ := r.src.Region(i)
			marker(b, r.id, i)
		}
		o, err := src.Propose(uint64(r.id), r.name, r.src, nil)
		if err != nil {
			r.refused = "propose: " + err.Error()
			continue
		}
		omu.Lock()
		r.o = o
		omu.Unlock()
		if r.earlyAbort {
			_ = r.o.Abort("frontend", errClientGone)
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
		if r.stallAt >= 0 && r.late {
			c.tell("resume %d", r.id)
		}
	}
	c.tell("report")
	var sum summary
	for line := range reports {
		verb, arg, _ := strings.Cut(line, " ")
		if verb == "summary" {
			if err := json.Unmarshal([]byte(arg), &sum); err != nil {
				return Ledger{}, fmt.Errorf("decode summary: %w", err)
			}
			break
		}
		var rep report
		if err := json.Unmarshal([]byte(arg), &rep); err != nil {
			return Ledger{}, fmt.Errorf("decode report: %w", err)
		}
		if r := byID[rep.ID]; r != nil {
			r.dst = &rep
		}
	}
	_ = src.Close()

	var l Ledger
	l.Requests = len(reqs)
	l.Authenticated = src.Peer().Mode.String()
	for _, r := range reqs {
		if r.src != nil {
			r.src.Release() // the prefill side is done with it, whatever happened
		}
	}
	_ = sender.Close()
	for _, r := range reqs {
		count(&l, r)
		if !cfg.Quiet {
			printTimeline(out, r)
		}
	}
	l.Prefill, l.Decode = prefill.Stats(), sum.Pool
	l.LateWrites = sum.LateWrites
	printLedger(out, cfg, l)
	return l, nil
}

var (
	errClientGone = errors.New("client went away")
	errBusy       = errors.New("decode worker at its running-request limit")
)

func lifted(h []step) bool {
	return slices.ContainsFunc(h, func(s step) bool { return s.To == handoff.Quarantined.String() })
}

func count(l *Ledger, r *request) {
	switch {
	case r.refused != "" && strings.HasPrefix(r.refused, "envelope"):
		l.RejectedEnvelope++
		return
	case r.refused != "":
		l.RejectedPrefill++
		return
	}
	if r.dst != nil {
		l.MarkerMismatches += r.dst.Mismatch
	}
	src := r.o.State()
	dst := ""
	var dh []step
	if r.dst != nil {
		dst, dh = r.dst.State, r.dst.History
	}
	switch {
	case src == handoff.Rejected:
		if errors.Is(r.o.Err(), kvlease.ErrExhausted) {
			l.RejectedDecode++
		} else {
			l.RejectedPolicy++
		}
	case dst == "" || !src.Final():
		l.Quarantined++
	case src == handoff.Delivered && dst == handoff.Delivered.String():
		l.Delivered++
	case src == handoff.Aborted || dst == handoff.Aborted.String():
		l.Aborted++
		if lifted(steps(r.o.History())) || lifted(dh) {
			l.AbortedLifted++
		}
	default:
		l.Failed++
	}
}

// ranges renders a set of block ids compactly: "3-7,9,12-13".
var ranges = ledger.Ranges

func printSteps(out io.Writer, side string, h []step) {
	for _, s := range h {
		fmt.Fprintf(out, "      %-7s %-13s by %-10s %s", side, s.To, s.By, s.Event)
		if s.Event == handoff.EventAttach.String() {
			if side == "prefill" {
				fmt.Fprintf(out, " transfer %d (registers p, the decode side reads it)", s.Transfer)
			} else {
				fmt.Fprintf(out, " transfer %d (gets into d)", s.Transfer)
			}
		}
		if s.Err != "" {
			fmt.Fprintf(out, ": %s", s.Err)
		}
		fmt.Fprintln(out)
	}
}

func printTimeline(out io.Writer, r *request) {
	fmt.Fprintf(out, "%s %4d+%-3d tokens", r.name, r.prompt, r.maxNew)
	if r.refused != "" {
		fmt.Fprintf(out, "  rejected by %s\n", r.refused)
		return
	}
	fmt.Fprintf(out, "  prefill p[%s]", ranges(r.srcIDs))
	if r.dst != nil && len(r.dst.Blocks) > 0 {
		fmt.Fprintf(out, "  decode d[%s]", ranges(r.dst.Blocks))
	}
	fmt.Fprintln(out)
	printSteps(out, "prefill", steps(r.o.History()))
	if r.dst != nil {
		printSteps(out, "decode", r.dst.History)
		switch {
		case r.dst.State == "":
			fmt.Fprintln(out, "      (the stalled reader never resumed: its decode blocks stay quarantined, never reused)")
		case r.stallAt >= 0 && r.late && slices.ContainsFunc(r.dst.History, func(s step) bool { return s.To == handoff.Transferring.String() }):
			fmt.Fprintln(out, "      (the stalled reader resumed late: its evidence put the quarantined blocks back)")
		}
	}
}

func printLedger(out io.Writer, cfg Config, l Ledger) {
	fmt.Fprintf(out, "\nledger: %d requests, seed %d, over UCX (%s)\n", l.Requests, cfg.Seed, os.Getenv("UCX_TLS"))
	fmt.Fprintf(out, "  delivered          %4d\n", l.Delivered)
	fmt.Fprintf(out, "  rejected           %4d  (envelope %d, prefill pool %d, decode policy %d, decode pool %d)\n",
		l.Rejected(), l.RejectedEnvelope, l.RejectedPrefill, l.RejectedPolicy, l.RejectedDecode)
	fmt.Fprintf(out, "  failed             %4d\n", l.Failed)
	fmt.Fprintf(out, "  aborted            %4d  (%d after a quarantine lifted by late evidence)\n", l.Aborted, l.AbortedLifted)
	fmt.Fprintf(out, "  quarantined        %4d  (evidence never came)\n", l.Quarantined)
	for _, p := range []struct {
		name string
		s    kvlease.Stats
	}{{"prefill", l.Prefill}, {"decode", l.Decode}} {
		fmt.Fprintf(out, "  %-7s blocks free %4d of %d, quarantined %d, other %d\n",
			p.name, p.s.Free, p.s.Capacity, p.s.Quarantined, p.s.Capacity-p.s.Free-p.s.Quarantined)
	}
	fmt.Fprintf(out, "  authenticated %s  (%s)\n", l.Authenticated, authNote(l.Authenticated))
	fmt.Fprintf(out, "  marker mismatches  %4d\n", l.MarkerMismatches)
	fmt.Fprintf(out, "  late writes        %4d  (receives posted into handoffs already resolved)\n", l.LateWrites)
}

// authNote says what the authentication mode of the run means.
func authNote(mode string) string {
	if mode == "none" {
		return "-insecure: crc32c block sums; anyone who reaches the ports could propose, or send blocks"
	}
	return "both halves proved the key; every control frame and every block bound to the session"
}

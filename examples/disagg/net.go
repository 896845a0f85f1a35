package main

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
	"bytes"
	crand "crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"slices"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
)

// decodeEnv names the environment variable that makes this program (or
// the test binary) the decode process: it holds the decodeSpec as JSON.
const decodeEnv = "KVLEASE_DISAGG_DECODE"

// decodeSpec is what the prefill process tells the decode process it
// starts: where to dial, the token to prove it is the child, and the run.
//
// The spec travels in the environment: it holds no secret. The
// pre-shared key of the control session (unless Cfg.Insecure) travels
// through a pipe the child inherits as file descriptor keyFD, read once:
// never a command line, never the environment.
type decodeSpec struct {
	Ctl   string
	Token []byte
	Cfg   Config
	Lie   bool
}

// keyFD is the child's descriptor of the key pipe (the first of
// exec.Cmd.ExtraFiles), and pskID the key's id.
const (
	keyFD = 3
	pskID = "disagg"
)

// auth is the half config's authentication for key (nil: insecure).
func auth(key []byte) (handoff.Authenticator, bool) {
	if key == nil {
		return nil, true
	}
	return &handoff.PSK{ID: pskID, Key: key}, false
}

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

var (
	errCut        = errors.New("data connection cut (injected fault)")
	errNotStarted = errors.New("handoff ended before its transfer started")
	errStopped    = errors.New("run over: the stalled sender gives up")
)

// netFaults draws the data-connection faults of the -net run, from a
// stream of their own so the burst itself (generate) is the in-process
// one. A request gets at most one: an early abort, else a stall, else a
// cut, else its mid-transfer abort (if generate drew one).
func netFaults(cfg Config, reqs []*request) {
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x6e6574666c74))
	for _, r := range reqs {
		fail, lost, at := rng.Float64(), rng.Float64(), rng.Float64()
		k := int(at * float64(envelope.BlocksFor(r.prompt)))
		switch {
		case r.earlyAbort:
			r.abortAt = -1 // the transfer never starts
		case lost < cfg.LostAckRate:
			r.stallAt, r.abortAt = k, -1
		case fail < cfg.FailRate:
			r.cutAt, r.abortAt = k, -1
		}
	}
}

// netReq is one request as the prefill process runs it.
type netReq struct {
	*request
	refs    []kvlease.BlockRef // the source lease's blocks, at Propose
	out     *handoff.Outgoing[[]byte]
	arrived chan struct{} // closed when the accept reached our plane
	start   chan bool     // true: stream; false: the handoff ended first
	resume  chan struct{} // closed when a stalled sender may go on
	started bool          // its transfer was let start
	view    *decodeView   // the decode process's side, from its report
}

// prefillWorld is the prefill process of a -net run.
type prefillWorld struct {
	cfg     Config
	prefill *kvlease.Pool[[]byte]
	src     *handoff.Source[[]byte]
	stop    chan struct{} // closed at teardown: stalled senders give up

	mu       sync.Mutex
	byID     map[uint64]*netReq
	senders  []*tcp.Sender
	late     map[int]bool // requests whose sender touched reclaimed memory
	protoErr []string
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
		case c.r.cutAt:
			_ = c.Conn.Close()
			return 0, errCut
		case c.r.stallAt:
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
		w.late[r.id] = true
		w.mu.Unlock()
	}
}

// RunNet runs the burst with the decode side in a child process (this
// program re-executed with decodeEnv set) and writes the timeline (unless
// cfg.Quiet) and the ledger to out. The child is killed if RunNet returns
// before it exited; it exits by itself when the control connection or
// its stdin closes.
func RunNet(cfg Config, out io.Writer) (Ledger, error) {
	return runNet(cfg, out, os.Stderr)
}

func runNet(cfg Config, out, childErr io.Writer) (l Ledger, err error) {
	if err := checkConfig(cfg); err != nil {
		return Ledger{}, err
	}
	if cfg.Deadline <= 0 {
		return Ledger{}, fmt.Errorf("deadline %v must be positive", cfg.Deadline)
	}
	w := &prefillWorld{cfg: cfg, stop: make(chan struct{}), byID: map[uint64]*netReq{}, late: map[int]bool{}}
	if w.prefill, err = newPool(envelope.PoolBlocks); err != nil {
		return Ledger{}, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return Ledger{}, err
	}
	defer ln.Close()
	spec := decodeSpec{Ctl: ln.Addr().String(), Token: make([]byte, 16), Cfg: cfg, Lie: cfg.lie}
	_, _ = crand.Read(spec.Token)
	var key []byte
	if !cfg.Insecure {
		if key, err = handoff.GenerateKey(); err != nil {
			return Ledger{}, err
		}
	}
	child, err := startDecode(spec, key, childErr)
	if err != nil {
		return Ledger{}, err
	}
	defer child.kill() // a no-op once it exited by itself
	conn, err := acceptChild(ln.(*net.TCPListener), spec.Token)
	if err != nil {
		return Ledger{}, err
	}
	a, insecure := auth(key)
	w.src, err = handoff.NewSource(conn, prefillPlane{w}, handoff.HalfConfig{
		Envelope: envelope, Name: "prefill", Peer: "decode", Deadline: cfg.Deadline,
		Auth: a, Insecure: insecure,
		OnError: func(err error) {
			w.mu.Lock()
			w.protoErr = append(w.protoErr, err.Error())
			w.mu.Unlock()
		},
	})
	if err != nil {
		_ = conn.Close()
		return Ledger{}, err
	}
	defer w.teardown()

	reqs := generate(cfg)
	netFaults(cfg, reqs)
	nrs := make([]*netReq, len(reqs))
	w.mu.Lock()
	for k, r := range reqs {
		nrs[k] = &netReq{request: r, arrived: make(chan struct{}), start: make(chan bool, 1), resume: make(chan struct{})}
		w.byID[uint64(r.id)] = nrs[k]
	}
	w.mu.Unlock()

	// Admission, in request order: each proposal is answered before the
	// next is made, so what the decode side decides is the same every run.
	answer := 10*time.Second + cfg.Deadline
	for _, r := range nrs {
		if err := w.admit(r, answer); err != nil {
			return Ledger{}, err
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
				return Ledger{}, fmt.Errorf("%s: stalled transfer is %v, want quarantined", r.name, st)
			}
		}
	}
	for _, r := range nrs {
		if r.stalls() && r.lateAck {
			close(r.resume)
		}
	}
	for _, r := range nrs {
		if r.out != nil && !(r.stalls() && !r.lateAck) {
			if st := r.out.Wait(settle); !st.Final() {
				return Ledger{}, fmt.Errorf("%s: no evidence within %v: %v: %v", r.name, settle, st, r.out.History())
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
	rep, err := child.finish(settle)
	l.Child = child.exit
	l.Authenticated = w.src.Peer().Mode.String()
	if err != nil {
		return l, err
	}
	views := map[uint64]*decodeView{}
	for i := range rep.Handoffs {
		views[rep.Handoffs[i].ID] = &rep.Handoffs[i]
	}

	l.Requests = len(nrs)
	for _, r := range nrs {
		if r.out != nil {
			r.view = views[uint64(r.id)]
			if r.view == nil || (r.view.State != r.out.State() && !stuckHere(r)) {
				l.Disagreements++
			}
			st := r.out.State()
			tally(&l, "", st, errors.Is(r.out.Err(), handoff.ErrRejected), st == handoff.Aborted && wasQuarantined(r.out.History()))
		} else {
			tally(&l, r.refused, 0, false, false)
		}
		if !cfg.Quiet {
			printNetTimeline(out, r)
		}
	}
	l.Decode = rep.Decode
	l.MarkerMismatches = rep.MarkerMismatches
	w.mu.Lock()
	l.LateWrites = len(w.late) + rep.LateWrites
	l.ProtocolErrors = len(w.protoErr) + len(rep.Errors)
	errs := append(slices.Clone(w.protoErr), rep.Errors...)
	w.mu.Unlock()
	for _, e := range errs {
		fmt.Fprintln(out, "protocol error:", e)
	}
	printLedger(out, cfg, l, "the stalled sender never resumed")
	return l, nil
}

// stuckHere reports whether r's sender stalled for good in this process:
// this side's transfer stays quarantined, while the decode side ended its
// own reader and lifted its quarantine (Aborted): the two sides differ,
// each on its own evidence.
func stuckHere(r *netReq) bool {
	return r.stalls() && !r.lateAck && r.out.State() == handoff.Quarantined && r.view.State == handoff.Aborted
}

// stalls reports whether r's transfer was started and stalls.
func (r *netReq) stalls() bool { return r.stallAt >= 0 && r.started }

// admit takes one request to its decode side's answer (or refuses it
// here), and aborts it before its start if its client goes away then.
func (w *prefillWorld) admit(r *netReq, answer time.Duration) error {
	if err := envelope.CheckRequest(r.prompt, r.maxNew); err != nil {
		r.refused = "envelope: " + err.Error()
		return nil
	}
	src, err := w.prefill.Acquire(r.name, envelope.BlocksFor(r.prompt))
	if err != nil {
		r.refused = "prefill pool: " + err.Error()
		return nil
	}
	r.src = src
	r.srcIDs = src.AppendBlockIDs(nil, 0)
	for i := range src.Len() { // prefill: the request's KV is its marker
		b, _ := src.Region(i)
		marker(b, r.id, i)
		r.refs = append(r.refs, src.Ref(i))
	}
	r.out, err = w.src.Propose(uint64(r.id), r.name, src, nil)
	if err != nil {
		r.refused = "propose: " + err.Error()
		return nil
	}
	select {
	case <-r.out.Done(): // rejected: the history says by whom
		return nil
	case <-r.arrived:
	case <-time.After(answer):
		return fmt.Errorf("%s: no answer from the decode process within %v", r.name, answer)
	}
	if r.earlyAbort {
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

func wasQuarantined(h []handoff.Step) bool {
	for _, s := range h {
		if s.To == handoff.Quarantined {
			return true
		}
	}
	return false
}

// teardown ends the run: stalled senders give up (their late evidence
// comes now, after the ledger), the data connections close.
func (w *prefillWorld) teardown() {
	close(w.stop)
	_ = w.src.Close()
	w.mu.Lock()
	senders := slices.Clone(w.senders)
	w.mu.Unlock()
	for _, s := range senders {
		_ = s.Close()
	}
}

// acceptChild takes the decode process's control connection: the first
// one that proves, with the token, to be our child.
func acceptChild(ln *net.TCPListener, token []byte) (net.Conn, error) {
	end := time.Now().Add(30 * time.Second)
	_ = ln.SetDeadline(end)
	for {
		c, err := ln.Accept()
		if err != nil {
			return nil, fmt.Errorf("decode process did not connect: %w", err)
		}
		got := make([]byte, len(token))
		_ = c.SetReadDeadline(end)
		_, err = io.ReadFull(c, got)
		_ = c.SetReadDeadline(time.Time{})
		if err == nil && bytes.Equal(got, token) {
			return c, nil
		}
		_ = c.Close() // not our child
	}
}

// decodeProc is the decode child process.
type decodeProc struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser // held open for the child's life: closing it (or our death) ends the child
	stdout io.ReadCloser
	done   bool
	exit   ChildExit
}

// startDecode starts this program again as the decode process. Its stdin
// is a pipe from us: it exits when that closes, so it dies with us even
// if we are killed. key, unless nil, goes down a second pipe the child
// inherits as descriptor keyFD.
func startDecode(spec decodeSpec, key []byte, stderr io.Writer) (*decodeProc, error) {
	exe, err := os.Executable()
	if err != nil {
		exe = os.Args[0]
	}
	b, err := json.Marshal(spec)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), decodeEnv+"="+string(b))
	cmd.Stderr = stderr
	stdin, err := cmd.StdinPipe() // closed by Wait, or by our death
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	var keyW *os.File
	if key != nil {
		keyR, w, err := os.Pipe()
		if err != nil {
			return nil, err
		}
		keyW = w
		cmd.ExtraFiles = []*os.File{keyR}
		defer keyR.Close() // the child holds its own copy
	}
	if err := cmd.Start(); err != nil {
		if keyW != nil {
			_ = keyW.Close()
		}
		return nil, fmt.Errorf("start decode process: %w", err)
	}
	if keyW != nil {
		// 32 bytes fit the pipe's buffer: the write does not wait for the
		// child to read.
		_, err := keyW.Write(key)
		_ = keyW.Close()
		if err != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			return nil, fmt.Errorf("hand the key to the decode process: %w", err)
		}
	}
	return &decodeProc{cmd: cmd, stdin: stdin, stdout: stdout, exit: ChildExit{Ran: true}}, nil
}

// finish reads the decode process's report (it writes it once its control
// connection ended) and reaps it, killing it if it takes longer than d.
func (p *decodeProc) finish(d time.Duration) (decodeReport, error) {
	type result struct {
		rep decodeReport
		err error
	}
	ch := make(chan result, 1)
	go func() {
		var rep decodeReport
		err := json.NewDecoder(p.stdout).Decode(&rep)
		_, _ = io.Copy(io.Discard, p.stdout)
		ch <- result{rep, err}
	}()
	var res result
	select {
	case res = <-ch:
	case <-time.After(d):
		_ = p.cmd.Process.Kill()
		res = <-ch
		res.err = fmt.Errorf("decode process did not report within %v (killed)", d)
	}
	werr := p.reap()
	switch {
	case res.err != nil:
		return res.rep, fmt.Errorf("decode process report: %w (exit: %v)", res.err, werr)
	case werr != nil:
		return res.rep, fmt.Errorf("decode process: %w", werr)
	}
	return res.rep, nil
}

// reap waits for the decode process (its stdout read to the end) and
// records how it ended.
func (p *decodeProc) reap() error {
	err := p.cmd.Wait()
	p.done = true
	p.exit.Exited = p.cmd.ProcessState.Exited()
	p.exit.Code = p.cmd.ProcessState.ExitCode()
	return err
}

// kill kills and reaps the decode process unless it was reaped already.
func (p *decodeProc) kill() {
	if p.done {
		return
	}
	_ = p.cmd.Process.Kill()
	_, _ = io.Copy(io.Discard, p.stdout)
	_ = p.reap()
}

// printNetTimeline writes one request's timeline: its blocks on each
// side, then each side's history with the evidence of every step.
func printNetTimeline(out io.Writer, r *netReq) {
	fmt.Fprintf(out, "%s %4d+%-3d tokens", r.name, r.prompt, r.maxNew)
	if r.refused != "" {
		fmt.Fprintf(out, "  rejected by %s\n", r.refused)
		return
	}
	fmt.Fprintf(out, "  prefill p[%s]", ranges(r.srcIDs))
	if r.view != nil && r.view.Blocks != nil {
		fmt.Fprintf(out, "  decode d[%s]", ranges(r.view.Blocks))
	}
	fmt.Fprintln(out)
	fmt.Fprintln(out, "    prefill process")
	for _, s := range wireSteps(r.out.History()) {
		printStep(out, "prefill", s)
	}
	if v := r.view; v != nil {
		fmt.Fprintln(out, "    decode process")
		for _, s := range v.Steps {
			printStep(out, "decode", s)
		}
		if v.Checked > 0 {
			fmt.Fprintf(out, "      (decode checked %d block markers: after delivery and before release; %d mismatched)\n", v.Checked, v.Mismatches)
		}
	}
	switch {
	case r.stalls() && r.lateAck:
		fmt.Fprintf(out, "      (the sender stalled as block %d was about to go out, past both deadlines, then resumed: each side's own goroutine stopped, that late evidence returned its blocks)\n", r.stallAt)
	case r.stalls():
		fmt.Fprintf(out, "      (the sender stalled as block %d was about to go out and never resumed: no evidence ever came here, its blocks stay quarantined, never reused; the decode side ended its own reader at its deadline, and that return lifted its quarantine)\n", r.stallAt)
	case r.cutAt >= 0 && r.started:
		fmt.Fprintf(out, "      (the data connection was cut as block %d was about to go out: each side failed on its own goroutine's exit)\n", r.cutAt)
	}
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// printStep writes one step of side's history ("prefill" or "decode"),
// with what proved it.
func printStep(out io.Writer, side string, s wireStep) {
	fmt.Fprintf(out, "      %-13v by %-10s %v", s.To, s.By, s.Event)
	if s.Event == handoff.EventAttach {
		if side == "prefill" {
			fmt.Fprintf(out, " transfer %d (tcp sender reads p)", s.Transfer)
		} else {
			fmt.Fprintf(out, " transfer %d (tcp receiver writes d)", s.Transfer)
		}
	}
	peer := map[string]string{"prefill": "decode", "decode": "prefill"}[side]
	switch {
	case s.By == "transport" && (s.Event == handoff.EventResolve || s.Event == handoff.EventResolveError):
		if side == "prefill" {
			fmt.Fprint(out, " [proof: our sender goroutine's last read of p returned]")
		} else {
			fmt.Fprint(out, " [proof: our receiver goroutine writing d exited]")
		}
	case s.Event == handoff.EventQuiescent:
		fmt.Fprint(out, " [noted: our sender goroutine's last read of p returned; the decode side's word is still due]")
	case s.Event == handoff.EventPeerOutcome:
		fmt.Fprint(out, " [noted: the decode side's word; our own evidence decides with it]")
	case s.By == "deadline" && s.Event == handoff.EventExpire:
		fmt.Fprint(out, " [no proof by the deadline: quarantined, never reused]")
	case s.By == "deadline":
		fmt.Fprint(out, " [our reads had stopped; the decode side's word never came]")
	case s.By == peer && s.Event == handoff.EventAbort && s.To == handoff.Aborting:
		fmt.Fprint(out, " [told over the control connection; our own evidence still decides]")
	case s.By == peer && s.Event == handoff.EventAbort:
		fmt.Fprint(out, " [told over the control connection; nothing had moved]")
	case s.By == peer && s.Event == handoff.EventResolveError:
		fmt.Fprint(out, " [our reads had stopped; the outcome is the decode side's report]")
	}
	if s.Err != "" {
		fmt.Fprintf(out, ": %s", s.Err)
	}
	fmt.Fprintln(out)
}

package rig

// The decode child process of a two-process run: this program started
// again, with a spec in its environment (where to dial, the token that
// proves it is the child, the run) and the pre-shared key down a pipe it
// inherits (keypipe: never its command line or environment). Its stdin
// is a pipe from the parent: lines the parent tells it, and its end when
// the parent dies, which ends the child. Its stdout is lines it tells
// the parent, the last one its report.

import (
	"bufio"
	"bytes"
	crand "crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/internal/keypipe"

	"go.uber.org/atomic"
)

// specEnv names the environment variable that makes this program (or a
// test binary) the decode child: it holds the spec as JSON (no secret).
const specEnv = "KVLEASE_RIG_CHILD"

// spec is what the parent tells the child it starts.
type spec struct {
	Ctl   string // the parent's control listener
	Token []byte // the child's proof, its first bytes on the control connection
	Cfg   Config
}

// reportVerb starts the child's last line: its Report as JSON.
const reportVerb = "report "

// pskID is the id of the run's pre-shared key.
const pskID = "disagg"

// Auth is hc authenticated with key, or Insecure when key is nil.
func Auth(hc handoff.HalfConfig, key []byte) handoff.HalfConfig {
	if key == nil {
		hc.Insecure = true
	} else {
		hc.Auth = &handoff.PSK{ID: pskID, Key: key}
	}
	return hc
}

// Child is the decode process, seen from the parent.
type Child struct {
	// Key is the pre-shared key handed to the child (nil: Insecure).
	Key []byte

	cmd    *exec.Cmd
	ln     *net.TCPListener
	token  []byte
	stdin  io.WriteCloser // held open for the child's life: closing it (or our death) ends the child
	mu     sync.Mutex     // stdin's writers
	lines  chan string    // stdout, but for the report
	report chan string    // the report line, once
	done   bool           // reaped
	exit   ChildExit
}

// StartChild starts this program again as the decode process of run
// cfg, its stderr going to stderr, and listens for its control
// connection (Control). Unless cfg.Insecure it draws the key and hands
// it down. The program's main (or TestMain) must call ChildMain first
// thing when IsChild. Kill the child (deferred) if it may not end by
// itself.
func StartChild(cfg Config, stderr io.Writer) (*Child, error) {
	if cfg.Deadline <= 0 {
		return nil, fmt.Errorf("deadline %v must be positive", cfg.Deadline)
	}
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	c := &Child{ln: ln.(*net.TCPListener), token: make([]byte, 16), lines: make(chan string, 256), report: make(chan string, 1), exit: ChildExit{Ran: true}}
	_, _ = crand.Read(c.token)
	fail := func(err error) (*Child, error) {
		_ = ln.Close()
		return nil, err
	}
	b, err := json.Marshal(spec{Ctl: ln.Addr().String(), Token: c.token, Cfg: cfg})
	if err != nil {
		return fail(err)
	}
	c.cmd = exec.Command(exe)
	c.cmd.Env = append(os.Environ(), specEnv+"="+string(b))
	c.cmd.Stderr = stderr
	sendKey := func() error { return nil }
	if !cfg.Insecure {
		if c.Key, err = handoff.GenerateKey(); err != nil {
			return fail(err)
		}
		if sendKey, err = keypipe.Attach(c.cmd, c.Key); err != nil {
			return fail(err)
		}
	}
	if c.stdin, err = c.cmd.StdinPipe(); err != nil { // closed by Wait, or by our death
		return fail(err)
	}
	stdout, err := c.cmd.StdoutPipe()
	if err != nil {
		return fail(err)
	}
	err = c.cmd.Start()
	if kerr := sendKey(); err == nil && kerr != nil {
		_ = c.cmd.Process.Kill()
		_ = c.cmd.Wait()
		err = fmt.Errorf("hand the key to the decode process: %w", kerr)
	}
	if err != nil {
		return fail(fmt.Errorf("start decode process: %w", err))
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(nil, 64<<20)
		for sc.Scan() {
			if line := sc.Text(); strings.HasPrefix(line, reportVerb) {
				c.report <- strings.TrimPrefix(line, reportVerb)
			} else {
				c.lines <- line
			}
		}
		_, _ = io.Copy(io.Discard, stdout)
		close(c.lines)
		close(c.report)
	}()
	return c, nil
}

// Control takes the child's control connection: the first one that
// proves, with the token, to be our child. The listener closes.
func (c *Child) Control() (net.Conn, error) {
	defer c.ln.Close()
	end := time.Now().Add(30 * time.Second)
	_ = c.ln.SetDeadline(end)
	for {
		conn, err := c.ln.Accept()
		if err != nil {
			return nil, fmt.Errorf("decode process did not connect: %w", err)
		}
		got := make([]byte, len(c.token))
		_ = conn.SetReadDeadline(end)
		_, err = io.ReadFull(conn, got)
		_ = conn.SetReadDeadline(time.Time{})
		if err == nil && bytes.Equal(got, c.token) {
			return conn, nil
		}
		_ = conn.Close() // not our child
	}
}

// Tell writes a line to the child (Parent.Commands).
func (c *Child) Tell(format string, args ...any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, _ = fmt.Fprintf(c.stdin, format+"\n", args...)
}

// Lines are the lines the child tells (Parent.Say), but for its report;
// closed when its stdout ends.
func (c *Child) Lines() <-chan string { return c.lines }

// Report waits for the child's report, killing the child if that takes
// longer than d. The child lives on until Wait: what the parent still
// holds towards it (a plane's connections) can close first.
func (c *Child) Report(d time.Duration) (Report, error) {
	var rep Report
	select {
	case line, ok := <-c.report:
		if !ok {
			return rep, errors.New("decode process ended without a report")
		}
		if err := json.Unmarshal([]byte(line), &rep); err != nil {
			return rep, fmt.Errorf("decode process report: %w", err)
		}
		return rep, nil
	case <-time.After(d):
		_ = c.cmd.Process.Kill()
		return rep, fmt.Errorf("decode process did not report within %v (killed)", d)
	}
}

// Wait tells the child it is done (its stdin closes: a child that
// reported exits 0) and reaps it.
func (c *Child) Wait() error {
	c.mu.Lock()
	_ = c.stdin.Close()
	c.mu.Unlock()
	if err := c.reap(); err != nil {
		return fmt.Errorf("decode process: %w", err)
	}
	return nil
}

// Finish is Report, then Wait.
func (c *Child) Finish(d time.Duration) (Report, error) {
	rep, err := c.Report(d)
	if werr := c.Wait(); err == nil {
		err = werr
	}
	return rep, err
}

// Exit is how the child ended (once reaped).
func (c *Child) Exit() ChildExit { return c.exit }

// Kill kills and reaps the child unless it was reaped already.
func (c *Child) Kill() {
	if c.done {
		return
	}
	_ = c.cmd.Process.Kill()
	_ = c.reap()
}

// reap waits for the child, its stdout read to the end, and records how
// it ended.
func (c *Child) reap() error {
	for range c.lines { // whatever nobody read
	}
	err := c.cmd.Wait()
	c.done = true
	c.exit.Exited = c.cmd.ProcessState.Exited()
	c.exit.Code = c.cmd.ProcessState.ExitCode()
	return err
}

// IsChild reports whether this process is a decode child StartChild
// started.
func IsChild() bool {
	_, ok := os.LookupEnv(specEnv)
	return ok
}

// Parent is the parent process, seen from the child.
type Parent struct {
	// Cfg is the run; Key the pre-shared key (nil: Cfg.Insecure).
	Cfg Config
	Key []byte

	spec spec
	cmds chan string
	mu   sync.Mutex // stdout's writers; errs
	out  io.Writer
	errs []string
}

// Fail records err in the report's Errors: a refused control message, or
// anything else that went wrong.
func (p *Parent) Fail(err error) {
	p.mu.Lock()
	p.errs = append(p.errs, err.Error())
	p.mu.Unlock()
}

// ChildMain is the decode child's main: serve runs the decode side and
// returns its report, which goes to the parent as the last line; then
// the child waits for its stdin, a pipe from the parent, to close
// (Child.Wait) and returns 0. If stdin closes before the report (the
// parent is gone) it exits at once (os.Exit 3), and (os.Exit 4) if it
// runs far too long. It returns the exit status.
func ChildMain(stdin io.Reader, stdout, stderr io.Writer, serve func(p *Parent) (Report, error)) int {
	p := &Parent{cmds: make(chan string, 256), out: stdout}
	if err := json.Unmarshal([]byte(os.Getenv(specEnv)), &p.spec); err != nil {
		fmt.Fprintln(stderr, "decode: bad spec:", err)
		return 1
	}
	p.Cfg = p.spec.Cfg
	// The key comes down the pipe the parent handed us; without one, only
	// an -insecure run goes on.
	key, ok, err := keypipe.Read()
	if err != nil || (!ok && !p.Cfg.Insecure) {
		fmt.Fprintln(stderr, "decode: no key from the prefill process:", err)
		return 1
	}
	p.Key = key
	var reported atomic.Bool
	served, done := make(chan struct{}), make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stdin)
		for sc.Scan() {
			select {
			case p.cmds <- sc.Text():
			case <-served: // nobody listens any more
			}
		}
		if !reported.Load() {
			fmt.Fprintln(stderr, "decode: stdin closed, the prefill process is gone: exiting")
			os.Exit(3)
		}
		close(done)
	}()
	limit := 2*time.Minute + 10*p.Cfg.Deadline
	time.AfterFunc(limit, func() {
		fmt.Fprintf(stderr, "decode: still running after %v: exiting\n", limit)
		os.Exit(4)
	})
	rep, err := serve(p)
	close(served)
	if err != nil {
		fmt.Fprintln(stderr, "decode:", err)
		return 1
	}
	p.mu.Lock()
	rep.Errors = append(rep.Errors, p.errs...)
	p.mu.Unlock()
	b, err := json.Marshal(rep)
	if err != nil {
		fmt.Fprintln(stderr, "decode: report:", err)
		return 1
	}
	reported.Store(true)
	p.Say("%s%s", reportVerb, b)
	<-done // the parent is done with us
	return 0
}

// Dial dials the parent's control listener and proves with the token
// that this is its child.
func (p *Parent) Dial() (net.Conn, error) {
	conn, err := net.DialTimeout("tcp", p.spec.Ctl, 10*time.Second)
	if err != nil {
		return nil, fmt.Errorf("dial the prefill process: %w", err)
	}
	_ = conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
	if _, err := conn.Write(p.spec.Token); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("send the token: %w", err)
	}
	_ = conn.SetWriteDeadline(time.Time{})
	return conn, nil
}

// Commands are the lines the parent tells (Child.Tell).
func (p *Parent) Commands() <-chan string { return p.cmds }

// Say writes a line to the parent (Child.Lines).
func (p *Parent) Say(format string, args ...any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	fmt.Fprintf(p.out, format+"\n", args...)
}

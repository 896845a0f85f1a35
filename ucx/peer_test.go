package ucx_test

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/internal/keypipe"
	"github.com/kvlease/kvlease/ucx"
)

// The fault suite runs the two halves in two processes: the test binary
// re-executes itself as the peer (TestMain sees KVUCX_PEER), which dials
// the test's control listener on 127.0.0.1 and reports on stdout, one
// "KV ..." line per fact. Both processes run UCX over UCX_TLS=tcp on lo.

func TestMain(m *testing.M) {
	if role := os.Getenv("KVUCX_PEER"); role != "" {
		os.Exit(peerMain(role))
	}
	os.Exit(m.Run())
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

func say(format string, args ...any) { fmt.Printf("KV "+format+"\n", args...) }

// peerMain is the peer process: role "source" proposes one handoff of
// KVUCX_BLOCKS blocks stamped with KVUCX_SEED; role "dest" serves one.
// KVUCX_STALL stops the destination's reader before the receive (or
// get) of that block, or the source's sender before its message, until a
// line arrives on stdin; KVUCX_ABORT (source) aborts when "abort"
// arrives on stdin; KVUCX_PULL=1 selects the pull model; KVUCX_STREAM=k
// (source) streams the handoff in 8 layers and marks k of them.
func peerMain(role string) int {
	seed := uint32(envInt("KVUCX_SEED", 1))
	blocks := envInt("KVUCX_BLOCKS", 8)
	deadline := time.Duration(envInt("KVUCX_DEADLINE_MS", 20000)) * time.Millisecond
	conn, err := net.DialTimeout("tcp", os.Getenv("KVUCX_CTRL"), 10*time.Second)
	if err != nil {
		say("error %v", err)
		return 1
	}
	mem, _ := kvlease.NewHostMemory(64, blockBytes)
	pool, _ := kvlease.NewPool[[]byte](mem)
	stdin := bufio.NewReader(os.Stdin)
	cfg := ucx.Config{MaxGet: blockBytes, Window: 2, Pull: os.Getenv("KVUCX_PULL") == "1"}
	// The test process hands its key down a pipe; none: insecure (pull).
	key, _, err := keypipe.Read()
	if err != nil {
		say("error %v", err)
		return 1
	}
	stall := envInt("KVUCX_STALL", -1)
	switch role {
	case "source":
		cfg.BeforeSend = func(_ handoff.PlaneID, block int) {
			if block == stall {
				say("sending %d", block)
				_, _ = stdin.ReadString('\n')
			}
		}
		sender, err := ucx.NewSender(cfg, ucx.HostBytes)
		if err != nil {
			say("error %v", err)
			return 1
		}
		src, err := handoff.NewSource(conn, sender, withAuth(handoff.HalfConfig{Envelope: env(64), Name: "prefill", Peer: "decode", Deadline: deadline}, key))
		if err != nil {
			say("error %v", err)
			return 1
		}
		lease, _ := pool.Acquire("r", blocks)
		_ = stampLease(lease, seed)
		regions := make([][]byte, 0, blocks)
		for i := range blocks {
			r, _ := lease.Region(i)
			regions = append(regions, r)
		}
		var opts []handoff.ProposeOption
		var prog *handoff.Progress
		if k := envInt("KVUCX_STREAM", -1); k >= 0 {
			// A streaming handoff of 8 layers whose prefill marks k of
			// them (the blocks hold their markers already), says so,
			// and computes nothing more.
			prog, _ = handoff.NewProgress(blocks, 8)
			opts = append(opts, handoff.Streaming(prog))
		}
		o, err := src.Propose(1, "r", lease, nil, opts...)
		if err != nil {
			say("error %v", err)
			return 1
		}
		if prog != nil {
			k := envInt("KVUCX_STREAM", 0)
			go func() {
				for i := 0; i < 20000 && o.State() != handoff.Transferring && !o.State().Final(); i++ {
					time.Sleep(time.Millisecond)
				}
				for l := range k {
					time.Sleep(time.Millisecond)
					_ = prog.WroteLayers(l + 1)
				}
				for i := 0; i < 20000 && sender.Stats().Messages < k*blocks && !o.State().Final(); i++ {
					time.Sleep(time.Millisecond)
				}
				say("layers %d sent", k)
			}()
		}
		aborted := make(chan struct{})
		if os.Getenv("KVUCX_ABORT") != "" {
			go func() {
				defer close(aborted)
				if line, _ := stdin.ReadString('\n'); strings.TrimSpace(line) == "abort" {
					_ = o.Abort("prefill", errors.New("client went away"))
					o.Wait(20 * time.Second)
					say("aborted %v", o.State())
				}
			}()
		} else {
			close(aborted)
		}
		st := o.Wait(60 * time.Second)
		<-aborted
		say("source %v markers %s", st, verdict(markedRegions(regions, seed)))
		lease.Release()
		_ = src.Close()
		_ = sender.Close()
		s := pool.Stats()
		say("pool free %d quarantined %d", s.Free, s.Quarantined)
	case "hostile":
		// An authenticated destination that, given the Start bytes,
		// asks the source's worker for the address the test names on
		// stdin ("target ADDR"), then receives as usual.
		recv, err := ucx.NewReceiver(cfg, ucx.HostBytes)
		if err != nil {
			say("error %v", err)
			return 1
		}
		finals := make(chan *handoff.Incoming[[]byte], 1)
		dst, err := handoff.NewDestination(pool, hostilePlane{recv, stdin}, handoff.DestinationConfig[[]byte]{
			HalfConfig:  withAuth(handoff.HalfConfig{Envelope: env(64), Name: "decode", Peer: "prefill", Deadline: deadline}, key),
			OnDelivered: func(in *handoff.Incoming[[]byte]) { in.Lease().Release() },
			OnFinal:     func(in *handoff.Incoming[[]byte]) { finals <- in },
		})
		if err != nil {
			say("error %v", err)
			return 1
		}
		go func() { _ = dst.Serve(conn) }()
		select {
		case in := <-finals:
			say("hostile %v", in.State())
		case <-time.After(60 * time.Second):
			say("hostile timeout")
		}
		_, _ = stdin.ReadString('\n') // until the test is done with us
		_ = recv.Close()
	case "dest":
		// accepted is the one handoff this peer serves, once accepted.
		var accepted atomic.Pointer[handoff.Incoming[[]byte]]
		cfg.BeforeGet = func(_ handoff.PlaneID, block int) {
			if block == stall {
				say("reading %d", block)
				line, _ := stdin.ReadString('\n')
				if strings.TrimSpace(line) == "go-after-abort" {
					// The source aborted on its side; its Abort frame
					// races this line. Resume only once this side has
					// handled it, so what the reader does next is
					// decided by the abort, not by which arrived first.
					waitAborting(accepted.Load())
				}
			}
		}
		recv, err := ucx.NewReceiver(cfg, ucx.HostBytes)
		if err != nil {
			say("error %v", err)
			return 1
		}
		finals := make(chan *handoff.Incoming[[]byte], 1)
		dst, err := handoff.NewDestination(pool, recv, handoff.DestinationConfig[[]byte]{
			HalfConfig:  withAuth(handoff.HalfConfig{Envelope: env(64), Name: "decode", Peer: "prefill", Deadline: deadline}, key),
			OnAccept:    func(in *handoff.Incoming[[]byte]) { accepted.Store(in) },
			OnDelivered: func(*handoff.Incoming[[]byte]) {},
			OnFinal:     func(in *handoff.Incoming[[]byte]) { finals <- in },
		})
		if err != nil {
			say("error %v", err)
			return 1
		}
		served := make(chan struct{})
		go func() { _ = dst.Serve(conn); close(served) }()
		select {
		case in := <-finals:
			m := "none"
			if in.State() == handoff.Delivered {
				m = verdict(marked(in.Lease(), seed))
				in.Lease().Release()
			}
			say("dest %v markers %s", in.State(), m)
		case <-time.After(60 * time.Second):
			say("dest timeout")
		}
		// The Done goes out on its own goroutine: wait for the source
		// to end the control connection.
		select {
		case <-served:
		case <-time.After(30 * time.Second):
			say("serve timeout")
		}
		_ = recv.Close()
		s := pool.Stats()
		say("pool free %d quarantined %d", s.Free, s.Quarantined)
	}
	return 0
}

// waitAborting waits (at most 20 s) until in has left Transferring: the
// destination handled the source's Abort.
func waitAborting(in *handoff.Incoming[[]byte]) {
	for end := time.Now().Add(20 * time.Second); in != nil && time.Now().Before(end); {
		if in.State() != handoff.Transferring {
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// hostilePlane is the hostile peer's plane: before receiving, it tries
// to read target from the source's worker and says what it got.
type hostilePlane struct {
	*ucx.Receiver[[]byte]
	stdin *bufio.Reader
}

func (h hostilePlane) Receive(id handoff.PlaneID, regions [][]byte, start []byte, attach func(*kvlease.Transfer) error) error {
	line, _ := h.stdin.ReadString('\n')
	target, err := strconv.ParseUint(strings.TrimPrefix(strings.TrimSpace(line), "target "), 0, 64)
	if err != nil {
		say("stolen error %v", err)
		return h.Receiver.Receive(id, regions, start, attach)
	}
	got, ok, err := ucx.HostileRead(start, target, blockBytes)
	if err != nil {
		say("stolen error %v", err)
	} else {
		say("stolen %v %x", ok, got[:8])
	}
	return h.Receiver.Receive(id, regions, start, attach)
}

func verdict(err error) string {
	if err != nil {
		return "bad"
	}
	return "ok"
}

// peer is the other process, seen from the test.
type peer struct {
	t      *testing.T
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string
	conn   net.Conn
	exited chan struct{}
}

// startPeer starts the peer in role with the extra environment and
// returns it with its control connection accepted. The peer gets the test
// key through an inherited pipe, unless it runs the pull model
// (KVUCX_PULL=1: insecure).
func startPeer(t *testing.T, role string, extra ...string) *peer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "KVUCX_PEER="+role, "KVUCX_CTRL="+ln.Addr().String(),
		"UCX_TLS=tcp", "UCX_NET_DEVICES=lo")
	cmd.Env = append(cmd.Env, extra...)
	sendKey := func() error { return nil }
	if !slices.Contains(extra, "KVUCX_PULL=1") {
		if sendKey, err = keypipe.Attach(cmd, testKey); err != nil {
			t.Fatal(err)
		}
	}
	cmd.Stderr = os.Stderr
	p := &peer{t: t, cmd: cmd, lines: make(chan string, 64), exited: make(chan struct{})}
	if p.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	err = cmd.Start()
	if kerr := sendKey(); err == nil {
		err = kerr
	}
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if line, ok := strings.CutPrefix(sc.Text(), "KV "); ok {
				p.lines <- line
			}
		}
		close(p.lines)
		_ = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
		<-p.exited
	})
	_ = ln.(*net.TCPListener).SetDeadline(time.Now().Add(20 * time.Second))
	if p.conn, err = ln.Accept(); err != nil {
		t.Fatalf("peer never connected: %v", err)
	}
	return p
}

// expect waits for the peer's next line and checks that it starts with
// prefix; it returns the line.
func (p *peer) expect(prefix string) string {
	p.t.Helper()
	select {
	case line, ok := <-p.lines:
		if !ok {
			p.t.Fatalf("peer exited, expecting %q", prefix)
		}
		if !strings.HasPrefix(line, prefix) {
			p.t.Fatalf("peer said %q, expecting %q", line, prefix)
		}
		return line
	case <-time.After(30 * time.Second):
		p.t.Fatalf("peer silent, expecting %q", prefix)
	}
	return ""
}

// expectFinal expects the peer's report of its final state, one of want,
// with no delivered markers to check.
func (p *peer) expectFinal(role string, want ...handoff.State) {
	p.t.Helper()
	line := p.expect(role + " ")
	for _, st := range want {
		if line == fmt.Sprintf("%s %v markers none", role, st) {
			return
		}
	}
	p.t.Fatalf("peer said %q, want %s in %v", line, role, want)
}

func (p *peer) tell(line string) {
	_, _ = io.WriteString(p.stdin, line+"\n")
}

// kill kills the peer and waits until it is reaped.
func (p *peer) kill() {
	_ = p.cmd.Process.Kill()
	<-p.exited
}

// stop stops the peer (SIGSTOP) and waits until the kernel says it is
// stopped.
func (p *peer) stop() {
	p.t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGSTOP)
	for range 1000 {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid))
		if err == nil {
			if i := strings.LastIndexByte(string(b), ')'); i > 0 && i+2 < len(b) && b[i+2] == 'T' {
				return
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	p.t.Fatal("peer never stopped")
}

func (p *peer) resume() { _ = p.cmd.Process.Signal(syscall.SIGCONT) }

// waitExit waits for the peer to exit by itself.
func (p *peer) waitExit() {
	p.t.Helper()
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		p.t.Fatal("peer never exited")
	}
}

//go:build unix

package tcp_test

// The peer process of the cross-process tests and benchmarks: the test
// binary re-executes itself with peerEnv set, and TestMain runs runPeer
// instead of the tests. The peer plays one half of a handoff (the source
// or the destination) over a control connection it dials to the parent,
// obeys one-line commands on stdin and reports one-line events on
// stdout. A hold makes it stop its data stream after a given number of
// blocks, deterministically, until the parent says "release": the
// "mid-stream" of every fault case.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
	"github.com/kvlease/kvlease/internal/syncbuf"
)

const peerEnv = "KVLEASE_TCP_PEER"

func TestMain(m *testing.M) {
	if v := os.Getenv(peerEnv); v != "" {
		os.Exit(runPeer(v))
	}
	if v := os.Getenv(attackEnv); v != "" {
		os.Exit(runAttacker(v))
	}
	os.Exit(m.Run())
}

// peerConfig configures the peer process.
type peerConfig struct {
	Role       string        // "source" or "dest"
	Ctrl       string        // the parent's control listener
	BlockBytes int           // block size (and envelope BlockBytes)
	PoolBlocks int           // pool size
	Deadline   time.Duration // the half's deadline (0: bound)
	HoldAfter  int           // hold the data stream after this many blocks; -1: never
	// GateOnAccept (dest): stop delivering control reads from the moment
	// a proposal is accepted until "ungate".
	GateOnAccept bool
	// SmallBuffers (dest): the data listener's sockets get small kernel
	// buffers, so a stalled receiver stalls its sender.
	SmallBuffers bool
	// Bench (dest): no marker checks, leases released on delivery; the
	// peer also serves a raw sink and an echo for the baselines.
	Bench bool
	// Profile, if set, is where the peer writes its CPU profile (until
	// "exit").
	Profile string
	// Insecure: the peer's half runs without authentication (tests that
	// speak the control protocol by hand).
	Insecure bool
	// TLSDir, if set, holds the test TLS material (writeTLS): the peer's
	// half authenticates with mutual TLS instead of the test key.
	TLSDir string
}

// envFor is the envelope of the tests: blocks of 16 tokens, a context of
// up to 512 blocks.
func envFor(blockBytes, poolBlocks int) handoff.Envelope {
	return handoff.Envelope{BlockTokens: 16, BlockBytes: blockBytes, PoolBlocks: poolBlocks,
		MaxContextTokens: 16 * min(poolBlocks, 512), MaxPrefillTokens: 512, MaxRunningRequests: 4}
}

// hashesFor are the chained hashes of a request's n full blocks; seed
// makes each request's prefix its own.
func hashesFor(seed, n int) []kvlease.BlockHash {
	tokens := make([]int32, 16*n)
	for i := range tokens {
		tokens[i] = int32(seed*100000 + i)
	}
	return kvlease.ChainHashes(kvlease.BlockHash(seed), tokens, 16)
}

// stampLease writes request seed's marker into every block of l: block
// i, byte j holds seed+i+j%7.
func stampLease(l *kvlease.Lease[[]byte], seed byte) error {
	for i := range l.Len() {
		r, err := l.Region(i)
		if err != nil {
			return err
		}
		for j := range r {
			r[j] = seed + byte(i) + byte(j%7)
		}
	}
	return nil
}

// markedFrom is marked for the blocks from..Len()-1 (those that moved).
func markedFrom(l *kvlease.Lease[[]byte], seed byte, from int) error {
	for i := from; i < l.Len(); i++ {
		r, err := l.ReadRegion(i)
		if err != nil {
			return err
		}
		for j := range r {
			if r[j] != seed+byte(i)+byte(j%7) {
				return fmt.Errorf("block %d byte %d = %d, want %d (marker of request %d)", i, j, r[j], seed+byte(i)+byte(j%7), seed)
			}
		}
	}
	return nil
}

func seedOf(request string) byte {
	n, _ := strconv.Atoi(strings.TrimPrefix(request, "seed="))
	return byte(n)
}

// statsLine renders a pool's counts, its Check and a plane's Stats as
// key=value fields.
func statsLine(p *kvlease.Pool[[]byte], ps handoff.PlaneStats) string {
	s := p.Stats()
	check := "ok"
	if err := p.Check(); err != nil {
		check = strconv.Quote(err.Error())
	}
	return fmt.Sprintf("free=%d cached=%d leased=%d draining=%d quarantined=%d open=%d check=%s started=%d completed=%d failed=%d canceled=%d refused=%d bytes=%d",
		s.Free, s.Cached, s.Leased, s.Draining, s.Quarantined, s.OpenLeases, check,
		ps.Started, ps.Completed, ps.Failed, ps.Canceled, ps.Refused, ps.Bytes)
}

// ctlConn wraps a control connection: gate holds back every read's
// result until ungate (the half's read loop then stalls with the frame
// already in hand), and onStart is told each Start frame written.
type ctlConn struct {
	net.Conn
	mu      sync.Mutex
	gated   chan struct{}
	onStart func(id uint64)
	// nextStart is 1 + the id of the handoff whose Start is the next
	// write (set by startSignal: the frames themselves are sealed).
	nextStart atomic.Uint64
}

// startSignal is a send plane that tells its ctlConn that the next
// control write is the Start of the handoff it just sent (the source
// writes it right after Send returns, on the same goroutine).
type startSignal struct {
	handoff.SendPlane[[]byte]
	ctl *ctlConn
}

func (p startSignal) Send(id handoff.PlaneID, regions [][]byte, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	b, err := p.SendPlane.Send(id, regions, accept, attach)
	if err == nil {
		p.ctl.nextStart.Store(id.Handoff + 1)
	}
	return b, err
}

func (c *ctlConn) gate() {
	c.mu.Lock()
	if c.gated == nil {
		c.gated = make(chan struct{})
	}
	c.mu.Unlock()
}

func (c *ctlConn) ungate() {
	c.mu.Lock()
	if c.gated != nil {
		close(c.gated)
		c.gated = nil
	}
	c.mu.Unlock()
}

func (c *ctlConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.mu.Lock()
	g := c.gated
	c.mu.Unlock()
	if g != nil {
		select {
		case <-g:
		case <-time.After(bound):
		}
	}
	return n, err
}

func (c *ctlConn) Write(p []byte) (int, error) {
	id := c.nextStart.Swap(0)
	n, err := c.Conn.Write(p)
	if err == nil && c.onStart != nil && id != 0 {
		c.onStart(id - 1)
	}
	return n, err
}

// holdWrap returns a WrapConn that holds each data connection after
// blocks blocks (with the hello, on the source), reporting through say.
func holdWrap(blocks, blockBytes int, insecure bool, say func(string, ...any), release <-chan struct{}) func(net.Conn) net.Conn {
	if blocks < 0 {
		return nil
	}
	// The hello (60 bytes), then per block its 8-byte header and 16-byte
	// tag (a keyed session): both sides' wrapped connections carry all
	// of it.
	limit := 60 + int64(blocks)*int64(8+16+blockBytes)
	if insecure {
		limit = 60 + int64(blocks)*int64(8+4+blockBytes) // crc32c trailers
	}
	return func(c net.Conn) net.Conn {
		return &holdConn{Conn: c, left: limit, onHold: func() { say("held %d", blocks) }, release: release}
	}
}

// runPeer is the peer process's main.
func runPeer(spec string) int {
	var cfg peerConfig
	if err := json.Unmarshal([]byte(spec), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "peer config:", err)
		return 2
	}
	if cfg.Deadline == 0 {
		cfg.Deadline = bound
	}
	if cfg.Profile != "" {
		f, err := os.Create(cfg.Profile)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		defer func() {
			pprof.StopCPUProfile()
			_ = f.Close()
		}()
	}
	var outMu sync.Mutex
	out := bufio.NewWriter(os.Stdout)
	say := func(format string, args ...any) {
		outMu.Lock()
		defer outMu.Unlock()
		fmt.Fprintf(out, format+"\n", args...)
		_ = out.Flush()
	}
	mem, err := kvlease.NewHostMemory(cfg.PoolBlocks, cfg.BlockBytes)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	pool, err := kvlease.NewPool[[]byte](mem)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	raw, err := net.DialTimeout("tcp", cfg.Ctrl, bound)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctl := &ctlConn{Conn: raw, onStart: func(id uint64) { say("start-sent %d", id) }}
	release := make(chan struct{})
	var releaseOnce sync.Once
	env := envFor(cfg.BlockBytes, cfg.PoolBlocks)
	half := handoff.HalfConfig{Envelope: env, Deadline: cfg.Deadline, Auth: testAuth,
		OnError: func(err error) { say("protoerr %q", err.Error()) }}
	if cfg.Insecure {
		half.Auth, half.Insecure, half.Logf = nil, true, quiet
	}
	if cfg.TLSDir != "" {
		if half.Auth, err = readTLS(cfg.TLSDir, cfg.Role); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
	}
	var run func(cmd []string) bool
	switch cfg.Role {
	case "source":
		half.Name, half.Peer = "prefill", "decode"
		sender := tcp.NewSender(tcp.Config{WrapConn: holdWrap(cfg.HoldAfter, cfg.BlockBytes, cfg.Insecure, say, release)})
		src, err := handoff.NewSource(ctl, startSignal{sender, ctl}, half)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		run = sourceCommands(pool, src, sender, say)
	case "dest":
		half.Name, half.Peer = "decode", "prefill"
		run, err = destPeer(cfg, pool, ctl, half, say, release)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
	default:
		fmt.Fprintln(os.Stderr, "peer role", cfg.Role)
		return 2
	}
	say("ready")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) == 0 {
			continue
		}
		switch f[0] {
		case "release":
			releaseOnce.Do(func() { close(release) })
			say("released")
		case "exit":
			return 0
		default:
			if !run(f) {
				say("unknown command %q", in.Text())
			}
		}
	}
	return 0
}

// waitFor polls state until it is want or final, within bound.
func waitFor(state func() handoff.State, want handoff.State) handoff.State {
	end := time.Now().Add(bound)
	for {
		s := state()
		if s == want || s.Final() || time.Now().After(end) {
			return s
		}
		time.Sleep(time.Millisecond)
	}
}

func errText(err error) string {
	if err == nil {
		return `""`
	}
	return strconv.Quote(err.Error())
}

func parseState(s string) handoff.State {
	for st := handoff.Proposed; st <= handoff.Quarantined; st++ {
		if st.String() == s {
			return st
		}
	}
	return 0
}

func sourceCommands(pool *kvlease.Pool[[]byte], src *handoff.Source[[]byte], sender *tcp.Sender, say func(string, ...any)) func([]string) bool {
	outs := map[uint64]*handoff.Outgoing[[]byte]{}
	leases := map[uint64]*kvlease.Lease[[]byte]{}
	return func(f []string) bool {
		id, _ := strconv.ParseUint(append(f, "0")[1], 10, 64)
		switch f[0] {
		case "propose": // propose ID BLOCKS SEED
			n, _ := strconv.Atoi(f[2])
			seed, _ := strconv.Atoi(f[3])
			l, err := pool.Acquire(fmt.Sprintf("r%d", id), n)
			if err == nil {
				err = stampLease(l, byte(seed))
			}
			var o *handoff.Outgoing[[]byte]
			if err == nil {
				o, err = src.Propose(id, fmt.Sprintf("seed=%d", seed), l, hashesFor(seed, n))
			}
			if err != nil {
				if l != nil {
					l.Release()
				}
				say("propose-error %d %s", id, errText(err))
				return true
			}
			outs[id], leases[id] = o, l
			say("proposed %d", id)
		case "wait": // wait ID STATE
			o := outs[id]
			if o == nil {
				say("state %d none", id)
				return true
			}
			s := waitFor(o.State, parseState(f[2]))
			say("state %d %v %s %s", id, s, errText(o.Err()), leases[id].State())
		case "abort":
			say("aborted %d %s", id, errText(outs[id].Abort("prefill", nil)))
		case "free":
			if l := leases[id]; l != nil {
				l.Release()
			}
			say("freed %d", id)
		case "stats":
			say("stats %s", statsLine(pool, sender.Stats()))
		default:
			return false
		}
		return true
	}
}

// destPeer serves the control connection as the destination half.
func destPeer(cfg peerConfig, pool *kvlease.Pool[[]byte], ctl *ctlConn, half handoff.HalfConfig, say func(string, ...any), release <-chan struct{}) (func([]string) bool, error) {
	lc := net.ListenConfig{}
	if cfg.SmallBuffers {
		lc.Control = func(_, _ string, c syscall.RawConn) error {
			var serr error
			err := c.Control(func(fd uintptr) {
				serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 16<<10)
			})
			return errors.Join(err, serr)
		}
	}
	ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	recv := tcp.NewReceiver(ln, tcp.Config{WrapConn: holdWrap(cfg.HoldAfter, cfg.BlockBytes, cfg.Insecure, say, release),
		OnError: func(err error) { say("refused %q", err.Error()) }})
	var mu sync.Mutex
	ins := map[uint64]*handoff.Incoming[[]byte]{}
	kept := map[uint64]*kvlease.Lease[[]byte]{}
	dcfg := handoff.DestinationConfig[[]byte]{HalfConfig: half, MaxSessionBlocks: -1,
		OnAccept: func(in *handoff.Incoming[[]byte]) {
			mu.Lock()
			ins[in.ID()] = in
			mu.Unlock()
			if cfg.GateOnAccept {
				ctl.gate()
			}
			if !cfg.Bench {
				say("accepted %d hits=%d", in.ID(), in.Hits())
			}
		},
		OnDelivered: func(in *handoff.Incoming[[]byte]) {
			if cfg.Bench {
				in.Lease().Release()
				return
			}
			res := "ok"
			if err := markedFrom(in.Lease(), seedOf(in.Request()), in.Hits()); err != nil {
				res = strconv.Quote(err.Error())
			}
			mu.Lock()
			kept[in.ID()] = in.Lease()
			mu.Unlock()
			say("delivered %d markers=%s", in.ID(), res)
		},
		OnFinal: func(in *handoff.Incoming[[]byte]) {
			if !cfg.Bench {
				say("final %d %v %s", in.ID(), in.State(), errText(in.Err()))
			}
		},
	}
	dst, err := handoff.NewDestination(pool, recv, dcfg)
	if err != nil {
		return nil, err
	}
	go func() {
		err := dst.Serve(ctl)
		say("served %s", errText(err))
	}()
	if cfg.Bench {
		if err := benchServers(say); err != nil {
			return nil, err
		}
	}
	get := func(id uint64) *handoff.Incoming[[]byte] {
		mu.Lock()
		defer mu.Unlock()
		return ins[id]
	}
	return func(f []string) bool {
		id, _ := strconv.ParseUint(append(f, "0")[1], 10, 64)
		switch f[0] {
		case "ungate":
			ctl.ungate()
			say("ungated")
		case "crossed": // crossed N: wait (bounded) until N messages crossed an end
			for end := time.Now().Add(bound); dst.Stats().Crossed < int64(id) && time.Now().Before(end); time.Sleep(time.Millisecond) {
			}
			say("crossed %d", dst.Stats().Crossed)
		case "reject":
			say("rejected %d %s", id, errText(get(id).Reject("decode", errors.New("decode changed its mind"))))
		case "abort":
			say("aborted %d %s", id, errText(get(id).Abort("decode", nil)))
		case "wait": // wait ID STATE
			in := get(id)
			if in == nil {
				say("state %d none", id)
				return true
			}
			s := waitFor(in.State, parseState(f[2]))
			say("state %d %v %s", id, s, errText(in.Err()))
		case "check": // check ID: markers again before the blocks may be reused, then release
			mu.Lock()
			l := kept[id]
			delete(kept, id)
			mu.Unlock()
			res := "ok"
			if l == nil {
				res = "none"
			} else {
				if err := markedFrom(l, seedOf(get(id).Request()), get(id).Hits()); err != nil {
					res = strconv.Quote(err.Error())
				}
				l.Release()
			}
			say("checked %d %s", id, res)
		case "stats":
			say("stats %s", statsLine(pool, recv.Stats()))
		default:
			return false
		}
		return true
	}, nil
}

var sinkBuf []byte // the sink's destination area (one copy at a time)

// benchServers serves the baselines of the benchmarks in the peer
// process: a raw sink (reads a 4-byte length, then that many bytes into
// a destination area of that size, then answers one byte) and an echo of 64-byte
// messages. It reports their addresses.
func benchServers(say func(string, ...any)) error {
	sink, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	echo, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	go func() {
		for {
			c, err := sink.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				var hdr [4]byte
				for {
					if _, err := io.ReadFull(c, hdr[:]); err != nil {
						return
					}
					// Into a destination area as large as the copy (as a
					// handoff writes its blocks), reused from copy to copy
					// (as the pool's memory is).
					n := int(uint32(hdr[0]) | uint32(hdr[1])<<8 | uint32(hdr[2])<<16 | uint32(hdr[3])<<24)
					if len(sinkBuf) < n {
						sinkBuf = make([]byte, n)
					}
					if _, err := io.ReadFull(c, sinkBuf[:n]); err != nil {
						return
					}
					if _, err := c.Write(hdr[:1]); err != nil {
						return
					}
				}
			}()
		}
	}()
	go func() {
		for {
			c, err := echo.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				var m [64]byte
				for {
					if _, err := io.ReadFull(c, m[:]); err != nil {
						return
					}
					if _, err := c.Write(m[:]); err != nil {
						return
					}
				}
			}()
		}
	}()
	say("bench sink=%s echo=%s", sink.Addr(), echo.Addr())
	return nil
}

// peer is the parent's handle on a peer process.
type peer struct {
	t       testing.TB
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	lines   chan string
	stderr  *syncbuf.Buffer
	mu      sync.Mutex
	seen    []string      // every line
	pending []string      // lines no expect took yet
	gone    chan struct{} // closed once reaped
	reaped  sync.Once
}

// startPeer starts the peer process with cfg and waits for it to be
// ready. It is killed and reaped in t.Cleanup.
func startPeer(t testing.TB, cfg peerConfig) *peer {
	t.Helper()
	p := spawn(t, peerEnv, cfg)
	t.Cleanup(func() { p.kill() })
	return p
}

// spawn re-executes the test binary with env set to spec in JSON (the
// peer or the attacker process), its stdout's lines in p.lines.
func spawn(t testing.TB, env string, spec any) *peer {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	p := &peer{t: t, cmd: exec.Command(exe), lines: make(chan string, 1024), stderr: &syncbuf.Buffer{}, gone: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), env+"="+string(b))
	p.cmd.Stderr = p.stderr
	if p.stdin, err = p.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	stdout, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
	}()
	return p
}

// stop asks the peer to exit, waits for it (within bound), and reaps it.
func (p *peer) stop() {
	_, _ = fmt.Fprintln(p.stdin, "exit")
	done := make(chan struct{})
	go func() {
		for range p.lines {
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(bound):
	}
	p.kill()
}

// kill kills (SIGKILL, also when stopped) and reaps the peer.
func (p *peer) kill() {
	p.reaped.Do(func() {
		_ = p.cmd.Process.Kill()
		_ = p.cmd.Wait()
		close(p.gone)
	})
}

func (p *peer) signal(sig syscall.Signal) {
	p.t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatalf("signal %v: %v", sig, err)
	}
}

// do sends one command line.
func (p *peer) do(format string, args ...any) {
	p.t.Helper()
	if _, err := fmt.Fprintf(p.stdin, format+"\n", args...); err != nil {
		p.t.Fatalf("peer command %q: %v\n%s", fmt.Sprintf(format, args...), err, p.stderr)
	}
}

// expect waits for the first line not yet expected that starts with
// prefix (within bound) and returns its fields. Lines are kept in order;
// an expect skips over lines that a later expect may still take.
func (p *peer) expect(prefix string) []string {
	p.t.Helper()
	timer := time.NewTimer(bound)
	defer timer.Stop()
	for {
		p.mu.Lock()
		for i, l := range p.pending {
			if strings.HasPrefix(l, prefix) {
				p.pending = append(p.pending[:i], p.pending[i+1:]...)
				p.mu.Unlock()
				return strings.Fields(l)
			}
		}
		p.mu.Unlock()
		select {
		case l, ok := <-p.lines:
			if !ok {
				p.t.Fatalf("peer exited waiting for %q; saw %q\nstderr:\n%s", prefix, p.log(), p.stderr)
			}
			p.mu.Lock()
			p.seen = append(p.seen, l)
			p.pending = append(p.pending, l)
			p.mu.Unlock()
		case <-timer.C:
			p.t.Fatalf("no %q from the peer within %v; saw %q\nstderr:\n%s", prefix, bound, p.log(), p.stderr)
		}
	}
}

func (p *peer) log() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.seen...)
}

// saw counts the lines seen so far that start with prefix.
func (p *peer) saw(prefix string) int {
	n := 0
	for _, l := range p.log() {
		if strings.HasPrefix(l, prefix) {
			n++
		}
	}
	return n
}

// stats asks for the peer's pool and plane counts.
func (p *peer) stats() map[string]string {
	p.t.Helper()
	p.do("stats")
	return fields(p.expect("stats ")[1:])
}

// fields parses key=value fields.
func fields(f []string) map[string]string {
	m := map[string]string{}
	for _, kv := range f {
		if k, v, ok := strings.Cut(kv, "="); ok {
			m[k] = v
		}
	}
	return m
}

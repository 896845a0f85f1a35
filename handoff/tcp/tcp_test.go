package tcp_test

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
)

const blockBytes = 4096

// testAuth is the pre-shared key of the tests' halves (and of the peer
// processes the fault suites start: the same binary).
var testAuth = &handoff.PSK{ID: "test", Key: []byte("kvlease tcp tests' shared key 32")}

// quiet drops the insecure sessions' log lines.
func quiet(string, ...any) {}

func env(poolBlocks int) handoff.Envelope {
	return handoff.Envelope{BlockTokens: 16, BlockBytes: blockBytes, PoolBlocks: poolBlocks,
		MaxContextTokens: 16 * 64, MaxPrefillTokens: 512, MaxRunningRequests: 4}
}

func hostPool(t testing.TB, blocks int, opts ...kvlease.Option) *kvlease.Pool[[]byte] {
	t.Helper()
	return hostPoolOf(t, blocks, blockBytes, opts...)
}

func hostPoolOf(t testing.TB, blocks, bb int, opts ...kvlease.Option) *kvlease.Pool[[]byte] {
	t.Helper()
	mem, err := kvlease.NewHostMemory(blocks, bb)
	if err != nil {
		t.Fatal(err)
	}
	p, err := kvlease.NewPool[[]byte](mem, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// stamp fills block i of l with a marker of (seed, i).
func stamp(t testing.TB, l *kvlease.Lease[[]byte], seed byte) {
	t.Helper()
	for i := range l.Len() {
		r, err := l.Pool().Region(l.Ref(i))
		if err != nil {
			t.Fatal(err)
		}
		for j := range r {
			r[j] = seed + byte(i) + byte(j%7)
		}
	}
}

// marked reports the first block of l whose content is not (seed, i).
func marked(l *kvlease.Lease[[]byte], seed byte) error {
	for i := range l.Len() {
		r, err := l.Pool().Region(l.Ref(i))
		if err != nil {
			return err
		}
		for j := range r {
			if r[j] != seed+byte(i)+byte(j%7) {
				return fmt.Errorf("block %d byte %d = %d, want %d", i, j, r[j], seed+byte(i)+byte(j%7))
			}
		}
	}
	return nil
}

// loop is both halves in one process over 127.0.0.1: a control
// connection and a data listener.
type loop struct {
	srcPool, dstPool *kvlease.Pool[[]byte]
	src              *handoff.Source[[]byte]
	dst              *handoff.Destination[[]byte]
	sender           *tcp.Sender
	recv             *tcp.Receiver

	mu        sync.Mutex
	accepted  map[uint64]*handoff.Incoming[[]byte]
	delivered []*handoff.Incoming[[]byte]
	finals    map[uint64]*handoff.Incoming[[]byte]
	serveErr  chan error
}

type loopConfig struct {
	deadline   time.Duration
	decide     func(*handoff.ProposeMsg) error
	wrapSend   func(net.Conn) net.Conn
	wrapRecv   func(net.Conn) net.Conn
	keepLeases bool
	hello      time.Duration // the receiver's HelloTimeout
	dstOpts    []kvlease.Option
	onError    func(error) // the destination's protocol errors
	// sendCfg and recvCfg configure the planes (wrapSend, wrapRecv and
	// hello, where set, override theirs).
	sendCfg, recvCfg tcp.Config
	// blockBytes is both pools' block size (and the envelope's);
	// blockBytes (the constant) when zero.
	blockBytes int
}

func newLoop(t *testing.T, lc loopConfig) *loop {
	t.Helper()
	bb := lc.blockBytes
	if bb == 0 {
		bb = blockBytes
	}
	e := env(64)
	e.BlockBytes = bb
	l := &loop{srcPool: hostPoolOf(t, 64, bb), dstPool: hostPoolOf(t, 64, bb, lc.dstOpts...), finals: map[uint64]*handoff.Incoming[[]byte]{}, accepted: map[uint64]*handoff.Incoming[[]byte]{}, serveErr: make(chan error, 1)}
	ctlLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dataLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	rc, sc := lc.recvCfg, lc.sendCfg
	if lc.wrapRecv != nil {
		rc.WrapConn = lc.wrapRecv
	}
	if lc.hello != 0 {
		rc.HelloTimeout = lc.hello
	}
	if lc.wrapSend != nil {
		sc.WrapConn = lc.wrapSend
	}
	l.recv = tcp.NewReceiver(dataLn, rc)
	l.sender = tcp.NewSender(sc)
	dl := lc.deadline
	if dl == 0 {
		dl = 10 * time.Second
	}
	l.dst, err = handoff.NewDestination(l.dstPool, l.recv, handoff.DestinationConfig[[]byte]{
		HalfConfig: handoff.HalfConfig{Envelope: e, Name: "decode", Peer: "prefill", Deadline: dl, OnError: lc.onError, Auth: testAuth},
		Decide:     lc.decide,
		OnAccept: func(in *handoff.Incoming[[]byte]) {
			l.mu.Lock()
			l.accepted[in.ID()] = in
			l.mu.Unlock()
		},
		OnDelivered: func(in *handoff.Incoming[[]byte]) {
			l.mu.Lock()
			l.delivered = append(l.delivered, in)
			l.mu.Unlock()
			if !lc.keepLeases {
				in.Lease().Release()
			}
		},
		OnFinal: func(in *handoff.Incoming[[]byte]) {
			l.mu.Lock()
			l.finals[in.ID()] = in
			l.mu.Unlock()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		c, err := ctlLn.Accept()
		_ = ctlLn.Close()
		if err != nil {
			l.serveErr <- err
			return
		}
		l.serveErr <- l.dst.Serve(c)
	}()
	c, err := net.Dial("tcp", ctlLn.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	l.src, err = handoff.NewSource(c, l.sender, handoff.HalfConfig{Envelope: e, Name: "prefill", Peer: "decode", Deadline: dl, Auth: testAuth})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = l.src.Close()
		<-l.serveErr
		_ = l.sender.Close()
		_ = l.recv.Close()
		for _, p := range []*kvlease.Pool[[]byte]{l.srcPool, l.dstPool} {
			if err := p.Check(); err != nil {
				t.Error(err)
			}
		}
	})
	return l
}

func (l *loop) incoming(id uint64) *handoff.Incoming[[]byte] {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.finals[id]
}

func waitFinal(t *testing.T, in interface {
	Done() <-chan struct{}
	State() handoff.State
}) {
	t.Helper()
	select {
	case <-in.Done():
	case <-time.After(10 * time.Second):
		t.Fatalf("still %v after 10 s", in.State())
	}
}

func waitIncoming(t *testing.T, l *loop, id uint64) *handoff.Incoming[[]byte] {
	t.Helper()
	for range 1000 {
		if in := l.incoming(id); in != nil {
			return in
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("destination never finished handoff %d", id)
	return nil
}

func TestLoopbackDelivered(t *testing.T) {
	l := newLoop(t, loopConfig{keepLeases: true})
	lease, err := l.srcPool.Acquire("r1", 10)
	if err != nil {
		t.Fatal(err)
	}
	stamp(t, lease, 1)
	tokens := make([]int32, 16*10)
	for i := range tokens {
		tokens[i] = int32(i)
	}
	hashes := kvlease.ChainHashes(7, tokens, 16)
	o, err := l.src.Propose(1, "r1", lease, hashes[:8]) // 8 full blocks, 2 partial
	if err != nil {
		t.Fatal(err)
	}
	waitFinal(t, o)
	if o.State() != handoff.Delivered {
		t.Fatalf("source %v: %v", o.State(), o.History())
	}
	in := waitIncoming(t, l, 1)
	if in.State() != handoff.Delivered || in.Hits() != 0 {
		t.Fatalf("destination %v hits %d: %v", in.State(), in.Hits(), in.History())
	}
	if err := marked(in.Lease(), 1); err != nil {
		t.Fatal(err)
	}
	in.Lease().Release()
	if got := l.dstPool.CachedPrefix(hashes[:8]); got != 8 {
		t.Fatalf("destination cached %d of 8 delivered full blocks", got)
	}
	lease.Release()

	// A second request with the same prefix: the destination takes its
	// own hits and asks for the rest alone.
	before := l.recv.Stats().Bytes
	lease2, _ := l.srcPool.Acquire("r2", 10)
	stamp(t, lease2, 1)
	o2, err := l.src.Propose(2, "r2", lease2, hashes[:8])
	if err != nil {
		t.Fatal(err)
	}
	waitFinal(t, o2)
	in2 := waitIncoming(t, l, 2)
	if o2.State() != handoff.Delivered || in2.Hits() != 8 || o2.From() != 8 {
		t.Fatalf("second handoff %v hits %d from %d", o2.State(), in2.Hits(), o2.From())
	}
	if moved := l.recv.Stats().Bytes - before; moved != 2*blockBytes {
		t.Fatalf("second handoff moved %d bytes, want %d", moved, 2*blockBytes)
	}
	if err := marked(in2.Lease(), 1); err != nil {
		t.Fatal(err)
	}
	in2.Lease().Release()
	lease2.Release()
}

func TestLoopbackRejected(t *testing.T) {
	l := newLoop(t, loopConfig{decide: func(p *handoff.ProposeMsg) error {
		if p.Request == "no" {
			return errors.New("decode at its limit")
		}
		return nil
	}})
	lease, _ := l.srcPool.Acquire("no", 3)
	o, err := l.src.Propose(5, "no", lease, nil)
	if err != nil {
		t.Fatal(err)
	}
	waitFinal(t, o)
	if o.State() != handoff.Rejected || !errors.Is(o.Err(), handoff.ErrRejected) {
		t.Fatalf("%v %v", o.State(), o.Err())
	}
	if lease.State() != kvlease.LeaseActive {
		t.Fatal("a rejection closed the source lease")
	}
	// Exhausted: a request larger than the destination can hold now.
	hog, _ := l.dstPool.Acquire("hog", 60)
	lease2, _ := l.srcPool.Acquire("big", 10)
	o2, _ := l.src.Propose(6, "big", lease2, nil)
	waitFinal(t, o2)
	if o2.State() != handoff.Rejected || !errors.Is(o2.Err(), kvlease.ErrExhausted) {
		t.Fatalf("%v %v", o2.State(), o2.Err())
	}
	hog.Release()
	lease.Release()
	lease2.Release()
	if s := l.dstPool.Stats(); s.Free != 64 {
		t.Fatalf("destination %+v", s)
	}
}

// chunkConn writes in pieces of at most size bytes, each its own write
// (so the receiver sees frames split at every possible boundary), and
// flips the byte at offset flip of the stream (-1: none).
type chunkConn struct {
	net.Conn
	size int
	flip int64
	off  int64
}

func (c *chunkConn) Write(p []byte) (int, error) {
	total := 0
	for len(p) > 0 {
		n := min(len(p), c.size)
		piece := append([]byte(nil), p[:n]...)
		if c.flip >= c.off && c.flip < c.off+int64(n) {
			piece[c.flip-c.off] ^= 0x40
		}
		m, err := c.Conn.Write(piece)
		total += m
		c.off += int64(m)
		if err != nil {
			return total, err
		}
		p = p[n:]
	}
	return total, nil
}

// TestLoopbackChunked: a stream arriving in small odd pieces (every
// frame split across reads, headers and checksums too) is received
// intact by the scattered reads.
func TestLoopbackChunked(t *testing.T) {
	for _, size := range []int{1, 7, 4099} {
		l := newLoop(t, loopConfig{keepLeases: true, wrapSend: func(c net.Conn) net.Conn {
			return &chunkConn{Conn: c, size: size, flip: -1}
		}})
		lease, _ := l.srcPool.Acquire("r", 5)
		stamp(t, lease, 9)
		o, err := l.src.Propose(1, "r", lease, nil)
		if err != nil {
			t.Fatal(err)
		}
		waitFinal(t, o)
		in := waitIncoming(t, l, 1)
		if o.State() != handoff.Delivered || in.State() != handoff.Delivered {
			t.Fatalf("pieces of %d: source %v, destination %v: %v", size, o.State(), in.State(), in.History())
		}
		if err := marked(in.Lease(), 9); err != nil {
			t.Fatalf("pieces of %d: %v", size, err)
		}
		in.Lease().Release()
		lease.Release()
	}
}

// TestLoopbackCorrupt: a flipped byte in the layout, a header, a block or
// a check fails the transfer on the destination with ErrCorrupt, by the
// check that guards that byte (the offsets follow the current wire; they
// once assumed a 27-byte hello and a frame per block, so every flip
// landed in a block's bytes); the
// source learns it from Done and fails too; every block returns.
func TestLoopbackCorrupt(t *testing.T) {
	// The wire of the 4 adjacent blocks, in the keyed (psk) session: the
	// hello (60 bytes), the layout (a count and one frame of 4 blocks),
	// the frame's header (index, length), its 4 blocks, a 16-byte tag
	// per block.
	const hello, layout, header, tag = 60, 8, 8, 16
	const body = hello + layout + header
	const tags = body + 4*blockBytes
	type flip struct {
		at   int64
		want string // what the destination's error names
	}
	cases := map[string]flip{
		"layout count":  {hello, "layout of 65 frames"},
		"header index":  {hello + layout + 1, "frame says block 16384 of"},
		"header length": {hello + layout + 5, "frame says block 0 of 0 bytes"},
		"block":         {body + blockBytes + 100, "block 1 of 4"},
		"checksum":      {tags + 2*tag, "block 2 of 4"},
		"last checksum": {tags + 4*tag - 1, "block 3 of 4"},
		"hello token":   {5, ""},
	}
	for name, f := range cases {
		t.Run(name, func(t *testing.T) {
			l := newLoop(t, loopConfig{hello: 200 * time.Millisecond, wrapSend: func(c net.Conn) net.Conn {
				return &chunkConn{Conn: c, size: 1 << 20, flip: f.at}
			}})
			lease, _ := l.srcPool.Acquire("r", 4)
			stamp(t, lease, 3)
			o, err := l.src.Propose(1, "r", lease, nil)
			if err != nil {
				t.Fatal(err)
			}
			waitFinal(t, o)
			if o.State() != handoff.Failed {
				t.Fatalf("source %v: %v", o.State(), o.History())
			}
			if name == "hello token" {
				// An unknown token: the destination refused the data
				// connection; its receive gave up waiting for the right
				// one, having written nothing.
				in := waitIncoming(t, l, 1)
				if in.State() != handoff.Failed || !errors.Is(in.Err(), tcp.ErrNoData) {
					t.Fatalf("destination %v %v", in.State(), in.Err())
				}
				if s := l.recv.Stats(); s.Refused != 1 || s.Bytes != 0 {
					t.Fatalf("receiver %+v", s)
				}
			} else {
				in := waitIncoming(t, l, 1)
				if in.State() != handoff.Failed || !errors.Is(in.Err(), tcp.ErrCorrupt) || !strings.Contains(in.Err().Error(), f.want) {
					t.Fatalf("destination %v %v, want an error naming %q", in.State(), in.Err(), f.want)
				}
				if s := l.recv.Stats(); s.Failed != 1 || s.Completed != 0 {
					t.Fatalf("receiver %+v", s)
				}
			}
			lease.Release()
			if s := l.dstPool.Stats(); s.Free != 64 || s.Cached != 0 {
				t.Fatalf("destination pool %+v", s)
			}
		})
	}
}

// TestLoopbackTokens: a proposal with tokens fills a verified-mode
// destination's cache (SealTokens on arrival) and its repeat hits
// there, checked against the tokens; a hash-only proposal to a verified
// pool misses and is still delivered (its blocks stay unsealed, which
// is reported); a plain pool takes tokens through their hashes.
func TestLoopbackTokens(t *testing.T) {
	const seed = kvlease.BlockHash(7)
	tokens := make([]int32, 16*9+5) // 9 full blocks and a partial tenth
	for i := range tokens {
		tokens[i] = int32(1000 + i)
	}
	hashes := kvlease.ChainHashes(seed, tokens, 16)
	run := func(t *testing.T, l *loop, id uint64, tokened bool) *handoff.Incoming[[]byte] {
		t.Helper()
		lease, _ := l.srcPool.Acquire("r", 10)
		stamp(t, lease, 5)
		var o *handoff.Outgoing[[]byte]
		var err error
		if tokened {
			o, err = l.src.ProposeTokens(id, "r", lease, seed, tokens)
		} else {
			o, err = l.src.Propose(id, "r", lease, hashes)
		}
		if err != nil {
			t.Fatal(err)
		}
		waitFinal(t, o)
		in := waitIncoming(t, l, id)
		if o.State() != handoff.Delivered || in.State() != handoff.Delivered {
			t.Fatalf("handoff %d: source %v, destination %v: %v", id, o.State(), in.State(), in.History())
		}
		if err := marked(in.Lease(), 5); err != nil {
			t.Fatal(err)
		}
		in.Lease().Release()
		lease.Release()
		return in
	}
	t.Run("verified", func(t *testing.T) {
		var mu sync.Mutex
		var reported []error
		l := newLoop(t, loopConfig{keepLeases: true, dstOpts: []kvlease.Option{kvlease.WithVerifiedPrefix(16)},
			onError: func(err error) { mu.Lock(); reported = append(reported, err); mu.Unlock() }})
		if in := run(t, l, 1, true); in.Hits() != 0 {
			t.Fatalf("%d hits in an empty cache", in.Hits())
		}
		if got := l.dstPool.CachedPrefixTokens(seed, tokens); got != 9 {
			t.Fatalf("verified destination holds %d of the 9 delivered full blocks", got)
		}
		before := l.recv.Stats().Bytes
		if in := run(t, l, 2, true); in.Hits() != 9 {
			t.Fatalf("repeat: %d hits, want 9", in.Hits())
		}
		if moved := l.recv.Stats().Bytes - before; moved != blockBytes {
			t.Fatalf("repeat moved %d bytes, want one block", moved)
		}
		// Hashes alone prove nothing to a verified pool.
		if in := run(t, l, 3, false); in.Hits() != 0 {
			t.Fatalf("hash-only proposal: %d verified hits", in.Hits())
		}
		mu.Lock()
		defer mu.Unlock()
		if len(reported) != 1 || !strings.Contains(reported[0].Error(), "unsealed") || !errors.Is(reported[0], kvlease.ErrInvalidArgument) {
			t.Fatalf("reported %v", reported)
		}
	})
	t.Run("plain", func(t *testing.T) {
		l := newLoop(t, loopConfig{keepLeases: true})
		run(t, l, 1, true)
		if got := l.dstPool.CachedPrefix(hashes); got != 9 {
			t.Fatalf("plain destination holds %d of the 9 delivered full blocks", got)
		}
		if in := run(t, l, 2, true); in.Hits() != 9 {
			t.Fatalf("repeat: %d hits, want 9", in.Hits())
		}
	})
	t.Run("bad input", func(t *testing.T) {
		l := newLoop(t, loopConfig{})
		lease, _ := l.srcPool.Acquire("r", 2)
		defer lease.Release()
		for name, toks := range map[string][]int32{"none": nil, "more than the blocks hold": make([]int32, 33)} {
			if _, err := l.src.ProposeTokens(9, "r", lease, seed, toks); !errors.Is(err, kvlease.ErrInvalidArgument) {
				t.Errorf("%s: %v", name, err)
			}
		}
	})
}

// TestLoopbackAbort: an abort on either side while the stream is held
// mid-way reaches the other side over the control connection; both
// drain until their own loop stops, and end Aborted with every block
// back.
func TestLoopbackAbort(t *testing.T) {
	for _, who := range []string{"source", "destination"} {
		t.Run(who, func(t *testing.T) {
			held, release := make(chan struct{}), make(chan struct{})
			l := newLoop(t, loopConfig{wrapSend: func(c net.Conn) net.Conn {
				return &holdConn{Conn: c, left: 27 + 2*(12+blockBytes), onHold: func() { close(held) }, release: release}
			}})
			lease, _ := l.srcPool.Acquire("r", 8)
			stamp(t, lease, 2)
			o, err := l.src.Propose(1, "r", lease, nil)
			if err != nil {
				t.Fatal(err)
			}
			<-held
			l.mu.Lock()
			in := l.accepted[1]
			l.mu.Unlock()
			waitState(t, "destination", in.State, handoff.Transferring)
			var other func() []handoff.Step
			var peer string
			if who == "source" {
				err, other, peer = o.Abort("prefill", nil), in.History, "prefill"
			} else {
				err, other, peer = in.Abort("decode", nil), o.History, "decode"
			}
			if err != nil {
				t.Fatal(err)
			}
			step := waitStep(t, other, handoff.EventAbort)
			if step.By != peer || !errors.Is(step.Err, handoff.ErrPeer) || !errors.Is(step.Err, kvlease.ErrAborted) {
				t.Errorf("the other side's abort step: %v", step)
			}
			if lease.State() == kvlease.LeaseActive {
				t.Error("the abort left the source lease open")
			}
			close(release)
			waitFinal(t, o)
			waitFinal(t, in)
			if o.State() != handoff.Aborted || in.State() != handoff.Aborted {
				t.Fatalf("source %v, destination %v", o.State(), in.State())
			}
			for _, p := range []*kvlease.Pool[[]byte]{l.srcPool, l.dstPool} {
				if s := p.Stats(); s.Free != 64 {
					t.Fatalf("%+v", s)
				}
			}
		})
	}
}

// bound is the longest any wait of the suite may take: a bound, never an
// expectation.
const bound = 20 * time.Second

// holdConn holds a data stream once limit bytes have passed (in Write
// on the source, in Read on the destination) until release is closed.
type holdConn struct {
	net.Conn
	left    int64 // bytes before the hold; -1 once held or never
	onHold  func()
	release <-chan struct{}
}

func (c *holdConn) hold() {
	c.left = -1
	c.onHold()
	select {
	case <-c.release:
	case <-time.After(bound):
	}
}

func (c *holdConn) Write(p []byte) (int, error) {
	if c.left < 0 || int64(len(p)) <= c.left {
		if c.left >= 0 {
			c.left -= int64(len(p))
		}
		return c.Conn.Write(p)
	}
	n, err := c.Conn.Write(p[:c.left])
	if err != nil {
		return n, err
	}
	c.hold()
	m, err := c.Conn.Write(p[n:])
	return n + m, err
}

func (c *holdConn) Read(p []byte) (int, error) {
	if c.left == 0 {
		c.hold()
	}
	if c.left > 0 && int64(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.Conn.Read(p)
	if c.left > 0 {
		c.left -= int64(n)
	}
	return n, err
}

// waitState polls state until it is want (within bound).
func waitState(t testing.TB, what string, state func() handoff.State, want handoff.State) {
	t.Helper()
	end := time.Now().Add(bound)
	for {
		s := state()
		if s == want {
			return
		}
		if s.Final() || time.Now().After(end) {
			t.Fatalf("%s is %v, want %v", what, s, want)
		}
		time.Sleep(time.Millisecond)
	}
}

// waitStep waits (within bound) for a step of event e in history.
func waitStep(t testing.TB, history func() []handoff.Step, e handoff.Event) handoff.Step {
	t.Helper()
	for end := time.Now().Add(bound); time.Now().Before(end); time.Sleep(time.Millisecond) {
		for _, s := range history() {
			if s.Event == e {
				return s
			}
		}
	}
	t.Fatalf("no %v step in %v", e, history())
	return handoff.Step{}
}

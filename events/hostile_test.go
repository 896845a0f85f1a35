package events

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/internal/syncbuf"
)

// The tests here play hostile or broken peers against a Publisher while
// a well-behaved zmq4 subscriber keeps receiving: after each attack the
// engine seals a new chain and the subscriber must get it.

// harness is a publisher with a PUB and a replay socket on loopback and
// one well-behaved zmq4 subscriber.
type harness struct {
	t    *testing.T
	pool *kvlease.Pool[[]byte]
	pub  *Publisher
	sub  zmq4.Socket
	msgs chan zmq4.Msg
	seed int
	bt   int
}

func newHarness(t *testing.T, cfg Config, blocks, blockTokens int) *harness {
	t.Helper()
	mem, err := kvlease.NewHostMemory(blocks, 16)
	require.NoError(t, err)
	pool, err := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(blockTokens), kvlease.WithKVEvents(64))
	require.NoError(t, err)
	t.Cleanup(func() { pool.Close() })
	cfg.Endpoint, cfg.Bind = "tcp://127.0.0.1:0", true
	if cfg.ReplayEndpoint == "" {
		cfg.ReplayEndpoint = "tcp://127.0.0.1:0"
	}
	cfg.Pod, cfg.Model = "pod", "m"
	pub, err := NewPublisher(cfg, Source{Pool: pool})
	require.NoError(t, err)
	t.Cleanup(func() { pub.Close() })
	h := &harness{t: t, pool: pool, pub: pub, msgs: make(chan zmq4.Msg, 1024), bt: blockTokens}
	h.sub = h.subscribe()
	return h
}

// subscribe connects a zmq4 subscriber and waits until the publisher
// knows it; its messages go to h.msgs.
func (h *harness) subscribe() zmq4.Socket {
	h.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sub := zmq4.NewSub(ctx)
	h.t.Cleanup(func() { sub.Close(); cancel() })
	before := len(h.pub.Subscriptions())
	require.NoError(h.t, sub.Dial("tcp://"+h.pub.Addr().String()))
	require.NoError(h.t, sub.SetOption(zmq4.OptionSubscribe, "kv@"))
	require.Eventually(h.t, func() bool { return len(h.pub.Subscriptions()) > before }, 10*time.Second, time.Millisecond)
	go func() {
		for {
			m, err := sub.Recv()
			if err != nil {
				return
			}
			h.msgs <- m
		}
	}()
	return sub
}

// roundTrip seals a new chain of n blocks, releases it and waits until
// the subscriber received the batch that stores it.
func (h *harness) roundTrip(n int) {
	h.t.Helper()
	h.awaitChain(h.msgs, h.sealChain(n))
}

// sealChain seals a new chain of n blocks, releases it, flushes the
// publisher and returns the hash of the chain's first block.
func (h *harness) sealChain(n int) uint64 {
	h.t.Helper()
	h.seed++
	bt := h.bt
	l, err := h.pool.Acquire("r", n)
	require.NoError(h.t, err)
	var first kvlease.BlockHash
	parent := kvlease.BlockHash(h.seed)
	for i := range n {
		toks := make([]int32, bt)
		for j := range toks {
			toks[j] = int32(h.seed*1_000_003 + i*bt + j + 1<<20)
		}
		bh, err := l.SealTokens(i, parent, toks)
		require.NoError(h.t, err)
		if i == 0 {
			first = bh
		}
		parent = bh
	}
	l.Release()
	flush(h.t, h.pub)
	return uint64(first)
}

// awaitChain waits (up to 10 s) until msgs delivers the batch that
// stores the chain starting with first.
func (h *harness) awaitChain(msgs <-chan zmq4.Msg, first uint64) {
	h.t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case m := <-msgs:
			require.Len(h.t, m.Frames, 3)
			b, err := DecodeBatch(m.Frames[2])
			require.NoError(h.t, err)
			for _, e := range b.Events {
				if e.Type == "BlockStored" && len(e.BlockHashes) > 0 && e.BlockHashes[0] == first {
					return
				}
			}
		case <-timeout:
			h.t.Fatalf("the subscriber never got chain %x; %+v", first, h.pub.Stats())
		}
	}
}

// rawDial connects to addr with a plain TCP socket.
func rawDial(t *testing.T, addr net.Addr) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr.String(), 5*time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

// rawHandshake completes a NULL handshake as socketType on c.
func rawHandshake(t *testing.T, c net.Conn, socketType string) *bufio.Reader {
	t.Helper()
	out := appendGreeting(nil, false)
	out = appendReady(out, socketType)
	_, err := c.Write(out)
	require.NoError(t, err)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
	r := bufio.NewReader(c)
	var g [greetingLen]byte
	_, err = io.ReadFull(r, g[:])
	require.NoError(t, err)
	_, err = parseGreeting(g[:])
	require.NoError(t, err)
	var buf []byte
	hdr, body, err := readFrame(r, 1<<10, &buf)
	require.NoError(t, err)
	require.True(t, hdr.command())
	name, _, err := parseCommand(body)
	require.NoError(t, err)
	require.Equal(t, "READY", name)
	require.NoError(t, c.SetReadDeadline(time.Time{}))
	return r
}

// closedByPeer waits (up to limit) until the publisher closes c: a read
// returns EOF or a reset, after whatever the publisher sent first.
func closedByPeer(t *testing.T, c net.Conn, limit time.Duration) {
	t.Helper()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(limit)))
	_, err := io.Copy(io.Discard, c)
	var ne net.Error
	require.False(t, errors.As(err, &ne) && ne.Timeout(), "connection still open after %v", limit)
}

// hugeCommand is the 73 bytes that crashed zmq4: a greeting and a long
// command frame declaring 2^62 bytes.
func hugeCommand() []byte {
	b := appendGreeting(nil, false)
	b = append(b, flagCommand|flagLong)
	return binary.BigEndian.AppendUint64(b, 1<<62)
}

func TestHostile73BytesCrash(t *testing.T) {
	h := newHarness(t, Config{}, 16, 4)
	require.Len(t, hugeCommand(), 73)
	for _, addr := range []net.Addr{h.pub.Addr(), h.pub.ReplayAddr()} {
		c := rawDial(t, addr)
		_, err := c.Write(hugeCommand())
		require.NoError(t, err)
		closedByPeer(t, c, 5*time.Second)
		h.roundTrip(2)

		// The same after a complete handshake, as a message frame.
		c = rawDial(t, addr)
		rawHandshake(t, c, map[bool]string{true: "SUB", false: "DEALER"}[addr == h.pub.Addr()])
		_, err = c.Write(binary.BigEndian.AppendUint64([]byte{flagLong}, 1<<62))
		require.NoError(t, err)
		closedByPeer(t, c, 5*time.Second)
		h.roundTrip(2)
	}
	require.GreaterOrEqual(t, h.pub.Stats().Refused, uint64(2))
}

// A connection that sends nothing holds no other subscriber or replay
// client up: the handshake runs off the accept loop.
func TestHostileIdleConnection(t *testing.T) {
	h := newHarness(t, Config{HandshakeTimeout: time.Minute}, 16, 4)
	rawDial(t, h.pub.Addr())
	rawDial(t, h.pub.ReplayAddr())
	h.roundTrip(1)
	h.subscribe() // a second subscriber joins while the idle one waits
	h.roundTrip(1)
	replayFrom(t, h.pub, 0, -1)
}

// A greeting sent a byte at a time is cut off at the handshake deadline.
func TestHostileSlowlorisGreeting(t *testing.T) {
	h := newHarness(t, Config{HandshakeTimeout: 300 * time.Millisecond}, 16, 4)
	for _, addr := range []net.Addr{h.pub.Addr(), h.pub.ReplayAddr()} {
		c := rawDial(t, addr)
		g := appendGreeting(nil, false)
		start := time.Now()
		for i := 0; i < len(g); i++ {
			if _, err := c.Write(g[i : i+1]); err != nil {
				break // closed on us: that is the point
			}
			time.Sleep(50 * time.Millisecond)
		}
		closedByPeer(t, c, 5*time.Second)
		require.Less(t, time.Since(start), 5*time.Second)
		h.roundTrip(1)
	}
	require.GreaterOrEqual(t, h.pub.Stats().Refused, uint64(2))
}

// 1,000 connections that never finish their handshake: beyond
// MaxHandshakes they are refused at once, the others end at the
// deadline; the subscriber already there keeps receiving throughout, and
// a new one can join afterwards.
func TestHostileThousandHalfOpen(t *testing.T) {
	const n = 1000
	h := newHarness(t, Config{HandshakeTimeout: 500 * time.Millisecond, MaxHandshakes: 16}, 16, 4)
	conns := make([]net.Conn, 0, n)
	for i := range n {
		c, err := net.DialTimeout("tcp", h.pub.Addr().String(), 5*time.Second)
		require.NoError(t, err)
		conns = append(conns, c)
		_, _ = c.Write(appendGreeting(nil, false)[:10]) // a signature, then nothing
		if i%100 == 0 {
			h.roundTrip(1)
		}
	}
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	h.roundTrip(1)
	deadline := time.Now().Add(20 * time.Second)
	var wg sync.WaitGroup
	for _, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = c.SetReadDeadline(deadline)
			_, _ = io.Copy(io.Discard, c)
		}()
	}
	wg.Wait()
	require.True(t, time.Now().Before(deadline), "every half-open connection closed by the publisher in time")
	require.GreaterOrEqual(t, h.pub.Stats().Refused, uint64(n))
	h.subscribe()
	h.roundTrip(1)
}

// stalledSubscriber connects a raw subscriber to everything that never
// reads, with a tiny receive buffer.
func stalledSubscriber(t *testing.T, h *harness) net.Conn {
	t.Helper()
	c := rawDial(t, h.pub.Addr())
	require.NoError(t, c.(*net.TCPConn).SetReadBuffer(4096))
	rawHandshake(t, c, "SUB")
	_, err := c.Write(append(appendFrameHeader(nil, 0, 1), 1)) // subscribe to everything
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(h.pub.Subscriptions()) == 2 }, 10*time.Second, time.Millisecond)
	return c
}

// A subscriber that subscribes and never reads loses messages to its HWM;
// the allocator and the other subscriber never wait for it.
func TestHostileSubscriberNeverReads(t *testing.T) {
	h := newHarness(t, Config{HWM: 4, SendTimeout: time.Hour}, 64, 4096)
	stalledSubscriber(t, h)
	// ~160 KiB a batch, until the stalled subscriber's socket buffers
	// and queue are full (bounded: 100 batches are far more than they hold).
	rounds := 0
	for ; rounds < 100 && h.pub.Stats().SubscriberDrops == 0; rounds++ {
		h.roundTrip(8)
	}
	t.Logf("first drop after %d batches", rounds)
	for range 5 {
		h.roundTrip(8)
	}
	st := h.pub.Stats()
	require.Positive(t, st.SubscriberDrops, "the stalled subscriber lost messages to its HWM")
	require.Zero(t, st.DroppedBatches, "the publisher itself dropped nothing")
	require.Len(t, h.pub.Subscriptions(), 2, "it is still connected (SendTimeout is an hour)")
}

// A subscriber whose socket takes no byte for SendTimeout is dropped.
func TestHostileStalledSubscriberDropped(t *testing.T) {
	h := newHarness(t, Config{HWM: 4, SendTimeout: 200 * time.Millisecond}, 64, 4096)
	stalledSubscriber(t, h)
	for i := 0; i < 100 && len(h.pub.Subscriptions()) == 2; i++ {
		h.roundTrip(8)
	}
	require.Eventually(t, func() bool { return len(h.pub.Subscriptions()) == 1 }, 10*time.Second, 5*time.Millisecond,
		"the stalled subscriber is dropped after SendTimeout")
	h.roundTrip(1)
}

// replayFrom asks the replay socket for the batches from start with a
// zmq4 DEALER and returns their seqs; want ≥ 0 checks how many.
func replayFrom(t *testing.T, p *Publisher, start uint64, want int) []uint64 {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dealer := zmq4.NewDealer(ctx, zmq4.WithID(zmq4.SocketIdentity(fmt.Sprint("replayer-", start))))
	defer dealer.Close()
	require.NoError(t, dealer.Dial("tcp://"+p.ReplayAddr().String()))
	require.NoError(t, dealer.Send(zmq4.NewMsgFrom(nil, binary.BigEndian.AppendUint64(nil, start))))
	var seqs []uint64
	for range 10_000 {
		m := recvTimeout(t, dealer)
		require.Len(t, m.Frames, 4)
		if string(m.Frames[2]) == string(replayEnd) {
			if want >= 0 {
				require.Len(t, seqs, want)
			}
			return seqs
		}
		_, err := DecodeBatch(m.Frames[3])
		require.NoError(t, err)
		seqs = append(seqs, binary.BigEndian.Uint64(m.Frames[2]))
	}
	t.Fatal("no end of replay")
	return nil
}

// Replay requests of the wrong shape are ignored (and counted) on a
// connection that stays usable; protocol violations close it; a real
// client is served throughout.
func TestHostileMalformedReplay(t *testing.T) {
	h := newHarness(t, Config{}, 16, 4)
	h.roundTrip(1)
	msg := func(frames ...[]byte) []byte {
		var b []byte
		for i, f := range frames {
			flags := byte(flagMore)
			if i == len(frames)-1 {
				flags = 0
			}
			b = appendFrameHeader(b, flags, len(f))
			b = append(b, f...)
		}
		return b
	}
	seq0 := binary.BigEndian.AppendUint64(nil, 0)
	c := rawDial(t, h.pub.ReplayAddr())
	r := rawHandshake(t, c, "DEALER")
	for _, bad := range [][]byte{
		msg(seq0),                        // no delimiter
		msg(nil, seq0[:7]),               // short seq
		msg(nil, seq0, nil),              // a frame too many
		msg([]byte("x"), seq0),           // a delimiter that is not empty
		appendCommand(nil, "HELLO", nil), // an unknown command
	} {
		_, err := c.Write(bad)
		require.NoError(t, err)
	}
	_, err := c.Write(msg(nil, seq0)) // still answered
	require.NoError(t, err)
	var buf []byte
	require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
	ends := 0
	for ends == 0 {
		hdr, body, err := readFrame(r, 1<<20, &buf)
		require.NoError(t, err)
		if !hdr.more() && len(body) == 0 {
			ends++
		}
	}
	require.EqualValues(t, 4, h.pub.Stats().MalformedReplays)

	for _, violation := range [][]byte{
		msg(nil, nil, nil, nil, nil, nil, nil, nil, nil), // nine frames
		{0x08, 0},                   // a reserved flag bit
		{flagCommand | flagMore, 0}, // a command with MORE
		append(appendFrameHeader(nil, flagMore, 0), appendCommand(nil, "PING", []byte{0, 1})...), // a command inside a message
		appendCommand(nil, "PING", make([]byte, 40)),                                             // a PING with an oversized context
	} {
		c := rawDial(t, h.pub.ReplayAddr())
		rawHandshake(t, c, "DEALER")
		_, err := c.Write(violation)
		require.NoError(t, err)
		closedByPeer(t, c, 5*time.Second)
	}
	replayFrom(t, h.pub, 0, 1)
	h.roundTrip(1)
}

// A replay answer holds at most ReplayPerRequest batches, whatever the
// ring keeps; a client that never reads its answers stalls no other.
func TestReplayBoundedPerRequest(t *testing.T) {
	h := newHarness(t, Config{ReplayPerRequest: 3, SendTimeout: 300 * time.Millisecond}, 64, 1024)
	for range 10 {
		h.roundTrip(4)
	}
	require.Equal(t, []uint64{0, 1, 2}, replayFrom(t, h.pub, 0, 3))
	require.Equal(t, []uint64{5, 6, 7}, replayFrom(t, h.pub, 5, 3))

	// A client pipelines requests and never reads.
	c := rawDial(t, h.pub.ReplayAddr())
	require.NoError(t, c.(*net.TCPConn).SetReadBuffer(4096))
	rawHandshake(t, c, "DEALER")
	var req []byte
	for range 200 {
		req = appendFrameHeader(req, flagMore, 0)
		req = appendFrameHeader(req, 0, 8)
		req = binary.BigEndian.AppendUint64(req, 0)
	}
	_, err := c.Write(req)
	require.NoError(t, err)
	require.Equal(t, []uint64{0, 1, 2}, replayFrom(t, h.pub, 0, 3))
	require.Eventually(t, func() bool { return h.pub.replay.clients() == 0 }, 10*time.Second, 5*time.Millisecond,
		"the client that never reads is dropped after SendTimeout")
	h.roundTrip(1)
}

// Closing the publisher ends connections still in their handshake at
// once, not at their deadline; so does the end of Start's context.
func TestPublisherStopsWithContext(t *testing.T) {
	mem, err := kvlease.NewHostMemory(4, 16)
	require.NoError(t, err)
	pool, err := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(4), kvlease.WithKVEvents(16))
	require.NoError(t, err)
	defer pool.Close()
	ctx, cancel := context.WithCancel(context.Background())
	pub, err := Start(ctx, Config{Endpoint: "tcp://127.0.0.1:0", Bind: true, ReplayEndpoint: "tcp://127.0.0.1:0",
		HandshakeTimeout: time.Hour}, Source{Pool: pool})
	require.NoError(t, err)
	c := rawDial(t, pub.Addr())
	r := rawDial(t, pub.ReplayAddr())
	time.Sleep(20 * time.Millisecond) // accepted and in their handshake
	cancel()
	select {
	case <-pub.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("publisher still running after its context ended")
	}
	closedByPeer(t, c, 5*time.Second)
	closedByPeer(t, r, 5*time.Second)
	require.ErrorIs(t, pub.Flush(context.Background()), ErrClosed)
	require.NoError(t, pub.Close())
}

// With no endpoint the publisher binds loopback (vLLM's port); a
// tcp://*: endpoint binds every interface and says so in the log.
func TestPublisherDefaultsToLoopback(t *testing.T) {
	mem, err := kvlease.NewHostMemory(4, 16)
	require.NoError(t, err)
	pool, err := kvlease.NewPool[[]byte](mem, kvlease.WithKVEvents(16))
	require.NoError(t, err)
	defer pool.Close()
	pub, err := NewPublisher(Config{}, Source{Pool: pool})
	if err != nil {
		// The port may be taken on this machine; the attempt was still
		// loopback only.
		require.ErrorContains(t, err, "127.0.0.1:5557")
	} else {
		require.True(t, pub.Addr().(*net.TCPAddr).IP.IsLoopback(), "%v", pub.Addr())
		require.NoError(t, pub.Close())
	}

	var log syncbuf.Buffer
	pub, err = NewPublisher(Config{Endpoint: "tcp://*:0", Logger: newTextLogger(&log)}, Source{Pool: pool})
	require.NoError(t, err)
	defer pub.Close()
	require.True(t, pub.Addr().(*net.TCPAddr).IP.IsUnspecified())
	require.Contains(t, log.String(), "every interface")
}

func newTextLogger(w io.Writer) *slog.Logger { return slog.New(slog.NewTextHandler(w, nil)) }

// A socket bound where other hosts can reach it is logged; loopback and
// ipc are not.
func TestWarnExposedBinds(t *testing.T) {
	for _, c := range []struct {
		ep   string
		addr net.Addr
		want string
	}{
		{"tcp://*:1", &net.TCPAddr{IP: net.IPv6unspecified, Port: 1}, "every interface"},
		{"tcp://10.1.2.3:1", &net.TCPAddr{IP: net.IPv4(10, 1, 2, 3), Port: 1}, "network address"},
		{"tcp://127.0.0.1:1", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1}, ""},
		{"tcp://[::1]:1", &net.TCPAddr{IP: net.IPv6loopback, Port: 1}, ""},
		{"ipc:///tmp/kv", &net.UnixAddr{Name: "/tmp/kv", Net: "unix"}, ""},
	} {
		ep, err := parseEndpoint(c.ep)
		require.NoError(t, err)
		var log syncbuf.Buffer
		warnAll(newTextLogger(&log), "PUB", ep, c.addr)
		if c.want == "" {
			require.Empty(t, log.String(), c.ep)
		} else {
			require.Contains(t, log.String(), c.want, c.ep)
		}
	}
}

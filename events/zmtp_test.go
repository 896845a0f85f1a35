package events

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// scriptConn is a net.Conn whose peer sends script and reads nothing.
type scriptConn struct {
	r *bytes.Reader
}

func (c scriptConn) Read(b []byte) (int, error)       { return c.r.Read(b) }
func (c scriptConn) Write(b []byte) (int, error)      { return len(b), nil }
func (c scriptConn) Close() error                     { return nil }
func (c scriptConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c scriptConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c scriptConn) SetDeadline(time.Time) error      { return nil }
func (c scriptConn) SetReadDeadline(time.Time) error  { return nil }
func (c scriptConn) SetWriteDeadline(time.Time) error { return nil }

func testLimits() limits {
	return limits{handshake: time.Second, maxMessage: 4096, maxConns: 4, maxPending: 4, perAddr: 4, hwm: 4}
}

func TestGreetingRoundTrip(t *testing.T) {
	g, err := parseGreeting(appendGreeting(nil, true))
	require.NoError(t, err)
	require.Equal(t, greeting{major: 3, minor: 1, mechanism: "NULL", asServer: true}, g)
	for name, mutate := range map[string]func([]byte){
		"signature": func(b []byte) { b[0] = 0 },
		"ZMTP 2":    func(b []byte) { b[10] = 2 },
		"CURVE":     func(b []byte) { copy(b[12:], "CURVE") },
		"padding":   func(b []byte) { b[12+mechanismLen-1] = 'x' },
		"as-server": func(b []byte) { b[32] = 7 },
	} {
		b := appendGreeting(nil, false)
		mutate(b)
		_, err := parseGreeting(b)
		require.ErrorIs(t, err, ErrProtocol, name)
	}
}

func TestParseReady(t *testing.T) {
	data := appendProperty(nil, "socket-type", "DEALER")
	data = appendProperty(data, "Identity", "abc")
	data = appendProperty(data, "X-Other", "ignored")
	p, err := parseReady(data)
	require.NoError(t, err)
	require.Equal(t, readyProps{socketType: "DEALER"}, p)
	for name, bad := range map[string][]byte{
		"no socket type":  appendProperty(nil, "Identity", "x"),
		"value too long":  binary.BigEndian.AppendUint32(append([]byte{1}, 'a'), 1<<31),
		"empty name":      {0, 0, 0, 0, 0},
		"long identity":   appendProperty(appendProperty(nil, "Socket-Type", "DEALER"), "Identity", string(make([]byte, 256))),
		"truncated value": appendProperty(nil, "Socket-Type", "DEALER")[:15],
	} {
		_, err := parseReady(bad)
		require.ErrorIs(t, err, ErrProtocol, name)
	}
}

func TestParseEndpoint(t *testing.T) {
	for ep, want := range map[string]endpoint{
		"tcp://*:5557":         {network: "tcp", addr: ":5557", all: true},
		"tcp://0.0.0.0:1":      {network: "tcp", addr: "0.0.0.0:1", all: true},
		"tcp://[::]:1":         {network: "tcp", addr: "[::]:1", all: true},
		"tcp://127.0.0.1:5557": {network: "tcp", addr: "127.0.0.1:5557"},
		"tcp://router:5557":    {network: "tcp", addr: "router:5557"},
		"ipc:///tmp/kv":        {network: "unix", addr: "/tmp/kv"},
	} {
		got, err := parseEndpoint(ep)
		require.NoError(t, err, ep)
		require.Equal(t, want, got, ep)
	}
	for _, ep := range []string{"", "tcp://", "tcp://host", "inproc://kv", "ipc://", "udp://x:1"} {
		_, err := parseEndpoint(ep)
		require.ErrorIs(t, err, ErrInvalidConfig, ep)
	}
}

// The handshake refuses a peer of the wrong socket type.
func TestHandshakeSocketType(t *testing.T) {
	script := appendGreeting(nil, false)
	script = appendReady(script, "PUSH")
	_, _, err := handshake(scriptConn{bytes.NewReader(script)}, "PUB", true, []string{"SUB", "XSUB"}, testLimits())
	require.ErrorIs(t, err, ErrProtocol)
	script = appendReady(appendGreeting(nil, false), "SUB")
	_, _, err = handshake(scriptConn{bytes.NewReader(script)}, "PUB", true, []string{"SUB", "XSUB"}, testLimits())
	require.NoError(t, err)
}

// Subscriptions in both forms: ZMTP 3.0 messages and 3.1 commands; only
// prefixes of the topic count.
func TestSubscriptionForms(t *testing.T) {
	s := newPubSocket("kv@pod@m", testLimits(), nil)
	c := &subConn{s: s, counts: make([]int64, len(s.topic)+1)}
	sub, ok := parseSubscriptionMessage([]byte("\x01kv@"))
	require.True(t, ok)
	c.subscribe(sub)
	require.True(t, c.matches.Load())
	c.subscribe(subscription{subscribe: true, topic: []byte("other")})
	c.subscribe(subscription{subscribe: true, topic: []byte("kv@pod@m-longer")})
	require.Equal(t, int64(1), c.counts[3])
	sub, _ = parseSubscriptionMessage([]byte("\x00kv@"))
	c.subscribe(sub)
	require.False(t, c.matches.Load())
	c.subscribe(subscription{topic: []byte("kv@")}) // a cancel without subscribe changes nothing
	require.Zero(t, c.counts[3])
	_, ok = parseSubscriptionMessage([]byte("\x02kv@"))
	require.False(t, ok)
}

// FuzzZMTPPeer plays the fuzzer as a subscriber or replay client: the
// handshake and then every message and command it sends. Nothing may
// panic, every error wraps ErrProtocol or is an I/O error, and no frame
// or message beyond the limit is ever held.
func FuzzZMTPPeer(f *testing.F) {
	ready := appendReady(appendGreeting(nil, false), "SUB")
	f.Add(append(ready, 0, 4, 1, 'k', 'v', '@'))
	f.Add(append(ready, appendCommand(nil, "SUBSCRIBE", []byte("kv"))...))
	f.Add(append(ready, appendCommand(nil, "PING", []byte{0, 10, 'x'})...))
	f.Add(append(appendReady(appendGreeting(nil, false), "DEALER"), 1, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 1))
	f.Add(hugeCommand())
	f.Fuzz(func(t *testing.T, data []byte) {
		lim := testLimits()
		_, r, err := handshake(scriptConn{bytes.NewReader(data)}, "PUB", true, []string{"SUB", "XSUB", "DEALER"}, lim)
		if err != nil {
			require.True(t, errors.Is(err, ErrProtocol) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF), "%v", err)
			return
		}
		s := newPubSocket("kv@p@m", lim, nil)
		c := &subConn{s: s, counts: make([]int64, len(s.topic)+1)}
		pr := peerReader{r: r, limit: lim.maxMessage}
		for range 1000 {
			cmd, cdata, frames, err := pr.next()
			if err != nil {
				require.True(t, errors.Is(err, ErrProtocol) || isClosedErr(err), "%v", err)
				return
			}
			require.LessOrEqual(t, cap(pr.frame), lim.maxMessage)
			require.LessOrEqual(t, len(pr.buf), lim.maxMessage)
			require.LessOrEqual(t, len(frames), maxPeerFrames)
			switch cmd {
			case "SUBSCRIBE", "CANCEL":
				c.subscribe(subscription{subscribe: cmd == "SUBSCRIBE", topic: cdata})
			case "PING":
				_, _ = pingReply(nil, cdata)
			case "":
				if len(frames) == 1 {
					if sub, ok := parseSubscriptionMessage(frames[0]); ok {
						c.subscribe(sub)
					}
				}
			}
			var sum int64
			for _, k := range c.counts {
				require.GreaterOrEqual(t, k, int64(0))
				sum += k
			}
			require.Equal(t, sum, c.total)
			require.Equal(t, sum > 0, c.matches.Load())
		}
	})
}

// FuzzParseReady: any READY body parses or fails with ErrProtocol.
func FuzzParseReady(f *testing.F) {
	f.Add(appendProperty(nil, "Socket-Type", "SUB"))
	f.Add(appendProperty(appendProperty(nil, "Identity", "x"), "Socket-Type", "DEALER"))
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := parseReady(data)
		if err != nil {
			require.ErrorIs(t, err, ErrProtocol)
			return
		}
		require.NotEmpty(t, p.socketType)
	})
}

// FuzzParseEndpoint: any endpoint string parses or fails with
// ErrInvalidConfig; a parsed one names tcp or unix.
func FuzzParseEndpoint(f *testing.F) {
	for _, s := range []string{"tcp://*:5557", "tcp://[::1]:0", "ipc:///tmp/x", "tcp://a:b:c"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		e, err := parseEndpoint(s)
		if err != nil {
			require.ErrorIs(t, err, ErrInvalidConfig)
			return
		}
		require.Contains(t, []string{"tcp", "unix"}, e.network)
	})
}

// readFrame never allocates beyond its limit, whatever the header says.
func TestReadFrameLimit(t *testing.T) {
	var buf []byte
	r := bufio.NewReader(bytes.NewReader(binary.BigEndian.AppendUint64([]byte{flagLong}, 1<<62)))
	_, _, err := readFrame(r, 1<<20, &buf)
	require.ErrorIs(t, err, ErrProtocol)
	require.Zero(t, cap(buf))
}

// FuzzReplayRequests plays the fuzzer as a replay client after its
// handshake: whatever it sends, the service does not panic, returns once
// the input ends, and writes no more than a bounded amount per byte
// received (at most perRequest batches per request, a PONG per PING).
func FuzzReplayRequests(f *testing.F) {
	req := func(seq uint64) []byte {
		b := appendFrameHeader(nil, flagMore, 0)
		b = appendFrameHeader(b, 0, 8)
		return binary.BigEndian.AppendUint64(b, seq)
	}
	f.Add(req(0))
	f.Add(append(req(1), req(0)...))
	f.Add(append(appendCommand(nil, "PING", []byte{0, 1, 'a'}), req(2)...))
	f.Add([]byte{flagMore, 0, flagMore, 0, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		ring := &replayRing{max: 4}
		for i := range uint64(6) {
			ring.add(i, []byte{byte(i)})
		}
		s := newReplaySocket("kv@p@m", ring, 2, testLimits(), nil)
		var out countingConn
		out.r = bytes.NewReader(data)
		s.serve(&out, bufio.NewReader(out.r))
		// A request takes at least 6 bytes and is answered with at most
		// 2 batches of 4 frames (≤ 25 bytes here) and an end (16 bytes);
		// a PING of n bytes with a PONG of fewer.
		requests := len(data)/6 + 1
		require.LessOrEqual(t, out.written, requests*(2*(2+2+8+2+8+2+1)+2+2+10+2)+16*len(data))
	})
}

// countingConn is a scriptConn that counts what is written to it.
type countingConn struct {
	scriptConn
	written int
}

func (c *countingConn) Write(b []byte) (int, error) {
	c.written += len(b)
	return len(b), nil
}

// Both sockets close once: the first close ends the connections still in
// their handshake (long before its deadline) and closes done; a second
// close is a no-op.
func TestSocketsCloseOnce(t *testing.T) {
	lim := testLimits()
	lim.handshake = time.Hour
	ep := endpoint{network: "tcp", addr: "127.0.0.1:0"}
	pub := newPubSocket("kv", lim, slog.Default())
	require.NoError(t, pub.listen(ep))
	rep := newReplaySocket("kv", &replayRing{max: 1}, 1, lim, slog.Default())
	require.NoError(t, rep.listen(ep))
	pc, rc := rawDial(t, pub.addr()), rawDial(t, rep.addr())
	require.Eventually(t, func() bool { return rep.clients() == 1 }, 5*time.Second, time.Millisecond)
	require.Eventually(t, func() bool {
		pub.mu.Lock()
		defer pub.mu.Unlock()
		return pub.shaking.len() == 1
	}, 5*time.Second, time.Millisecond)
	for range 2 {
		require.NoError(t, pub.close())
		require.NoError(t, rep.close())
	}
	<-pub.done
	<-rep.done
	closedByPeer(t, pc, 5*time.Second)
	closedByPeer(t, rc, 5*time.Second)
}

// A peer's messages cost no allocation once the reader's buffers have
// grown: what a peer sends does not drive the garbage collector.
func TestPeerReaderNoAllocPerMessage(t *testing.T) {
	msg := appendFrameHeader(nil, flagMore, 0)
	msg = appendFrameHeader(msg, 0, 8)
	msg = binary.BigEndian.AppendUint64(msg, 7)
	const runs = 100
	data := bytes.Repeat(msg, runs+2) // AllocsPerRun runs once more to warm up
	pr := peerReader{r: bufio.NewReader(bytes.NewReader(data)), limit: 4096}
	allocs := testing.AllocsPerRun(runs, func() {
		_, _, frames, err := pr.next()
		if err != nil || len(frames) != 2 || binary.BigEndian.Uint64(frames[1]) != 7 {
			t.Fatalf("frames %q, err %v", frames, err)
		}
	})
	require.Zero(t, allocs)
}

// FuzzParseReplayRequest: any frames parse as a request only in the one
// shape [empty, 8-byte seq], whose seq comes back.
func FuzzParseReplayRequest(f *testing.F) {
	f.Add([]byte{}, binary.BigEndian.AppendUint64(nil, 5), true)
	f.Add([]byte{1}, []byte{0, 0, 0, 0, 0, 0, 0, 1}, true)
	f.Add([]byte{}, []byte{1, 2, 3}, false)
	f.Fuzz(func(t *testing.T, a, b []byte, two bool) {
		frames := [][]byte{a}
		if two {
			frames = append(frames, b)
		}
		start, ok := parseReplayRequest(frames)
		require.Equal(t, two && len(a) == 0 && len(b) == 8, ok)
		if ok {
			require.Equal(t, binary.BigEndian.Uint64(b), start)
		}
	})
}

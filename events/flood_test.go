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
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
)

// The floods of issue 30 (item 5) on the event stream: an outsider on
// the same host holds subscribers that never subscribe, half-open
// handshakes, or silent replay clients, redialling each one the
// publisher closes, while an honest router on another address
// (127.0.0.1; all of 127/8 is loopback on Linux, so the attacker dials
// from 127.0.0.2 and up) joins five times and must be served each time.
// Before the per-address caps and the idle drops, each flood locked the
// router out (0 of 5 greetings answered).

// attackerAddr is where the floods come from.
const attackerAddr = "127.0.0.2"

// flood keeps n connections from one local address to a socket: each is
// dialled, set up (a handshake, a partial greeting) and then held,
// reading whatever comes, until the publisher closes it; then it is
// dialled again after a pause, as an attacker keeping its hold would.
// Bounded: at most floodDials dials per connection, and it stops when
// the test ends.
type flood struct {
	dials, closed atomic.Int64
	mu            sync.Mutex
	conns         map[net.Conn]struct{}
	stopped       bool
	stop          chan struct{}
	wg            sync.WaitGroup
}

const (
	floodDials = 1000
	floodPause = 20 * time.Millisecond
)

func startFlood(t *testing.T, from string, to net.Addr, n int, setup func(net.Conn) error) *flood {
	t.Helper()
	f := &flood{conns: map[net.Conn]struct{}{}, stop: make(chan struct{})}
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}, Timeout: 5 * time.Second}
	for range n {
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			for range floodDials {
				c, err := d.Dial("tcp", to.String())
				f.dials.Add(1)
				if err == nil && f.hold(c) {
					if setup(c) == nil {
						_, _ = io.Copy(io.Discard, c) // until the publisher (or the test's end) closes it
					}
					f.release(c)
					f.closed.Add(1)
				}
				select {
				case <-f.stop:
					return
				case <-time.After(floodPause):
				}
			}
		}()
	}
	t.Cleanup(f.end)
	return f
}

func (f *flood) hold(c net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.stopped {
		_ = c.Close()
		return false
	}
	f.conns[c] = struct{}{}
	return true
}

func (f *flood) release(c net.Conn) {
	f.mu.Lock()
	delete(f.conns, c)
	f.mu.Unlock()
	_ = c.Close()
}

func (f *flood) end() {
	f.mu.Lock()
	if !f.stopped {
		f.stopped = true
		close(f.stop)
		for c := range f.conns {
			_ = c.Close()
		}
	}
	f.mu.Unlock()
	f.wg.Wait()
}

// zmtpHandshake completes a NULL handshake as socketType, without the
// test's assertions (it runs on a flood's goroutines).
func zmtpHandshake(c net.Conn, socketType string) error {
	if _, err := c.Write(appendReady(appendGreeting(nil, false), socketType)); err != nil {
		return err
	}
	if err := c.SetReadDeadline(time.Now().Add(10 * time.Second)); err != nil {
		return err
	}
	r := bufio.NewReader(c)
	var g [greetingLen]byte
	if _, err := io.ReadFull(r, g[:]); err != nil {
		return err
	}
	var buf []byte
	if _, _, err := readFrame(r, 1<<10, &buf); err != nil {
		return err
	}
	return c.SetReadDeadline(time.Time{})
}

// The three ways to hold a place without doing anything.
var (
	neverSubscribe = func(c net.Conn) error { return zmtpHandshake(c, "SUB") }
	silentReplay   = func(c net.Conn) error { return zmtpHandshake(c, "DEALER") }
	halfOpen       = func(c net.Conn) error {
		_, err := c.Write(appendGreeting(nil, false)[:10]) // a signature, then nothing
		return err
	}
)

// quietHarness is newHarness with a logger that drops the floods'
// thousands of refusals.
func quietHarness(t *testing.T, cfg Config) *harness {
	t.Helper()
	cfg.Logger = slog.New(slog.DiscardHandler)
	return newHarness(t, cfg, 64, 4)
}

// locked runs get (a count of a socket's tables) under the socket's lock.
func locked(s *sockLife, get func() int) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return get()
}

// honestRouter joins as a new zmq4 subscriber from 127.0.0.1 rounds
// times, each time until it receives a chain sealed after it joined,
// and returns how long each join took (dial to first batch received).
// Any refusal fails the test.
func honestRouter(t *testing.T, h *harness, rounds int) []time.Duration {
	t.Helper()
	var took []time.Duration
	for range rounds {
		start := time.Now()
		ctx, cancel := context.WithCancel(context.Background())
		sub := zmq4.NewSub(ctx)
		before := len(h.pub.Subscriptions())
		require.NoError(t, sub.Dial("tcp://"+h.pub.Addr().String()), "the honest router was refused")
		require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, "kv@"))
		require.Eventually(t, func() bool { return len(h.pub.Subscriptions()) > before }, 10*time.Second, time.Millisecond,
			"the honest router's subscription never arrived")
		msgs := make(chan zmq4.Msg, 64)
		go func() {
			for {
				m, err := sub.Recv()
				if err != nil {
					return
				}
				msgs <- m
			}
		}()
		h.awaitChain(msgs, h.sealChain(1))
		took = append(took, time.Since(start))
		sub.Close()
		cancel()
		require.Eventually(t, func() bool { return len(h.pub.Subscriptions()) == before }, 10*time.Second, time.Millisecond)
	}
	return took
}

// honestReplays asks the replay socket from 127.0.0.1 rounds times
// (a new zmq4 DEALER each time) and returns how long each answer took.
func honestReplays(t *testing.T, h *harness, rounds int) []time.Duration {
	t.Helper()
	var took []time.Duration
	for range rounds {
		start := time.Now()
		require.NotEmpty(t, replayFrom(t, h.pub, 0, -1))
		took = append(took, time.Since(start))
	}
	return took
}

// logServed logs the honest router's rounds and what the attacker did
// meanwhile (dialsBefore: its dials when the rounds began).
func logServed(t *testing.T, what string, took []time.Duration, f *flood, dialsBefore int64) {
	t.Helper()
	s := slices.Clone(took)
	slices.Sort(s)
	t.Logf("%s: honest router served %d of %d, median %v, slowest %v; attacker dialled %d times meanwhile (%d in all, %d closed by the publisher)",
		what, len(took), len(took), s[len(s)/2].Round(time.Microsecond), s[len(s)-1].Round(time.Microsecond),
		f.dials.Load()-dialsBefore, f.dials.Load(), f.closed.Load())
}

// 64 subscribers that finish the handshake and never subscribe are sent
// nothing, so SendTimeout never ends them; with the defaults they held
// every subscriber place. Now one address holds MaxPerAddress of them
// (and each at most HandshakeTimeout); the router gets through.
func TestFloodSubscribersNeverSubscribe(t *testing.T) {
	h := quietHarness(t, Config{})
	f := startFlood(t, attackerAddr, h.pub.Addr(), DefaultMaxSubscribers, neverSubscribe)
	attacker := func() int {
		return locked(&h.pub.pub.sockLife, func() int { return len(h.pub.pub.conns.byAddr[attackerAddr]) })
	}
	require.Eventually(t, func() bool { return attacker() >= DefaultMaxPerAddress && f.dials.Load() >= DefaultMaxSubscribers },
		10*time.Second, time.Millisecond)
	d0 := f.dials.Load()
	took := honestRouter(t, h, 5)
	require.Equal(t, DefaultMaxPerAddress, attacker(), "the flood still holds its share: it was there throughout")
	logServed(t, "64 subscribers that never subscribe", took, f, d0)
}

// 32 silent half-open handshakes held every handshake place (and were
// redialled as they timed out). Now one address holds MaxPerAddress.
func TestFloodHalfOpenHandshakes(t *testing.T) {
	h := quietHarness(t, Config{})
	f := startFlood(t, attackerAddr, h.pub.Addr(), DefaultMaxHandshakes, halfOpen)
	attacker := func() int {
		return locked(&h.pub.pub.sockLife, func() int { return len(h.pub.pub.shaking.byAddr[attackerAddr]) })
	}
	require.Eventually(t, func() bool { return attacker() >= DefaultMaxPerAddress && f.dials.Load() >= DefaultMaxHandshakes },
		10*time.Second, time.Millisecond)
	d0 := f.dials.Load()
	took := honestRouter(t, h, 5)
	require.Positive(t, attacker(), "the flood still holds handshakes: it was there throughout")
	logServed(t, "32 silent half-open handshakes", took, f, d0)
}

// 64 silent replay clients held every replay place. Now one address
// holds MaxPerAddress, each at most ReplayIdleTimeout.
func TestFloodSilentReplayClients(t *testing.T) {
	h := quietHarness(t, Config{})
	h.roundTrip(1) // something to replay
	f := startFlood(t, attackerAddr, h.pub.ReplayAddr(), DefaultMaxSubscribers, silentReplay)
	attacker := func() int {
		return locked(&h.pub.replay.sockLife, func() int { return len(h.pub.replay.conns.byAddr[attackerAddr]) })
	}
	require.Eventually(t, func() bool { return attacker() >= DefaultMaxPerAddress && f.dials.Load() >= DefaultMaxSubscribers },
		10*time.Second, time.Millisecond)
	d0 := f.dials.Load()
	took := honestReplays(t, h, 5)
	require.Equal(t, DefaultMaxPerAddress, attacker(), "the flood still holds its share: it was there throughout")
	logServed(t, "64 silent replay clients", took, f, d0)
}

// When one address (allowed a high per-address cap) or several fill a
// table, a connection from an address that holds fewer displaces the
// oldest of the busiest: the router gets through on every table.
func TestFloodDisplacedByQuieterAddress(t *testing.T) {
	t.Run("subscribers", func(t *testing.T) {
		h := quietHarness(t, Config{MaxSubscribers: 16, MaxPerAddress: 64, HandshakeTimeout: time.Minute})
		f := startFlood(t, attackerAddr, h.pub.Addr(), 32, neverSubscribe)
		total := func() int { return locked(&h.pub.pub.sockLife, h.pub.pub.conns.len) }
		require.Eventually(t, func() bool { return total() == 16 && f.closed.Load() > 0 }, 10*time.Second, time.Millisecond)
		d0 := f.dials.Load()
		took := honestRouter(t, h, 5)
		require.Eventually(t, func() bool { return total() == 16 }, 10*time.Second, time.Millisecond,
			"the flood takes back the router's place: it was there throughout")
		require.Positive(t, h.pub.Stats().Refused)
		logServed(t, "subscriber table full from one address", took, f, d0)
	})
	t.Run("handshakes", func(t *testing.T) {
		h := quietHarness(t, Config{MaxHandshakes: 8, MaxPerAddress: 64, HandshakeTimeout: time.Minute})
		f := startFlood(t, attackerAddr, h.pub.Addr(), 16, halfOpen)
		total := func() int { return locked(&h.pub.pub.sockLife, h.pub.pub.shaking.len) }
		require.Eventually(t, func() bool { return total() == 8 && f.dials.Load() >= 16 }, 10*time.Second, time.Millisecond)
		d0 := f.dials.Load()
		took := honestRouter(t, h, 5)
		logServed(t, "handshake table full from one address", took, f, d0)
	})
	t.Run("handshakes from four addresses", func(t *testing.T) {
		h := quietHarness(t, Config{MaxHandshakes: 8, MaxPerAddress: 2, HandshakeTimeout: time.Minute})
		var floods []*flood
		for i := range 4 {
			floods = append(floods, startFlood(t, fmt.Sprintf("127.0.0.%d", 2+i), h.pub.Addr(), 4, halfOpen))
		}
		total := func() int { return locked(&h.pub.pub.sockLife, h.pub.pub.shaking.len) }
		require.Eventually(t, func() bool { return total() == 8 }, 10*time.Second, time.Millisecond)
		d0 := floods[0].dials.Load()
		took := honestRouter(t, h, 5)
		logServed(t, "handshake table full from four addresses", took, floods[0], d0)
	})
	t.Run("replay clients", func(t *testing.T) {
		h := quietHarness(t, Config{MaxSubscribers: 8, MaxPerAddress: 64, ReplayIdleTimeout: time.Minute})
		h.roundTrip(1)
		f := startFlood(t, attackerAddr, h.pub.ReplayAddr(), 16, silentReplay)
		total := func() int { return locked(&h.pub.replay.sockLife, h.pub.replay.conns.len) }
		require.Eventually(t, func() bool { return total() == 8 && f.closed.Load() > 0 }, 10*time.Second, time.Millisecond)
		d0 := f.dials.Load()
		took := honestReplays(t, h, 5)
		logServed(t, "replay table full from one address", took, f, d0)
	})
}

// A subscriber that holds no subscription is dropped once
// HandshakeTimeout passes: after its handshake, after cancelling its
// last subscription, and whatever PINGs it sends meanwhile. One that
// keeps a subscription stays.
func TestSubscriberWithoutSubscriptionDropped(t *testing.T) {
	h := quietHarness(t, Config{HandshakeTimeout: 500 * time.Millisecond})

	silent := rawDial(t, h.pub.Addr())
	rawHandshake(t, silent, "SUB")

	pinger := rawDial(t, h.pub.Addr())
	pr := rawHandshake(t, pinger, "SUB")
	pingDone := make(chan struct{})
	go func() { // PINGs until closed: they do not count as a subscription
		defer close(pingDone)
		for range 1000 {
			if _, err := pinger.Write(appendCommand(nil, "PING", []byte{0, 10})); err != nil {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	go func() { _, _ = io.Copy(io.Discard, pr) }()

	canceller := rawDial(t, h.pub.Addr())
	rawHandshake(t, canceller, "SUB")
	sub := append(appendFrameHeader(nil, 0, 4), 1, 'k', 'v', '@')
	_, err := canceller.Write(sub)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(h.pub.Subscriptions()) == 2 }, 10*time.Second, time.Millisecond)

	closedByPeer(t, silent, 10*time.Second)
	closedByPeer(t, pinger, 10*time.Second)
	<-pingDone
	// The canceller outlived the other two (HandshakeTimeout, with a
	// subscription); it cancels, and goes the same way.
	_, err = canceller.Write(append(appendFrameHeader(nil, 0, 4), 0, 'k', 'v', '@'))
	require.NoError(t, err)
	closedByPeer(t, canceller, 10*time.Second)
	require.EqualValues(t, 3, h.pub.Stats().IdleDrops)
	h.roundTrip(1) // the harness's subscriber, subscribed all along, stays
	require.Len(t, h.pub.Subscriptions(), 1)
}

// A replay client is dropped ReplayIdleTimeout after its handshake or
// its last answer; a zmq4 DEALER that asks again later simply redials.
func TestReplayIdleClientDropped(t *testing.T) {
	h := quietHarness(t, Config{ReplayIdleTimeout: 300 * time.Millisecond})
	h.roundTrip(1)
	c := rawDial(t, h.pub.ReplayAddr())
	r := rawHandshake(t, c, "DEALER")
	req := appendFrameHeader(nil, flagMore, 0)
	req = appendFrameHeader(req, 0, 8)
	req = binary.BigEndian.AppendUint64(req, 0)
	_, err := c.Write(req)
	require.NoError(t, err)
	var buf []byte
	require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
	for done := false; !done; {
		hdr, body, err := readFrame(r, 1<<20, &buf)
		require.NoError(t, err, "the answer came before the idle timeout")
		done = !hdr.more() && len(body) == 0
	}
	_, err = io.Copy(io.Discard, r)
	var ne net.Error
	require.False(t, errors.As(err, &ne) && ne.Timeout(), "still open 10 s after its last answer")
	require.EqualValues(t, 1, h.pub.Stats().IdleDrops)
	require.Eventually(t, func() bool { return h.pub.replay.clients() == 0 }, 10*time.Second, time.Millisecond)
	require.Equal(t, []uint64{0}, replayFrom(t, h.pub, 0, 1))
}

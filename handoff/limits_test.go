package handoff

import (
	"errors"
	"net"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/internal/wire"
)

// Tests of the per-identity bounds: blocks and handoffs across an
// identity's sessions, sessions per identity and in all, the idle
// timeout.

// keyring is a destination's PSK that knows the test key under the ids
// "honest" and "hog" (and "test").
var keyring = &PSK{ID: testPSK.ID, Key: testPSK.Key, Keys: map[string][]byte{"honest": testPSK.Key, "hog": testPSK.Key}}

func as(id string) *PSK { return &PSK{ID: id, Key: testPSK.Key} }

// destination returns a destination over pool with the keyring and a
// function that serves one more session on a pipe and returns the
// source's end.
func destination(t testing.TB, pool *kvlease.Pool[[]byte], cfg DestinationConfig[[]byte]) (*Destination[[]byte], func() net.Conn) {
	t.Helper()
	cfg.Envelope, cfg.Auth = testEnvelope(), keyring
	dst, err := NewDestination(pool, newManualPlane(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return dst, func() net.Conn {
		a, b := net.Pipe()
		served := make(chan error, 1)
		go func() { served <- dst.Serve(b) }()
		t.Cleanup(func() {
			_ = a.Close()
			<-served
		})
		return a
	}
}

// ask proposes id (n blocks) on c and returns the answer.
func ask(t testing.TB, c *wire.Conn, id uint64, n uint32) wire.Message {
	t.Helper()
	if err := c.Send(&ProposeMsg{ID: id, Blocks: n, Envelope: testEnvelope().Fingerprint()}); err != nil {
		t.Fatal(err)
	}
	m, err := c.Read()
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestIdentityBlocks: the hog, one identity with three sessions
// each proposing half the pool and never starting, holds half the pool
// at most (the second and third are refused, counted), while another
// identity is served from the other half; IdentityLimits gives one
// identity more, and an identity's room comes back as its handoffs end.
func TestIdentityBlocks(t *testing.T) {
	pool := newHostPool(t, 32, hbBytes)
	dst, open := destination(t, pool, DestinationConfig[[]byte]{StartTimeout: -1,
		IdentityLimits: func(id string) Limits {
			if id == "psk:test" {
				return Limits{Blocks: -1}
			}
			return Limits{}
		}})
	var hog []*wire.Conn
	for k := range 3 {
		c := rawSource(t, open(), as("hog"))
		hog = append(hog, c)
		m := ask(t, c, 1, 16)
		switch r, _ := m.(*wire.RejectMsg); {
		case k == 0 && m.Type() != wire.MsgAccept:
			t.Fatalf("the hog's first session: %v", m)
		case k > 0 && (r == nil || r.Code != wire.RejectLimit || !strings.Contains(r.Reason, "would make psk:hog hold 32, at most 16")):
			t.Fatalf("the hog's session %d: %#v", k+1, m)
		}
	}
	if st := dst.Stats(); st.IdentityRefused != 2 || st.LimitRefused != 0 {
		t.Fatalf("stats %+v", st)
	}
	// Another identity gets the other half; its own cap is the default.
	h := rawSource(t, open(), as("honest"))
	for id, want := range []wire.MsgType{wire.MsgAccept, wire.MsgAccept, wire.MsgReject} {
		if m := ask(t, h, uint64(id+1), 8); m.Type() != want {
			t.Fatalf("the honest identity's proposal %d: %v, want %v", id+1, m, want)
		}
	}
	if s := pool.Stats(); s.Leased != 32 {
		t.Fatalf("pool %+v", s)
	}
	// The hog's first handoff ends: its second session has room again.
	if err := hog[0].Send(&wire.AbortMsg{ID: 1}); err != nil {
		t.Fatal(err)
	}
	if m, err := hog[0].Read(); err != nil || m.Type() != wire.MsgAck {
		t.Fatalf("%v %v", m, err)
	}
	if m := ask(t, hog[1], 2, 16); m.Type() != wire.MsgAccept {
		t.Fatalf("after the hog's first handoff ended: %v", m)
	}
	// "psk:test" has no block cap (IdentityLimits), only the session's.
	c := rawSource(t, open(), testPSK)
	if m := ask(t, c, 1, 16); m.Type() != wire.MsgReject || !strings.Contains(m.(*wire.RejectMsg).Reason, "exhausted") {
		t.Fatalf("a full pool: %v", m)
	}
	if st := dst.Stats(); st.IdentityRefused != 2 || st.LimitRefused != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// TestIdentityHandoffs: handoffs in flight are capped per identity
// across its sessions.
func TestIdentityHandoffs(t *testing.T) {
	pool := newHostPool(t, 32, hbBytes)
	dst, open := destination(t, pool, DestinationConfig[[]byte]{StartTimeout: -1,
		IdentityLimits: func(string) Limits { return Limits{Handoffs: 3} }})
	a, b := rawSource(t, open(), testPSK), rawSource(t, open(), testPSK)
	for i, want := range []wire.MsgType{wire.MsgAccept, wire.MsgAccept, wire.MsgAccept, wire.MsgReject} {
		c := a
		if i%2 == 1 {
			c = b
		}
		if m := ask(t, c, uint64(i+1), 1); m.Type() != want {
			t.Fatalf("proposal %d: %v, want %v", i+1, m, want)
		}
	}
	if st := dst.Stats(); st.IdentityRefused != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// TestSessionLimits: sessions per identity and in all are capped; the
// session past a cap is refused at the end of its handshake (NewSource
// fails with ErrLimit, both sides count it), and a session that ends
// makes room. Another identity is not held back by one at its cap.
func TestSessionLimits(t *testing.T) {
	pool := newHostPool(t, 32, hbBytes)
	dst, open := destination(t, pool, DestinationConfig[[]byte]{MaxSessions: 3,
		IdentityLimits: func(id string) Limits {
			if id == "psk:hog" {
				return Limits{Sessions: 2}
			}
			return Limits{}
		}})
	source := func(id string) (*Source[[]byte], error) {
		return NewSource(open(), newManualPlane(), HalfConfig{Envelope: testEnvelope(), Auth: as(id)})
	}
	var hog []*Source[[]byte]
	for range 2 {
		s, err := source("hog")
		if err != nil {
			t.Fatal(err)
		}
		hog = append(hog, s)
	}
	s, err := source("hog")
	if s != nil || !errors.Is(err, ErrLimit) || errors.Is(err, ErrAuth) || !strings.Contains(err.Error(), "refused the session") {
		t.Fatalf("a third session of the hog: %v", err)
	}
	if s, err = source("honest"); err != nil {
		t.Fatalf("another identity: %v", err)
	}
	if _, err := source("test"); !errors.Is(err, ErrLimit) {
		t.Fatalf("a fourth session in all: %v", err)
	}
	_ = hog[0].Close()
	var again *Source[[]byte]
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(time.Millisecond) {
		if again, err = source("hog"); err == nil {
			break
		}
	}
	if err != nil {
		t.Fatalf("a session once another of the hog ended: %v", err)
	}
	// The destination counts a session just after its confirm went out.
	for end := time.Now().Add(10 * time.Second); dst.Stats().Sessions < 4 && time.Now().Before(end); time.Sleep(time.Millisecond) {
	}
	if st := dst.Stats(); st.SessionsRefused < 2 || st.AuthRefused != 0 || st.Sessions != 4 {
		t.Fatalf("stats %+v", st)
	}
	for _, x := range []*Source[[]byte]{hog[1], s, again} {
		_ = x.Close()
	}
}

// TestSessionIdleTimeout: a session with nothing in flight for
// SessionIdleTimeout is closed (counted); one with a handoff in flight
// is not, and its timeout counts from when its last handoff ended.
func TestSessionIdleTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		pool := newHostPool(t, 32, hbBytes)
		dst, err := NewDestination(pool, newManualPlane(), DestinationConfig[[]byte]{
			HalfConfig:   HalfConfig{Envelope: testEnvelope(), Auth: testPSK},
			StartTimeout: -1, SessionIdleTimeout: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		a, b := net.Pipe()
		served := make(chan error, 1)
		go func() { served <- dst.Serve(b) }()
		c := rawSource(t, a, testPSK)
		open := func() bool {
			synctest.Wait()
			select {
			case <-served:
				return false
			default:
				return true
			}
		}
		time.Sleep(59 * time.Second)
		if m := ask(t, c, 1, 4); m.Type() != wire.MsgAccept {
			t.Fatal(m)
		}
		time.Sleep(10 * time.Minute) // in flight: not idle
		if !open() {
			t.Fatal("a session with a handoff in flight was closed")
		}
		if err := c.Send(&wire.AbortMsg{ID: 1}); err != nil {
			t.Fatal(err)
		}
		if m, err := c.Read(); err != nil || m.Type() != wire.MsgAck {
			t.Fatalf("%v %v", m, err)
		}
		time.Sleep(time.Minute - time.Nanosecond)
		if !open() {
			t.Fatal("closed before its idle timeout")
		}
		time.Sleep(time.Nanosecond)
		synctest.Wait()
		select {
		case err := <-served:
			if !errors.Is(err, errIdle) {
				t.Fatalf("Serve: %v", err)
			}
		default:
			t.Fatal("an idle session was not closed")
		}
		if st := dst.Stats(); st.IdleClosed != 1 || st.FramesRefused != 0 {
			t.Fatalf("stats %+v", st)
		}
		if _, err := c.Read(); err == nil {
			t.Fatal("the source's end still reads")
		}
		_ = a.Close()
	})
}

// TestSourceDoneOnIdleClose: a real Source learns that the destination
// closed its idle session from Done, without proposing, and Err says
// why; Close on a live session closes Done too.
func TestSourceDoneOnIdleClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		pool := newHostPool(t, 32, hbBytes)
		dst, err := NewDestination(pool, newManualPlane(), DestinationConfig[[]byte]{
			HalfConfig:         HalfConfig{Envelope: testEnvelope(), Auth: testPSK},
			SessionIdleTimeout: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		open := func() (*Source[[]byte], chan error) {
			a, b := net.Pipe()
			served := make(chan error, 1)
			go func() { served <- dst.Serve(b) }()
			src, err := NewSource(a, newManualPlane(), HalfConfig{Envelope: testEnvelope(), Auth: testPSK})
			if err != nil {
				t.Fatal(err)
			}
			return src, served
		}
		done := func(s *Source[[]byte]) bool {
			synctest.Wait()
			select {
			case <-s.Done():
				return true
			default:
				return false
			}
		}
		src, served := open()
		time.Sleep(time.Minute - time.Nanosecond)
		if done(src) || src.Err() != nil {
			t.Fatalf("Done before the idle timeout (Err %v)", src.Err())
		}
		time.Sleep(time.Nanosecond)
		if !done(src) {
			t.Fatal("Done still open after the destination closed the idle session")
		}
		if err := src.Err(); !errors.Is(err, ErrConnLost) {
			t.Fatalf("Err: %v", err)
		}
		if err := <-served; !errors.Is(err, errIdle) {
			t.Fatalf("Serve: %v", err)
		}
		_ = src.Close()

		live, served := open()
		if done(live) || live.Err() != nil {
			t.Fatal("a new session is done at once")
		}
		_ = live.Close()
		if !done(live) || !errors.Is(live.Err(), ErrConnLost) {
			t.Fatalf("after Close: Err %v", live.Err())
		}
		<-served
		if st := dst.Stats(); st.IdleClosed != 1 {
			t.Fatalf("stats %+v", st)
		}
	})
}

package handoff

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/internal/wire"
	"github.com/kvlease/kvlease/internal/testpki"
)

// Tests of the authentication: the handshake in each mode and its
// refusals, the psk record layer, authorization, and the per-session
// bounds, with hand-played peers where a real half would not misbehave.

// issue returns a leaf certificate of ca for uri (a URI SAN) valid until
// notAfter, for 127.0.0.1 and "decode".
func issue(t testing.TB, ca *testpki.CA, uri string, notAfter time.Time) tls.Certificate {
	t.Helper()
	return ca.Issue(t, testpki.Leaf{Name: uri, URI: uri, DNS: []string{"decode"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1)},
		Usage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}, NotAfter: notAfter})
}

// tlsPair returns a source's and a destination's TLS authenticators,
// both issued by ca, with URI identities.
func tlsPair(t testing.TB, ca *testpki.CA) (src, dst *TLS) {
	later := time.Now().Add(time.Hour)
	src = &TLS{Config: &tls.Config{Certificates: []tls.Certificate{issue(t, ca, "spiffe://kvlease/prefill", later)}, RootCAs: ca.Pool, ServerName: "decode"}}
	dst = &TLS{Config: &tls.Config{Certificates: []tls.Certificate{issue(t, ca, "spiffe://kvlease/decode", later)}, ClientCAs: ca.Pool}}
	return src, dst
}

// handshakePair runs both sides' handshakes over a pipe and returns
// their results.
func handshakePair(src, dst Authenticator) (cs, ds *handshake, cerr, derr error) {
	a, b := net.Pipe()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		ds, derr = authenticate(b, false, dst, 7, time.Second)
		if derr != nil {
			_ = b.Close()
		}
	}()
	cs, cerr = authenticate(a, true, src, 7, time.Second)
	if cerr != nil {
		_ = a.Close()
	}
	wg.Wait()
	_ = a.Close()
	_ = b.Close()
	return cs, ds, cerr, derr
}

// TestAuthRequired: no authenticator and no Insecure is refused, with an
// error that says how to fix it; so are both at once and authenticators
// that cannot work.
func TestAuthRequired(t *testing.T) {
	pool := newHostPool(t, 32, hbBytes)
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	ca := testpki.NewCA(t, "ca")
	srcTLS, _ := tlsPair(t, ca)
	for _, tt := range []struct {
		name string
		half HalfConfig
		want string
	}{
		{"none", HalfConfig{}, "set HalfConfig.Auth to &handoff.PSK"},
		{"both", HalfConfig{Auth: testPSK, Insecure: true}, "both Auth and Insecure"},
		{"short key", HalfConfig{Auth: &PSK{ID: "x", Key: []byte("short")}}, "at least 16 bytes"},
		{"tls without config", HalfConfig{Auth: &TLS{}}, "needs a *tls.Config"},
		{"tls destination without ClientCAs", HalfConfig{Auth: srcTLS}, "ClientCAs"},
	} {
		tt.half.Envelope = testEnvelope()
		_, derr := NewDestination(pool, newManualPlane(), DestinationConfig[[]byte]{HalfConfig: tt.half})
		if !errors.Is(derr, kvlease.ErrInvalidArgument) || !strings.Contains(derr.Error(), tt.want) {
			t.Errorf("%s: NewDestination: %v, want ErrInvalidArgument and %q", tt.name, derr, tt.want)
		}
		if tt.name == "tls destination without ClientCAs" {
			continue // a source config
		}
		_, serr := NewSource(a, newManualPlane(), tt.half)
		if !errors.Is(serr, kvlease.ErrInvalidArgument) || !strings.Contains(serr.Error(), tt.want) {
			t.Errorf("%s: NewSource: %v, want ErrInvalidArgument and %q", tt.name, serr, tt.want)
		}
	}
}

// TestHandshake: each mode's handshake between matching and mismatched
// sides: who succeeds, the identities, and every refusal wrapping ErrAuth
// (a downgrade marked as one).
func TestHandshake(t *testing.T) {
	ca, other := testpki.NewCA(t, "ca"), testpki.NewCA(t, "other")
	srcTLS, dstTLS := tlsPair(t, ca)
	strangerTLS, _ := tlsPair(t, other)
	expired := &TLS{Config: &tls.Config{Certificates: []tls.Certificate{issue(t, ca, "spiffe://kvlease/old", time.Now().Add(-time.Minute))}, RootCAs: ca.Pool, ServerName: "decode"}}
	otherKey := &PSK{ID: "test", Key: []byte("another key, also 32 bytes long.")}
	ring := &PSK{Keys: map[string][]byte{"fleet-a": testPSK.Key, "fleet-b": otherKey.Key}}
	for _, tt := range []struct {
		name          string
		src, dst      Authenticator
		ok            bool
		srcID, dstID  string // identities each side reports of the other
		downgradeSide string // "src", "dst": which side counts a downgrade
	}{
		{"psk", testPSK, testPSK, true, "psk:test", "psk:test", ""},
		{"psk keyring", &PSK{ID: "fleet-b", Key: otherKey.Key}, ring, true, "psk:fleet-b", "psk:fleet-b", ""},
		{"psk wrong key", otherKey, testPSK, false, "", "", ""},
		{"psk unknown id", &PSK{ID: "nobody", Key: testPSK.Key}, testPSK, false, "", "", ""},
		{"tls", srcTLS, dstTLS, true, "spiffe://kvlease/decode", "spiffe://kvlease/prefill", ""},
		{"tls unknown cert", strangerTLS, dstTLS, false, "", "", ""},
		{"tls expired cert", expired, dstTLS, false, "", "", ""},
		{"insecure source, psk destination", nil, testPSK, false, "", "", "dst"},
		{"psk source, insecure destination", testPSK, nil, false, "", "", "src"},
		{"tls source, psk destination", srcTLS, testPSK, false, "", "", ""},
		{"psk source, tls destination", testPSK, dstTLS, false, "", "", ""},
		{"insecure", nil, nil, true, "", "", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cs, ds, cerr, derr := handshakePair(tt.src, tt.dst)
			if !tt.ok {
				if cerr == nil || derr == nil {
					t.Fatalf("source %v, destination %v: want both refused", cerr, derr)
				}
				for side, err := range map[string]error{"src": cerr, "dst": derr} {
					var ae *authError
					isAE := errors.As(err, &ae)
					if errors.Is(err, ErrAuth) != true {
						t.Errorf("%s: %v does not wrap ErrAuth", side, err)
					}
					if want := side == tt.downgradeSide; want && (!isAE || !ae.downgrade) {
						t.Errorf("%s: %v not marked a downgrade", side, err)
					}
				}
				return
			}
			if cerr != nil || derr != nil {
				t.Fatalf("source %v, destination %v", cerr, derr)
			}
			if cs.peer.Identity != tt.srcID || ds.peer.Identity != tt.dstID {
				t.Errorf("identities: source sees %q, destination sees %q", cs.peer.Identity, ds.peer.Identity)
			}
			// Both sides derive the same data-plane keys (none when
			// insecure), distinct per label and context.
			k1, e1 := cs.peer.Key("plane", []byte{1}, 32)
			k2, e2 := ds.peer.Key("plane", []byte{1}, 32)
			k3, _ := ds.peer.Key("plane", []byte{2}, 32)
			if tt.src == nil {
				if e1 == nil || e2 == nil || cs.peer.Secure() {
					t.Errorf("an insecure session gives keys: %v %v", e1, e2)
				}
				return
			}
			if e1 != nil || e2 != nil || !bytes.Equal(k1, k2) || bytes.Equal(k1, k3) {
				t.Errorf("data keys: %x %x %x (%v %v)", k1, k2, k3, e1, e2)
			}
		})
	}
}

// TestHalvesRefuseBeforeActing: a source with the wrong key is refused
// by a destination in its handshake; nothing of it is acted on, nothing
// acquired, and both sides count it.
func TestHalvesRefuseBeforeActing(t *testing.T) {
	pool := newHostPool(t, 32, hbBytes)
	accepted := 0
	dst, err := NewDestination(pool, newManualPlane(), DestinationConfig[[]byte]{
		HalfConfig: HalfConfig{Envelope: testEnvelope(), Auth: testPSK},
		OnAccept:   func(*Incoming[[]byte]) { accepted++ },
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name      string
		half      HalfConfig
		downgrade int64
	}{
		{"wrong key", HalfConfig{Auth: &PSK{ID: "test", Key: []byte("not the key, but 32 bytes long..")}}, 0},
		{"insecure", HalfConfig{Insecure: true, Logf: quiet}, 1},
	} {
		a, b := net.Pipe()
		served := make(chan error, 1)
		go func() { served <- dst.Serve(b) }()
		tt.half.Envelope = testEnvelope()
		src, err := NewSource(a, newManualPlane(), tt.half)
		if src != nil || !errors.Is(err, ErrAuth) {
			t.Fatalf("%s: NewSource: %v", tt.name, err)
		}
		if err := <-served; !errors.Is(err, ErrAuth) {
			t.Fatalf("%s: Serve: %v", tt.name, err)
		}
		if tt.downgrade > 0 && !strings.Contains(err.Error(), "this side requires none") {
			t.Errorf("%s: the source's error does not say what it offered: %v", tt.name, err)
		}
	}
	st := dst.Stats()
	if st.AuthRefused != 2 || st.Downgrades != 1 || st.Sessions != 0 || accepted != 0 {
		t.Fatalf("stats %+v, %d accepted", st, accepted)
	}
	if s := pool.Stats(); s.Free != s.Capacity || s.Acquires != 0 {
		t.Fatalf("pool %+v", s)
	}
}

// recordTap is a connection that copies what is written to it once the
// handshake is over (after arm), so a test can replay it.
type recordTap struct {
	net.Conn
	mu    sync.Mutex
	armed bool
	out   [][]byte
}

func (c *recordTap) Write(p []byte) (int, error) {
	c.mu.Lock()
	if c.armed {
		c.out = append(c.out, append([]byte(nil), p...))
	}
	c.mu.Unlock()
	return c.Conn.Write(p)
}

// TestReplayedRecordEndsSession: a record the source sent, written again
// on its connection, ends the destination's session (ErrAuth, counted)
// before it is acted on: the handoff it carried is not proposed twice.
func TestReplayedRecordEndsSession(t *testing.T) {
	pool := newHostPool(t, 32, hbBytes)
	var mu sync.Mutex
	proposals := 0
	dst, _ := NewDestination(pool, newManualPlane(), DestinationConfig[[]byte]{
		HalfConfig:   HalfConfig{Envelope: testEnvelope(), Auth: testPSK},
		StartTimeout: -1,
		Decide: func(*ProposeMsg) error {
			mu.Lock()
			proposals++
			mu.Unlock()
			return errors.New("no")
		},
	})
	a, b := net.Pipe()
	served := make(chan error, 1)
	go func() { served <- dst.Serve(b) }()
	tap := &recordTap{Conn: a}
	src, err := NewSource(tap, newManualPlane(), HalfConfig{Envelope: testEnvelope(), Auth: testPSK})
	if err != nil {
		t.Fatal(err)
	}
	tap.mu.Lock()
	tap.armed = true
	tap.mu.Unlock()
	l, _ := newHostPool(t, 32, hbBytes).Acquire("r", 2)
	o, err := src.Propose(1, "r", l, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st := o.Wait(10 * time.Second); st != Rejected || !errors.Is(o.Err(), ErrRejected) {
		t.Fatalf("handoff %v: %v", st, o.History())
	}
	tap.mu.Lock()
	replay := tap.out[0]
	tap.mu.Unlock()
	// The destination refuses the record on its header: the rest of the
	// write may find the pipe closed.
	_, _ = a.Write(replay)
	select {
	case err := <-served:
		if !errors.Is(err, ErrAuth) || !strings.Contains(err.Error(), "replayed") {
			t.Fatalf("Serve: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the replay did not end the session")
	}
	mu.Lock()
	defer mu.Unlock()
	if proposals != 1 || dst.Stats().FramesRefused != 1 {
		t.Fatalf("%d proposals decided, stats %+v", proposals, dst.Stats())
	}
	_ = src.Close()
	l.Release()
}

// rawSource plays a source by hand: it authenticates conn with auth and
// returns its control connection.
func rawSource(t testing.TB, conn net.Conn, auth Authenticator) *wire.Conn {
	t.Helper()
	h, err := authenticate(conn, true, auth, testEnvelope().Fingerprint(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c := wire.NewConn(h.conn2, h.ch, time.Second)
	return c
}

// servedDestination serves one pipe with a destination over pool and
// returns the source's end.
func servedDestination(t testing.TB, pool *kvlease.Pool[[]byte], cfg DestinationConfig[[]byte]) (*Destination[[]byte], net.Conn, chan error) {
	t.Helper()
	cfg.Envelope, cfg.Auth = testEnvelope(), testPSK
	dst, err := NewDestination(pool, newManualPlane(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	a, b := net.Pipe()
	served := make(chan error, 1)
	go func() { served <- dst.Serve(b) }()
	t.Cleanup(func() {
		_ = a.Close()
		<-served
	})
	return dst, a, served
}

// TestAuthorize: the destination's Authorize sees the authenticated
// identity; its refusal rejects before anything is acquired, counted.
func TestAuthorize(t *testing.T) {
	pool := newHostPool(t, 32, hbBytes)
	var seen []string
	dst, a, _ := servedDestination(t, pool, DestinationConfig[[]byte]{
		Authorize: func(p *Peer, m *ProposeMsg) error {
			seen = append(seen, p.String())
			if m.Request != "allowed" {
				return errors.New("not on the allowlist")
			}
			return nil
		},
	})
	c := rawSource(t, a, testPSK)
	for id, req := range []string{"allowed", "stranger"} {
		if err := c.Send(&ProposeMsg{ID: uint64(id + 1), Request: req, Blocks: 1, Envelope: testEnvelope().Fingerprint()}); err != nil {
			t.Fatal(err)
		}
		m, err := c.Read()
		if err != nil {
			t.Fatal(err)
		}
		switch m := m.(type) {
		case *wire.AcceptMsg:
			if req != "allowed" {
				t.Fatalf("%s accepted", req)
			}
		case *wire.RejectMsg:
			if req == "allowed" || m.Code != wire.RejectPolicy || !strings.Contains(m.Reason, "psk psk:test not authorized: not on the allowlist") {
				t.Fatalf("%s: %+v", req, m)
			}
		}
	}
	if len(seen) != 2 || seen[0] != "psk psk:test" || dst.Stats().Unauthorized != 1 {
		t.Fatalf("Authorize saw %v; stats %+v", seen, dst.Stats())
	}
}

// TestStartTimeout: an Accepted handoff whose Start never comes is
// aborted at StartTimeout, its lease released, the source told; counted.
func TestStartTimeout(t *testing.T) {
	pool := newHostPool(t, 32, hbBytes)
	finals := make(chan *Incoming[[]byte], 1)
	dst, a, _ := servedDestination(t, pool, DestinationConfig[[]byte]{
		StartTimeout: 50 * time.Millisecond,
		OnFinal:      func(in *Incoming[[]byte]) { finals <- in },
	})
	c := rawSource(t, a, testPSK)
	if err := c.Send(&ProposeMsg{ID: 1, Blocks: 4, Envelope: testEnvelope().Fingerprint()}); err != nil {
		t.Fatal(err)
	}
	if m, err := c.Read(); err != nil || m.Type() != wire.MsgAccept {
		t.Fatalf("%v %v", m, err)
	}
	m, err := c.Read()
	if am, ok := m.(*wire.AbortMsg); !ok || err != nil || !strings.Contains(am.Cause, "no start within") {
		t.Fatalf("after the start timeout: %#v %v", m, err)
	}
	in := <-finals
	if in.State() != Aborted || !errors.Is(in.Err(), ErrLimit) {
		t.Fatalf("%v: %v", in.State(), in.Err())
	}
	if s := pool.Stats(); s.Free != s.Capacity || dst.Stats().StartTimeouts != 1 {
		t.Fatalf("pool %+v, stats %+v", s, dst.Stats())
	}
}

// TestSessionCaps: handoffs in flight and blocks held per session are
// capped; a proposal past either is rejected with ErrLimit's code and
// counted, and the session goes on.
func TestSessionCaps(t *testing.T) {
	pool := newHostPool(t, 32, hbBytes)
	dst, a, _ := servedDestination(t, pool, DestinationConfig[[]byte]{MaxHandoffs: 2, MaxSessionBlocks: 6, StartTimeout: -1})
	c := rawSource(t, a, testPSK)
	for _, tt := range []struct {
		id, blocks uint32
		want       wire.MsgType
	}{
		{1, 3, wire.MsgAccept},
		{2, 4, wire.MsgReject}, // 7 blocks > 6
		{3, 3, wire.MsgAccept},
		{4, 1, wire.MsgReject}, // a third in flight
	} {
		if err := c.Send(&ProposeMsg{ID: uint64(tt.id), Blocks: tt.blocks, Envelope: testEnvelope().Fingerprint()}); err != nil {
			t.Fatal(err)
		}
		m, err := c.Read()
		if err != nil || m.Type() != tt.want {
			t.Fatalf("proposal %d: %v %v, want %v", tt.id, m, err, tt.want)
		}
		if r, ok := m.(*wire.RejectMsg); ok && (r.Code != wire.RejectLimit || !errors.Is(rejectSentinel(r.Code), kvlease.ErrExhausted)) {
			t.Fatalf("proposal %d: %+v", tt.id, r)
		}
	}
	// One ends: room again.
	if err := c.Send(&wire.AbortMsg{ID: 1}); err != nil {
		t.Fatal(err)
	}
	if m, err := c.Read(); err != nil || m.Type() != wire.MsgAck {
		t.Fatalf("%v %v", m, err)
	}
	if err := c.Send(&ProposeMsg{ID: 5, Blocks: 3, Envelope: testEnvelope().Fingerprint()}); err != nil {
		t.Fatal(err)
	}
	if m, err := c.Read(); err != nil || m.Type() != wire.MsgAccept {
		t.Fatalf("after an abort: %v %v", m, err)
	}
	if st := dst.Stats(); st.LimitRefused != 2 {
		t.Fatalf("stats %+v", st)
	}
}

// TestRejectedProposalsDoNotGrowTheHeap: 300 proposals of 8192 hashes
// each, all rejected, on one connection: the heap grows by at most 4 MiB
// (each would hold 64 KiB if the table kept it), and a rejected id
// stays refused as a duplicate.
func TestRejectedProposalsDoNotGrowTheHeap(t *testing.T) {
	pool := newHostPool(t, 32, hbBytes)
	_, a, _ := servedDestination(t, pool, DestinationConfig[[]byte]{MaxSessionBlocks: -1})
	c := rawSource(t, a, testPSK)
	hashes := make([]kvlease.BlockHash, 8192)
	for i := range hashes {
		hashes[i] = kvlease.BlockHash(i + 1)
	}
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	propose := func(id uint64) *wire.RejectMsg {
		t.Helper()
		if err := c.Send(&ProposeMsg{ID: id, Blocks: 8192, Envelope: testEnvelope().Fingerprint(), Hashes: hashes}); err != nil {
			t.Fatal(err)
		}
		m, err := c.Read()
		if err != nil {
			t.Fatal(err)
		}
		r, ok := m.(*wire.RejectMsg)
		if !ok {
			t.Fatalf("proposal %d answered %v", id, m)
		}
		return r
	}
	propose(1) // the buffers reach their size
	before := heap()
	for id := uint64(2); id <= 301; id++ {
		if r := propose(id); r.Code != wire.RejectCapacity {
			t.Fatalf("proposal %d: %+v", id, r)
		}
	}
	// The last ones leave the table on their own goroutines: wait (bounded).
	var grown uint64
	for end := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if after := heap(); after < before+4<<20 || time.Now().After(end) {
			grown = after - min(after, before)
			break
		}
	}
	if grown > 4<<20 {
		t.Fatalf("the heap grew by %d bytes over 300 rejected proposals", grown)
	}
	if r := propose(150); r.Code != wire.RejectDuplicate {
		t.Fatalf("a rejected id proposed again: %+v", r)
	}
}

// fakeListener hands out conns, with errs failed Accepts first.
type fakeListener struct {
	errs  chan error
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func (l *fakeListener) Accept() (net.Conn, error) {
	select {
	case err := <-l.errs:
		return nil, err
	default:
	}
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}
func (l *fakeListener) Close() error   { l.once.Do(func() { close(l.done) }); return nil }
func (l *fakeListener) Addr() net.Addr { return &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)} }

// hostConn is a pipe end that says it comes from host.
type hostConn struct {
	net.Conn
	host net.IP
}

func (c hostConn) RemoteAddr() net.Addr { return &net.TCPAddr{IP: c.host, Port: 40000} }

// TestListen: the accept loop survives transient errors (EMFILE) with a
// backoff, counts them, closes at once a connection past
// maxPendingHandshakesPerHost from one host, makes the busiest host's
// oldest handshake give way to a newcomer from another host at
// maxPendingHandshakes, serves the newcomer, and stops only when the
// listener closes.
func TestListen(t *testing.T) {
	pool := newHostPool(t, 32, hbBytes)
	dst, err := NewDestination(pool, newManualPlane(), DestinationConfig[[]byte]{
		HalfConfig: HalfConfig{Envelope: testEnvelope(), Auth: testPSK, HandshakeTimeout: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	ln := &fakeListener{errs: make(chan error, 3), conns: make(chan net.Conn), done: make(chan struct{})}
	for range 3 {
		ln.errs <- fmt.Errorf("accept: %w", syscall.EMFILE)
	}
	listened := make(chan error, 1)
	go func() { listened <- dst.Listen(ln) }()
	closedAtOnce := func(c net.Conn) bool {
		t.Helper()
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err := c.Read(make([]byte, 1))
		return err != nil && !errors.Is(err, os.ErrDeadlineExceeded)
	}
	host := func(k int) net.IP { return net.IPv4(10, 0, 0, byte(k)) }
	dial := func(k int) net.Conn {
		a, b := net.Pipe()
		ln.conns <- hostConn{b, host(k)}
		return a
	}
	// maxPendingHandshakes silent connections, maxPendingHandshakesPerHost
	// from each host; one more from the first host is closed at once.
	hosts := maxPendingHandshakes / maxPendingHandshakesPerHost
	var silent []net.Conn
	for k := range hosts {
		for range maxPendingHandshakesPerHost {
			silent = append(silent, dial(k+1))
		}
		if k == 0 {
			if c := dial(1); !closedAtOnce(c) {
				t.Fatal("a connection past the per-host cap was not closed at once")
			}
		}
	}
	// Full: a source from another host gets in, and the busiest host's
	// oldest handshake (the first host's first) gives way.
	a, b := net.Pipe()
	ln.conns <- hostConn{b, host(hosts + 1)}
	src, err := NewSource(a, newManualPlane(), HalfConfig{Envelope: testEnvelope(), Auth: testPSK})
	if err != nil {
		t.Fatalf("a source from another host while %d handshakes are pending: %v", maxPendingHandshakes, err)
	}
	if !closedAtOnce(silent[0]) {
		t.Fatal("the oldest handshake of the busiest host did not give way")
	}
	for _, c := range silent {
		_ = c.Close()
	}
	// The others fail their handshakes now: their places come back.
	for end := time.Now().Add(10 * time.Second); (dst.Stats().AuthRefused < int64(len(silent)-1) || dst.Stats().Sessions < 1) && time.Now().Before(end); time.Sleep(time.Millisecond) {
	}
	_ = src.Close()
	_ = ln.Close()
	if err := <-listened; err != nil {
		t.Fatal(err)
	}
	if st := dst.Stats(); st.AcceptErrors != 3 || st.Busy != 2 || st.Sessions != 1 || st.AuthRefused != int64(len(silent)-1) {
		t.Fatalf("stats %+v", st)
	}
}

// FuzzHandshake: a destination's handshake over any bytes from a peer
// ends with an error wrapping ErrAuth (or the connection's own), never a
// panic, and never authenticates a peer that does not hold the key.
func FuzzHandshake(f *testing.F) {
	fp := testEnvelope().Fingerprint()
	pre := preamble(AuthPSK, fp)
	f.Add(append(pre[:], make([]byte, 65)...))
	f.Add(append(pre[:], append(bytes.Repeat([]byte{7}, 64), 4, 't', 'e', 's', 't')...))
	f.Add(append(pre[:], append(bytes.Repeat([]byte{9}, 64), append([]byte{4, 't', 'e', 's', 't'}, bytes.Repeat([]byte{1}, 32)...)...)...))
	none := preamble(AuthNone, fp)
	f.Add(none[:])
	f.Add([]byte("GET / HTTP/1.1\r\n\r\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		a, c := net.Pipe()
		defer a.Close()
		go func() { _, _ = io.Copy(io.Discard, c) }() // take the answers
		go func() {
			_, _ = c.Write(b)
			_ = c.Close() // then the peer is gone
		}()
		h, err := authenticate(a, false, testPSK, fp, time.Second)
		if err == nil {
			t.Fatalf("authenticated %v from %d fuzzed bytes", h.peer, len(b))
		}
	})
}

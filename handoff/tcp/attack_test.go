package tcp_test

// The attack suite: a victim decode side (a Destination authenticated
// with a pre-shared key, its Listen loop, a Receiver) in this process, and
// an attacker: the test binary re-executed with attackEnv set, which
// plays one attack against the victim's ports, or sits between an honest
// source and the victim as a proxy and tampers with what passes. Each
// case asserts that the attack was refused, that not one byte of the
// attacker reached any block of the victim's pool, that nothing leaked
// (every block free, the pool's check clean), and that the counters say
// what happened.

import (
	"bufio"
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/big"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/internal/wire"
	"github.com/kvlease/kvlease/handoff/tcp"
	"github.com/kvlease/kvlease/internal/testpki"
)

const attackEnv = "KVLEASE_TCP_ATTACKER"

// attackSpec tells the attacker process what to do.
type attackSpec struct {
	Mode     string   // see runAttacker
	Ctrl     string   // the victim's control address
	Data     string   // the victim's data address
	Stolen   []byte   // a data token the attacker stole (the Accept's plane bytes)
	Captured []byte   // bytes the attacker captured earlier (a record, a stream)
	Conns    int      // connections of a flood
	Blocks   int      // blocks to propose
	Sessions int      // control sessions to open
	Local    []string // the addresses to dial from
}

const (
	atkBlockBytes = 4096
	atkPool       = 64
)

// runAttacker is the attacker process's main: it plays spec.Mode and
// reports "result ..." lines on stdout, then waits for "exit" on stdin.
func runAttacker(v string) int {
	var s attackSpec
	if err := json.Unmarshal([]byte(v), &s); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	say := func(format string, args ...any) { fmt.Printf(format+"\n", args...) }
	env := envFor(atkBlockBytes, atkPool)
	switch s.Mode {
	case "unauthenticated":
		// Speaks the insecure protocol: a preamble that offers no
		// authentication, then a proposal.
		c, err := net.Dial("tcp", s.Ctrl)
		if err != nil {
			say("result error %v", err)
			break
		}
		pre := binary.LittleEndian.AppendUint64([]byte{'K', 'A', wire.ProtocolVersion, byte(handoff.AuthNone)}, env.Fingerprint())
		_, _ = c.Write(append(pre, wire.AppendFrame(nil, &handoff.ProposeMsg{ID: 1, Request: "victim", Blocks: 4, Envelope: env.Fingerprint()})...))
		say("result %s", answer(c))
	case "bare-frames":
		// No handshake at all: a control frame straight away.
		c, err := net.Dial("tcp", s.Ctrl)
		if err != nil {
			say("result error %v", err)
			break
		}
		_, _ = c.Write(wire.AppendFrame(nil, &handoff.ProposeMsg{ID: 1, Request: "victim", Blocks: 4, Envelope: env.Fingerprint()}))
		say("result %s", answer(c))
	case "wrong-key", "wrong-cert":
		c, err := net.Dial("tcp", s.Ctrl)
		if err != nil {
			say("result error %v", err)
			break
		}
		var auth handoff.Authenticator = &handoff.PSK{ID: "test", Key: []byte("a guess at the key, 32 bytes....")}
		if s.Mode == "wrong-cert" {
			auth = &handoff.TLS{Config: selfIssued()}
		}
		src, err := handoff.NewSource(c, tcp.NewSender(tcp.Config{}), handoff.HalfConfig{Envelope: env, Auth: auth})
		if err != nil {
			say("result refused %s", oneLine(err))
			break
		}
		_ = src.Close()
		say("result authenticated")
	case "stolen-token":
		// Three data connections with the stolen token: no MAC (as the
		// insecure plane sends it), a forged MAC, and a guessed token;
		// each followed by blocks of the attacker's bytes.
		_, tok := splitPlane(s.Stolen)
		var guessed [16]byte
		_, _ = rand.Read(guessed[:])
		for _, h := range [][]byte{hello(tok, s.Blocks, 0, nil), hello(tok, s.Blocks, 1, bytes.Repeat([]byte{0xAA}, 32)), hello(guessed[:], s.Blocks, 0, nil)} {
			c, err := net.Dial("tcp", s.Data)
			if err != nil {
				say("result error %v", err)
				continue
			}
			_, _ = c.Write(append(h, attackerBlocks(s.Blocks)...))
			say("result %s", answer(c))
		}
	case "replay-data":
		// A data stream captured from a finished handoff, sent again.
		c, err := net.Dial("tcp", s.Data)
		if err != nil {
			say("result error %v", err)
			break
		}
		_, _ = c.Write(s.Captured)
		say("result %s", answer(c))
	case "flood":
		// Connections that never say hello, held open.
		var conns []net.Conn
		for range s.Conns {
			c, err := net.Dial("tcp", s.Data)
			if err != nil {
				break
			}
			conns = append(conns, c)
		}
		// Each connection read at once (a read past its deadline would
		// not look) for floodWindow, well inside the victim's hello
		// timeout (floodHello): those past the cap are closed in that
		// window however loaded the machine, the others only later.
		var closed atomic.Int32
		var wg sync.WaitGroup
		deadline := time.Now().Add(floodWindow)
		for _, c := range conns {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_ = c.SetReadDeadline(deadline)
				if _, err := c.Read(make([]byte, 1)); err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
					closed.Add(1)
				}
			}()
		}
		wg.Wait()
		say("result closed %d of %d", closed.Load(), len(conns))
		waitExit()
		return 0
	case "hog":
		// An authenticated peer that proposes the whole pool, then half
		// of it, and never starts: its plane's Send never returns.
		c, err := net.Dial("tcp", s.Ctrl)
		if err != nil {
			say("result error %v", err)
			break
		}
		pool := attackerPool(atkPool)
		src, err := handoff.NewSource(c, neverSend{}, handoff.HalfConfig{Envelope: env, Auth: testAuth})
		if err != nil {
			say("result refused %s", oneLine(err))
			break
		}
		for id, n := range []int{atkPool, atkPool / 2} {
			l, _ := pool.Acquire(fmt.Sprint("hog", id), n)
			o, err := src.Propose(uint64(id+1), "hog", l, nil)
			if err != nil {
				say("result error %v", err)
				break
			}
			st := o.Wait(bound)
			say("result %d %v %s", id+1, st, oneLine(o.Err()))
			if st.Final() {
				l.Release()
			}
		}
		waitExit()
		return 0
	case "mitm-control":
		// A proxy between an honest source and the victim: it forwards
		// the handshake, then injects a record captured from another
		// session into the victim's direction.
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			say("result error %v", err)
			break
		}
		say("ready %s", ln.Addr())
		src, err := ln.Accept()
		if err != nil {
			break
		}
		dst, err := net.Dial("tcp", s.Ctrl)
		if err != nil {
			say("result error %v", err)
			break
		}
		go func() {
			_, _ = io.Copy(src, dst)
			_ = src.Close() // the victim hung up: so does the proxy
		}()
		// The source's handshake bytes: preamble, nonce, ephemeral
		// share, key id, MAC.
		n := 12 + 32 + 32 + 1 + len(testAuth.ID) + 32
		if _, err := io.CopyN(dst, src, int64(n)); err != nil {
			say("result error %v", err)
			break
		}
		time.Sleep(50 * time.Millisecond) // the victim has taken the handshake
		_, _ = dst.Write(s.Captured)
		say("result injected %d bytes", len(s.Captured))
		_, _ = io.Copy(dst, src)
	case "mitm-data":
		// A proxy on the victim's data port: the first stream passes and
		// is recorded; the second passes its own hello, then the first
		// stream's blocks instead of its own.
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			say("result error %v", err)
			break
		}
		say("ready %s", ln.Addr())
		if !stdin.Scan() || !strings.HasPrefix(stdin.Text(), "data ") {
			break
		}
		s.Data = strings.TrimPrefix(stdin.Text(), "data ")
		var first bytes.Buffer
		for k := range 2 {
			src, err := ln.Accept()
			if err != nil {
				break
			}
			dst, err := net.Dial("tcp", s.Data)
			if err != nil {
				say("result error %v", err)
				break
			}
			go func() { _, _ = io.Copy(src, dst) }()
			if k == 0 {
				_, _ = io.Copy(io.MultiWriter(dst, &first), src)
				_ = dst.Close()
				say("recorded %d bytes", first.Len())
				continue
			}
			hello := make([]byte, 60)
			if _, err := io.ReadFull(src, hello); err != nil {
				say("result error %v", err)
				break
			}
			_, _ = dst.Write(hello)
			_, _ = dst.Write(first.Bytes()[60:])
			say("result spliced %s", answer(dst))
			_ = src.Close()
		}
	default:
		if boundsAttack(s, say) {
			return 0
		}
		fmt.Fprintln(os.Stderr, "attack mode", s.Mode)
		return 2
	}
	waitExit()
	return 0
}

// stdin is the attacker's command input.
var stdin = bufio.NewScanner(os.Stdin)

// waitExit waits for "exit" (or the end of stdin).
func waitExit() {
	for stdin.Scan() {
		if stdin.Text() == "exit" {
			return
		}
	}
}

func crc32c(b []byte) uint32 { return crc32.Checksum(b, crc32.MakeTable(crc32.Castagnoli)) }

// answer reads what the victim says back until it closes the connection
// (bounded): "closed" when it sent nothing but a handshake preamble,
// else "answered N bytes".
func answer(c net.Conn) string {
	_ = c.SetReadDeadline(time.Now().Add(bound))
	b, err := io.ReadAll(c)
	_ = c.Close()
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return "still-open"
	}
	if len(b) == 0 || (len(b) == 12 && b[0] == 'K' && b[1] == 'A') {
		return "closed"
	}
	return fmt.Sprintf("answered %d bytes", len(b))
}

func oneLine(err error) string {
	if err == nil {
		return "nil"
	}
	return strings.ReplaceAll(err.Error(), "\n", " ")
}

// splitPlane parses a tcp Accept's plane bytes: address, token.
func splitPlane(b []byte) (string, []byte) {
	n := int(binary.LittleEndian.Uint16(b))
	return string(b[2 : 2+n]), b[2+n:]
}

// hello is a data connection's hello with the given token, flags and
// MAC (zeros when nil).
func hello(tok []byte, blocks int, flags byte, mac []byte) []byte {
	h := append([]byte{'K', 'D', 3, flags}, tok...)
	h = binary.LittleEndian.AppendUint32(h, uint32(blocks))
	h = binary.LittleEndian.AppendUint32(h, atkBlockBytes)
	if mac == nil {
		mac = make([]byte, 32)
	}
	return append(h, mac...)
}

// attackerBlocks are a frame layout and block frames full of 0xEE, each
// with a valid crc32c, as the insecure plane would send them.
func attackerBlocks(n int) []byte {
	var b []byte
	block := bytes.Repeat([]byte{0xEE}, atkBlockBytes)
	b = binary.LittleEndian.AppendUint32(b, uint32(n)) // the frame layout: a block per frame
	for range n {
		b = binary.LittleEndian.AppendUint32(b, 1)
	}
	for i := range n {
		b = binary.LittleEndian.AppendUint32(b, uint32(i))
		b = binary.LittleEndian.AppendUint32(b, atkBlockBytes)
		b = append(b, block...)
		b = binary.LittleEndian.AppendUint32(b, crc32c(block))
	}
	return b
}

// neverSend is a send plane whose Send never returns: the source never
// starts what the victim accepted.
type neverSend struct{}

func (neverSend) Send(handoff.PlaneID, [][]byte, []byte, func(*kvlease.Transfer) error) ([]byte, error) {
	select {}
}
func (neverSend) Finish(handoff.PlaneID, error) {}

func attackerPool(blocks int) *kvlease.Pool[[]byte] {
	mem, _ := kvlease.NewHostMemory(blocks, atkBlockBytes)
	p, _ := kvlease.NewPool[[]byte](mem)
	return p
}

// selfIssued is a TLS client config with a certificate of the
// attacker's own making.
func selfIssued() *tls.Config {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "prefill"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	der, _ := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	return &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}, InsecureSkipVerify: true}
}

// startAttacker runs the attacker process with spec.
func startAttacker(t testing.TB, spec attackSpec) *peer {
	t.Helper()
	p := spawn(t, attackEnv, spec)
	t.Cleanup(p.stop)
	return p
}

// victim is the decode side under attack.
type victim struct {
	t      *testing.T
	pool   *kvlease.Pool[[]byte]
	dst    *handoff.Destination[[]byte]
	recv   *tcp.Receiver
	ctl    net.Listener
	data   string // the data listener's real address
	listen chan error

	mu        sync.Mutex
	accepts   int
	delivered map[uint64]*handoff.Incoming[[]byte]
	finals    map[uint64]*handoff.Incoming[[]byte]
}

type victimOpts struct {
	auth         handoff.Authenticator // testAuth when nil
	startTimeout time.Duration
	advertise    string        // the data address the receiver names in its Accepts (a proxy's)
	helloTimeout time.Duration // the receiver's; 2 s when zero
	sessionIdle  time.Duration // the destination's SessionIdleTimeout
}

// advertised is a listener that names another address (a proxy's).
type advertised struct {
	net.Listener
	addr net.Addr
}

func (a advertised) Addr() net.Addr { return a.addr }

func newVictim(t *testing.T, o victimOpts) *victim {
	t.Helper()
	v := &victim{t: t, pool: hostPool2(t, atkPool, atkBlockBytes), listen: make(chan error, 1),
		delivered: map[uint64]*handoff.Incoming[[]byte]{}, finals: map[uint64]*handoff.Incoming[[]byte]{}}
	dl := listen(t)
	v.data = dl.Addr().String()
	var dataLn net.Listener = dl
	if o.advertise != "" {
		a, err := net.ResolveTCPAddr("tcp", o.advertise)
		if err != nil {
			t.Fatal(err)
		}
		dataLn = advertised{dl, a}
	}
	hello := o.helloTimeout
	if hello == 0 {
		hello = 2 * time.Second
	}
	v.recv = tcp.NewReceiver(dataLn, tcp.Config{HelloTimeout: hello})
	if o.auth == nil {
		o.auth = testAuth
	}
	var err error
	v.dst, err = handoff.NewDestination(v.pool, v.recv, handoff.DestinationConfig[[]byte]{
		HalfConfig:         handoff.HalfConfig{Envelope: envFor(atkBlockBytes, atkPool), Name: "decode", Peer: "prefill", Auth: o.auth, Deadline: bound, HandshakeTimeout: 2 * time.Second},
		StartTimeout:       o.startTimeout,
		SessionIdleTimeout: o.sessionIdle,
		OnAccept: func(*handoff.Incoming[[]byte]) {
			v.mu.Lock()
			v.accepts++
			v.mu.Unlock()
		},
		OnDelivered: func(in *handoff.Incoming[[]byte]) {
			v.mu.Lock()
			v.delivered[in.ID()] = in
			v.mu.Unlock()
		},
		OnFinal: func(in *handoff.Incoming[[]byte]) {
			v.mu.Lock()
			v.finals[in.ID()] = in
			v.mu.Unlock()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	v.ctl = listen(t)
	go func() { v.listen <- v.dst.Listen(v.ctl) }()
	t.Cleanup(func() {
		_ = v.ctl.Close()
		<-v.listen
		_ = v.recv.Close()
	})
	return v
}

// untouched checks that no block of the victim's pool holds a byte the
// attacker sent (0xEE), that every block is free, and the pool's check.
func (v *victim) untouched() {
	v.t.Helper()
	for end := time.Now().Add(bound); ; time.Sleep(5 * time.Millisecond) {
		if s := v.pool.Stats(); s.Free+s.Cached == s.Capacity || time.Now().After(end) {
			break
		}
	}
	if s := v.pool.Stats(); s.Free+s.Cached != s.Capacity || s.OpenLeases != 0 {
		v.t.Errorf("victim pool %+v: blocks still held", s)
	}
	for id := range kvlease.BlockID(atkPool) {
		r, err := v.pool.Region(kvlease.BlockRef{ID: id})
		if err != nil {
			continue
		}
		if bytes.IndexByte(r, 0xEE) >= 0 {
			v.t.Errorf("block %d holds the attacker's bytes", id)
		}
	}
	if err := v.pool.Check(); err != nil {
		v.t.Error(err)
	}
}

// honest is an honest source of the victim: it dials ctrl (the victim's
// control port or a proxy's) and proposes marked blocks.
type honest struct {
	src    *handoff.Source[[]byte]
	sender *tcp.Sender
	pool   *kvlease.Pool[[]byte]
}

func newHonest(t *testing.T, ctrl string, plane func(*tcp.Sender) handoff.SendPlane[[]byte], cfg tcp.Config) *honest {
	t.Helper()
	h := &honest{sender: tcp.NewSender(cfg), pool: hostPool2(t, atkPool, atkBlockBytes)}
	c, err := net.Dial("tcp", ctrl)
	if err != nil {
		t.Fatal(err)
	}
	var p handoff.SendPlane[[]byte] = h.sender
	if plane != nil {
		p = plane(h.sender)
	}
	if h.src, err = handoff.NewSource(c, p, handoff.HalfConfig{Envelope: envFor(atkBlockBytes, atkPool), Auth: testAuth, Deadline: bound}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = h.src.Close()
		_ = h.sender.Close()
	})
	return h
}

func (h *honest) propose(t *testing.T, id uint64, n int) *handoff.Outgoing[[]byte] {
	t.Helper()
	l, err := h.pool.Acquire(fmt.Sprint("r", id), n)
	if err != nil {
		t.Fatal(err)
	}
	if err := stampLease(l, byte(id)); err != nil {
		t.Fatal(err)
	}
	o, err := h.src.Propose(id, fmt.Sprint("seed=", id), l, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Release)
	return o
}

// checkDelivered checks that the victim's handoff id holds the honest
// source's marks, then releases it.
func (v *victim) checkDelivered(id uint64) {
	v.t.Helper()
	v.final(id) // OnDelivered runs just before OnFinal
	v.mu.Lock()
	in := v.delivered[id]
	v.mu.Unlock()
	if in == nil {
		v.t.Fatalf("handoff %d not delivered", id)
	}
	if err := markedFrom(in.Lease(), byte(id), 0); err != nil {
		v.t.Errorf("handoff %d: %v", id, err)
	}
	in.Lease().Release()
}

func (v *victim) final(id uint64) *handoff.Incoming[[]byte] {
	v.t.Helper()
	for end := time.Now().Add(bound); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		v.mu.Lock()
		in := v.finals[id]
		v.mu.Unlock()
		if in != nil {
			return in
		}
	}
	v.t.Fatalf("handoff %d never final", id)
	return nil
}

func waitStats[T any](t *testing.T, what string, get func() T, ok func(T) bool) T {
	t.Helper()
	var s T
	for end := time.Now().Add(bound); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		if s = get(); ok(s) {
			return s
		}
	}
	t.Fatalf("%s: %+v", what, s)
	return s
}

// TestAttackUnauthenticated: a process that does not authenticate (it
// offers the insecure mode, or sends frames with no handshake at all)
// is refused before any message is acted on.
func TestAttackUnauthenticated(t *testing.T) {
	v := newVictim(t, victimOpts{})
	for _, mode := range []string{"unauthenticated", "bare-frames"} {
		a := startAttacker(t, attackSpec{Mode: mode, Ctrl: v.ctl.Addr().String()})
		if f := a.expect("result"); f[1] != "closed" {
			t.Fatalf("%s: %q", mode, f)
		}
	}
	st := waitStats(t, "victim", v.dst.Stats, func(s handoff.HalfStats) bool { return s.AuthRefused == 2 })
	if st.Downgrades != 1 || st.Sessions != 0 {
		t.Errorf("victim stats %+v: want 2 refused, 1 a downgrade, no session", st)
	}
	v.untouched()
}

// TestAttackWrongCredentials: a process with the wrong key, or a
// certificate no CA of ours issued, is refused in the handshake.
func TestAttackWrongCredentials(t *testing.T) {
	t.Run("psk", func(t *testing.T) {
		v := newVictim(t, victimOpts{})
		a := startAttacker(t, attackSpec{Mode: "wrong-key", Ctrl: v.ctl.Addr().String()})
		if f := a.expect("result"); f[1] != "refused" || !strings.Contains(strings.Join(f, " "), "does not hold key") {
			t.Fatalf("%q", f)
		}
		waitStats(t, "victim", v.dst.Stats, func(s handoff.HalfStats) bool { return s.AuthRefused == 1 && s.Sessions == 0 })
		v.untouched()
	})
	t.Run("tls", func(t *testing.T) {
		ca := testpki.NewCA(t, "kvlease test CA")
		v := newVictim(t, victimOpts{auth: &handoff.TLS{Config: &tls.Config{Certificates: []tls.Certificate{atkLeaf(t, ca)}, ClientCAs: ca.Pool}}})
		a := startAttacker(t, attackSpec{Mode: "wrong-cert", Ctrl: v.ctl.Addr().String()})
		if f := a.expect("result"); f[1] != "refused" || !strings.Contains(strings.Join(f, " "), "refused this source's certificate") {
			t.Fatalf("%q", f)
		}
		waitStats(t, "victim", v.dst.Stats, func(s handoff.HalfStats) bool { return s.AuthRefused == 1 && s.Sessions == 0 })
		v.untouched()
	})
}

// stealing is a send plane that, before it sends, hands the Accept's
// plane bytes (the data address and token) to steal and waits for it:
// the attacker acts with a stolen token while the handoff is prepared.
type stealing struct {
	handoff.SendPlane[[]byte]
	steal func(accept []byte)
}

func (p stealing) Send(id handoff.PlaneID, regions [][]byte, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	p.steal(accept)
	return p.SendPlane.Send(id, regions, accept, attach)
}

// TestAttackStolenToken: with a prepared handoff's token stolen (or
// guessed), the attacker's data connections are refused, the slot stays
// the honest sender's, and its handoff is delivered with its own bytes.
func TestAttackStolenToken(t *testing.T) {
	v := newVictim(t, victimOpts{})
	var a *peer
	h := newHonest(t, v.ctl.Addr().String(), func(s *tcp.Sender) handoff.SendPlane[[]byte] {
		return stealing{s, func(accept []byte) {
			a = startAttacker(t, attackSpec{Mode: "stolen-token", Data: v.data, Stolen: accept, Blocks: 4})
			for range 3 {
				if f := a.expect("result"); f[1] != "closed" {
					t.Errorf("stolen token: %q", f)
				}
			}
		}}
	}, tcp.Config{})
	o := h.propose(t, 1, 4)
	if st := o.Wait(bound); st != handoff.Delivered {
		t.Fatalf("honest handoff %v: %v", st, o.History())
	}
	v.checkDelivered(1)
	st := waitStats(t, "receiver", v.recv.Stats, func(s handoff.PlaneStats) bool { return s.Refused == 3 })
	if st.RefusedAuth != 2 || st.Completed != 1 || st.Started != 1 {
		t.Errorf("receiver stats %+v: want 3 refused (2 unauthenticated), 1 completed", st)
	}
	v.untouched()
}

// TestAttackReplayedData: a finished handoff's whole data stream,
// captured and sent again, is refused: its token was used once.
func TestAttackReplayedData(t *testing.T) {
	v := newVictim(t, victimOpts{})
	var mu sync.Mutex
	var captured bytes.Buffer
	h := newHonest(t, v.ctl.Addr().String(), nil, tcp.Config{WrapConn: func(c net.Conn) net.Conn { return &tap{Conn: c, mu: &mu, w: &captured} }})
	o := h.propose(t, 1, 4)
	if st := o.Wait(bound); st != handoff.Delivered {
		t.Fatalf("honest handoff %v", st)
	}
	v.checkDelivered(1)
	mu.Lock()
	stream := bytes.Clone(captured.Bytes())
	mu.Unlock()
	a := startAttacker(t, attackSpec{Mode: "replay-data", Data: v.data, Captured: stream})
	if f := a.expect("result"); f[1] != "closed" {
		t.Fatalf("%q", f)
	}
	waitStats(t, "receiver", v.recv.Stats, func(s handoff.PlaneStats) bool { return s.Refused == 1 && s.Completed == 1 && s.Started == 1 })
	v.untouched()
}

// tap copies what is written through a connection.
type tap struct {
	net.Conn
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (c *tap) Write(p []byte) (int, error) {
	c.mu.Lock()
	c.w.Write(p)
	c.mu.Unlock()
	return c.Conn.Write(p)
}

// TestAttackReplayedRecord: a control record captured from one session
// and injected into another by a proxy on the path is refused: the
// victim ends that session (counted) and acts on nothing in it.
func TestAttackReplayedRecord(t *testing.T) {
	v := newVictim(t, victimOpts{})
	// Session A: an honest proposal whose records are captured.
	var mu sync.Mutex
	var captured bytes.Buffer
	ca, err := net.Dial("tcp", v.ctl.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	tc := &tap{Conn: ca, mu: &mu, w: &captured}
	srcA, err := handoff.NewSource(tc, tcp.NewSender(tcp.Config{}), handoff.HalfConfig{Envelope: envFor(atkBlockBytes, atkPool), Auth: testAuth})
	if err != nil {
		t.Fatal(err)
	}
	defer srcA.Close()
	mu.Lock()
	hs := captured.Len() // the handshake's bytes
	mu.Unlock()
	l, _ := hostPool2(t, atkPool, atkBlockBytes).Acquire("a", 2)
	defer l.Release()
	if err := stampLease(l, 77); err != nil {
		t.Fatal(err)
	}
	oA, err := srcA.Propose(77, "a", l, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st := oA.Wait(bound); st != handoff.Delivered {
		t.Fatalf("session A's handoff %v: %v", st, oA.History())
	}
	v.checkDelivered(77)
	mu.Lock()
	record := bytes.Clone(captured.Bytes()[hs:])
	mu.Unlock()
	// Session B, through the attacker's proxy, which injects A's record.
	a := startAttacker(t, attackSpec{Mode: "mitm-control", Ctrl: v.ctl.Addr().String(), Captured: record})
	proxy := a.expect("ready")[1]
	before := v.dst.Stats()
	cb, err := net.Dial("tcp", proxy)
	if err != nil {
		t.Fatal(err)
	}
	srcB, err := handoff.NewSource(cb, tcp.NewSender(tcp.Config{}), handoff.HalfConfig{Envelope: envFor(atkBlockBytes, atkPool), Auth: testAuth})
	if err != nil {
		t.Fatal(err)
	}
	defer srcB.Close()
	a.expect("result injected")
	st := waitStats(t, "victim", v.dst.Stats, func(s handoff.HalfStats) bool { return s.FramesRefused == before.FramesRefused+1 })
	if st.Sessions != before.Sessions+1 {
		t.Errorf("stats %+v", st)
	}
	// Session B is gone: its source finds out on its next proposal.
	l2, _ := hostPool2(t, atkPool, atkBlockBytes).Acquire("b", 2)
	defer l2.Release()
	o, err := srcB.Propose(78, "b", l2, nil)
	if err == nil {
		if s := o.Wait(bound); s != handoff.Rejected || !errors.Is(o.Err(), handoff.ErrConnLost) {
			t.Errorf("session B's proposal: %v %v", s, o.Err())
		}
	} else if !errors.Is(err, handoff.ErrConnLost) {
		t.Errorf("session B's proposal: %v", err)
	}
	// The injected proposal was not acted on: one accept, session A's.
	v.mu.Lock()
	accepts := v.accepts
	v.mu.Unlock()
	if accepts != 1 {
		t.Errorf("the victim accepted %d handoffs, want session A's alone", accepts)
	}
	v.untouched()
}

// TestAttackBlocksOfAnotherHandoff: a proxy on the data path passes a
// second handoff's own hello, then the first handoff's blocks (valid
// tags, under the first handoff's key): the receiver refuses the first
// block (ErrCorrupt), the second handoff fails, and none of its blocks
// is sealed or kept.
func TestAttackBlocksOfAnotherHandoff(t *testing.T) {
	a := startAttacker(t, attackSpec{Mode: "mitm-data"})
	proxy := a.expect("ready")[1]
	v := newVictim(t, victimOpts{advertise: proxy})
	a.do("data %s", v.data)
	// A connection per handoff: the proxy splices the second
	// connection's hello onto the first one's blocks (on a reused
	// connection, TestReuseReplayedHello).
	h := newHonest(t, v.ctl.Addr().String(), nil, tcp.Config{MaxIdleConns: -1})
	o1 := h.propose(t, 1, 4)
	if st := o1.Wait(bound); st != handoff.Delivered {
		t.Fatalf("first handoff %v: %v", st, o1.History())
	}
	v.checkDelivered(1)
	a.expect("recorded")
	o2 := h.propose(t, 2, 4)
	if f := a.expect("result spliced"); len(f) < 2 {
		t.Fatalf("%q", f)
	}
	in := v.final(2)
	if in.State() != handoff.Failed || !errors.Is(in.Err(), tcp.ErrCorrupt) || !strings.Contains(in.Err().Error(), "tag does not verify") {
		t.Fatalf("victim's second handoff %v: %v", in.State(), in.Err())
	}
	if st := o2.Wait(bound); st != handoff.Failed {
		t.Errorf("source's second handoff %v", st)
	}
	v.untouched()
}

// TestAttackHog: an authenticated peer that proposes the whole pool is
// refused by the per-session cap; what it then gets accepted and never
// starts is aborted at the start timeout and its blocks return.
func TestAttackHog(t *testing.T) {
	v := newVictim(t, victimOpts{startTimeout: 200 * time.Millisecond})
	a := startAttacker(t, attackSpec{Mode: "hog", Ctrl: v.ctl.Addr().String()})
	if f := a.expect("result 1"); f[2] != "rejected" || !strings.Contains(strings.Join(f, " "), "would make this session hold") {
		t.Fatalf("whole pool: %q", f)
	}
	if f := a.expect("result 2"); f[2] != "aborted" || !strings.Contains(strings.Join(f, " "), "no start within") {
		t.Fatalf("half the pool: %q", f)
	}
	st := waitStats(t, "victim", v.dst.Stats, func(s handoff.HalfStats) bool { return s.StartTimeouts == 1 })
	if st.LimitRefused != 1 {
		t.Errorf("stats %+v", st)
	}
	v.untouched()
}

// TestAttackHelloFlood: connections to the data port that never say
// hello, from one host: past MaxPendingHellosPerHost each is closed at
// once (counted); the rest time out; an honest handoff still gets
// through afterwards (TestAttackHoldPending: while they last).
// floodWindow is how long the flooding attacker watches its connections;
// floodHello, the victim's hello timeout in that test, leaves a wide
// margin after it.
const floodWindow, floodHello = 3 * time.Second, 10 * time.Second

func TestAttackHelloFlood(t *testing.T) {
	v := newVictim(t, victimOpts{helloTimeout: floodHello})
	const conns = tcp.DefaultMaxPendingHellos + 36
	const past = conns - tcp.DefaultMaxPendingHellosPerHost
	a := startAttacker(t, attackSpec{Mode: "flood", Data: v.data, Conns: conns})
	f := a.expect("result closed")
	if f[2] != fmt.Sprint(past) {
		t.Errorf("%q: want the %d past the cap closed at once (receiver %+v)", f, past, v.recv.Stats())
	}
	st := waitStats(t, "receiver", v.recv.Stats, func(s handoff.PlaneStats) bool { return s.Refused == conns })
	if st.RefusedBusy != past {
		t.Errorf("receiver stats %+v", st)
	}
	h := newHonest(t, v.ctl.Addr().String(), nil, tcp.Config{})
	if o := h.propose(t, 1, 4); o.Wait(bound) != handoff.Delivered {
		t.Fatalf("honest handoff after the flood: %v", o.History())
	}
	v.checkDelivered(1)
	v.untouched()
}

// atkLeaf is the victim's TLS identity, issued by ca.
func atkLeaf(t *testing.T, ca *testpki.CA) tls.Certificate {
	return ca.Issue(t, testpki.Leaf{Name: "decode", DNS: []string{"decode"},
		Usage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
}

package tcp

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// capPlane captures the PlaneIDs the halves hand their planes, and
// moves nothing.
type capPlane struct{ ids chan handoff.PlaneID }

func (p capPlane) Send(id handoff.PlaneID, _ [][]byte, _ []byte, _ func(*kvlease.Transfer) error) ([]byte, error) {
	p.ids <- id
	return nil, errors.New("capture only")
}
func (capPlane) Finish(handoff.PlaneID, error) {}
func (p capPlane) Prepare(id handoff.PlaneID, _ int) ([]byte, error) {
	p.ids <- id
	return []byte("x"), nil
}
func (capPlane) Receive(handoff.PlaneID, [][]byte, []byte, func(*kvlease.Transfer) error) error {
	return errors.New("capture only")
}
func (capPlane) Forget(handoff.PlaneID) {}

// secureID returns the PlaneIDs of handoff handoffID as the two halves
// of a psk session hand them to their planes.
func secureID(t testing.TB, handoffID uint64) (src, dst handoff.PlaneID) {
	t.Helper()
	env := handoff.Envelope{BlockTokens: 16, BlockBytes: 64, PoolBlocks: 8, MaxContextTokens: 128, MaxPrefillTokens: 128, MaxRunningRequests: 4}
	auth := &handoff.PSK{ID: "test", Key: make([]byte, 32)}
	pool := func() *kvlease.Pool[[]byte] {
		mem, _ := kvlease.NewHostMemory(8, 64)
		p, _ := kvlease.NewPool[[]byte](mem)
		return p
	}
	dp, sp := capPlane{make(chan handoff.PlaneID, 1)}, capPlane{make(chan handoff.PlaneID, 1)}
	dst2, err := handoff.NewDestination(pool(), dp, handoff.DestinationConfig[[]byte]{HalfConfig: handoff.HalfConfig{Envelope: env, Auth: auth}})
	if err != nil {
		t.Fatal(err)
	}
	a, b := net.Pipe()
	go func() { _ = dst2.Serve(b) }()
	s, err := handoff.NewSource(a, sp, handoff.HalfConfig{Envelope: env, Auth: auth})
	if err != nil {
		t.Fatal(err)
	}
	l, _ := pool().Acquire("r", 1)
	if _, err := s.Propose(handoffID, "r", l, nil); err != nil {
		t.Fatal(err)
	}
	dst, src = <-dp.ids, <-sp.ids
	_ = s.Close()
	return src, dst
}

// TestSeal: a keyed seal's hello and block tags verify only under the
// same session, token, handoff and block index; an unkeyed seal's
// hello is refused by a keyed slot (a downgrade) and the reverse; a
// hello with an unknown flag, or an unkeyed one with a MAC field not
// zero, is refused as corrupt.
func TestSeal(t *testing.T) {
	srcID, dstID := secureID(t, 7)
	tok := [16]byte{1, 2, 3}
	s, _ := newSeal(srcID, tok)
	d, _ := newSeal(dstID, tok)
	otherTok, _ := newSeal(dstID, [16]byte{9})
	dstID8 := dstID
	dstID8.Handoff = 8
	otherHandoff, _ := newSeal(dstID8, tok)
	plain, _ := newSeal(handoff.PlaneID{Handoff: 7}, tok)
	if !s.keyed || !d.keyed || plain.keyed {
		t.Fatal("keyed by the session's peer, unkeyed without one")
	}
	h := s.hello(tok, 4, 4096)
	if err := d.checkHello(h); err != nil {
		t.Fatalf("the sender's own hello: %v", err)
	}
	if err := d.checkHello(s.helloFlags(tok, 4, 4096, flagStream)); err != nil {
		t.Fatalf("the sender's own stream hello: %v", err)
	}
	flipped := bytes.Clone(h)
	flipped[3] |= flagStream // the flags are under the MAC: no one turns stream mode on
	if err := d.checkHello(flipped); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("a keyed hello whose stream flag was set in transit: %v", err)
	}
	for name, sl := range map[string]*seal{"another token": otherTok, "another handoff": otherHandoff} {
		if err := sl.checkHello(h); !errors.Is(err, ErrUnauthenticated) {
			t.Errorf("%s: hello %v", name, err)
		}
	}
	if err := d.checkHello(plain.hello(tok, 4, 4096)); !errors.Is(err, ErrUnauthenticated) {
		t.Errorf("unkeyed hello to a keyed slot: %v", err)
	}
	if err := plain.checkHello(h); !errors.Is(err, ErrCorrupt) {
		t.Errorf("keyed hello to an unkeyed slot: %v", err)
	}
	// An unkeyed hello carries a zero MAC field and no flag but keyed's.
	ph := plain.hello(tok, 4, 4096)
	if err := plain.checkHello(ph); err != nil {
		t.Errorf("the unkeyed sender's own hello: %v", err)
	}
	for name, at := range map[string]int{"nonzero MAC field": helloLength - 1, "unknown flag": 3} {
		bad := bytes.Clone(ph)
		bad[at] ^= 4 // 2 is flagStream
		if err := plain.checkHello(bad); !errors.Is(err, ErrCorrupt) {
			t.Errorf("unkeyed hello with a %s: %v", name, err)
		}
	}
	// A stream hello is known (flagStream) and MACed like any other.
	if err := plain.checkHello(plain.helloFlags(tok, 4, 4096, flagStream)); err != nil {
		t.Errorf("the unkeyed sender's stream hello: %v", err)
	}
	bad := bytes.Clone(h)
	bad[3] |= 0x80
	if err := d.checkHello(bad); !errors.Is(err, ErrCorrupt) {
		t.Errorf("keyed hello with an unknown flag: %v", err)
	}
	block := bytes.Repeat([]byte{5}, 4096)
	tag := make([]byte, s.trailer())
	s.sum(tag, 3, block)
	if err := d.verify(3, block, tag); err != nil {
		t.Fatalf("block 3: %v", err)
	}
	for name, f := range map[string]func() error{
		"another index":   func() error { return d.verify(2, block, tag) },
		"another handoff": func() error { return otherHandoff.verify(3, block, tag) },
		"flipped byte": func() error {
			b := bytes.Clone(block)
			b[100] ^= 1
			return d.verify(3, b, tag)
		},
	} {
		if err := f(); !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// FuzzCheckHello: no hello but the sender's own verifies under a keyed
// slot; none panics.
func FuzzCheckHello(f *testing.F) {
	srcID, dstID := secureID(f, 7)
	tok := [16]byte{1}
	s, _ := newSeal(srcID, tok)
	good := s.hello(tok, 4, 4096)
	f.Add(good)
	f.Add(make([]byte, helloLength))
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) < helloLength {
			b = append(b, make([]byte, helloLength-len(b))...)
		}
		b = b[:helloLength]
		d, _ := newSeal(dstID, tok)
		if err := d.checkHello(b); err == nil && !bytes.Equal(b, good) {
			t.Fatalf("a forged hello verified: %x", b)
		}
	})
}

// TestSenderRefusesForeignAddress: an Accept naming a data address off
// the authenticated peer's host is refused before anything is dialled
// (ErrAddress, counted), unless the host is in AllowDataHosts.
func TestSenderRefusesForeignAddress(t *testing.T) {
	srcID, _ := secureID(t, 1)
	srcID.Peer.Addr = &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1}
	accept := func(addr string) []byte {
		b := []byte{byte(len(addr)), 0}
		return append(append(b, addr...), make([]byte, 16)...)
	}
	s := NewSender(Config{DialTimeout: time.Second})
	defer s.Close()
	_, err := s.Send(srcID, [][]byte{make([]byte, 64)}, accept("10.9.8.7:4242"), nil)
	if !errors.Is(err, ErrAddress) || !errors.Is(err, handoff.ErrAuth) || s.Stats().RefusedAddr != 1 {
		t.Fatalf("foreign address: %v, stats %+v", err, s.Stats())
	}
	allow := NewSender(Config{DialTimeout: 50 * time.Millisecond, AllowDataHosts: []string{"10.9.8.7"}})
	defer allow.Close()
	if err := allow.checkAddr(srcID, "10.9.8.7:4242"); err != nil {
		t.Fatalf("allowlisted: %v", err)
	}
	if err := s.checkAddr(srcID, "127.0.0.1:4242"); err != nil {
		t.Fatalf("the peer's own host: %v", err)
	}
}

// flakyListener fails its first Accepts with EMFILE.
type flakyListener struct {
	net.Listener
	fails int
}

func (l *flakyListener) Accept() (net.Conn, error) {
	if l.fails > 0 {
		l.fails--
		return nil, fmt.Errorf("accept: %w", syscall.EMFILE)
	}
	return l.Listener.Accept()
}

// TestReceiverAcceptBackoff: the data accept loop survives transient
// errors, counts them, and still serves connections; it stops on Close.
func TestReceiverAcceptBackoff(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := NewReceiver(&flakyListener{Listener: ln, fails: 3}, Config{HelloTimeout: time.Second})
	c, err := net.Dial("tcp", r.Addr())
	if err != nil {
		t.Fatal(err)
	}
	_, _ = c.Write([]byte("not a hello"))
	_ = c.(*net.TCPConn).CloseWrite()
	for end := time.Now().Add(10 * time.Second); r.Stats().Refused < 1 && time.Now().Before(end); time.Sleep(time.Millisecond) {
	}
	if st := r.Stats(); st.AcceptErrors != 3 || st.Refused != 1 {
		t.Fatalf("stats %+v", st)
	}
	_ = c.Close()
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
}

// flipConn flips one byte of what is written through it, at offset at.
type flipConn struct {
	net.Conn
	at, off int
}

func (c *flipConn) Write(p []byte) (int, error) {
	if c.at >= c.off && c.at < c.off+len(p) {
		p = bytes.Clone(p)
		p[c.at-c.off] ^= 1
	}
	c.off += len(p)
	return c.Conn.Write(p)
}

// TestKeyedPipeline: a keyed transfer large enough to check its blocks
// off the socket's goroutine delivers intact, and fails (ErrCorrupt) on
// one flipped byte; each side's transfer resolves only after its
// checker returned.
func TestKeyedPipeline(t *testing.T) {
	const bb, n = 64 << 10, 32
	for _, flip := range []bool{false, true} {
		srcID, dstID := secureID(t, 3)
		var wrap func(net.Conn) net.Conn
		if flip {
			// A byte of block 9's body, past the hello, the layout
			// (a block per frame: the regions are apart) and 9 frames.
			at := helloLength + 4 + 4*n + 9*(frameHeader+bb+tagLength) + frameHeader + 100
			wrap = func(c net.Conn) net.Conn { return &flipConn{Conn: c, at: at} }
		}
		src, dst := make([][]byte, n), make([][]byte, n)
		for i := range src {
			// A byte more than the block: no two regions are adjacent.
			src[i], dst[i] = append(make([]byte, 0, bb+1), bytes.Repeat([]byte{byte(i + 1)}, bb)...), make([]byte, bb)
		}
		sendErr, recvErr := transfer(t, srcID, dstID, src, dst, wrap)
		switch {
		case !flip && (recvErr != nil || sendErr != nil):
			t.Fatalf("clean transfer: sender %v, receiver %v", sendErr, recvErr)
		case !flip && !slicesEqual(src, dst):
			t.Fatal("clean transfer delivered other bytes")
		case flip && (!errors.Is(recvErr, ErrCorrupt) || !strings.Contains(recvErr.Error(), "block 9 of 32")):
			t.Fatalf("flipped byte: receiver %v", recvErr)
		}
	}
}

func slicesEqual(a, b [][]byte) bool {
	for i := range a {
		if !bytes.Equal(a[i], b[i]) {
			return false
		}
	}
	return true
}

// FuzzParseAccept: the destination's Accept plane bytes either parse into
// an address and a token that re-encode to the same bytes, or are refused
// with ErrCorrupt; never a panic.
func FuzzParseAccept(f *testing.F) {
	good := binary.LittleEndian.AppendUint16(nil, 14)
	good = append(good, "127.0.0.1:4000"...)
	good = append(good, make([]byte, 16)...)
	f.Add(good)
	f.Add([]byte{0xff, 0xff})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		addr, tok, err := parseAccept(b)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		again := binary.LittleEndian.AppendUint16(nil, uint16(len(addr)))
		again = append(append(again, addr...), tok[:]...)
		if !bytes.Equal(again, b) {
			t.Fatalf("parsed %q %x from %x, which re-encode to %x", addr, tok, b, again)
		}
	})
}

// FuzzCheckFrameHeader: a data frame's header passes only when it names
// exactly the block and the length the receiver expects.
func FuzzCheckFrameHeader(f *testing.F) {
	h := binary.LittleEndian.AppendUint32(nil, 3)
	h = binary.LittleEndian.AppendUint32(h, 4096)
	f.Add(h, 3, 4096)
	f.Add([]byte{1, 2, 3}, 0, 0)
	f.Add(h, -1, -1)
	f.Fuzz(func(t *testing.T, h []byte, i, size int) {
		err := checkFrameHeader(h, i, 8, size)
		ok := len(h) >= frameHeader && i >= 0 && size >= 0 &&
			uint64(binary.LittleEndian.Uint32(h)) == uint64(i) && uint64(binary.LittleEndian.Uint32(h[4:])) == uint64(size)
		if (err == nil) != ok {
			t.Fatalf("header %x for block %d of %d bytes: %v", h, i, size, err)
		}
		if err != nil && !errors.Is(err, ErrCorrupt) {
			t.Fatalf("error %v does not wrap ErrCorrupt", err)
		}
	})
}

// TestHelloBlockBytes: an unkeyed hello (no MAC covers it) announcing
// blocks of another size than the receiver's regions is refused
// (ErrCorrupt) before a byte is read into them; the sender's own hello
// goes through.
func TestHelloBlockBytes(t *testing.T) {
	const bb, n = 4096, 4
	for _, flip := range []bool{false, true} {
		var wrap func(net.Conn) net.Conn
		if flip {
			// The low byte of the hello's block bytes (offset 24): 4096 becomes 4097.
			wrap = func(c net.Conn) net.Conn { return &flipConn{Conn: c, at: 24} }
		}
		src, dst := make([][]byte, n), make([][]byte, n)
		for i := range src {
			src[i], dst[i] = bytes.Repeat([]byte{byte(i + 1)}, bb), make([]byte, bb)
		}
		id := handoff.PlaneID{Handoff: 1}
		sendErr, recvErr := transfer(t, id, id, src, dst, wrap)
		switch {
		case !flip && (sendErr != nil || recvErr != nil || !slicesEqual(src, dst)):
			t.Fatalf("clean transfer: sender %v, receiver %v", sendErr, recvErr)
		case flip && (!errors.Is(recvErr, ErrCorrupt) || !strings.Contains(recvErr.Error(), "hello announces blocks of 4097 bytes")):
			t.Fatalf("hello of another block size: receiver %v", recvErr)
		case flip && !bytes.Equal(dst[0], make([]byte, bb)):
			t.Fatal("the receiver wrote into its regions after refusing the hello")
		}
	}
}

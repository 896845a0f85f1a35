package handoff

import (
	"bytes"
	"crypto/ecdh"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvlease/kvlease/handoff/internal/wire"
)

// Forward secrecy: a psk session recorded on the wire stays sealed when
// the key leaks later, where the derivation of protocol version 2 (the
// key and the nonces alone) opened it.

// legacyPSK is PSK with version 2's derivation: no ephemeral share (its
// first flight and answer carry zeros where the shares go), the session
// keys from HKDF over the key salted with the nonces. It lives in this
// test file only: the benchmarks measure today's handshake against it,
// and TestForwardSecrecy shows that a leaked key opened its sessions.
type legacyPSK struct{ *PSK }

func (p legacyPSK) first(h *handshake) ([]byte, error) {
	if _, err := rand.Read(h.cn[:]); err != nil {
		return nil, err
	}
	h.id = p.ID
	b := append(h.cn[:], make([]byte, shareBytes)...)
	return append(append(b, byte(len(p.ID))), p.ID...), nil
}

// legacyTranscript is version 2's: both preambles, both nonces, the id.
func legacyTranscript(pre [2][preambleLength]byte, cn, sn [nonceBytes]byte, id string) []byte {
	t := append(append(pre[0][:], pre[1][:]...), cn[:]...)
	t = append(t, sn[:]...)
	return append(append(t, byte(len(id))), id...)
}

// legacyKeys is version 2's derivation.
func legacyKeys(key []byte, cn, sn [nonceBytes]byte, id string) ([]byte, error) {
	return hkdf.Key(sha256.New, key, append(cn[:], sn[:]...), "kvlease handoff session v2 "+id, 3*32)
}

func (p legacyPSK) handshake(h *handshake) error {
	var key []byte
	if h.client {
		key = p.Key
		var resp [nonceBytes + shareBytes + sha256.Size]byte
		if _, err := io.ReadFull(h.conn, resp[:]); err != nil {
			return refuseAuth(false, "legacy psk: %v", err)
		}
		copy(h.sn[:], resp[:nonceBytes])
		t := legacyTranscript(h.pre, h.cn, h.sn, h.id)
		if !hmac.Equal(resp[nonceBytes+shareBytes:], pskMAC(key, "kvlease psk destination", t)) {
			return refuseAuth(false, "legacy psk: the destination does not hold key %q", h.id)
		}
		if _, err := h.conn.Write(pskMAC(key, "kvlease psk source", t)); err != nil {
			return err
		}
	} else {
		if key = p.key(h.id); key == nil {
			return refuseAuth(false, "legacy psk: unknown key id %q", h.id)
		}
		if _, err := rand.Read(h.sn[:]); err != nil {
			return err
		}
		t := legacyTranscript(h.pre, h.cn, h.sn, h.id)
		msg := append(append(h.sn[:], make([]byte, shareBytes)...), pskMAC(key, "kvlease psk destination", t)...)
		if _, err := h.conn.Write(msg); err != nil {
			return err
		}
		var mac [sha256.Size]byte
		if _, err := io.ReadFull(h.conn, mac[:]); err != nil {
			return refuseAuth(false, "legacy psk: %v", err)
		}
		if !hmac.Equal(mac[:], pskMAC(key, "kvlease psk source", t)) {
			return refuseAuth(false, "legacy psk: the source does not hold key %q", h.id)
		}
	}
	keys, err := legacyKeys(key, h.cn, h.sn, h.id)
	if err != nil {
		return err
	}
	return h.keyed(keys)
}

// spyPSK is PSK that keeps the source's ephemeral private key: the
// test's control, which knows what no eavesdropper can.
type spyPSK struct {
	*PSK
	eph **ecdh.PrivateKey
}

func (p spyPSK) first(h *handshake) ([]byte, error) {
	b, err := p.PSK.first(h)
	*p.eph = h.eph
	return b, err
}

// wiretap records both directions of a connection as its user sees them.
type wiretap struct {
	net.Conn
	mu      sync.Mutex
	out, in bytes.Buffer // written (source → destination), read
}

func (c *wiretap) Write(p []byte) (int, error) {
	c.mu.Lock()
	c.out.Write(p)
	c.mu.Unlock()
	return c.Conn.Write(p)
}

func (c *wiretap) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.mu.Lock()
	c.in.Write(p[:n])
	c.mu.Unlock()
	return n, err
}

// recorded is what an eavesdropper parses out of a recorded psk session.
type recorded struct {
	pre            [2][preambleLength]byte
	cn, sn         [nonceBytes]byte
	id             string
	srcPub, dstPub []byte
	records        []byte // the source's records, after its handshake
}

func parseRecording(out, in []byte) (*recorded, error) {
	r := &recorded{}
	hsIn := preambleLength + nonceBytes + shareBytes + sha256.Size + 1 // the destination's bytes before any record
	if len(out) < preambleLength+nonceBytes+shareBytes+1 || len(in) < hsIn {
		return nil, errors.New("short recording")
	}
	copy(r.pre[0][:], out)
	copy(r.pre[1][:], in)
	o := out[preambleLength:]
	copy(r.cn[:], o)
	r.srcPub = o[nonceBytes : nonceBytes+shareBytes]
	n := int(o[nonceBytes+shareBytes])
	o = o[nonceBytes+shareBytes+1:]
	if len(o) < n+sha256.Size {
		return nil, errors.New("short recording")
	}
	r.id = string(o[:n])
	r.records = o[n+sha256.Size:]
	i := in[preambleLength:]
	copy(r.sn[:], i)
	r.dstPub = i[nonceBytes : nonceBytes+shareBytes]
	return r, nil
}

// open opens the first of r's source records with the session keys
// derived by derive and returns the message it holds.
func (r *recorded) open(keys []byte, err error) (wire.Message, error) {
	if err != nil {
		return nil, err
	}
	ch, err := wire.NewChannel(keys[32:64], keys[:32]) // the destination's side: it reads the source's key
	if err != nil {
		return nil, err
	}
	frame, _, err := ch.ReadRecord(bytes.NewReader(r.records), nil, nil)
	if err != nil {
		return nil, err
	}
	return wire.ParseFrame(frame)
}

// transcript is the v3 transcript as the eavesdropper rebuilds it.
func (r *recorded) transcript() []byte {
	t := append(append(r.pre[0][:], r.pre[1][:]...), r.cn[:]...)
	t = append(append(t, r.sn[:]...), byte(len(r.id)))
	t = append(append(t, r.id...), r.srcPub...)
	return append(t, r.dstPub...)
}

// recordSession runs one psk session between a source and a destination
// authenticated by src and dst, the source proposing tokens, and returns
// what a wiretap on the source's connection saw.
func recordSession(t *testing.T, src, dst Authenticator, tokens []int32) (out, in []byte) {
	t.Helper()
	pool := newHostPool(t, 32, hbBytes)
	d, err := NewDestination(pool, newManualPlane(), DestinationConfig[[]byte]{
		HalfConfig: HalfConfig{Envelope: testEnvelope(), Auth: dst},
		Decide:     func(*ProposeMsg) error { return errors.New("recorded, not served") },
	})
	if err != nil {
		t.Fatal(err)
	}
	a, b := net.Pipe()
	served := make(chan error, 1)
	go func() { served <- d.Serve(b) }()
	tap := &wiretap{Conn: a}
	s, err := NewSource(tap, newManualPlane(), HalfConfig{Envelope: testEnvelope(), Auth: src})
	if err != nil {
		t.Fatal(err)
	}
	l, err := newHostPool(t, 32, hbBytes).Acquire("secret", 3)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	o, err := s.ProposeTokens(1, "secret", l, 0, tokens)
	if err != nil {
		t.Fatal(err)
	}
	if st := o.Wait(10 * time.Second); st != Rejected {
		t.Fatalf("handoff %v: %v", st, o.Err())
	}
	_ = s.Close()
	<-served
	tap.mu.Lock()
	defer tap.mu.Unlock()
	return bytes.Clone(tap.out.Bytes()), bytes.Clone(tap.in.Bytes())
}

// TestForwardSecrecy: a recorded ProposeTokens session, the key leaked
// afterwards. With version 2's derivation the leaked key opens the
// recorded proposal (every prompt token); with today's it does not,
// however the eavesdropper combines what it recorded with the key (the
// old derivation, today's with either public share or none in place of
// the X25519 secret); the test's control, which kept the source's
// ephemeral private key, opens it, so the recording and its parse are
// right and only the ephemeral secret is missing.
func TestForwardSecrecy(t *testing.T) {
	tokens := make([]int32, 3*testEnvelope().BlockTokens)
	for i := range tokens {
		tokens[i] = int32(1000 + 7*i)
	}
	leaked := testPSK.Key
	secret := func(m wire.Message, err error) error {
		if err != nil {
			return err
		}
		p, ok := m.(*ProposeMsg)
		if !ok || !slices.Equal(p.Tokens, tokens) {
			return fmt.Errorf("opened to %#v", m)
		}
		return nil
	}

	// Version 2: the key alone opens it.
	out, in := recordSession(t, legacyPSK{testPSK}, legacyPSK{testPSK}, tokens)
	r, err := parseRecording(out, in)
	if err != nil {
		t.Fatal(err)
	}
	if err := secret(r.open(legacyKeys(leaked, r.cn, r.sn, r.id))); err != nil {
		t.Fatalf("the old derivation did not open its recording with the leaked key: %v", err)
	}

	// Today: nothing the eavesdropper holds opens it.
	var eph *ecdh.PrivateKey
	out, in = recordSession(t, spyPSK{testPSK, &eph}, testPSK, tokens)
	if r, err = parseRecording(out, in); err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(r.srcPub, make([]byte, shareBytes)) || bytes.Equal(r.srcPub, r.dstPub) {
		t.Fatalf("shares %x %x", r.srcPub, r.dstPub)
	}
	attempts := map[string][]byte{"no secret": nil, "the source's share": r.srcPub, "the destination's share": r.dstPub, "zeros": make([]byte, 32)}
	for name, guess := range attempts {
		if err := secret(r.open(pskSessionKeys(leaked, guess, r.transcript(), r.id))); !errors.Is(err, ErrAuth) {
			t.Errorf("the leaked key and %s: %v, want the record refused", name, err)
		}
	}
	if err := secret(r.open(legacyKeys(leaked, r.cn, r.sn, r.id))); !errors.Is(err, ErrAuth) {
		t.Errorf("the old derivation on today's recording: %v", err)
	}
	pub, err := ecdh.X25519().NewPublicKey(r.dstPub)
	if err != nil {
		t.Fatal(err)
	}
	shared, err := eph.ECDH(pub)
	if err != nil {
		t.Fatal(err)
	}
	if err := secret(r.open(pskSessionKeys(leaked, shared, r.transcript(), r.id))); err != nil {
		t.Fatalf("the control, with the ephemeral secret: %v", err)
	}
}

// TestLowOrderShare: a psk source whose ephemeral share is of low order
// (an all-zero X25519 secret: no contribution) is refused by the
// destination: it has sent its challenge, never its confirm, nothing
// keyed.
func TestLowOrderShare(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	done := make(chan error, 1)
	go func() {
		_, err := authenticate(b, false, testPSK, 7, time.Second)
		_ = b.Close()
		done <- err
	}()
	pre := preamble(AuthPSK, 7)
	msg := append(append(pre[:], make([]byte, nonceBytes)...), make([]byte, shareBytes)...) // a zero share: low order
	msg = append(append(msg, byte(len(testPSK.ID))), testPSK.ID...)
	go func() { _, _ = a.Write(msg) }()
	got, _ := io.ReadAll(a)
	// Its challenge went out; no confirm followed it.
	if err := <-done; !errors.Is(err, ErrAuth) || len(got) != preambleLength+nonceBytes+shareBytes+sha256.Size {
		t.Fatalf("destination: %v; it answered %d bytes", err, len(got))
	}
}

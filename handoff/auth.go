package handoff

import (
	"crypto/ecdh"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/internal/wire"
)

// Authentication. Every control connection starts with a handshake in
// which both halves authenticate each other before any message is acted
// on, and which binds every later frame, and the data plane, to the
// session it establishes.
//
// The handshake begins with a preamble each way, in the clear:
//
//	"KA" | protocol version | mode (0 none, 1 psk, 2 tls) | envelope fingerprint (8 bytes LE)
//
// The source (the client) sends first; the destination answers with its
// own, even when it is about to refuse, so the source's error says what
// the destination wants. A mode that is not this side's own is refused:
// a peer offering none to a secure side is a downgrade (counted as such).
// Then, by mode:
//
//   - psk: right behind its preamble, the source sends a 32-byte nonce,
//     an ephemeral X25519 public key and its key id; the destination
//     answers with its own nonce and ephemeral public key and
//     HMAC-SHA256(key, "kvlease psk destination" | transcript); the
//     source checks it and answers HMAC-SHA256(key, "kvlease psk
//     source" | transcript). The transcript is both preambles, both
//     nonces, the key id and both public keys, so the MACs authenticate
//     the ephemeral shares. The session keys come from HKDF-SHA256 over
//     the key and the X25519 shared secret, salted with the transcript's
//     SHA-256: one AES-256-GCM key per direction for the control frames,
//     and a secret for the data plane. The ephemeral private keys are
//     dropped when the handshake ends, so a key that leaks later does not
//     open recorded sessions (forward secrecy): it proves who spoke, it
//     no longer tells what was said. Every later frame is a record:
//     length (4 bytes LE) | sequence (8 bytes LE) | AES-GCM of the frame,
//     nonce = the sequence, the length and the sequence as additional
//     data. Each direction counts from zero; a record whose sequence is
//     not the next one (a replay, a reordering, a frame from another
//     session) or whose tag does not verify ends the session.
//   - tls: a TLS 1.3 handshake with certificates on both sides (TLS 1.3
//     key exchanges are ephemeral: forward secret too); the frames then
//     travel inside TLS as they are, and the data-plane secret is
//     exported from the TLS session (RFC 8446 exporter).
//   - none: nothing more. Only a side whose config says Insecure speaks
//     it, and each such session logs that it is unauthenticated.
//
// The handshake ends with one byte from the destination, once it has
// authenticated the source and admitted the session under its caps
// (DestinationConfig.MaxSessions, Limits.Sessions): 'K', or 'L' for a
// session refused by a cap (the source's NewSource then fails with
// ErrLimit). In a tls session the byte travels inside TLS, which also
// tells a source whose certificate the destination refused.

// AuthMode is how a control session was authenticated.
type AuthMode uint8

// The authentication modes.
const (
	// AuthNone: no authentication (HalfConfig.Insecure).
	AuthNone AuthMode = iota
	// AuthPSK: a pre-shared key (PSK).
	AuthPSK
	// AuthTLS: mutual TLS 1.3 (TLS).
	AuthTLS
	numAuthModes
)

func (m AuthMode) String() string {
	switch m {
	case AuthNone:
		return "none"
	case AuthPSK:
		return "psk"
	case AuthTLS:
		return "tls"
	}
	return fmt.Sprintf("auth(%d)", uint8(m))
}

// An Authenticator authenticates a half's control connections: *PSK or
// *TLS. Set one in HalfConfig.Auth.
type Authenticator interface {
	// Mode is the authenticator's mode.
	Mode() AuthMode
	validate(client bool) error
	// first returns what a source sends right behind its preamble.
	first(h *handshake) ([]byte, error)
	handshake(h *handshake) error
}

// minKeyBytes is the shortest pre-shared key PSK accepts.
const minKeyBytes = 16

// PSK authenticates with a pre-shared key: a challenge-response over both
// sides' random nonces (HMAC-SHA256), which derives the session's keys
// (HKDF-SHA256). Both halves hold the key; it never travels.
//
// A source offers the key ID/Key. A destination accepts ID/Key and, if
// set, every key of Keys under its id, so that one decode worker can tell
// several prefill fleets apart: the peer's identity is "psk:" and the id.
type PSK struct {
	// ID names the key (at most 255 bytes; sent in the clear).
	ID string
	// Key is the secret, at least 16 bytes (GenerateKey draws 32).
	Key []byte
	// Keys, on a destination, are further accepted keys by id.
	Keys map[string][]byte
}

// Mode returns AuthPSK.
func (p *PSK) Mode() AuthMode { return AuthPSK }

func (p *PSK) validate(client bool) error {
	ok := len(p.ID) <= 255 && (len(p.Key) >= minKeyBytes || (!client && len(p.Key) == 0 && len(p.Keys) > 0))
	for id, k := range p.Keys {
		ok = ok && len(id) <= 255 && len(k) >= minKeyBytes
	}
	if !ok {
		return fmt.Errorf("kvlease: handoff: PSK needs a key of at least %d bytes (handoff.GenerateKey draws one) and ids of at most 255 bytes: %w",
			minKeyBytes, kvlease.ErrInvalidArgument)
	}
	return nil
}

func (p *PSK) key(id string) []byte {
	if id == p.ID && len(p.Key) > 0 {
		return p.Key
	}
	return p.Keys[id]
}

// GenerateKey returns a fresh random 32-byte key for PSK.
func GenerateKey() ([]byte, error) {
	k := make([]byte, 32)
	if _, err := rand.Read(k); err != nil {
		return nil, err
	}
	return k, nil
}

// TLS authenticates with mutual TLS 1.3. Config is the caller's
// *tls.Config: on a source it must hold the client certificate
// (Certificates or GetClientCertificate) and the roots that verify the
// destination (RootCAs, ServerName); on a destination its certificate
// and ClientCAs, which verify every source. The halves clone it and
// force TLS 1.3 and, on a destination, RequireAndVerifyClientCert. The
// peer's identity is its leaf certificate's first URI SAN, else its
// subject.
type TLS struct {
	Config *tls.Config
}

// Mode returns AuthTLS.
func (t *TLS) Mode() AuthMode { return AuthTLS }

func (t *TLS) validate(client bool) error {
	c := t.Config
	switch {
	case c == nil:
		return fmt.Errorf("kvlease: handoff: TLS needs a *tls.Config: %w", kvlease.ErrInvalidArgument)
	case client && len(c.Certificates) == 0 && c.GetClientCertificate == nil:
		return fmt.Errorf("kvlease: handoff: TLS on a source needs a client certificate (tls.Config.Certificates): %w", kvlease.ErrInvalidArgument)
	case !client && c.ClientCAs == nil:
		return fmt.Errorf("kvlease: handoff: TLS on a destination needs tls.Config.ClientCAs to verify its sources: %w", kvlease.ErrInvalidArgument)
	case !client && len(c.Certificates) == 0 && c.GetCertificate == nil:
		return fmt.Errorf("kvlease: handoff: TLS on a destination needs a certificate (tls.Config.Certificates): %w", kvlease.ErrInvalidArgument)
	}
	return nil
}

// Peer is the other side of a control session, as the halves and the
// data planes see it: how it was authenticated, who it proved to be, and
// where it connected from. A plane derives its keys for the session from
// it (Key), so that nothing outside the session can speak on the data
// plane.
type Peer struct {
	// Mode is how the session was authenticated.
	Mode AuthMode
	// Identity is who the peer proved to be: "psk:" and the key id, the
	// certificate's URI SAN or subject; "" when Mode is AuthNone.
	Identity string
	// Addr is the control connection's remote address.
	Addr net.Addr

	secret []byte // the data-plane secret; nil for AuthNone
}

// Secure reports whether the session is authenticated (p not nil and
// Mode not AuthNone).
func (p *Peer) Secure() bool { return p != nil && p.Mode != AuthNone && len(p.secret) > 0 }

// Key derives n bytes of key material for a data plane from the
// session's secret (HKDF-SHA256 expand), under label (the plane's name
// and purpose) and context (what the key is for: a token, a handoff
// id). Both halves derive the same bytes. It fails with
// ErrInvalidArgument for an unauthenticated session.
func (p *Peer) Key(label string, context []byte, n int) ([]byte, error) {
	if !p.Secure() {
		return nil, fmt.Errorf("kvlease: handoff: no session key in an unauthenticated session: %w", kvlease.ErrInvalidArgument)
	}
	info := make([]byte, 0, len(label)+1+len(context))
	info = append(append(append(info, label...), 0), context...)
	return hkdf.Expand(sha256.New, p.secret, string(info), n)
}

// String returns "mode identity".
func (p *Peer) String() string {
	if p == nil {
		return "none"
	}
	if p.Identity == "" {
		return p.Mode.String()
	}
	return p.Mode.String() + " " + p.Identity
}

// DefaultHandshakeTimeout bounds a handshake when
// HalfConfig.HandshakeTimeout is zero.
const DefaultHandshakeTimeout = 5 * time.Second

// handshake is one side's run of the authentication.
type handshake struct {
	conn        net.Conn
	client      bool
	fingerprint uint64
	timeout     time.Duration

	// psk: both nonces, the key id, this side's ephemeral key and the
	// peer's public key (what the source sends behind its preamble)
	cn, sn  [nonceBytes]byte
	id      string
	eph     *ecdh.PrivateKey
	peerPub []byte

	// results
	peer  *Peer
	conn2 net.Conn      // the connection the frames use (a *tls.Conn for tls)
	ch    *wire.Channel // the record layer (psk)
	// preambles as sent by the client and the server
	pre [2][preambleLength]byte
}

const preambleLength = 2 + 1 + 1 + 8

// The destination's last handshake byte.
const (
	confirmOK    = 'K' // authenticated and admitted
	confirmLimit = 'L' // refused by a session cap
)

// authError is a refusal of the authentication; downgrade marks a peer
// that offered a weaker mode.
type authError struct {
	err       error
	downgrade bool
}

func (e *authError) Error() string { return e.err.Error() }
func (e *authError) Unwrap() error { return e.err }

func refuseAuth(downgrade bool, format string, args ...any) error {
	return &authError{err: fmt.Errorf("kvlease: handoff: "+format+": %w", append(args, ErrAuth)...), downgrade: downgrade}
}

// authenticate runs the handshake over conn for a half configured with
// auth (nil: insecure), admitting every session. On success the peer,
// the connection to use and the record layer (nil unless psk) are in h.
func authenticate(conn net.Conn, client bool, auth Authenticator, fingerprint uint64, timeout time.Duration) (*handshake, error) {
	return authenticateAdmit(conn, client, auth, fingerprint, timeout, nil)
}

// authenticateAdmit is authenticate; on the destination, admit (if set)
// decides whether the authenticated peer may hold a session: its error
// (wrapping ErrLimit) refuses it, and the source is told so.
func authenticateAdmit(conn net.Conn, client bool, auth Authenticator, fingerprint uint64, timeout time.Duration, admit func(*Peer) error) (*handshake, error) {
	h := &handshake{conn: conn, client: client, fingerprint: fingerprint, timeout: timeout}
	if h.timeout <= 0 {
		h.timeout = DefaultHandshakeTimeout
	}
	_ = conn.SetDeadline(time.Now().Add(h.timeout))
	defer func() { _ = conn.SetDeadline(time.Time{}) }()
	mode := AuthNone
	if auth != nil {
		mode = auth.Mode()
	}
	ours := preamble(mode, fingerprint)
	me, them := 0, 1
	if !client {
		me, them = 1, 0
	}
	h.pre[me] = ours
	if client {
		first := ours[:]
		if auth != nil {
			more, err := auth.first(h)
			if err != nil {
				return nil, err
			}
			first = append(first, more...)
		}
		if _, err := conn.Write(first); err != nil {
			return nil, fmt.Errorf("kvlease: handoff: handshake: %w (%w)", ErrAuth, err)
		}
	}
	if _, err := io.ReadFull(conn, h.pre[them][:]); err != nil {
		return nil, refuseAuth(false, "handshake: no preamble from the peer (%v)", err)
	}
	p := h.pre[them]
	current := p[0] == 'K' && p[1] == 'A' && p[2] == wire.ProtocolVersion
	if !client {
		if current && AuthMode(p[3]) == AuthPSK {
			// A psk source's first flight follows its preamble: take it
			// before answering, whatever our mode, so that the source
			// is not left writing while we answer.
			if err := h.readPSKFirst(); err != nil {
				return nil, err
			}
		}
		// Answer even a refusal, so the source learns what we want.
		if _, err := conn.Write(ours[:]); err != nil {
			return nil, fmt.Errorf("kvlease: handoff: handshake: %w (%w)", ErrAuth, err)
		}
	}
	if p[0] != 'K' || p[1] != 'A' {
		return nil, refuseAuth(false, "handshake: preamble starts %q, want \"KA\"", p[:2])
	}
	if p[2] != wire.ProtocolVersion {
		return nil, refuseAuth(false, "handshake: peer speaks protocol version %d, this side %d", p[2], wire.ProtocolVersion)
	}
	theirs := AuthMode(p[3])
	if theirs != mode {
		down := theirs == AuthNone
		return nil, refuseAuth(down, "handshake: peer offers authentication %v, this side requires %v (set the same Auth on both halves; Insecure on both to run without)", theirs, mode)
	}
	h.peer = &Peer{Mode: mode, Addr: conn.RemoteAddr()}
	h.conn2 = conn
	if auth != nil {
		if err := auth.handshake(h); err != nil {
			return nil, err
		}
	}
	if err := h.confirm(admit); err != nil {
		return nil, err
	}
	return h, nil
}

// confirm is the handshake's last byte: the destination sends whether it
// admitted the session, the source reads it.
func (h *handshake) confirm(admit func(*Peer) error) error {
	var b [1]byte
	if !h.client {
		b[0] = confirmOK
		var refused error
		if admit != nil {
			if refused = admit(h.peer); refused != nil {
				b[0] = confirmLimit
			}
		}
		if _, err := h.conn2.Write(b[:]); err != nil && refused == nil {
			return refuseAuth(false, "%v handshake: confirm: %v", h.peer.Mode, err)
		}
		return refused
	}
	_, err := io.ReadFull(h.conn2, b[:])
	switch {
	case err == nil && b[0] == confirmOK:
		return nil
	case err == nil && b[0] == confirmLimit:
		return fmt.Errorf("kvlease: handoff: the destination authenticated this source (%v) and refused the session: too many sessions: %w", h.peer, ErrLimit)
	case h.peer.Mode == AuthTLS:
		return refuseAuth(false, "tls handshake: the destination refused this source's certificate (%v)", err)
	case h.peer.Mode == AuthPSK:
		return refuseAuth(false, "psk handshake: the destination refused this source's proof of key %q (%v)", h.id, err)
	}
	return refuseAuth(false, "handshake: the destination ended it (%v, %q)", err, b[:])
}

func preamble(mode AuthMode, fingerprint uint64) [preambleLength]byte {
	var b [preambleLength]byte
	b[0], b[1], b[2], b[3] = 'K', 'A', wire.ProtocolVersion, byte(mode)
	binary.LittleEndian.PutUint64(b[4:], fingerprint)
	return b
}

const (
	nonceBytes = 32
	shareBytes = 32 // an X25519 public key
)

// first returns the psk source's first flight, sent right behind its
// preamble: its nonce, its ephemeral public key, its key id.
func (p *PSK) first(h *handshake) ([]byte, error) {
	if _, err := rand.Read(h.cn[:]); err != nil {
		return nil, err
	}
	eph, err := ecdh.X25519().GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	h.eph, h.id = eph, p.ID
	b := make([]byte, 0, nonceBytes+shareBytes+1+len(p.ID))
	b = append(append(b, h.cn[:]...), eph.PublicKey().Bytes()...)
	return append(append(b, byte(len(p.ID))), p.ID...), nil
}

// readPSKFirst reads a psk source's first flight (the destination).
func (h *handshake) readPSKFirst() error {
	var head [nonceBytes + shareBytes + 1]byte
	if _, err := io.ReadFull(h.conn, head[:]); err != nil {
		return refuseAuth(false, "psk handshake: half a challenge (%v)", err)
	}
	copy(h.cn[:], head[:nonceBytes])
	h.peerPub = append([]byte(nil), head[nonceBytes:nonceBytes+shareBytes]...)
	idb := make([]byte, head[nonceBytes+shareBytes])
	if _, err := io.ReadFull(h.conn, idb); err != nil {
		return refuseAuth(false, "psk handshake: half a key id (%v)", err)
	}
	h.id = string(idb)
	return nil
}

// shared is the X25519 secret of this side's ephemeral key and the
// peer's public key; a public key of low order (an all-zero secret) is
// refused.
func (h *handshake) shared() ([]byte, error) {
	pub, err := ecdh.X25519().NewPublicKey(h.peerPub)
	if err == nil {
		var s []byte
		if s, err = h.eph.ECDH(pub); err == nil {
			return s, nil
		}
	}
	return nil, refuseAuth(false, "psk handshake: the peer's ephemeral key: %v", err)
}

func (p *PSK) handshake(h *handshake) error {
	conn := h.conn
	var key, shared []byte
	var err error
	if h.client {
		key = p.Key
		var resp [nonceBytes + shareBytes + sha256.Size]byte
		if _, err := io.ReadFull(conn, resp[:]); err != nil {
			return refuseAuth(false, "psk handshake: the destination refused key %q or went away (%v)", h.id, err)
		}
		copy(h.sn[:], resp[:nonceBytes])
		h.peerPub = resp[nonceBytes : nonceBytes+shareBytes]
		t := h.transcript()
		if !hmac.Equal(resp[nonceBytes+shareBytes:], pskMAC(key, "kvlease psk destination", t)) {
			return refuseAuth(false, "psk handshake: the destination does not hold key %q", h.id)
		}
		if _, err := conn.Write(pskMAC(key, "kvlease psk source", t)); err != nil {
			return fmt.Errorf("kvlease: handoff: psk handshake: %w (%w)", ErrAuth, err)
		}
		// The X25519 secret is needed for the keys alone: computed while
		// the destination checks our MAC.
		if shared, err = h.shared(); err != nil {
			return err
		}
	} else {
		if key = p.key(h.id); key == nil {
			return refuseAuth(false, "psk handshake: unknown key id %q", h.id)
		}
		if _, err := rand.Read(h.sn[:]); err != nil {
			return err
		}
		if h.eph, err = ecdh.X25519().GenerateKey(rand.Reader); err != nil {
			return err
		}
		t := h.transcript()
		msg := make([]byte, 0, nonceBytes+shareBytes+sha256.Size)
		msg = append(append(msg, h.sn[:]...), h.eph.PublicKey().Bytes()...)
		if _, err := conn.Write(append(msg, pskMAC(key, "kvlease psk destination", t)...)); err != nil {
			return fmt.Errorf("kvlease: handoff: psk handshake: %w (%w)", ErrAuth, err)
		}
		// The X25519 secret is needed for the keys alone: computed while
		// the source checks our MAC (a share of low order is refused
		// before anything is keyed).
		if shared, err = h.shared(); err != nil {
			return err
		}
		var mac [sha256.Size]byte
		if _, err := io.ReadFull(conn, mac[:]); err != nil {
			return refuseAuth(false, "psk handshake: no response to the challenge (%v)", err)
		}
		if !hmac.Equal(mac[:], pskMAC(key, "kvlease psk source", t)) {
			return refuseAuth(false, "psk handshake: the source does not hold key %q", h.id)
		}
	}
	keys, err := pskSessionKeys(key, shared, h.transcript(), h.id)
	h.eph = nil // forward secrecy: the ephemeral key is gone with the handshake
	if err != nil {
		return err
	}
	return h.keyed(keys)
}

// pskSessionKeys derives a psk session's keys (the source's sending key,
// the destination's, the data-plane secret) from the key and the X25519
// shared secret, salted with the transcript: without the shared secret,
// the key alone derives nothing.
func pskSessionKeys(key, shared, transcript []byte, id string) ([]byte, error) {
	ikm := make([]byte, 0, len(key)+len(shared))
	ikm = append(append(ikm, key...), shared...)
	salt := sha256.Sum256(transcript)
	return hkdf.Key(sha256.New, ikm, salt[:], "kvlease handoff session v3 "+id, 3*32)
}

// keyed installs a psk session's keys (pskSessionKeys' layout).
func (h *handshake) keyed(keys []byte) error {
	c2s, s2c := keys[:32], keys[32:64]
	var err error
	if h.client {
		h.ch, err = wire.NewChannel(c2s, s2c)
	} else {
		h.ch, err = wire.NewChannel(s2c, c2s)
	}
	if err != nil {
		return err
	}
	h.peer.Identity = "psk:" + h.id
	h.peer.secret = keys[64:]
	return nil
}

// transcript is what both MACs of the psk handshake cover: both
// preambles, both nonces, the key id, the source's public key and the
// destination's.
func (h *handshake) transcript() []byte {
	t := make([]byte, 0, 2*preambleLength+2*nonceBytes+1+len(h.id)+2*shareBytes)
	t = append(append(t, h.pre[0][:]...), h.pre[1][:]...)
	t = append(append(t, h.cn[:]...), h.sn[:]...)
	t = append(append(t, byte(len(h.id))), h.id...)
	mine := h.eph.PublicKey().Bytes()
	if h.client {
		return append(append(t, mine...), h.peerPub...)
	}
	return append(append(t, h.peerPub...), mine...)
}

func pskMAC(key []byte, label string, transcript []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(label))
	m.Write(transcript)
	return m.Sum(nil)
}

// first: a tls source sends nothing behind its preamble.
func (t *TLS) first(*handshake) ([]byte, error) { return nil, nil }

func (t *TLS) handshake(h *handshake) error {
	cfg := t.Config.Clone()
	cfg.MinVersion = tls.VersionTLS13
	var c *tls.Conn
	if h.client {
		c = tls.Client(h.conn, cfg)
	} else {
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
		c = tls.Server(h.conn, cfg)
	}
	if err := c.Handshake(); err != nil {
		return refuseAuth(false, "tls handshake: %v", err)
	}
	// In TLS 1.3 the client's handshake is over before the server has
	// checked its certificate: the confirm byte (inside the session)
	// tells a refused source here, not on its first frame.
	h.conn2 = c
	cs := c.ConnectionState()
	if len(cs.PeerCertificates) == 0 {
		return refuseAuth(false, "tls handshake: the peer sent no certificate")
	}
	ctx := append(h.pre[0][4:12:12], h.pre[1][4:12]...)
	secret, err := cs.ExportKeyingMaterial("kvlease handoff data v2", ctx, 32)
	if err != nil {
		return refuseAuth(false, "tls handshake: export keying material: %v", err)
	}
	h.peer.Identity = CertIdentity(cs.PeerCertificates[0])
	h.peer.secret = secret
	return nil
}

// CertIdentity is the identity the halves report for a peer certificate:
// its first URI SAN, else its subject.
func CertIdentity(c *x509.Certificate) string {
	if len(c.URIs) > 0 {
		return c.URIs[0].String()
	}
	return c.Subject.String()
}

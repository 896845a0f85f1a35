package handoff

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
)

// The control protocol between the two halves of a handoff.
//
// Every message travels in one frame:
//
//	magic "KH" | version (1 byte) | type (1 byte) | length (4 bytes LE) | crc32c (4 bytes LE) | payload (length bytes)
//
// The checksum (Castagnoli) covers the first eight header bytes and the
// payload. Frames follow the authentication handshake (auth.go): in a
// psk session each travels sealed in a record (channel.go), in a tls
// session inside TLS, in an insecure one as it is. Every payload starts with the handoff id (8 bytes LE). Strings
// and opaque bytes are a 2-byte length and the bytes; the hashes of a
// proposal are a 4-byte count and 8 bytes each, optionally followed by
// its tokens: a 4-byte count, the 8-byte namespace seed, 4 bytes each. A reader checks the
// length against MaxFrame before it allocates, and a frame that has begun
// must arrive whole within the connection's frame timeout.
//
// Who sends what (S = source side, D = destination side):
//
//	S→D Propose  {id, request, blocks, envelope fingerprint, chained hashes[, seed, tokens]}
//	D→S Accept   {id, first block wanted (the prefix hits), data-plane bytes}
//	D→S Reject   {id, code, reason}          (instead of Accept, or after it while no Start came)
//	S→D Start    {id, data-plane bytes}      (the source's transfer is attached)
//	D→S Done     {id, error text}            (the destination's transfer resolved; "" = delivered)
//	S→D Ack      {id, of=Done}
//	S↔D Abort    {id, cause}
//	S↔D Ack      {id, of=Abort}
//
// A message for an unknown handoff, or one its handoff's state does not
// allow (a duplicate, a reordering), is refused with an error and changes
// nothing. A malformed frame (bad magic, version, checksum, length or
// payload) ends the connection.

// ProtocolVersion is the control protocol's version. A frame (and a
// handshake) of another version is refused. Version 2 added the
// authentication handshake (auth.go) and the psk record layer.
const ProtocolVersion = 2

// Limits of the control protocol.
const (
	MaxFrame     = 1 << 20 // most payload bytes in one frame
	MaxText      = 1024    // most bytes of a request name, reason or cause
	MaxPlane     = 4096    // most data-plane bytes in Accept or Start
	MaxBlocks    = 1 << 16 // most blocks in one handoff
	headerLength = 12
)

// ErrProtocol is wrapped by every error about a malformed or unexpected
// message: bad framing, checksum, version, length, a payload that does not
// parse, a message its handoff's state does not allow.
var ErrProtocol = errors.New("kvlease: handoff protocol violation")

// MsgType is the type byte of a control message.
type MsgType uint8

// The control message types.
const (
	MsgPropose MsgType = iota + 1
	MsgAccept
	MsgReject
	MsgStart
	MsgDone
	MsgAbort
	MsgAck
	numMsgTypes
)

var msgNames = [numMsgTypes]string{"", "propose", "accept", "reject", "start", "done", "abort", "ack"}

func (t MsgType) String() string {
	if t > 0 && t < numMsgTypes {
		return msgNames[t]
	}
	return fmt.Sprintf("msg(%d)", uint8(t))
}

// A Message is one control message. Each type has its own parse function.
type Message interface {
	Type() MsgType
	Handoff() uint64
	appendPayload(b []byte) []byte
}

// ProposeMsg offers a handoff: the source holds Blocks blocks of request
// Request whose full blocks have the chained hashes Hashes (at most
// Blocks of them), under the envelope whose Fingerprint is Envelope.
// Tokens, when present, are the tokens whose KV the blocks hold and Seed
// their namespace: Hashes is then ChainHashes(Seed, Tokens), and a
// destination in verified mode checks its hits and seals what arrives
// with them (Source.ProposeTokens).
type ProposeMsg struct {
	ID       uint64
	Request  string
	Blocks   uint32
	Envelope uint64
	Hashes   []kvlease.BlockHash
	Seed     kvlease.BlockHash
	Tokens   []int32
}

// AcceptMsg accepts a handoff: the destination holds a lease of all the
// blocks, took blocks 0..From-1 from its own prefix cache and wants
// From..Blocks-1. Plane is the data plane's bytes (an address, keys).
type AcceptMsg struct {
	ID    uint64
	From  uint32
	Plane []byte
}

// RejectCode says why a destination refused, so the source's error can
// wrap the matching sentinel.
type RejectCode uint8

// The reject codes.
const (
	RejectPolicy    RejectCode = iota // the destination decided (ErrRejected)
	RejectExhausted                   // no room now (kvlease.ErrExhausted)
	RejectCapacity                    // can never fit (kvlease.ErrExceedsCapacity)
	RejectEnvelope                    // envelopes disagree (kvlease.ErrInvalidArgument)
	RejectDuplicate                   // the id is already in use (ErrState)
	RejectClosed                      // the pool is closed (kvlease.ErrPoolClosed)
	RejectLimit                       // a per-session cap (ErrLimit)
	numRejectCodes
)

func (c RejectCode) sentinel() error {
	switch c {
	case RejectExhausted:
		return kvlease.ErrExhausted
	case RejectCapacity:
		return kvlease.ErrExceedsCapacity
	case RejectEnvelope:
		return kvlease.ErrInvalidArgument
	case RejectDuplicate:
		return ErrState
	case RejectClosed:
		return kvlease.ErrPoolClosed
	case RejectLimit:
		return ErrLimit
	}
	return ErrRejected
}

// rejectCode maps a destination's error to its code.
func rejectCode(err error) RejectCode {
	switch {
	case errors.Is(err, ErrLimit):
		return RejectLimit
	case errors.Is(err, kvlease.ErrExceedsCapacity):
		return RejectCapacity
	case errors.Is(err, kvlease.ErrExhausted):
		return RejectExhausted
	case errors.Is(err, kvlease.ErrPoolClosed):
		return RejectClosed
	case errors.Is(err, ErrState):
		return RejectDuplicate
	case errors.Is(err, kvlease.ErrInvalidArgument):
		return RejectEnvelope
	}
	return RejectPolicy
}

// RejectMsg refuses a handoff, before or after accepting it (as long as no
// Start was taken).
type RejectMsg struct {
	ID     uint64
	Code   RejectCode
	Reason string
}

// StartMsg says the source's transfer is attached and the data plane may
// move bytes; Plane is the data plane's bytes (for a pull model, the keys
// of the registered memory).
type StartMsg struct {
	ID    uint64
	Plane []byte
}

// DoneMsg reports that the destination's transfer resolved: Err is empty
// when every wanted block arrived intact (Delivered), else the outcome.
type DoneMsg struct {
	ID  uint64
	Err string
}

// AbortMsg gives up on a handoff, from either side.
type AbortMsg struct {
	ID    uint64
	Cause string
}

// AckMsg acknowledges a Done or an Abort.
type AckMsg struct {
	ID uint64
	Of MsgType
}

func (m *ProposeMsg) Type() MsgType { return MsgPropose }
func (m *AcceptMsg) Type() MsgType  { return MsgAccept }
func (m *RejectMsg) Type() MsgType  { return MsgReject }
func (m *StartMsg) Type() MsgType   { return MsgStart }
func (m *DoneMsg) Type() MsgType    { return MsgDone }
func (m *AbortMsg) Type() MsgType   { return MsgAbort }
func (m *AckMsg) Type() MsgType     { return MsgAck }

func (m *ProposeMsg) Handoff() uint64 { return m.ID }
func (m *AcceptMsg) Handoff() uint64  { return m.ID }
func (m *RejectMsg) Handoff() uint64  { return m.ID }
func (m *StartMsg) Handoff() uint64   { return m.ID }
func (m *DoneMsg) Handoff() uint64    { return m.ID }
func (m *AbortMsg) Handoff() uint64   { return m.ID }
func (m *AckMsg) Handoff() uint64     { return m.ID }

var le = binary.LittleEndian

func appendBytes(b, v []byte) []byte { return append(le.AppendUint16(b, uint16(len(v))), v...) }
func appendText(b []byte, s string) []byte {
	s = clip(s)
	return append(le.AppendUint16(b, uint16(len(s))), s...)
}

func (m *ProposeMsg) appendPayload(b []byte) []byte {
	b = le.AppendUint64(b, m.ID)
	b = appendText(b, m.Request)
	b = le.AppendUint32(b, m.Blocks)
	b = le.AppendUint64(b, m.Envelope)
	b = le.AppendUint32(b, uint32(len(m.Hashes)))
	for _, h := range m.Hashes {
		b = le.AppendUint64(b, uint64(h))
	}
	if len(m.Tokens) > 0 {
		b = le.AppendUint32(b, uint32(len(m.Tokens)))
		b = le.AppendUint64(b, uint64(m.Seed))
		for _, t := range m.Tokens {
			b = le.AppendUint32(b, uint32(t))
		}
	}
	return b
}

func (m *AcceptMsg) appendPayload(b []byte) []byte {
	return appendBytes(le.AppendUint32(le.AppendUint64(b, m.ID), m.From), m.Plane)
}

func (m *RejectMsg) appendPayload(b []byte) []byte {
	return appendText(append(le.AppendUint64(b, m.ID), byte(m.Code)), m.Reason)
}

func (m *StartMsg) appendPayload(b []byte) []byte {
	return appendBytes(le.AppendUint64(b, m.ID), m.Plane)
}

func (m *DoneMsg) appendPayload(b []byte) []byte {
	return appendText(le.AppendUint64(b, m.ID), m.Err)
}

func (m *AbortMsg) appendPayload(b []byte) []byte {
	return appendText(le.AppendUint64(b, m.ID), m.Cause)
}

func (m *AckMsg) appendPayload(b []byte) []byte {
	return append(le.AppendUint64(b, m.ID), byte(m.Of))
}

// reader reads a payload field by field; the first error sticks.
type reader struct {
	b   []byte
	err error
	msg MsgType
}

func (r *reader) fail(what string) {
	if r.err == nil {
		r.err = fmt.Errorf("kvlease: handoff %v message: %s: %w", r.msg, what, ErrProtocol)
	}
}

func (r *reader) take(n int, what string) []byte {
	if r.err != nil {
		return nil
	}
	if n > len(r.b) {
		r.fail("truncated " + what)
		return nil
	}
	v := r.b[:n:n]
	r.b = r.b[n:]
	return v
}

func (r *reader) u8(what string) uint8 {
	if v := r.take(1, what); v != nil {
		return v[0]
	}
	return 0
}

func (r *reader) u32(what string) uint32 {
	if v := r.take(4, what); v != nil {
		return le.Uint32(v)
	}
	return 0
}

func (r *reader) u64(what string) uint64 {
	if v := r.take(8, what); v != nil {
		return le.Uint64(v)
	}
	return 0
}

func (r *reader) bytes(what string, limit int) []byte {
	v := r.take(2, what+" length")
	if v == nil {
		return nil
	}
	n := int(le.Uint16(v))
	if n > limit {
		r.fail(fmt.Sprintf("%s of %d bytes exceeds %d", what, n, limit))
		return nil
	}
	return r.take(n, what)
}

func (r *reader) end() error {
	if r.err == nil && len(r.b) != 0 {
		r.fail(fmt.Sprintf("%d trailing bytes", len(r.b)))
	}
	return r.err
}

// ParseProposeMsg parses a Propose payload.
func ParseProposeMsg(p []byte) (*ProposeMsg, error) {
	r := &reader{b: p, msg: MsgPropose}
	m := &ProposeMsg{ID: r.u64("id")}
	m.Request = string(r.bytes("request", MaxText))
	m.Blocks = r.u32("blocks")
	m.Envelope = r.u64("envelope")
	n := r.u32("hash count")
	switch {
	case r.err != nil:
	case m.Blocks == 0 || m.Blocks > MaxBlocks:
		r.fail(fmt.Sprintf("%d blocks outside 1..%d", m.Blocks, MaxBlocks))
	case n > m.Blocks:
		r.fail(fmt.Sprintf("%d hashes for %d blocks", n, m.Blocks))
	case int(n)*8 > len(r.b):
		r.fail(fmt.Sprintf("%d hashes in %d bytes", n, len(r.b)))
	default:
		m.Hashes = make([]kvlease.BlockHash, n)
		for i := range m.Hashes {
			m.Hashes[i] = kvlease.BlockHash(r.u64("hash"))
		}
		if len(r.b) == 0 {
			break
		}
		nt := r.u32("token count")
		m.Seed = kvlease.BlockHash(r.u64("seed"))
		switch {
		case r.err != nil:
		case nt == 0 || int(nt)*4 != len(r.b):
			r.fail(fmt.Sprintf("%d tokens in %d bytes", nt, len(r.b)))
		default:
			m.Tokens = make([]int32, nt)
			for i := range m.Tokens {
				m.Tokens[i] = int32(r.u32("token"))
			}
		}
	}
	if err := r.end(); err != nil {
		return nil, err
	}
	return m, nil
}

// ParseAcceptMsg parses an Accept payload.
func ParseAcceptMsg(p []byte) (*AcceptMsg, error) {
	r := &reader{b: p, msg: MsgAccept}
	m := &AcceptMsg{ID: r.u64("id"), From: r.u32("from")}
	m.Plane = append([]byte(nil), r.bytes("plane", MaxPlane)...)
	if m.From > MaxBlocks {
		r.fail(fmt.Sprintf("first wanted block %d exceeds %d", m.From, MaxBlocks))
	}
	if err := r.end(); err != nil {
		return nil, err
	}
	return m, nil
}

// ParseRejectMsg parses a Reject payload.
func ParseRejectMsg(p []byte) (*RejectMsg, error) {
	r := &reader{b: p, msg: MsgReject}
	m := &RejectMsg{ID: r.u64("id"), Code: RejectCode(r.u8("code"))}
	m.Reason = string(r.bytes("reason", MaxText))
	if r.err == nil && m.Code >= numRejectCodes {
		r.fail(fmt.Sprintf("unknown reject code %d", m.Code))
	}
	if err := r.end(); err != nil {
		return nil, err
	}
	return m, nil
}

// ParseStartMsg parses a Start payload.
func ParseStartMsg(p []byte) (*StartMsg, error) {
	r := &reader{b: p, msg: MsgStart}
	m := &StartMsg{ID: r.u64("id")}
	m.Plane = append([]byte(nil), r.bytes("plane", MaxPlane)...)
	if err := r.end(); err != nil {
		return nil, err
	}
	return m, nil
}

// ParseDoneMsg parses a Done payload.
func ParseDoneMsg(p []byte) (*DoneMsg, error) {
	r := &reader{b: p, msg: MsgDone}
	m := &DoneMsg{ID: r.u64("id")}
	m.Err = string(r.bytes("error", MaxText))
	if err := r.end(); err != nil {
		return nil, err
	}
	return m, nil
}

// ParseAbortMsg parses an Abort payload.
func ParseAbortMsg(p []byte) (*AbortMsg, error) {
	r := &reader{b: p, msg: MsgAbort}
	m := &AbortMsg{ID: r.u64("id")}
	m.Cause = string(r.bytes("cause", MaxText))
	if err := r.end(); err != nil {
		return nil, err
	}
	return m, nil
}

// ParseAckMsg parses an Ack payload.
func ParseAckMsg(p []byte) (*AckMsg, error) {
	r := &reader{b: p, msg: MsgAck}
	m := &AckMsg{ID: r.u64("id"), Of: MsgType(r.u8("of"))}
	if r.err == nil && m.Of != MsgDone && m.Of != MsgAbort {
		r.fail(fmt.Sprintf("ack of %v", m.Of))
	}
	if err := r.end(); err != nil {
		return nil, err
	}
	return m, nil
}

// ParseMessage parses the payload of a frame of type t.
func ParseMessage(t MsgType, payload []byte) (Message, error) {
	switch t {
	case MsgPropose:
		return nilIfErr(ParseProposeMsg(payload))
	case MsgAccept:
		return nilIfErr(ParseAcceptMsg(payload))
	case MsgReject:
		return nilIfErr(ParseRejectMsg(payload))
	case MsgStart:
		return nilIfErr(ParseStartMsg(payload))
	case MsgDone:
		return nilIfErr(ParseDoneMsg(payload))
	case MsgAbort:
		return nilIfErr(ParseAbortMsg(payload))
	case MsgAck:
		return nilIfErr(ParseAckMsg(payload))
	}
	return nil, fmt.Errorf("kvlease: handoff: unknown message type %d: %w", uint8(t), ErrProtocol)
}

// nilIfErr keeps a typed nil pointer out of the Message interface.
func nilIfErr[M Message](m M, err error) (Message, error) {
	if err != nil {
		return nil, err
	}
	return m, nil
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// crcOf is the frame checksum: crc32c over the first eight header bytes
// and the payload.
func crcOf(head, payload []byte) uint32 {
	return crc32.Update(crc32.Checksum(head, castagnoli), castagnoli, payload)
}

// AppendFrame appends m's frame to b.
func AppendFrame(b []byte, m Message) []byte {
	start := len(b)
	b = append(b, 'K', 'H', ProtocolVersion, byte(m.Type()), 0, 0, 0, 0, 0, 0, 0, 0)
	b = m.appendPayload(b)
	h := b[start : start+headerLength]
	le.PutUint32(h[4:], uint32(len(b)-start-headerLength))
	le.PutUint32(h[8:], crcOf(h[:8], b[start+headerLength:]))
	return b
}

// ReadFrame reads one frame from r into buf (grown as needed, never past
// MaxFrame) and parses it. It returns the message and the buffer for the
// next call. Any error wraps ErrProtocol unless it is r's own (io.EOF, a
// timeout, a reset).
func ReadFrame(r io.Reader, buf []byte) (Message, []byte, error) {
	return readFrame(r, buf, nil)
}

// readFrame is ReadFrame; began, if set, is called once the first byte
// of a frame has arrived (to arm the frame deadline).
func readFrame(r io.Reader, buf []byte, began func()) (Message, []byte, error) {
	if cap(buf) < headerLength {
		buf = make([]byte, 0, 512)
	}
	h := buf[:headerLength]
	if _, err := io.ReadFull(r, h[:1]); err != nil {
		return nil, buf, err
	}
	if began != nil {
		began()
	}
	if _, err := io.ReadFull(r, h[1:]); err != nil {
		return nil, buf, fmt.Errorf("kvlease: handoff: half a frame header: %w (%w)", ErrProtocol, err)
	}
	if h[0] != 'K' || h[1] != 'H' {
		return nil, buf, fmt.Errorf("kvlease: handoff: bad frame magic %q: %w", h[:2], ErrProtocol)
	}
	if h[2] != ProtocolVersion {
		return nil, buf, fmt.Errorf("kvlease: handoff: protocol version %d, want %d: %w", h[2], ProtocolVersion, ErrProtocol)
	}
	n := le.Uint32(h[4:])
	if n > MaxFrame {
		return nil, buf, fmt.Errorf("kvlease: handoff: frame of %d bytes exceeds %d: %w", n, MaxFrame, ErrProtocol)
	}
	if cap(buf) < headerLength+int(n) {
		nb := make([]byte, headerLength+int(n))
		copy(nb, h)
		buf = nb
	}
	frame := buf[:headerLength+int(n)]
	if _, err := io.ReadFull(r, frame[headerLength:]); err != nil {
		return nil, buf, fmt.Errorf("kvlease: handoff: half a frame (%d bytes announced): %w (%w)", n, ErrProtocol, err)
	}
	m, err := parseFrame(frame)
	return m, buf, err
}

// parseFrame checks a whole frame (its header already checked for magic,
// version and length by the reader) and parses its payload.
func parseFrame(frame []byte) (Message, error) {
	if len(frame) < headerLength {
		return nil, fmt.Errorf("kvlease: handoff: frame of %d bytes: %w", len(frame), ErrProtocol)
	}
	h := frame[:headerLength]
	if h[0] != 'K' || h[1] != 'H' {
		return nil, fmt.Errorf("kvlease: handoff: bad frame magic %q: %w", h[:2], ErrProtocol)
	}
	if h[2] != ProtocolVersion {
		return nil, fmt.Errorf("kvlease: handoff: protocol version %d, want %d: %w", h[2], ProtocolVersion, ErrProtocol)
	}
	if n := le.Uint32(h[4:]); int(n) != len(frame)-headerLength {
		return nil, fmt.Errorf("kvlease: handoff: frame announces %d bytes, holds %d: %w", n, len(frame)-headerLength, ErrProtocol)
	}
	crc := crcOf(h[:8], frame[headerLength:])
	if crc != le.Uint32(h[8:]) {
		return nil, fmt.Errorf("kvlease: handoff: frame checksum %08x, computed %08x: %w", le.Uint32(h[8:]), crc, ErrProtocol)
	}
	return ParseMessage(MsgType(h[3]), frame[headerLength:])
}

// DefaultFrameTimeout bounds how long a frame that has begun may take to
// arrive whole, and how long a write may block.
const DefaultFrameTimeout = 10 * time.Second

// ctrl is one control connection: framed reads on one goroutine, writes
// serialised by a mutex, each with a deadline. In a psk session every
// frame travels in a sealed record (ch).
type ctrl struct {
	c       net.Conn
	ch      *channel // nil unless psk
	timeout time.Duration
	rbuf    []byte

	wmu  sync.Mutex
	wbuf []byte
	sbuf []byte // the sealed record
}

func newCtrl(c net.Conn, timeout time.Duration) *ctrl {
	if timeout <= 0 {
		timeout = DefaultFrameTimeout
	}
	return &ctrl{c: c, timeout: timeout}
}

// read waits (without a deadline) for a frame to begin, then gives the
// rest of it the frame timeout.
func (c *ctrl) read() (Message, error) {
	_ = c.c.SetReadDeadline(time.Time{})
	began := func() { _ = c.c.SetReadDeadline(time.Now().Add(c.timeout)) }
	if c.ch != nil {
		frame, buf, err := c.ch.readRecord(c.c, c.rbuf, began)
		c.rbuf = buf
		if err != nil {
			return nil, err
		}
		return parseFrame(frame)
	}
	m, buf, err := readFrame(c.c, c.rbuf, began)
	c.rbuf = buf
	return m, err
}

func (c *ctrl) send(m Message) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.wbuf = AppendFrame(c.wbuf[:0], m)
	out := c.wbuf
	if c.ch != nil {
		c.sbuf = c.ch.seal(c.sbuf[:0], c.wbuf)
		out = c.sbuf
	}
	_ = c.c.SetWriteDeadline(time.Now().Add(c.timeout))
	_, err := c.c.Write(out)
	return err
}

// clip cuts a text to MaxText bytes for the wire.
func clip(s string) string {
	if len(s) > MaxText {
		return s[:MaxText]
	}
	return s
}

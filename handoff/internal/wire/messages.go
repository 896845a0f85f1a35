package wire

import (
	"encoding/binary"
	"fmt"

	"github.com/kvlease/kvlease"
)

// The messages of the control protocol (see frame.go for the frame and
// who sends what): one struct each, with its append and parse functions.

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
// with them (Source.ProposeTokens). Namespace, when set, is the public
// namespace identifier of the tenant whose blocks these are
// (kvlease.Tenant.Namespace), and Salt the public salt their seed was
// derived with (Seed is kvlease.Pool.TenantSeed(tenant, Salt)): the
// destination seals them only for a tenant its Tenant policy allows the
// authenticated proposer, and only if Seed is that tenant's seed for
// Salt (see DestinationConfig.Tenant).
type ProposeMsg struct {
	ID        uint64
	Request   string
	Blocks    uint32
	Envelope  uint64
	Hashes    []kvlease.BlockHash
	Namespace string
	Salt      kvlease.BlockHash
	Seed      kvlease.BlockHash
	Tokens    []int32
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
	RejectNamespace                   // the proposed namespace is not the proposer's (ErrNamespace)
	numRejectCodes
)

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
	b = appendText(b, m.Namespace)
	b = le.AppendUint64(b, uint64(m.Salt))
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
		r.err = fmt.Errorf("kvlease: handoff %v message: %s: %w", r.msg, what, ErrProtocolFatal)
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
		m.Namespace = string(r.bytes("namespace", MaxText))
		m.Salt = kvlease.BlockHash(r.u64("salt"))
		if r.err != nil || len(r.b) == 0 {
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
	return nil, fmt.Errorf("kvlease: handoff: unknown message type %d: %w", uint8(t), ErrProtocolFatal)
}

// nilIfErr keeps a typed nil pointer out of the Message interface.
func nilIfErr[M Message](m M, err error) (Message, error) {
	if err != nil {
		return nil, err
	}
	return m, nil
}

// clip cuts a text to MaxText bytes for the wire.
func clip(s string) string {
	if len(s) > MaxText {
		return s[:MaxText]
	}
	return s
}

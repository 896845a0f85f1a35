package events

// The ZeroMQ wire protocol, ZMTP 3.x (rfc.zeromq.org specs 23 and 37), as
// far as a publisher serves it: the greeting, the NULL mechanism's READY
// and ERROR commands, message frames, and the commands a subscriber sends
// (SUBSCRIBE, CANCEL, PING; and ZMTP 3.0's subscription messages). Written
// from the specification. Nothing here trusts a peer: every size is
// checked against a limit before anything is allocated or read, and every
// violation is an error wrapping ErrProtocol that closes the connection.

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// ErrProtocol is wrapped by the error that ends a connection whose peer
// broke ZMTP: a bad greeting, a frame over the size limit, an unknown
// mechanism or socket type, a malformed command.
var ErrProtocol = errors.New("events: ZMTP protocol violation")

// ZMTP greeting (spec 23): signature (0xFF, 8 bytes padding, 0x7F),
// version (major, minor), mechanism (20 bytes, NUL-padded), as-server,
// filler (31 zero bytes): 64 bytes.
const (
	greetingLen  = 64
	zmtpMajor    = 3
	zmtpMinor    = 1 // we speak 3.1 and accept 3.0 peers
	mechanismLen = 20
)

// Frame flags (spec 23): MORE, LONG and COMMAND; the other bits are
// reserved and must be zero.
const (
	flagMore     = 0x01
	flagLong     = 0x02
	flagCommand  = 0x04
	flagReserved = 0xF8
)

// appendGreeting appends our greeting: ZMTP 3.1, NULL mechanism.
func appendGreeting(buf []byte, asServer bool) []byte {
	buf = append(buf, 0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, zmtpMajor, zmtpMinor)
	var mech [mechanismLen]byte
	copy(mech[:], "NULL")
	buf = append(buf, mech[:]...)
	if asServer {
		buf = append(buf, 1)
	} else {
		buf = append(buf, 0)
	}
	var filler [31]byte
	return append(buf, filler[:]...)
}

// greeting is what a peer's greeting says.
type greeting struct {
	major, minor byte
	mechanism    string
	asServer     bool
}

// parseGreeting checks a peer's 64-byte greeting: the ZMTP 3 signature, a
// major version of at least 3 (a later 3.x minor is spoken as ours), the
// NULL mechanism.
func parseGreeting(b []byte) (greeting, error) {
	if len(b) != greetingLen {
		return greeting{}, fmt.Errorf("events: greeting of %d bytes: %w", len(b), ErrProtocol)
	}
	if b[0] != 0xFF || b[9] != 0x7F {
		return greeting{}, fmt.Errorf("events: not a ZMTP 3 signature (% x): %w", b[:10], ErrProtocol)
	}
	g := greeting{major: b[10], minor: b[11], asServer: b[32] == 1}
	if g.major < zmtpMajor {
		return g, fmt.Errorf("events: ZMTP %d.%d peer (want 3.x): %w", g.major, g.minor, ErrProtocol)
	}
	mech := b[12 : 12+mechanismLen]
	n := 0
	for n < len(mech) && mech[n] != 0 {
		n++
	}
	for _, c := range mech[n:] {
		if c != 0 {
			return g, fmt.Errorf("events: mechanism field not NUL-padded: %w", ErrProtocol)
		}
	}
	g.mechanism = string(mech[:n])
	if g.mechanism != "NULL" {
		return g, fmt.Errorf("events: mechanism %q (only NULL is served): %w", g.mechanism, ErrProtocol)
	}
	if b[32] > 1 {
		return g, fmt.Errorf("events: as-server %d: %w", b[32], ErrProtocol)
	}
	return g, nil
}

// frameHeader is a frame's flags and body size.
type frameHeader struct {
	flags byte
	size  uint64
}

func (h frameHeader) more() bool    { return h.flags&flagMore != 0 }
func (h frameHeader) command() bool { return h.flags&flagCommand != 0 }

// readFrameHeader reads a frame's flags and size and checks them: no
// reserved bit, no MORE on a command, a size within limit. Nothing is
// allocated.
func readFrameHeader(r *bufio.Reader, limit int) (frameHeader, error) {
	var h frameHeader
	flags, err := r.ReadByte()
	if err != nil {
		return h, err
	}
	h.flags = flags
	if flags&flagReserved != 0 {
		return h, fmt.Errorf("events: frame flags %#02x: %w", flags, ErrProtocol)
	}
	if flags&flagCommand != 0 && flags&flagMore != 0 {
		return h, fmt.Errorf("events: command frame with MORE: %w", ErrProtocol)
	}
	if flags&flagLong != 0 {
		var sz [8]byte
		if _, err := io.ReadFull(r, sz[:]); err != nil {
			return h, err
		}
		h.size = binary.BigEndian.Uint64(sz[:])
	} else {
		b, err := r.ReadByte()
		if err != nil {
			return h, err
		}
		h.size = uint64(b)
	}
	if h.size > uint64(limit) {
		return h, fmt.Errorf("events: frame of %d bytes (limit %d): %w", h.size, limit, ErrProtocol)
	}
	return h, nil
}

// readFrame reads one whole frame whose size is within limit into buf
// (grown only up to limit) and returns its header and body, a slice of
// buf valid until the next call.
func readFrame(r *bufio.Reader, limit int, buf *[]byte) (frameHeader, []byte, error) {
	h, err := readFrameHeader(r, limit)
	if err != nil {
		return h, nil, err
	}
	n := int(h.size) // ≤ limit
	if cap(*buf) < n {
		*buf = make([]byte, n)
	}
	body := (*buf)[:n]
	if _, err := io.ReadFull(r, body); err != nil {
		return h, nil, err
	}
	return h, body, nil
}

// appendFrameHeader appends the header of a frame of n bytes.
func appendFrameHeader(buf []byte, flags byte, n int) []byte {
	if n > 255 {
		return binary.BigEndian.AppendUint64(append(buf, flags|flagLong), uint64(n))
	}
	return append(buf, flags, byte(n))
}

// appendCommand appends a command frame: its name and body.
func appendCommand(buf []byte, name string, body []byte) []byte {
	buf = appendFrameHeader(buf, flagCommand, 1+len(name)+len(body))
	buf = append(buf, byte(len(name)))
	buf = append(buf, name...)
	return append(buf, body...)
}

// appendReady appends a NULL mechanism READY command with our socket type.
func appendReady(buf []byte, socketType string) []byte {
	var props []byte
	props = appendProperty(props, "Socket-Type", socketType)
	return appendCommand(buf, "READY", props)
}

// appendError appends an ERROR command (ZMTP 3.1) giving reason.
func appendError(buf []byte, reason string) []byte {
	if len(reason) > 255 {
		reason = reason[:255]
	}
	return appendCommand(buf, "ERROR", append([]byte{byte(len(reason))}, reason...))
}

func appendProperty(buf []byte, name, value string) []byte {
	buf = append(buf, byte(len(name)))
	buf = append(buf, name...)
	buf = binary.BigEndian.AppendUint32(buf, uint32(len(value)))
	return append(buf, value...)
}

// parseCommand splits a command frame's body into its name and data.
func parseCommand(body []byte) (name string, data []byte, err error) {
	if len(body) < 1 || int(body[0]) == 0 || 1+int(body[0]) > len(body) {
		return "", nil, fmt.Errorf("events: command without a name: %w", ErrProtocol)
	}
	n := int(body[0])
	return string(body[1 : 1+n]), body[1+n:], nil
}

// readyProps is what a peer's READY says that we use. A peer's Identity
// is checked but not kept: the replay socket answers on the connection a
// request came in on, so it needs no routing id.
type readyProps struct {
	socketType string
}

// maxIdentity bounds a peer's routing id (spec 23: 0..255 bytes).
const maxIdentity = 255

// parseReady parses a READY command's metadata: properties of a 1-byte
// name size, the name, a 4-byte value size and the value. Socket-Type is
// required; Identity, if present, is at most 255 bytes; other properties
// are skipped. Names compare case-insensitively (spec 23).
func parseReady(data []byte) (readyProps, error) {
	var p readyProps
	for len(data) > 0 {
		n := int(data[0])
		if n == 0 || 1+n+4 > len(data) {
			return p, fmt.Errorf("events: READY property name: %w", ErrProtocol)
		}
		name := data[1 : 1+n]
		vlen := binary.BigEndian.Uint32(data[1+n:])
		data = data[1+n+4:]
		if uint64(vlen) > uint64(len(data)) {
			return p, fmt.Errorf("events: READY property value of %d bytes, %d left: %w", vlen, len(data), ErrProtocol)
		}
		value := data[:vlen]
		data = data[vlen:]
		switch {
		case asciiEqualFold(name, "Socket-Type"):
			p.socketType = string(value)
		case asciiEqualFold(name, "Identity"):
			if len(value) > maxIdentity {
				return p, fmt.Errorf("events: identity of %d bytes: %w", len(value), ErrProtocol)
			}
		}
	}
	if p.socketType == "" {
		return p, fmt.Errorf("events: READY without Socket-Type: %w", ErrProtocol)
	}
	return p, nil
}

func asciiEqualFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := range b {
		x, y := b[i], s[i]
		if 'A' <= x && x <= 'Z' {
			x += 'a' - 'A'
		}
		if 'A' <= y && y <= 'Z' {
			y += 'a' - 'A'
		}
		if x != y {
			return false
		}
	}
	return true
}

// subscription is one change a subscriber asks for.
type subscription struct {
	subscribe bool // false: cancel
	topic     []byte
}

// parseSubscriptionMessage reads ZMTP 3.0's form: a one-frame message
// whose first byte is 1 (subscribe) or 0 (cancel), then the topic. ok is
// false for any other message, which a PUB socket ignores.
func parseSubscriptionMessage(body []byte) (subscription, bool) {
	if len(body) == 0 || body[0] > 1 {
		return subscription{}, false
	}
	return subscription{subscribe: body[0] == 1, topic: body[1:]}, true
}

// pingReply returns the PONG for a PING command's data: a 2-byte TTL and
// a context of at most 16 bytes, echoed.
func pingReply(buf []byte, data []byte) ([]byte, error) {
	if len(data) < 2 || len(data) > 2+16 {
		return buf, fmt.Errorf("events: PING of %d bytes: %w", len(data), ErrProtocol)
	}
	return appendCommand(buf, "PONG", data[2:]), nil
}

package wire

import (
	"fmt"
	"hash/crc32"
	"io"
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
// proposal are a 4-byte count and 8 bytes each, then its tenant
// namespace (a string, "" for none) and the 8-byte salt of its seed,
// optionally followed by its tokens: a 4-byte count, the 8-byte
// namespace seed, 4 bytes each. A reader checks the
// length against MaxFrame before it allocates, and a frame that has begun
// must arrive whole within the connection's frame timeout.
//
// Who sends what (S = source side, D = destination side):
//
//	S→D Propose  {id, request, blocks, envelope fingerprint, chained hashes, tenant namespace, salt[, seed, tokens]}
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
// authentication handshake (auth.go) and the psk record layer; version
// 3 the psk handshake's ephemeral X25519 shares (forward secrecy) and the
// destination's confirm byte; version 4 the tenant namespace and salt of
// a Propose.
const ProtocolVersion = 4

// Limits of the control protocol.
const (
	MaxFrame     = 1 << 20 // most payload bytes in one frame
	MaxText      = 1024    // most bytes of a request name, reason or cause
	MaxPlane     = 4096    // most data-plane bytes in Accept or Start
	MaxBlocks    = 1 << 16 // most blocks in one handoff
	headerLength = 12
)

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
		return nil, buf, fmt.Errorf("kvlease: handoff: half a frame header: %w (%w)", ErrProtocolFatal, err)
	}
	n, err := checkHeader(h)
	if err != nil {
		return nil, buf, err
	}
	if cap(buf) < headerLength+int(n) {
		nb := make([]byte, headerLength+int(n))
		copy(nb, h)
		buf = nb
	}
	frame := buf[:headerLength+int(n)]
	if _, err := io.ReadFull(r, frame[headerLength:]); err != nil {
		return nil, buf, fmt.Errorf("kvlease: handoff: half a frame (%d bytes announced): %w (%w)", n, ErrProtocolFatal, err)
	}
	m, err := ParseFrame(frame)
	return m, buf, err
}

// checkHeader checks a frame header's magic, version and length (at most
// MaxFrame) and returns the length: the one check of a header, whether
// it came bare (readFrame, before the payload is allocated) or out of a
// record (ParseFrame).
func checkHeader(h []byte) (uint32, error) {
	if h[0] != 'K' || h[1] != 'H' {
		return 0, fmt.Errorf("kvlease: handoff: bad frame magic %q: %w", h[:2], ErrProtocolFatal)
	}
	if h[2] != ProtocolVersion {
		return 0, fmt.Errorf("kvlease: handoff: protocol version %d, want %d: %w", h[2], ProtocolVersion, ErrProtocolFatal)
	}
	n := le.Uint32(h[4:])
	if n > MaxFrame {
		return 0, fmt.Errorf("kvlease: handoff: frame of %d bytes exceeds %d: %w", n, MaxFrame, ErrProtocolFatal)
	}
	return n, nil
}

// ParseFrame checks a whole frame (header and checksum) and parses its
// payload.
func ParseFrame(frame []byte) (Message, error) {
	if len(frame) < headerLength {
		return nil, fmt.Errorf("kvlease: handoff: frame of %d bytes: %w", len(frame), ErrProtocolFatal)
	}
	h := frame[:headerLength]
	n, err := checkHeader(h)
	if err != nil {
		return nil, err
	}
	if int(n) != len(frame)-headerLength {
		return nil, fmt.Errorf("kvlease: handoff: frame announces %d bytes, holds %d: %w", n, len(frame)-headerLength, ErrProtocolFatal)
	}
	crc := crcOf(h[:8], frame[headerLength:])
	if crc != le.Uint32(h[8:]) {
		return nil, fmt.Errorf("kvlease: handoff: frame checksum %08x, computed %08x: %w", le.Uint32(h[8:]), crc, ErrProtocolFatal)
	}
	return ParseMessage(MsgType(h[3]), frame[headerLength:])
}

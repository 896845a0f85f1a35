package wire

import (
	"crypto/aes"
	"crypto/cipher"
	"fmt"
	"io"
	"slices"
)

// Channel is the record layer of a psk session: each control frame is
// sealed with AES-256-GCM under its direction's key, with the record's
// sequence number as the nonce. The receiver takes only the next
// sequence number of its direction, so a replayed, reordered, dropped or
// foreign record is refused before it is opened.
//
//	length (4 bytes LE: sequence + sealed frame) | sequence (8 bytes LE) | AES-GCM(frame) with its 16-byte tag
//
// The length and the sequence are the additional data.
type Channel struct {
	send, recv cipher.AEAD
	sseq, rseq uint64 // the next sequence to send, to take
}

const (
	recordHeader = 4 + 8
	recordTag    = 16
	// maxRecord bounds a record's length field: the largest frame, its
	// header, the sequence and the tag.
	maxRecord = 8 + headerLength + MaxFrame + recordTag
)

// NewChannel returns the record layer of one side of a psk session:
// sendKey seals what it sends, recvKey opens what it reads.
func NewChannel(sendKey, recvKey []byte) (*Channel, error) {
	s, err := newGCM(sendKey)
	if err != nil {
		return nil, err
	}
	r, err := newGCM(recvKey)
	if err != nil {
		return nil, err
	}
	return &Channel{send: s, recv: r}, nil
}

func newGCM(key []byte) (cipher.AEAD, error) {
	b, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(b)
}

func seqNonce(seq uint64) []byte {
	var n [12]byte
	le.PutUint64(n[4:], seq)
	return n[:]
}

// Seal appends the record of frame to b. Called with the writer's lock.
func (ch *Channel) Seal(b, frame []byte) []byte {
	start := len(b)
	b = append(append(b, make([]byte, recordHeader)...), frame...)
	return ch.sealTail(b, start)
}

// sealTail turns b[start:] (recordHeader bytes to fill, then a frame)
// into the frame's record, sealing the frame in place (no copy of it),
// and returns b grown by the tag. Called with the writer's lock.
func (ch *Channel) sealTail(b []byte, start int) []byte {
	n := len(b) - start - recordHeader // the frame's length
	le.PutUint32(b[start:], uint32(8+n+recordTag))
	le.PutUint64(b[start+4:], ch.sseq)
	b = slices.Grow(b, recordTag) // Seal then appends the tag in place
	frame := b[start+recordHeader:]
	sealed := ch.send.Seal(frame[:0], seqNonce(ch.sseq), frame, b[start:start+recordHeader])
	ch.sseq++
	return b[:start+recordHeader+len(sealed)]
}

// ReadRecord reads one record from r into buf and returns the frame it
// holds (opened in place) and the buffer for the next call. began is
// called once the first byte has arrived. Errors wrap ErrAuth (and
// ErrProtocolFatal) for anything but r's own.
func (ch *Channel) ReadRecord(r io.Reader, buf []byte, began func()) ([]byte, []byte, error) {
	if cap(buf) < recordHeader {
		buf = make([]byte, 0, 512)
	}
	h := buf[:recordHeader]
	if _, err := io.ReadFull(r, h[:1]); err != nil {
		return nil, buf, err
	}
	if began != nil {
		began()
	}
	if _, err := io.ReadFull(r, h[1:]); err != nil {
		return nil, buf, fmt.Errorf("kvlease: handoff: half a record header: %w (%w)", ErrProtocolFatal, err)
	}
	n := le.Uint32(h)
	if n < 8+recordTag || n > maxRecord {
		return nil, buf, fmt.Errorf("kvlease: handoff: record of %d bytes outside %d..%d: %w (%w)", n, 8+recordTag, maxRecord, ErrProtocolFatal, ErrAuth)
	}
	if seq := le.Uint64(h[4:]); seq != ch.rseq {
		return nil, buf, fmt.Errorf("kvlease: handoff: record sequence %d, want %d (replayed, reordered or from another session): %w (%w)", seq, ch.rseq, ErrAuth, ErrProtocolFatal)
	}
	if cap(buf) < 4+int(n) {
		nb := make([]byte, 4+int(n))
		copy(nb, h)
		buf = nb
	}
	rec := buf[:4+int(n)]
	if _, err := io.ReadFull(r, rec[recordHeader:]); err != nil {
		return nil, buf, fmt.Errorf("kvlease: handoff: half a record (%d bytes announced): %w (%w)", n, ErrProtocolFatal, err)
	}
	frame, err := ch.recv.Open(rec[recordHeader:recordHeader], seqNonce(ch.rseq), rec[recordHeader:], rec[:recordHeader])
	if err != nil {
		return nil, buf, fmt.Errorf("kvlease: handoff: record %d does not verify under the session key (forged or from another session): %w (%w)", ch.rseq, ErrAuth, ErrProtocolFatal)
	}
	ch.rseq++
	return frame, buf, nil
}

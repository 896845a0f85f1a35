package wire

import (
	"bytes"
	"errors"
	"io"
	"reflect"
	"testing"

	"github.com/kvlease/kvlease"
)

func sampleMessages() []Message {
	return []Message{
		&ProposeMsg{ID: 1, Request: "req-1", Blocks: 4, Envelope: 0xfeed, Hashes: []kvlease.BlockHash{1, 2, 3}},
		&ProposeMsg{ID: 2, Blocks: 1, Hashes: []kvlease.BlockHash{}},
		&ProposeMsg{ID: 11, Request: "verified", Blocks: 3, Envelope: 1, Hashes: []kvlease.BlockHash{4, 5}, Seed: 77, Tokens: []int32{1, -2, 3, 1 << 30}},
		&AcceptMsg{ID: 3, From: 2, Plane: []byte("addr+token")},
		&RejectMsg{ID: 4, Code: RejectExhausted, Reason: "full"},
		&StartMsg{ID: 5},
		&DoneMsg{ID: 6},
		&DoneMsg{ID: 7, Err: "crc mismatch"},
		&AbortMsg{ID: 8, Cause: "client went away"},
		&AckMsg{ID: 9, Of: MsgDone},
		&AckMsg{ID: 10, Of: MsgAbort},
	}
}

func TestProtoRoundTrip(t *testing.T) {
	var stream []byte
	for _, m := range sampleMessages() {
		stream = AppendFrame(stream, m)
	}
	r := bytes.NewReader(stream)
	var buf []byte
	for _, want := range sampleMessages() {
		got, b, err := ReadFrame(r, buf)
		buf = b
		if err != nil {
			t.Fatalf("%v: %v", want.Type(), err)
		}
		if p, ok := want.(*ProposeMsg); ok && len(p.Hashes) == 0 {
			p.Hashes = got.(*ProposeMsg).Hashes // nil vs empty
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("got %#v, want %#v", got, want)
		}
	}
	if _, _, err := ReadFrame(r, buf); err != io.EOF {
		t.Fatalf("after the last frame: %v", err)
	}
}

// TestProtoMalformed: every corruption of a frame is refused with an
// error wrapping ErrProtocol (or the reader's own error), never a panic.
func TestProtoMalformed(t *testing.T) {
	good := AppendFrame(nil, &ProposeMsg{ID: 1, Request: "r", Blocks: 3, Envelope: 9, Hashes: []kvlease.BlockHash{5, 6}})
	mutate := func(f func(b []byte) []byte) []byte { return f(append([]byte(nil), good...)) }
	cases := map[string][]byte{
		"bad magic":        mutate(func(b []byte) []byte { b[0] = 'X'; return b }),
		"bad version":      mutate(func(b []byte) []byte { b[2] = ProtocolVersion + 1; return b }),
		"unknown type":     AppendFrameRaw(99, []byte{1, 2, 3, 4, 5, 6, 7, 8}),
		"flipped payload":  mutate(func(b []byte) []byte { b[len(b)-1] ^= 1; return b }),
		"flipped type":     mutate(func(b []byte) []byte { b[3] = byte(MsgAbort); return b }),
		"oversize length":  mutate(func(b []byte) []byte { le.PutUint32(b[4:], MaxFrame+1); return b }),
		"half header":      good[:7],
		"half payload":     good[:len(good)-3],
		"too many hashes":  AppendFrameRaw(MsgPropose, (&ProposeMsg{ID: 1, Blocks: 1, Hashes: []kvlease.BlockHash{1, 2}}).appendPayload(nil)),
		"zero blocks":      AppendFrameRaw(MsgPropose, (&ProposeMsg{ID: 1}).appendPayload(nil)),
		"trailing bytes":   AppendFrameRaw(MsgDone, append((&DoneMsg{ID: 1}).appendPayload(nil), 0)),
		"truncated id":     AppendFrameRaw(MsgAbort, []byte{1, 2, 3}),
		"bad reject code":  AppendFrameRaw(MsgReject, (&RejectMsg{ID: 1, Code: 200}).appendPayload(nil)),
		"ack of propose":   AppendFrameRaw(MsgAck, (&AckMsg{ID: 1, Of: MsgPropose}).appendPayload(nil)),
		"oversize plane":   AppendFrameRaw(MsgStart, appendBytes(le.AppendUint64(nil, 1), make([]byte, MaxPlane+1))),
		"accept from huge": AppendFrameRaw(MsgAccept, (&AcceptMsg{ID: 1, From: MaxBlocks + 1}).appendPayload(nil)),
		"half a hash":      AppendFrameRaw(MsgPropose, (&ProposeMsg{ID: 1, Blocks: 2, Hashes: []kvlease.BlockHash{1, 2}}).appendPayload(nil)[:40]),
		"half token count": AppendFrameRaw(MsgPropose, append((&ProposeMsg{ID: 1, Blocks: 2, Hashes: []kvlease.BlockHash{1}}).appendPayload(nil), 1, 0)),
		"tokens short":     AppendFrameRaw(MsgPropose, (&ProposeMsg{ID: 1, Blocks: 2, Hashes: []kvlease.BlockHash{1}, Tokens: []int32{1, 2}}).appendPayload(nil)[:50]),
		"zero tokens":      AppendFrameRaw(MsgPropose, append(le.AppendUint64(le.AppendUint32((&ProposeMsg{ID: 1, Blocks: 2}).appendPayload(nil), 0), 5), 1, 2, 3, 4)),
	}
	for name, b := range cases {
		m, _, err := ReadFrame(bytes.NewReader(b), nil)
		if m != nil || err == nil {
			t.Errorf("%s: parsed %v", name, m)
			continue
		}
		if !errors.Is(err, ErrProtocol) || !errors.Is(err, ErrProtocolFatal) || errors.Is(err, ErrProtocolRefused) {
			t.Errorf("%s: %v does not wrap ErrProtocol and ErrProtocolFatal alone", name, err)
		}
		// The same bytes out of a record (a psk session) take the
		// other path, ParseFrame, which must refuse them alike.
		m, err = ParseFrame(b)
		if m != nil || !errors.Is(err, ErrProtocolFatal) || errors.Is(err, ErrProtocolRefused) {
			t.Errorf("%s out of a record: parsed %v, %v", name, m, err)
		}
	}
}

// AppendFrameRaw frames an arbitrary payload under type t with a valid
// checksum (for tests of payload parsing).
func AppendFrameRaw(t MsgType, payload []byte) []byte {
	b := append([]byte{'K', 'H', ProtocolVersion, byte(t)}, make([]byte, 8)...)
	b = append(b, payload...)
	le.PutUint32(b[4:], uint32(len(payload)))
	crc := crcOf(b[:8], payload)
	le.PutUint32(b[8:], crc)
	return b
}

// FuzzReadFrame: arbitrary bytes never panic; whatever parses re-encodes
// to the same frame.
func FuzzReadFrame(f *testing.F) {
	for _, m := range sampleMessages() {
		f.Add(AppendFrame(nil, m))
	}
	f.Add([]byte("KH\x01\x01garbage"))
	f.Fuzz(func(t *testing.T, b []byte) {
		r := bytes.NewReader(b)
		var buf []byte
		for range 8 {
			start := len(b) - r.Len()
			m, nb, err := ReadFrame(r, buf)
			buf = nb
			if err != nil {
				if err != io.EOF && !errors.Is(err, ErrProtocolFatal) {
					t.Fatalf("error %v wraps neither EOF nor ErrProtocolFatal", err)
				}
				return
			}
			end := len(b) - r.Len()
			if again := AppendFrame(nil, m); !bytes.Equal(again, b[start:end]) {
				t.Fatalf("%v re-encodes differently", m.Type())
			}
		}
	})
}

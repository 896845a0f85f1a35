package wire

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

// TestRecordLayer: a psk record is taken once, in order, under its own
// session's key; a replay, a reordering, a record of another session, a
// flipped bit or a lie about its length are refused with ErrAuth.
func TestRecordLayer(t *testing.T) {
	k1, k2 := bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32)
	send, _ := NewChannel(k1, k2)
	other, _ := NewChannel(bytes.Repeat([]byte{3}, 32), k2)
	frames := make([][]byte, 3)
	records := make([][]byte, 3)
	for i := range frames {
		frames[i] = AppendFrame(nil, &AbortMsg{ID: uint64(i + 1), Cause: "x"})
		records[i] = send.Seal(nil, frames[i])
	}
	foreign := other.Seal(nil, frames[0])
	flipped := append([]byte(nil), records[0]...)
	flipped[len(flipped)-1] ^= 1
	long := append([]byte(nil), records[0]...)
	le.PutUint32(long, maxRecord+1)
	for _, tt := range []struct {
		name string
		in   [][]byte
		ok   int // records taken before the refusal
	}{
		{"in order", records, 3},
		{"replayed", [][]byte{records[0], records[1], records[0]}, 2},
		{"reordered", [][]byte{records[0], records[2]}, 1},
		{"dropped first", [][]byte{records[1]}, 0},
		{"another session", [][]byte{foreign}, 0},
		{"flipped", [][]byte{flipped}, 0},
		{"too long", [][]byte{long}, 0},
	} {
		recv, _ := NewChannel(k2, k1)
		r := bytes.NewReader(bytes.Join(tt.in, nil))
		var buf []byte
		taken := 0
		var err error
		for range tt.in {
			var f []byte
			f, buf, err = recv.ReadRecord(r, buf, nil)
			if err != nil {
				break
			}
			if !bytes.Equal(f, frames[taken]) {
				t.Fatalf("%s: record %d opened to another frame", tt.name, taken)
			}
			taken++
		}
		if taken != tt.ok || (tt.ok < len(tt.in) && (!errors.Is(err, ErrAuth) || !errors.Is(err, ErrProtocol))) {
			t.Errorf("%s: took %d records, then %v; want %d and ErrAuth", tt.name, taken, err, tt.ok)
		}
	}
}

// TestRecordSealInPlace: a frame sealed where it lies (the send path:
// after other bytes, in a buffer with no spare capacity or with plenty)
// makes the record seal makes from a copy, and opens to the frame.
func TestRecordSealInPlace(t *testing.T) {
	k1, k2 := bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32)
	copying, _ := NewChannel(k1, k2)
	inPlace, _ := NewChannel(k1, k2)
	recv, _ := NewChannel(k2, k1)
	var stream []byte
	for i, spare := range []int{0, 1, recordTag, 4096} {
		frame := AppendFrame(nil, &AbortMsg{ID: uint64(i + 1), Cause: strings.Repeat("c", 100*i)})
		want := copying.Seal(nil, frame)
		prefix := []byte("earlier bytes")
		b := make([]byte, 0, len(prefix)+recordHeader+len(frame)+spare)
		b = append(append(append(b, prefix...), make([]byte, recordHeader)...), frame...)
		got := inPlace.sealTail(b, len(prefix))
		if !bytes.Equal(got[:len(prefix)], prefix) || !bytes.Equal(got[len(prefix):], want) {
			t.Fatalf("spare %d: in place %x, from a copy %x", spare, got[len(prefix):], want)
		}
		stream = append(stream, got[len(prefix):]...)
	}
	r := bytes.NewReader(stream)
	var buf []byte
	for i := range 4 {
		frame, nb, err := recv.ReadRecord(r, buf, nil)
		buf = nb
		if err != nil {
			t.Fatalf("record %d: %v", i, err)
		}
		m, err := ParseFrame(frame)
		if err != nil || m.(*AbortMsg).ID != uint64(i+1) {
			t.Fatalf("record %d: %v, %v", i, m, err)
		}
	}
}

// FuzzRecord: whatever bytes arrive as psk records, the reader takes a
// record only if it was sealed under its key with the next sequence, and
// otherwise returns an error; it never panics or allocates past
// maxRecord.
func FuzzRecord(f *testing.F) {
	k1, k2 := bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32)
	send, _ := NewChannel(k1, k2)
	f.Add(send.Seal(nil, AppendFrame(nil, &AbortMsg{ID: 1, Cause: "x"})))
	f.Add([]byte{0xff, 0xff, 0xff, 0x7f, 0, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{30, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		recv, _ := NewChannel(k2, k1)
		r := bytes.NewReader(b)
		var buf []byte
		for range 4 {
			frame, nb, err := recv.ReadRecord(r, buf, nil)
			buf = nb
			if err != nil {
				return
			}
			if _, err := ParseFrame(frame); err != nil {
				return
			}
		}
	})
}

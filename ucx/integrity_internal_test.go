package ucx

import (
	"bytes"
	"crypto/hkdf"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// keyed returns session keys as an authenticated session with secret
// would derive them (HKDF-SHA256, as handoff.Peer.Key does).
func keyed(secret []byte) sessionKeys {
	return func(_ handoff.PlaneID, context []byte) ([]byte, error) {
		return hkdf.Key(sha256.New, secret, nil, keyLabel+string(context), 32)
	}
}

// pushOnce moves src into dst: the source sends as handoff sid, the
// destination receives as handoff did. It returns the destination's
// outcome, or Receive's error.
func pushOnce(t testing.TB, s *Sender[[]byte], r *Receiver[[]byte], sid, did handoff.PlaneID, src, dst [][]byte) error {
	t.Helper()
	accept, err := r.Prepare(did, len(dst))
	if err != nil {
		t.Fatal(err)
	}
	start, err := s.Send(sid, src, accept, func(*kvlease.Transfer) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	defer s.Finish(sid, errors.New("test over"))
	var dt *kvlease.Transfer
	if err := r.Receive(did, dst, start, func(t *kvlease.Transfer) error { dt = t; return nil }); err != nil {
		return err
	}
	<-dt.Done()
	return dt.Err()
}

func blocksIn(buf []byte, n, size int) [][]byte {
	var out [][]byte
	for i := range n {
		out = append(out, buf[i*size:(i+1)*size:(i+1)*size])
	}
	return out
}

func TestBlockIntegrity(t *testing.T) {
	const n, size = 6, 4096
	k1, k2 := bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32)
	one := handoff.PlaneID{Session: 1, Handoff: 1}
	for _, tc := range []struct {
		name       string
		send, recv sessionKeys
		sid, did   handoff.PlaneID
		want       error // nil: delivered
		attached   bool  // refused after attach (the check runs on arrival)
	}{
		{"insecure crc32c", nil, nil, one, one, nil, true},
		{"same session key", keyed(k1), keyed(k1), one, one, nil, true},
		{"another session's key", keyed(k1), keyed(k2), one, one, ErrCorrupt, true},
		{"another handoff's blocks", keyed(k1), keyed(k1), one, handoff.PlaneID{Session: 1, Handoff: 2}, ErrCorrupt, true},
		{"crc32c into an authenticated session", nil, keyed(k1), one, one, ErrCorrupt, false},
		{"keyed sums without a key", keyed(k1), nil, one, one, ErrCorrupt, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := NewSender(Config{})
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			r, err := NewReceiver(Config{})
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			s.keys, r.keys = tc.send, tc.recv
			sb, db := make([]byte, n*size), make([]byte, n*size)
			for i := range sb {
				sb[i] = byte(i*7 + i/size)
			}
			err = pushOnce(t, s, r, tc.sid, tc.did, blocksIn(sb, n, size), blocksIn(db, n, size))
			if tc.want == nil {
				if err != nil || !bytes.Equal(sb, db) {
					t.Fatalf("outcome %v, blocks equal %v", err, bytes.Equal(sb, db))
				}
				if st := r.Stats(); st.Completed != 1 || st.Bytes != n*size {
					t.Fatalf("receiver %+v", st)
				}
				return
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("outcome %v, want %v", err, tc.want)
			}
			if st := r.Stats(); (st.Started == 1) != tc.attached || st.Completed != 0 {
				t.Fatalf("receiver %+v (attached %v)", st, tc.attached)
			}
		})
	}
}

func TestBlockSumsBindIndexAndHandoff(t *testing.T) {
	session := bytes.Repeat([]byte{9}, 32)
	nonce := bytes.Repeat([]byte{3}, nonceLen)
	data := make([]byte, 3*256)
	for i := range data {
		data[i] = byte(i * 13)
	}
	units := []int{256, 256, 256}
	sum := func(mode Integrity, id uint64, salt uint32, b int, pieces []Span) []byte {
		key, err := keyed(session)(handoff.PlaneID{Handoff: id}, keyContext(id, nonce, salt))
		if err != nil {
			t.Fatal(err)
		}
		s, err := newSummer(mode, key, units)
		if err != nil {
			t.Fatal(err)
		}
		out := make([]byte, mode.sumLen())
		s.sum(out, b, pieces)
		return out
	}
	whole := []Span{HostBytes(data)}
	base := sum(IntegrityMAC, 1, 7, 0, whole)
	for name, other := range map[string][]byte{
		"another index":   sum(IntegrityMAC, 1, 7, 1, whole),
		"another handoff": sum(IntegrityMAC, 2, 7, 0, whole),
		"another salt":    sum(IntegrityMAC, 1, 8, 0, whole),
	} {
		if bytes.Equal(base, other) {
			t.Fatalf("a block's MAC does not depend on %s", name)
		}
	}
	// Piece boundaries do not matter (units straddling pieces are
	// gathered): the sum is of the block's bytes.
	for _, cut := range [][]int{{256, 768}, {100, 500, 768}, {300, 400, 768}, {768}} {
		var pieces []Span
		prev := 0
		for _, c := range cut {
			pieces = append(pieces, HostBytes(data[prev:c]))
			prev = c
		}
		if got := sum(IntegrityMAC, 1, 7, 0, pieces); !bytes.Equal(got, base) {
			t.Fatalf("cut at %v: the MAC depends on how the block is cut", cut)
		}
	}
	data[300] ^= 1
	if bytes.Equal(base, sum(IntegrityMAC, 1, 7, 0, whole)) {
		t.Fatal("a flipped bit keeps the MAC")
	}
	if c := sum(IntegrityCRC, 1, 7, 0, whole); len(c) != 4 || !bytes.Equal(c, sum(IntegrityCRC, 2, 8, 1, whole)) {
		t.Fatal("crc32c sums are 4 bytes of the data alone")
	}
}

func TestPullRefusesAnAuthenticatedSession(t *testing.T) {
	// Pull binds nothing to the session, and its source serves the
	// destination any address: an authenticated session refuses it on
	// both sides, before anything is registered.
	s, err := NewSender(Config{Pull: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	r, err := NewReceiver(Config{Pull: true})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	s.keys, r.keys = keyed(make([]byte, 32)), keyed(make([]byte, 32))
	id := handoff.PlaneID{Session: 1, Handoff: 1}
	if _, err := r.Prepare(id, 1); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("prepare: %v", err)
	}
	accept := binary.LittleEndian.AppendUint32([]byte{'K', 'U', version}, 1)
	src := [][]byte{make([]byte, 64)}
	if _, err := s.Send(id, src, accept, func(*kvlease.Transfer) error { t.Fatal("attached"); return nil }); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("send: %v", err)
	}
	if st := s.Stats(); st.Registrations != 0 || st.Started != 0 {
		t.Fatalf("sender %+v", st)
	}
}

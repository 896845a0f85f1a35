package ucx

import (
	"bytes"
	"crypto/hkdf"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

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
	return pushVia(t, s, r, sid, did, src, dst, nil)
}

// pushVia is pushOnce passing the Start bytes through tamper (nil: as
// they are).
func pushVia(t testing.TB, s *Sender[[]byte], r *Receiver[[]byte], sid, did handoff.PlaneID, src, dst [][]byte, tamper func(*pushStart)) error {
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
	if tamper != nil {
		st, err := parsePushStart(start)
		if err != nil {
			t.Fatal(err)
		}
		tamper(st)
		start = appendPushStart(nil, st)
	}
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
			s, err := NewSender(Config{}, HostBytes)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			r, err := NewReceiver(Config{}, HostBytes)
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
	sum := func(mode integrityMode, id uint64, salt uint32, b int, pieces []Span) []byte {
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
	whole := []Span{hostSpan(data)}
	base := sum(integrityMAC, 1, 7, 0, whole)
	for name, other := range map[string][]byte{
		"another index":   sum(integrityMAC, 1, 7, 1, whole),
		"another handoff": sum(integrityMAC, 2, 7, 0, whole),
		"another salt":    sum(integrityMAC, 1, 8, 0, whole),
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
			pieces = append(pieces, hostSpan(data[prev:c]))
			prev = c
		}
		if got := sum(integrityMAC, 1, 7, 0, pieces); !bytes.Equal(got, base) {
			t.Fatalf("cut at %v: the MAC depends on how the block is cut", cut)
		}
	}
	data[300] ^= 1
	if bytes.Equal(base, sum(integrityMAC, 1, 7, 0, whole)) {
		t.Fatal("a flipped bit keeps the MAC")
	}
	if c := sum(integrityCRC, 1, 7, 0, whole); len(c) != 4 || !bytes.Equal(c, sum(integrityCRC, 2, 8, 1, whole)) {
		t.Fatal("crc32c sums are 4 bytes of the data alone")
	}
}

func TestPullRefusesAnAuthenticatedSession(t *testing.T) {
	// Pull binds nothing to the session, and its source serves the
	// destination any address: an authenticated session refuses it on
	// both sides, before anything is registered.
	s, err := NewSender(Config{Pull: true}, HostBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	r, err := NewReceiver(Config{Pull: true}, HostBytes)
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

// startWithMode returns the push Start bytes b with their integrity mode
// replaced by mode: what a key-holding source that chooses its own
// integrity would send.
func startWithMode(t *testing.T, b []byte, mode integrityMode) []byte {
	t.Helper()
	st, err := parsePushStart(b)
	if err != nil {
		t.Fatal(err)
	}
	st.mode = mode
	return appendPushStart(nil, st)
}

// pieces2 is a block as two host pieces (its halves), for the planes of
// pieces.
func pieces2(b []byte, dst []Span) []Span {
	h := len(b) / 2
	return append(dst, hostSpan(b[:h:h]), hostSpan(b[h:]))
}

// deviceSpan claims a host block is device memory (CUDA): nothing is
// mapped or read before the refusal under test.
func deviceSpan(b []byte, dst []Span) []Span {
	sp := hostSpan(b)
	sp.Memory = CUDA
	return append(dst, sp)
}

// TestKeyedSessionRefusesUncheckedBlocks: issue 30, item 7. In an
// authenticated session a source holds the key, so it could write any
// integrity mode in its Start bytes: "none" used to have its blocks
// delivered with no check at all. The destination refuses any mode but
// the keyed MAC, for every region kind (plain blocks, blocks of pieces,
// streamed), before anything is attached; and a keyed session refuses
// device memory on either side (nobody could check its sums). The honest
// handoff that follows on the same planes is delivered.
func TestKeyedSessionRefusesUncheckedBlocks(t *testing.T) {
	const n, size = 4, 4096
	key := keyed(bytes.Repeat([]byte{7}, 32))
	type planes struct {
		send func(id handoff.PlaneID, src [][]byte, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error)
		s    interface {
			Finish(handoff.PlaneID, error)
			Close() error
		}
		r interface {
			Prepare(handoff.PlaneID, int) ([]byte, error)
			Receive(handoff.PlaneID, [][]byte, []byte, func(*kvlease.Transfer) error) error
			Stats() Stats
			Close() error
		}
	}
	newPlanes := func(t *testing.T, kind string) planes {
		var s *Sender[[]byte]
		var r *Receiver[[]byte]
		var err error
		if kind == "pieces" {
			s, err = NewSender(Config{}, pieces2)
			if err == nil {
				r, err = NewReceiver(Config{}, pieces2)
			}
		} else {
			s, err = NewSender(Config{}, HostBytes)
			if err == nil {
				r, err = NewReceiver(Config{}, HostBytes)
			}
		}
		if err != nil {
			t.Fatal(err)
		}
		s.keys, r.keys = key, key
		send := s.Send
		if kind == "stream" {
			send = func(id handoff.PlaneID, src [][]byte, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
				p, err := handoff.NewProgress(len(src), 4)
				if err != nil {
					return nil, err
				}
				ready, err := p.Ready(0)
				if err != nil {
					return nil, err
				}
				start, err := s.SendStream(id, src, ready, accept, attach)
				p.WroteAll() // after: SendStream streamed (a complete ready is Send)
				return start, err
			}
		}
		return planes{send: send, s: s, r: r}
	}
	blocks := func(seed byte) ([]byte, [][]byte) {
		buf := make([]byte, n*size)
		for i := range buf {
			buf[i] = seed + byte(i*7+i/size)
		}
		return buf, blocksIn(buf, n, size)
	}
	for _, kind := range []string{"bytes", "pieces", "stream"} {
		t.Run(kind, func(t *testing.T) {
			p := newPlanes(t, kind)
			defer p.s.Close()
			defer p.r.Close()
			id := uint64(0)
			for _, mode := range []integrityMode{integrityNone, integrityCRC} {
				id++
				pid := handoff.PlaneID{Session: 1, Handoff: id}
				accept, err := p.r.Prepare(pid, n)
				if err != nil {
					t.Fatal(err)
				}
				_, src := blocks(1)
				start, err := p.send(pid, src, accept, func(*kvlease.Transfer) error { return nil })
				if err != nil {
					t.Fatal(err)
				}
				if st, err := parsePushStart(start); err != nil || (st.layers > 0) != (kind == "stream") || st.mode != integrityMAC {
					t.Fatalf("the honest Start: %+v, %v", st, err)
				}
				dbuf := make([]byte, n*size)
				var attached atomic.Bool
				err = p.r.Receive(pid, blocksIn(dbuf, n, size), startWithMode(t, start, mode), func(*kvlease.Transfer) error {
					attached.Store(true)
					return nil
				})
				p.s.Finish(pid, errors.New("refused"))
				if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "not keyed") || attached.Load() {
					t.Fatalf("%v sums in an authenticated session: %v (attached %v)", mode, err, attached.Load())
				}
				if bytes.ContainsFunc(dbuf, func(r rune) bool { return r != 0 }) {
					t.Fatalf("%v: a byte reached the destination's blocks", mode)
				}
			}
			if st := p.r.Stats(); st.Started != 0 {
				t.Fatalf("receiver %+v: a refused handoff started", st)
			}
			// The honest handoff beside it: keyed, delivered.
			id++
			pid := handoff.PlaneID{Session: 1, Handoff: id}
			began := time.Now()
			accept, err := p.r.Prepare(pid, n)
			if err != nil {
				t.Fatal(err)
			}
			sbuf, src := blocks(2)
			start, err := p.send(pid, src, accept, func(*kvlease.Transfer) error { return nil })
			if err != nil {
				t.Fatal(err)
			}
			dbuf := make([]byte, n*size)
			var dt *kvlease.Transfer
			if err := p.r.Receive(pid, blocksIn(dbuf, n, size), start, func(t *kvlease.Transfer) error { dt = t; return nil }); err != nil {
				t.Fatal(err)
			}
			<-dt.Done()
			p.s.Finish(pid, nil)
			if dt.Err() != nil || !bytes.Equal(sbuf, dbuf) {
				t.Fatalf("honest handoff: %v, blocks equal %v", dt.Err(), bytes.Equal(sbuf, dbuf))
			}
			if st := p.r.Stats(); st.Completed != 1 || st.Keyed != 1 {
				t.Fatalf("receiver %+v", st)
			}
			t.Logf("honest keyed handoff of %d × %d bytes delivered in %v", n, size, time.Since(began).Round(time.Microsecond))
		})
	}
	t.Run("device", func(t *testing.T) {
		// Keyed, blocks in device memory: refused on either side before
		// anything is attached.
		s, err := NewSender(Config{}, deviceSpan)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		r, err := NewReceiver(Config{}, deviceSpan)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		hs, err := NewSender(Config{}, HostBytes)
		if err != nil {
			t.Fatal(err)
		}
		defer hs.Close()
		s.keys, r.keys, hs.keys = key, key, key
		pid := handoff.PlaneID{Session: 1, Handoff: 1}
		accept, err := r.Prepare(pid, n)
		if err != nil {
			t.Fatal(err)
		}
		_, src := blocks(3)
		var attached atomic.Bool
		attach := func(*kvlease.Transfer) error { attached.Store(true); return nil }
		if _, err := s.Send(pid, src, accept, attach); !errors.Is(err, kvlease.ErrInvalidArgument) || attached.Load() {
			t.Fatalf("a keyed sender of device memory: %v (attached %v)", err, attached.Load())
		}
		start, err := hs.Send(pid, src, accept, func(*kvlease.Transfer) error { return nil })
		if err != nil {
			t.Fatal(err)
		}
		defer hs.Finish(pid, errors.New("refused"))
		dbuf := make([]byte, n*size)
		if err := r.Receive(pid, blocksIn(dbuf, n, size), start, attach); !errors.Is(err, kvlease.ErrInvalidArgument) || attached.Load() {
			t.Fatalf("a keyed receiver into device memory: %v (attached %v)", err, attached.Load())
		}
		if st := r.Stats(); st.Started != 0 {
			t.Fatalf("receiver %+v", st)
		}
	})
}

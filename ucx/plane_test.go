package ucx_test

import (
	"errors"
	"testing"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/ucx"
)

func TestLoopbackDelivered(t *testing.T) {
	for _, tc := range []struct {
		name  string
		lc    loopConfig
		keyed bool
	}{
		{"psk", loopConfig{keepLeases: true}, true},
		{"tls", loopConfig{keepLeases: true, tls: true}, true},
		{"insecure", loopConfig{keepLeases: true, insecure: true}, false},
		{"pull", loopConfig{keepLeases: true, send: ucx.Config{Pull: true}, recv: ucx.Config{Pull: true}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newLoop(t, tc.lc)
			lease, err := l.srcPool.Acquire("r1", 10)
			if err != nil {
				t.Fatal(err)
			}
			stamp(t, lease, 11)
			o, err := l.src.Propose(1, "r1", lease, nil)
			if err != nil {
				t.Fatal(err)
			}
			waitFinal(t, o)
			if o.State() != handoff.Delivered {
				t.Fatalf("source %v: %v", o.State(), o.History())
			}
			in := waitIncoming(t, l, 1)
			if in.State() != handoff.Delivered {
				t.Fatalf("destination %v: %v", in.State(), in.History())
			}
			if err := marked(in.Lease(), 11); err != nil {
				t.Fatal(err)
			}
			if err := marked(lease, 11); err != nil {
				t.Fatalf("source blocks changed: %v", err)
			}
			in.Lease().Release()
			lease.Release()
			// Authenticated, every block was checked against a MAC under
			// the session's key; insecure, against a crc32c.
			want := 0
			if tc.keyed {
				want = 1
			}
			if s, r := l.sender.Stats(), l.recv.Stats(); s.Keyed != want || r.Keyed != want || r.Completed != 1 {
				t.Fatalf("send %+v recv %+v, want %d keyed", s, r, want)
			}
			if tc.lc.tls {
				if p := in.Peer(); p.Mode != handoff.AuthTLS || p.Identity != prefillIdentity {
					t.Fatalf("destination saw the proposer as %v", p)
				}
			}
		})
	}
}

func TestManyRunsReadTheTable(t *testing.T) {
	// 200 blocks, no two adjacent: 200 registrations, whose keys do not
	// fit the Start bytes. Pulled, the destination reads the run table
	// from the source first, then the blocks.
	sender, err := ucx.NewSender(ucx.Config{Pull: true}, ucx.HostBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer sender.Close()
	recv, err := ucx.NewReceiver(ucx.Config{Pull: true}, ucx.HostBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer recv.Close()
	const n, size = 200, 64
	srcBuf, dstBuf := make([]byte, 2*n*size), make([]byte, 2*n*size)
	var src, dst [][]byte
	for i := range n {
		src = append(src, srcBuf[2*i*size:(2*i+1)*size:(2*i+1)*size])
		dst = append(dst, dstBuf[2*i*size:(2*i+1)*size:(2*i+1)*size])
		mark(src[i], 77, i)
	}
	for _, inline := range []bool{false, true} {
		id := handoff.PlaneID{Session: 1, Handoff: 1}
		s, d := src, dst
		if inline { // 20 runs fit the Start bytes
			id.Handoff, s, d = 2, src[:20], dst[:20]
		}
		accept, err := recv.Prepare(id, len(d))
		if err != nil {
			t.Fatal(err)
		}
		var st, dt *kvlease.Transfer
		start, err := sender.Send(id, s, accept, func(t *kvlease.Transfer) error { st = t; return nil })
		if err != nil || st == nil || len(start) > handoff.MaxPlane {
			t.Fatalf("Send of %d runs: %v (%d start bytes)", len(s), err, len(start))
		}
		if !inline {
			// Every truncation of table-mode Start bytes is refused.
			for n := range len(start) {
				bad := handoff.PlaneID{Session: 9, Handoff: uint64(n)}
				if _, err := recv.Prepare(bad, len(d)); err != nil {
					t.Fatal(err)
				}
				err := recv.Receive(bad, d, start[:n], func(*kvlease.Transfer) error { t.Fatal("attached"); return nil })
				if !errors.Is(err, ucx.ErrCorrupt) {
					t.Fatalf("start of %d of %d bytes: %v", n, len(start), err)
				}
			}
		}
		if err := recv.Receive(id, d, start, func(t *kvlease.Transfer) error { dt = t; return nil }); err != nil {
			t.Fatal(err)
		}
		<-dt.Done()
		if err := dt.Err(); err != nil {
			t.Fatal(err)
		}
		if err := markedRegions(d, 77); err != nil {
			t.Fatalf("%d runs: %v", len(d), err)
		}
		for i := range d { // the gaps between the blocks are untouched
			if gap := dstBuf[(2*i+1)*size : (2*i+2)*size]; string(gap) != string(make([]byte, size)) {
				t.Fatalf("gap after block %d written", i)
			}
		}
		sender.Finish(id, nil)
		<-st.Done()
		if err := st.Err(); err != nil {
			t.Fatal(err)
		}
		clear(dstBuf)
	}
	if s := sender.Stats(); s.Started != 2 || s.Completed != 2 {
		t.Fatalf("sender %+v", s)
	}
}

func TestBadPlaneBytes(t *testing.T) {
	sender, err := ucx.NewSender(ucx.Config{}, ucx.HostBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer sender.Close()
	recv, err := ucx.NewReceiver(ucx.Config{}, ucx.HostBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer recv.Close()
	buf := make([]byte, 4*blockBytes)
	regions := [][]byte{buf[:blockBytes], buf[blockBytes : 2*blockBytes]}
	attach := func(*kvlease.Transfer) error { t.Fatal("attached on bad plane bytes"); return nil }
	id := handoff.PlaneID{Session: 2, Handoff: 7}
	for _, accept := range [][]byte{nil, []byte("KU"), {'K', 'U', 9, 2, 0, 0, 0}, {'K', 'U', 1, 3, 0, 0, 0}} {
		if _, err := sender.Send(id, regions, accept, attach); !errors.Is(err, ucx.ErrCorrupt) {
			t.Fatalf("accept %q: %v", accept, err)
		}
	}
	if err := recv.Receive(id, regions, nil, attach); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("receive unprepared: %v", err)
	}
	accept, err := recv.Prepare(id, 2)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := recv.Prepare(id, 2); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("prepare twice: %v", err)
	}
	ok := func(*kvlease.Transfer) error { return nil }
	good, err := sender.Send(id, regions, accept, ok)
	if err != nil {
		t.Fatal(err)
	}
	defer sender.Finish(id, errors.New("test over"))
	// Every truncation of good Start bytes, and a few corruptions, are
	// refused with ErrCorrupt before anything is attached.
	bad := [][]byte{append(append([]byte(nil), good...), 0), {'K', 'U', 2}}
	for n := range len(good) {
		bad = append(bad, good[:n])
	}
	for _, b := range bad {
		recv.Forget(id)
		if _, err := recv.Prepare(id, 2); err != nil {
			t.Fatal(err)
		}
		if err := recv.Receive(id, regions, b, attach); !errors.Is(err, ucx.ErrCorrupt) {
			t.Fatalf("start of %d bytes: %v", len(b), err)
		}
	}
	// The right bytes for the wrong regions: one block too few.
	if _, err := recv.Prepare(id, 1); err != nil {
		t.Fatal(err)
	}
	if err := recv.Receive(id, regions[:1], good, attach); !errors.Is(err, ucx.ErrCorrupt) {
		t.Fatalf("start for 2 blocks into 1: %v", err)
	}
	// Regions of different sizes.
	if _, err := recv.Prepare(id, 2); err != nil {
		t.Fatal(err)
	}
	if err := recv.Receive(id, [][]byte{buf[:blockBytes], buf[blockBytes : blockBytes+8]}, good, attach); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("uneven regions: %v", err)
	}
}

func TestCancelIsARequest(t *testing.T) {
	// A reader stuck mid-transfer is cancelled: nothing resolves (the
	// cancel is a request). Once it can go on, it posts no more gets and
	// a flush after the posted ones completes: that is the evidence, and
	// the outcome is kvlease.ErrCanceled.
	stuck, release := make(chan struct{}), make(chan struct{})
	recv, err := ucx.NewReceiver(ucx.Config{MaxGet: 64, Window: 1, BeforeGet: func(_ handoff.PlaneID, block int) {
		if block == 2 {
			close(stuck)
			<-release
		}
	}}, ucx.HostBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer recv.Close()
	sender, err := ucx.NewSender(ucx.Config{}, ucx.HostBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer sender.Close()
	src, dst := make([]byte, 8*64), make([]byte, 8*64)
	var sr, dr [][]byte
	for i := range 8 {
		sr, dr = append(sr, src[i*64:(i+1)*64:(i+1)*64]), append(dr, dst[i*64:(i+1)*64:(i+1)*64])
		mark(sr[i], 5, i)
	}
	id := handoff.PlaneID{Session: 3, Handoff: 3}
	_, dt := startOnce(t, sender, recv, id, sr, dr)
	cancelStuck(t, dt, stuck, release)
	if err := markedRegions(dr[:2], 5); err != nil {
		t.Fatalf("the blocks read before the cancel: %v", err)
	}
	if string(dst[2*64:]) != string(make([]byte, 6*64)) {
		t.Fatal("blocks after the cancel were written")
	}
	if s := recv.Stats(); s.Canceled != 1 || s.Revoked != 0 {
		t.Fatalf("receiver %+v", s)
	}
	sender.Finish(id, errors.New("test over"))
}

func TestModelsMustAgree(t *testing.T) {
	// A pushing sender refuses a destination that asks to pull (it would
	// expose the source's memory), and a pulling sender refuses push
	// Accept bytes: both with ErrCorrupt, before anything is attached.
	regions := [][]byte{make([]byte, 64)}
	attach := func(*kvlease.Transfer) error { t.Fatal("attached across models"); return nil }
	for _, pull := range []bool{false, true} {
		s, err := ucx.NewSender(ucx.Config{Pull: pull}, ucx.HostBytes)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		r, err := ucx.NewReceiver(ucx.Config{Pull: !pull}, ucx.HostBytes)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		id := handoff.PlaneID{Session: 1, Handoff: 1}
		accept, err := r.Prepare(id, 1)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Send(id, regions, accept, attach); !errors.Is(err, ucx.ErrCorrupt) {
			t.Fatalf("sender (pull %v) took the other model's accept: %v", pull, err)
		}
		r.Forget(id)
		if st := s.Stats(); st.Started != 0 || st.Registrations != 0 {
			t.Fatalf("sender %+v", st)
		}
	}
}

func TestForgedBlocksFailTheHandoff(t *testing.T) {
	// Blocks whose MACs are not under the session's key (here the
	// source's plane derives its keys from another secret: blocks of
	// another session, or from someone who lacks the key) land in the
	// destination's lease but fail their check: the transfer resolves
	// with ErrCorrupt, the handoff fails, nothing is sealed, and every
	// block goes back to the pool.
	l := newLoop(t, loopConfig{})
	ucx.ForgeSessionKeys(l.sender, make([]byte, 32))
	lease, err := l.srcPool.Acquire("r1", 6)
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Release()
	stamp(t, lease, 12)
	tokens := make([]int32, 6*env(64).BlockTokens)
	for i := range tokens {
		tokens[i] = int32(i)
	}
	o, err := l.src.ProposeTokens(1, "r1", lease, 0, tokens)
	if err != nil {
		t.Fatal(err)
	}
	waitFinal(t, o)
	in := waitIncoming(t, l, 1)
	if in.State() != handoff.Failed {
		t.Fatalf("destination %v: %v", in.State(), in.History())
	}
	if o.State() != handoff.Failed {
		t.Fatalf("source %v: %v", o.State(), o.History())
	}
	if s := l.dstPool.Stats(); s.Free != s.Capacity || s.Cached != 0 {
		t.Fatalf("destination pool after forged blocks: %+v", s)
	}
	if r := l.recv.Stats(); r.Keyed != 1 || r.Completed != 0 {
		t.Fatalf("receiver %+v", r)
	}
}

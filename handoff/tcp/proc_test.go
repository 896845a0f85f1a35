//go:build unix

package tcp_test

// The cross-process fault suite: every case runs one half here and the
// other in a peer process (the test binary re-executed, see peer_test.go)
// over 127.0.0.1, and asserts states, counts, Stats and markers on both
// sides. Where a case needs the stream stopped mid-way, the peer holds
// it after a given number of blocks until told to go on, so nothing
// depends on timing luck.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/internal/wire"
	"github.com/kvlease/kvlease/handoff/tcp"
)

const (
	procBlockBytes = 4096
	procPool       = 64
)

func waitDone(t testing.TB, what string, done <-chan struct{}, state func() handoff.State) handoff.State {
	t.Helper()
	select {
	case <-done:
	case <-time.After(bound):
		t.Fatalf("%s still %v after %v", what, state(), bound)
	}
	return state()
}

// wantStats compares some of a key=value stats map.
func wantStats(t testing.TB, who string, got map[string]string, want string) {
	t.Helper()
	for _, kv := range strings.Fields(want) {
		k, v, _ := strings.Cut(kv, "=")
		if got[k] != v {
			t.Errorf("%s: %s=%s, want %s (all: %v)", who, k, got[k], v, got)
		}
	}
}

// planeOutcome is the plane's count of one transfer that ended with err:
// completed, failed or canceled, exactly one.
func planeOutcome(err error) string {
	switch {
	case err == nil:
		return "completed=1 failed=0 canceled=0"
	case errors.Is(err, kvlease.ErrCanceled):
		return "completed=0 failed=0 canceled=1"
	default:
		return "completed=0 failed=1 canceled=0"
	}
}

func localStats(p *kvlease.Pool[[]byte], ps handoff.PlaneStats) map[string]string {
	return fields(strings.Fields(statsLine(p, ps)))
}

func listen(t testing.TB) *net.TCPListener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return ln.(*net.TCPListener)
}

func acceptOne(t testing.TB, ln *net.TCPListener) net.Conn {
	t.Helper()
	_ = ln.SetDeadline(time.Now().Add(bound))
	c, err := ln.Accept()
	_ = ln.Close()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// destSide is the destination half here, the source in the peer.
type destSide struct {
	t     testing.TB
	pool  *kvlease.Pool[[]byte]
	recv  *tcp.Receiver
	dst   *handoff.Destination[[]byte]
	ctl   *ctlConn
	peer  *peer
	env   handoff.Envelope
	serve chan error

	mu        sync.Mutex
	ins       map[uint64]*handoff.Incoming[[]byte]
	delivered map[uint64]error // the marker check on delivery
	kept      map[uint64]*kvlease.Lease[[]byte]
	protoErrs []error
	refusals  []error
	quar      []uint64 // OnQuarantine's handoffs
}

func (d *destSide) quarantines() []uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]uint64(nil), d.quar...)
}

type sideOpts struct {
	deadline     time.Duration
	gateOnAccept bool
	auth         handoff.Authenticator // testAuth when nil (and not insecure)
	insecure     bool
	sendCfg      tcp.Config // the source side's plane (its WrapConn is newSrcSide's wrap)
	recvCfg      tcp.Config // the destination side's plane (its OnError is newDestSide's)
}

func newDestSide(t testing.TB, o sideOpts, pc peerConfig) *destSide {
	t.Helper()
	ln := listen(t)
	pc.Role, pc.Ctrl, pc.BlockBytes, pc.PoolBlocks = "source", ln.Addr().String(), procBlockBytes, procPool
	d := &destSide{t: t, pool: hostPool(t, procPool), env: envFor(procBlockBytes, procPool), serve: make(chan error, 1),
		ins: map[uint64]*handoff.Incoming[[]byte]{}, delivered: map[uint64]error{}, kept: map[uint64]*kvlease.Lease[[]byte]{}}
	d.peer = startPeer(t, pc)
	rc := o.recvCfg
	rc.OnError = func(err error) {
		d.mu.Lock()
		d.refusals = append(d.refusals, err)
		d.mu.Unlock()
	}
	d.recv = tcp.NewReceiver(listen(t), rc)
	if o.deadline == 0 {
		o.deadline = bound
	}
	var err error
	d.dst, err = handoff.NewDestination(d.pool, d.recv, handoff.DestinationConfig[[]byte]{
		HalfConfig: handoff.HalfConfig{Envelope: d.env, Name: "decode", Peer: "prefill", Deadline: o.deadline, Auth: testAuth,
			OnQuarantine: func(id uint64, _ error) {
				d.mu.Lock()
				d.quar = append(d.quar, id)
				d.mu.Unlock()
			},
			OnError: func(err error) {
				d.mu.Lock()
				d.protoErrs = append(d.protoErrs, err)
				d.mu.Unlock()
			}},
		OnAccept: func(in *handoff.Incoming[[]byte]) {
			d.mu.Lock()
			d.ins[in.ID()] = in
			d.mu.Unlock()
			if o.gateOnAccept {
				d.ctl.gate()
			}
		},
		OnDelivered: func(in *handoff.Incoming[[]byte]) {
			err := markedFrom(in.Lease(), seedOf(in.Request()), 0)
			d.mu.Lock()
			d.delivered[in.ID()] = err
			d.kept[in.ID()] = in.Lease()
			d.mu.Unlock()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	d.ctl = &ctlConn{Conn: acceptOne(t, ln)}
	go func() { d.serve <- d.dst.Serve(d.ctl) }()
	d.peer.expect("ready")
	t.Cleanup(func() {
		d.peer.kill()
		_ = d.ctl.Close()
		select {
		case <-d.serve:
		case <-time.After(bound):
			t.Error("Serve did not return")
		}
		_ = d.recv.Close()
		if err := d.pool.Check(); err != nil {
			t.Error(err)
		}
	})
	return d
}

// in waits for the destination's handle on handoff id.
func (d *destSide) in(id uint64) *handoff.Incoming[[]byte] {
	d.t.Helper()
	end := time.Now().Add(bound)
	for time.Now().Before(end) {
		d.mu.Lock()
		in := d.ins[id]
		d.mu.Unlock()
		if in != nil {
			return in
		}
		time.Sleep(time.Millisecond)
	}
	d.t.Fatalf("handoff %d never accepted here", id)
	return nil
}

// checkAndRelease checks a delivered lease's markers again (before its
// blocks may be reused) and releases it.
func (d *destSide) checkAndRelease(id uint64) {
	d.t.Helper()
	var err error
	var l *kvlease.Lease[[]byte]
	// OnDelivered runs just after the handoff is final here, and the
	// source may hear of the delivery first.
	for end := time.Now().Add(bound); l == nil && time.Now().Before(end); {
		d.mu.Lock()
		err, l = d.delivered[id], d.kept[id]
		delete(d.kept, id)
		d.mu.Unlock()
		if l == nil {
			time.Sleep(time.Millisecond)
		}
	}
	if l == nil {
		d.t.Fatalf("handoff %d was not delivered here", id)
	}
	if err != nil {
		d.t.Errorf("handoff %d: markers on delivery: %v", id, err)
	}
	if err := markedFrom(l, seedOf(d.in(id).Request()), 0); err != nil {
		d.t.Errorf("handoff %d: markers before reuse: %v", id, err)
	}
	l.Release()
}

func (d *destSide) errs() (proto, refused []error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]error(nil), d.protoErrs...), append([]error(nil), d.refusals...)
}

// srcSide is the source half here, the destination in the peer.
type srcSide struct {
	t      testing.TB
	pool   *kvlease.Pool[[]byte]
	sender *tcp.Sender
	src    *handoff.Source[[]byte]
	ctl    *ctlConn
	peer   *peer
	starts chan uint64 // each Start frame written
}

func newSrcSide(t testing.TB, o sideOpts, pc peerConfig, blockBytes, poolBlocks int, wrap func(net.Conn) net.Conn) *srcSide {
	t.Helper()
	ln := listen(t)
	pc.Role, pc.Ctrl, pc.BlockBytes, pc.PoolBlocks = "dest", ln.Addr().String(), blockBytes, poolBlocks
	s := &srcSide{t: t, pool: hostPool2(t, poolBlocks, blockBytes), sender: tcp.NewSender(withWrap(o.sendCfg, wrap)), starts: make(chan uint64, 64)}
	s.peer = startPeer(t, pc)
	s.ctl = &ctlConn{Conn: acceptOne(t, ln), onStart: func(id uint64) {
		select {
		case s.starts <- id:
		default: // nobody is counting (benchmarks)
		}
	}}
	if o.deadline == 0 {
		o.deadline = bound
	}
	var err error
	half := handoff.HalfConfig{Envelope: envFor(blockBytes, poolBlocks), Name: "prefill", Peer: "decode", Deadline: o.deadline, Auth: o.auth}
	switch {
	case o.insecure:
		half.Insecure, half.Logf = true, quiet
	case o.auth == nil:
		half.Auth = testAuth
	}
	s.src, err = handoff.NewSource(s.ctl, startSignal{s.sender, s.ctl}, half)
	if err != nil {
		t.Fatal(err)
	}
	s.peer.expect("ready")
	t.Cleanup(func() {
		s.peer.kill()
		_ = s.src.Close()
		_ = s.sender.Close()
		if err := s.pool.Check(); err != nil {
			t.Error(err)
		}
	})
	return s
}

func withWrap(c tcp.Config, wrap func(net.Conn) net.Conn) tcp.Config {
	c.WrapConn = wrap
	return c
}

func hostPool2(t testing.TB, blocks, blockBytes int) *kvlease.Pool[[]byte] {
	t.Helper()
	mem, err := kvlease.NewHostMemory(blocks, blockBytes)
	if err != nil {
		t.Fatal(err)
	}
	p, err := kvlease.NewPool[[]byte](mem)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// propose offers a stamped lease of n blocks under id.
func (s *srcSide) propose(id uint64, n, seed int) (*handoff.Outgoing[[]byte], *kvlease.Lease[[]byte]) {
	s.t.Helper()
	l, err := s.pool.Acquire(fmt.Sprintf("r%d", id), n)
	if err != nil {
		s.t.Fatal(err)
	}
	if err := stampLease(l, byte(seed)); err != nil {
		s.t.Fatal(err)
	}
	o, err := s.src.Propose(id, fmt.Sprintf("seed=%d", seed), l, hashesFor(seed, n))
	if err != nil {
		s.t.Fatal(err)
	}
	return o, l
}

// peerState asks the peer to wait for handoff id to reach want and
// returns its state line's fields (state, error text, ...).
func peerState(p *peer, id uint64, want handoff.State) []string {
	p.t.Helper()
	p.do("wait %d %v", id, want)
	f := p.expect(fmt.Sprintf("state %d ", id))
	if f[2] != want.String() {
		p.t.Fatalf("peer's handoff %d is %v, want %v (%q)", id, f[2], want, f)
	}
	return f[2:]
}

// TestProcClean: clean handoffs in both directions; the destination's
// prefix cache serves a repeated prefix, markers hold on delivery and
// before reuse, a second proposal of a used id is refused.
func TestProcClean(t *testing.T) {
	t.Run("to-parent", func(t *testing.T) {
		d := newDestSide(t, sideOpts{}, peerConfig{HoldAfter: -1})
		p := d.peer
		p.do("propose 1 8 11")
		p.expect("proposed 1")
		p.do("propose 2 8 12")
		p.expect("proposed 2")
		peerState(p, 1, handoff.Delivered)
		peerState(p, 2, handoff.Delivered)
		// The same prefix again, two blocks longer: 8 hits here, 2 move.
		p.do("propose 3 10 11")
		p.expect("proposed 3")
		peerState(p, 3, handoff.Delivered)
		p.do("propose 3 2 13")
		if f := p.expect("propose-error 3"); !strings.Contains(strings.Join(f, " "), "already used") {
			t.Errorf("a reused id: %q", f)
		}
		for id := uint64(1); id <= 3; id++ {
			in := d.in(id)
			if s := waitDone(t, "destination", in.Done(), in.State); s != handoff.Delivered {
				t.Fatalf("handoff %d here: %v %v", id, s, in.History())
			}
		}
		if h := d.in(3).Hits(); h != 8 {
			t.Errorf("handoff 3: %d prefix hits here, want 8", h)
		}
		for id := uint64(1); id <= 3; id++ {
			d.checkAndRelease(id)
		}
		wantStats(t, "destination", localStats(d.pool, d.recv.Stats()),
			fmt.Sprintf("free=%d cached=18 leased=0 draining=0 quarantined=0 open=0 check=ok started=3 completed=3 failed=0 canceled=0 refused=0 bytes=%d", procPool-18, 18*procBlockBytes))
		for id := 1; id <= 3; id++ {
			p.do("free %d", id)
			p.expect("freed")
		}
		wantStats(t, "peer source", p.stats(), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok started=3 completed=3 failed=0 canceled=0")
		if pe, _ := d.errs(); len(pe) != 0 {
			t.Errorf("protocol errors: %v", pe)
		}
	})
	t.Run("to-child", func(t *testing.T) {
		s := newSrcSide(t, sideOpts{}, peerConfig{HoldAfter: -1}, procBlockBytes, procPool, nil)
		p := s.peer
		o1, l1 := s.propose(1, 8, 21)
		o2, l2 := s.propose(2, 6, 22)
		for _, o := range []*handoff.Outgoing[[]byte]{o1, o2} {
			if st := waitDone(t, "source", o.Done(), o.State); st != handoff.Delivered {
				t.Fatalf("handoff %d here: %v %v", o.ID(), st, o.History())
			}
		}
		for id := uint64(1); id <= 2; id++ {
			if f := p.expect(fmt.Sprintf("delivered %d ", id)); f[2] != "markers=ok" {
				t.Errorf("peer: %q", f)
			}
			p.do("check %d", id)
			if f := p.expect(fmt.Sprintf("checked %d ", id)); f[2] != "ok" {
				t.Errorf("peer before reuse: %q", f)
			}
		}
		if _, err := s.src.Propose(1, "again", l1, nil); !errors.Is(err, handoff.ErrState) {
			t.Errorf("a reused id: %v", err)
		}
		if l1.State() != kvlease.LeaseActive {
			t.Error("delivery closed the source lease")
		}
		l1.Release()
		l2.Release()
		wantStats(t, "source", localStats(s.pool, s.sender.Stats()),
			fmt.Sprintf("free=64 leased=0 draining=0 quarantined=0 open=0 check=ok started=2 completed=2 failed=0 canceled=0 bytes=%d", 14*procBlockBytes))
		wantStats(t, "peer destination", p.stats(), "free=50 cached=14 leased=0 draining=0 quarantined=0 open=0 check=ok started=2 completed=2 failed=0 canceled=0 refused=0")
	})
}

// TestProcKilled: the peer is SIGKILLed mid-stream. The survivor ends
// Failed by its own evidence (its loop's error, or its own quiescence
// with the peer's word lost: a transfer cancelled and resolved), its
// blocks return, nothing leaks.
func TestProcKilled(t *testing.T) {
	t.Run("source-killed", func(t *testing.T) {
		d := newDestSide(t, sideOpts{}, peerConfig{HoldAfter: 2})
		d.peer.do("propose 1 8 31")
		d.peer.expect("held 2")
		in := d.in(1)
		waitState(t, "destination", in.State, handoff.Transferring)
		d.peer.kill()
		if s := waitDone(t, "destination", in.Done(), in.State); s != handoff.Failed {
			t.Fatalf("destination %v: %v", s, in.History())
		}
		last := in.History()[len(in.History())-1]
		if last.By != "transport" || last.Err == nil {
			t.Errorf("Failed by %q with %v: want the receiver's own error", last.By, last.Err)
		}
		select {
		case err := <-d.serve:
			d.serve <- err
		case <-time.After(bound):
			t.Fatal("Serve still running after the peer died")
		}
		// SIGKILL closes both of the peer's connections at once; which
		// one this side notices first is the kernel's and the
		// scheduler's choice. The data connection first: the read fails
		// and the plane counts a failure. The control session first: the
		// half cancels the transfer (its peer's word is lost) and waits
		// for it, and the plane counts a cancel. Either way exactly one,
		// and the count agrees with the transfer's own error.
		if in.Transfer().Err() == nil {
			t.Fatal("the destination's transfer completed without its source")
		}
		wantStats(t, "destination", localStats(d.pool, d.recv.Stats()),
			"free=64 cached=0 leased=0 draining=0 quarantined=0 open=0 check=ok started=1 "+planeOutcome(in.Transfer().Err()))
	})
	t.Run("destination-killed", func(t *testing.T) {
		s := newSrcSide(t, sideOpts{}, peerConfig{HoldAfter: 2}, procBlockBytes, procPool, nil)
		o, l := s.propose(1, 8, 32)
		s.peer.expect("held 2")
		s.peer.kill()
		if st := waitDone(t, "source", o.Done(), o.State); st != handoff.Failed {
			t.Fatalf("source %v: %v", st, o.History())
		}
		if o.Transfer() == nil || o.Transfer().State() != kvlease.TransferResolved {
			t.Fatal("Failed without its own transfer resolved")
		}
		if l.State() != kvlease.LeaseActive {
			t.Fatalf("source lease %v: a failed handoff leaves it the caller's", l.State())
		}
		l.Release()
		// The sender may have written every block before the peer died
		// (the socket's buffers hold them: completed), or be writing the
		// last when the connection resets (failed) or when the lost
		// control session cancels it (canceled).
		wantStats(t, "source", localStats(s.pool, s.sender.Stats()), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok started=1 "+planeOutcome(o.Transfer().Err()))
	})
}

// TestProcStopped: the peer is SIGSTOPped mid-stream past the deadline.
// The deadline quarantines the handoff of the side whose loop is blocked
// on it; the quarantine asks the plane to stop, which ends its own
// blocked read or write (a deadline in the past): the loop's return is
// local evidence, so the quarantine lifts within a second, while the
// peer is still stopped, and the blocks are free again. The peer, once
// continued, ends by its own evidence, and the blocks are reused by a
// clean handoff whose markers hold.
func TestProcStopped(t *testing.T) {
	const deadline = 200 * time.Millisecond
	// lifted checks that a quarantine was recorded and then lifted by
	// the transport (by its evidence: how soon is a matter of load, not
	// of the verdict, and only logged).
	lifted := func(t *testing.T, who string, h []handoff.Step) {
		t.Helper()
		var q *handoff.Step
		for i := range h {
			if h[i].To == handoff.Quarantined {
				q = &h[i]
			}
		}
		last := h[len(h)-1]
		if q == nil || last.From != handoff.Quarantined || last.By != "transport" || last.To != handoff.Aborted {
			t.Fatalf("%s: no quarantine lifted by the transport: %v", who, h)
		}
		if d := last.At.Sub(q.At); d < 0 {
			t.Errorf("%s: the quarantine lifted %v before it was set", who, d)
		} else {
			t.Logf("%s: the quarantine lifted %v after it was set", who, d)
		}
	}
	t.Run("source-stopped", func(t *testing.T) {
		d := newDestSide(t, sideOpts{deadline: deadline}, peerConfig{HoldAfter: 2})
		p := d.peer
		p.do("propose 1 8 41")
		p.expect("held 2")
		in := d.in(1)
		waitState(t, "destination", in.State, handoff.Transferring)
		p.signal(syscall.SIGSTOP)
		if s := waitDone(t, "destination", in.Done(), in.State); s != handoff.Aborted {
			t.Fatalf("destination %v: %v", s, in.History())
		}
		lifted(t, "destination", in.History())
		// OnQuarantine runs without the half's lock, so the late evidence
		// may end the handoff first; Stats counted it before that.
		for end := time.Now().Add(5 * time.Second); len(d.quarantines()) == 0 && time.Now().Before(end); {
			time.Sleep(time.Millisecond)
		}
		if q := d.quarantines(); len(q) != 1 || q[0] != 1 {
			t.Errorf("OnQuarantine told %v, want handoff 1", q)
		}
		if st := d.dst.Stats(); st.Quarantined != 1 {
			t.Errorf("destination stats %+v: want 1 quarantined", st)
		}
		// Lifted while the peer is still stopped: every block is back.
		wantStats(t, "destination", localStats(d.pool, d.recv.Stats()), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok started=1 completed=0")
		p.signal(syscall.SIGCONT)
		p.do("release")
		// The peer learns of our abort; its writer ends (the abort's
		// cancel, or the connection we closed), and that is its evidence.
		peerState(p, 1, handoff.Aborted)
		wantStats(t, "peer source", p.stats(), "free=64 leased=0 draining=0 quarantined=0 check=ok started=1 completed=0")
		// The blocks come back into use: no marker of the old stream.
		p.do("free 1")
		p.expect("freed")
		p.do("propose 2 8 42")
		peerState(p, 2, handoff.Delivered)
		d.checkAndRelease(2)
		p.do("free 2")
		p.expect("freed")
		wantStats(t, "peer source", p.stats(), "free=64 leased=0 quarantined=0 check=ok started=2 completed=1")
	})
	t.Run("destination-stopped", func(t *testing.T) {
		// Small socket buffers on both ends and far more bytes than they
		// hold: our writer is certainly blocked in the kernel.
		const bb, blocks = 64 << 10, 40
		wrap := func(c net.Conn) net.Conn {
			_ = c.(*net.TCPConn).SetWriteBuffer(16 << 10)
			return c
		}
		s := newSrcSide(t, sideOpts{deadline: deadline}, peerConfig{HoldAfter: 1, SmallBuffers: true}, bb, 64, wrap)
		p := s.peer
		o, l := s.propose(1, blocks, 43)
		p.expect("held 1")
		p.signal(syscall.SIGSTOP)
		if st := waitDone(t, "source", o.Done(), o.State); st != handoff.Aborted {
			t.Fatalf("source %v: %v", st, o.History())
		}
		lifted(t, "source", o.History())
		if st := s.src.Stats(); st.Quarantined != 1 {
			t.Errorf("source stats %+v: want 1 quarantined", st)
		}
		if l.State() == kvlease.LeaseActive {
			t.Error("the quarantine left the source lease open")
		}
		wantStats(t, "source", localStats(s.pool, s.sender.Stats()), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok started=1 completed=0")
		p.signal(syscall.SIGCONT)
		p.do("release")
		// The peer's reader finds our connection closed, or reads our
		// Abort first: Failed or Aborted, each on its own evidence.
		p.do("wait 1 aborted")
		if f := p.expect("state 1 "); f[2] != "aborted" && f[2] != "failed" {
			t.Fatalf("peer's handoff: %q", f)
		}
		wantStats(t, "peer destination", p.stats(), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok started=1 completed=0")
	})
}

// TestProcRejectRacesStart: the destination rejects while the source's
// Start is already on the wire (its read loop holds the Start back until
// the reject is done). The Start is refused as a crossing (counted in
// HalfStats.Crossed, not reported as a protocol error), nothing is
// written into the destination's blocks, and the source ends by its own
// evidence.
func TestProcRejectRacesStart(t *testing.T) {
	t.Run("parent-rejects", func(t *testing.T) {
		d := newDestSide(t, sideOpts{gateOnAccept: true}, peerConfig{HoldAfter: -1})
		p := d.peer
		p.do("propose 1 8 51")
		p.expect("start-sent 1")
		in := d.in(1)
		if err := in.Reject("decode", errors.New("changed its mind")); err != nil {
			t.Fatal(err)
		}
		d.ctl.ungate()
		peerState(p, 1, handoff.Failed)
		if s := in.State(); s != handoff.Rejected {
			t.Fatalf("destination %v", s)
		}
		for end := time.Now().Add(bound); d.dst.Stats().Crossed < 1 && time.Now().Before(end); time.Sleep(time.Millisecond) {
		}
		if c := d.dst.Stats().Crossed; c != 1 {
			t.Fatalf("the crossed Start counted %d times", c)
		}
		if pe, _ := d.errs(); len(pe) != 0 {
			t.Fatalf("a crossing reported as a protocol error: %v", pe)
		}
		p.do("free 1")
		p.expect("freed")
		wantStats(t, "destination", localStats(d.pool, d.recv.Stats()), "free=64 leased=0 open=0 check=ok started=0 completed=0 bytes=0")
		wantStats(t, "peer source", p.stats(), "free=64 leased=0 draining=0 quarantined=0 check=ok started=1")
	})
	t.Run("child-rejects", func(t *testing.T) {
		s := newSrcSide(t, sideOpts{}, peerConfig{HoldAfter: -1, GateOnAccept: true}, procBlockBytes, procPool, nil)
		p := s.peer
		o, l := s.propose(1, 8, 52)
		select {
		case <-s.starts:
		case <-time.After(bound):
			t.Fatal("no Start written")
		}
		p.do("reject 1")
		if f := p.expect("rejected 1"); f[2] != `""` {
			t.Fatalf("peer reject: %q", f)
		}
		p.do("ungate")
		p.expect("ungated")
		if st := waitDone(t, "source", o.Done(), o.State); st != handoff.Failed {
			t.Fatalf("source %v: %v", st, o.History())
		}
		p.do("crossed 1")
		if f := p.expect("crossed "); f[1] != "1" {
			t.Fatalf("the peer counted %q crossings", f)
		}
		for _, l := range p.log() {
			if strings.HasPrefix(l, "protoerr") {
				t.Fatalf("a crossing reported as a protocol error: %q", l)
			}
		}
		if l.State() != kvlease.LeaseActive {
			t.Error("a refused handoff closed the source lease")
		}
		l.Release()
		// Its writer may have finished into the socket buffers (Completed)
		// or hit the closed connection (Failed): either is its evidence.
		wantStats(t, "source", localStats(s.pool, s.sender.Stats()), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok started=1")
		wantStats(t, "peer destination", p.stats(), "free=64 leased=0 open=0 check=ok started=0 completed=0 bytes=0")
	})
}

// TestProcAbortDuringWrite: either side aborts while the stream is held
// mid-way. The abort reaches the other side over the control
// connection; both drain until their own evidence and end Aborted.
func TestProcAbortDuringWrite(t *testing.T) {
	for _, who := range []string{"parent", "child"} {
		t.Run("destination-here-"+who+"-aborts", func(t *testing.T) {
			d := newDestSide(t, sideOpts{}, peerConfig{HoldAfter: 2})
			p := d.peer
			p.do("propose 1 8 61")
			p.expect("held 2")
			in := d.in(1)
			waitState(t, "destination", in.State, handoff.Transferring)
			if who == "parent" {
				if err := in.Abort("decode", nil); err != nil {
					t.Fatal(err)
				}
				if f := peerState(p, 1, handoff.Aborting); !strings.Contains(strings.Join(f, " "), "peer abort") {
					t.Errorf("peer's abort step: %q", f)
				}
			} else {
				p.do("abort 1")
				p.expect("aborted 1")
				// Reflected here: Aborting, or already Aborted if our
				// receiver saw the cancel at a block boundary.
				step := waitStep(t, in.History, handoff.EventAbort)
				if step.By != "prefill" || step.From != handoff.Transferring || !errors.Is(step.Err, handoff.ErrPeer) || !errors.Is(step.Err, kvlease.ErrAborted) {
					t.Errorf("destination's abort step: %v", step)
				}
			}
			// Our receiver may be blocked in the kernel or may have seen the
			// cancel at a block boundary: its blocks drain until it stops.
			st := d.pool.Stats()
			if st.Leased != 0 || st.Draining != 8 && !(st.Draining == 0 && in.Transfer().State() == kvlease.TransferResolved) {
				t.Errorf("destination after the abort: %+v, transfer %v", st, in.Transfer().State())
			}
			p.do("release")
			if s := waitDone(t, "destination", in.Done(), in.State); s != handoff.Aborted {
				t.Fatalf("destination %v: %v", s, in.History())
			}
			peerState(p, 1, handoff.Aborted)
			wantStats(t, "destination", localStats(d.pool, d.recv.Stats()), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok started=1 completed=0")
			wantStats(t, "peer source", p.stats(), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok started=1 completed=0")
		})
		t.Run("source-here-"+who+"-aborts", func(t *testing.T) {
			s := newSrcSide(t, sideOpts{}, peerConfig{HoldAfter: 2}, procBlockBytes, procPool, nil)
			p := s.peer
			o, l := s.propose(1, 8, 62)
			p.expect("held 2")
			if who == "parent" {
				if err := o.Abort("prefill", nil); err != nil {
					t.Fatal(err)
				}
				if f := peerState(p, 1, handoff.Aborting); !strings.Contains(strings.Join(f, " "), "peer abort") {
					t.Errorf("peer's abort step: %q", f)
				}
			} else {
				p.do("abort 1")
				p.expect("aborted 1")
				step := waitStep(t, o.History, handoff.EventAbort)
				if step.By != "decode" || step.From != handoff.Transferring || !errors.Is(step.Err, handoff.ErrPeer) || !errors.Is(step.Err, kvlease.ErrAborted) {
					t.Errorf("source's abort step: %v", step)
				}
			}
			if l.State() == kvlease.LeaseActive {
				t.Error("an abort left the source lease open")
			}
			p.do("release")
			if st := waitDone(t, "source", o.Done(), o.State); st != handoff.Aborted {
				t.Fatalf("source %v: %v", st, o.History())
			}
			peerState(p, 1, handoff.Aborted)
			wantStats(t, "source", localStats(s.pool, s.sender.Stats()), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok started=1")
			wantStats(t, "peer destination", p.stats(), "free=64 leased=0 draining=0 quarantined=0 open=0 check=ok started=1 completed=0")
		})
	}
}

// TestProcGarbage: garbage, half frames and half hellos written to the
// control and data ports are refused with clear errors and change
// nothing; the peer's handoffs before and after are delivered.
func TestProcGarbage(t *testing.T) {
	d := newDestSide(t, sideOpts{}, peerConfig{HoldAfter: -1})
	p := d.peer
	p.do("propose 1 8 71")
	peerState(p, 1, handoff.Delivered)
	d.checkAndRelease(1)
	before := localStats(d.pool, d.recv.Stats())

	// The data port.
	good := wire.AppendFrame(nil, &wire.StartMsg{ID: 1})
	dataGarbage := map[string][]byte{
		"http":          []byte("GET / HTTP/1.0\r\n\r\n......"),
		"half hello":    {'K', 'D', 2, 9, 9},
		"wrong version": append([]byte{'K', 'D', 9}, make([]byte, 57)...),
		"unknown token": append([]byte{'K', 'D', 2}, make([]byte, 57)...),
		"control frame": good,
	}
	for name, b := range dataGarbage {
		c, err := net.Dial("tcp", d.recv.Addr())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write(b); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		_ = c.(*net.TCPConn).CloseWrite()
		_ = c.SetReadDeadline(time.Now().Add(bound))
		if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil {
			t.Errorf("%s: the receiver answered %d bytes, %v", name, n, err)
		}
		_ = c.Close()
	}
	end := time.Now().Add(bound)
	for _, r := d.errs(); len(r) < len(dataGarbage) && time.Now().Before(end); _, r = d.errs() {
		time.Sleep(time.Millisecond)
	}
	_, refused := d.errs()
	if len(refused) != len(dataGarbage) {
		t.Fatalf("%d refusals for %d garbage connections: %v", len(refused), len(dataGarbage), refused)
	}
	for _, err := range refused {
		if !errors.Is(err, tcp.ErrCorrupt) || !strings.Contains(err.Error(), "refused") {
			t.Errorf("refusal %v", err)
		}
	}

	// The control port: an insecure destination with a short frame
	// timeout serves each garbage connection after an insecure preamble
	// (garbage before or instead of the handshake is the attack suite's);
	// each ends with a clear error.
	short, err := handoff.NewDestination(d.pool, d.recv, handoff.DestinationConfig[[]byte]{
		HalfConfig: handoff.HalfConfig{Envelope: d.env, FrameTimeout: 100 * time.Millisecond, Insecure: true, Logf: quiet}})
	if err != nil {
		t.Fatal(err)
	}
	propose := wire.AppendFrame(nil, &handoff.ProposeMsg{ID: 9, Request: "seed=9", Blocks: 4, Envelope: d.env.Fingerprint()})
	badCRC := append([]byte(nil), propose...)
	badCRC[len(badCRC)-1] ^= 1
	ctlGarbage := []struct {
		name  string
		b     []byte
		stall bool
		want  string
	}{
		{"text", []byte("hello, is this the decode side?"), false, "bad frame magic"},
		{"bad checksum", badCRC, false, "checksum"},
		{"half a header", propose[:5], false, "half a frame header"},
		{"half a frame", propose[:len(propose)-3], false, "half a frame"},
		{"half a frame, stalled", propose[:len(propose)-3], true, "half a frame"},
		{"huge length", append([]byte{'K', 'H', wire.ProtocolVersion, byte(wire.MsgPropose), 0xff, 0xff, 0xff, 0x7f}, make([]byte, 4)...), false, "exceeds"},
	}
	for _, g := range ctlGarbage {
		ln := listen(t)
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		sc := acceptOne(t, ln)
		served := make(chan error, 1)
		go func() { served <- short.Serve(sc) }()
		pre := binary.LittleEndian.AppendUint64([]byte{'K', 'A', wire.ProtocolVersion, byte(handoff.AuthNone)}, d.env.Fingerprint())
		if _, err := c.Write(append(pre, g.b...)); err != nil {
			t.Fatal(err)
		}
		if !g.stall {
			_ = c.(*net.TCPConn).CloseWrite()
		}
		select {
		case err := <-served:
			if !errors.Is(err, handoff.ErrProtocol) || !strings.Contains(err.Error(), g.want) {
				t.Errorf("%s: Serve returned %v, want ErrProtocol and %q", g.name, err, g.want)
			}
		case <-time.After(bound):
			t.Fatalf("%s: Serve still running", g.name)
		}
		_ = c.Close()
	}
	after := localStats(d.pool, d.recv.Stats())
	after["refused"] = before["refused"]
	for k, v := range before {
		if after[k] != v {
			t.Errorf("garbage changed %s: %s → %s", k, v, after[k])
		}
	}
	// The peer's session never noticed.
	p.do("propose 2 8 72")
	peerState(p, 2, handoff.Delivered)
	d.checkAndRelease(2)
	if pe, _ := d.errs(); len(pe) != 0 {
		t.Errorf("protocol errors on the peer's session: %v", pe)
	}
}

// TestProcDuplicateID: a raw source here speaks the control protocol to
// the peer's destination: a second proposal of an id in use (and of one
// already final) is refused and leaves the first untouched; messages
// for unknown ids or of the wrong direction change nothing.
func TestProcDuplicateID(t *testing.T) {
	ln := listen(t)
	p := startPeer(t, peerConfig{Role: "dest", Ctrl: ln.Addr().String(), BlockBytes: procBlockBytes, PoolBlocks: procPool, HoldAfter: -1, Insecure: true})
	c := acceptOne(t, ln)
	defer c.Close()
	env := envFor(procBlockBytes, procPool)
	// The insecure handshake by hand: our preamble, the peer's and its
	// confirm byte.
	pre := binary.LittleEndian.AppendUint64([]byte{'K', 'A', wire.ProtocolVersion, byte(handoff.AuthNone)}, env.Fingerprint())
	if _, err := c.Write(pre); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(bound))
	if got := make([]byte, len(pre)+1); func() error { _, err := io.ReadFull(c, got); return err }() != nil || got[len(pre)] != 'K' {
		t.Fatalf("the peer's preamble and confirm: %q", got)
	}
	p.expect("ready")
	var buf []byte
	send := func(m wire.Message) {
		t.Helper()
		if _, err := c.Write(wire.AppendFrame(nil, m)); err != nil {
			t.Fatal(err)
		}
	}
	recv := func() wire.Message {
		t.Helper()
		_ = c.SetReadDeadline(time.Now().Add(bound))
		m, b, err := wire.ReadFrame(c, buf)
		buf = b
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	send(&handoff.ProposeMsg{ID: 7, Request: "seed=7", Blocks: 4, Envelope: env.Fingerprint()})
	if m, ok := recv().(*wire.AcceptMsg); !ok || m.ID != 7 || m.From != 0 {
		t.Fatalf("first proposal answered %#v", m)
	}
	p.expect("accepted 7")
	send(&handoff.ProposeMsg{ID: 7, Request: "seed=8", Blocks: 2, Envelope: env.Fingerprint()})
	if m, ok := recv().(*wire.RejectMsg); !ok || m.ID != 7 || m.Code != wire.RejectDuplicate {
		t.Fatalf("second proposal of id 7 answered %#v", m)
	}
	p.expect(`protoerr "kvlease: handoff destination: id 7 already used`)
	send(&wire.StartMsg{ID: 99})
	p.expect(`protoerr "kvlease: handoff destination: start for unknown handoff 99`)
	send(&wire.DoneMsg{ID: 7})
	p.expect(`protoerr "kvlease: handoff destination: unexpected done`)
	wantStats(t, "peer destination", p.stats(), "free=60 leased=4 open=1 check=ok started=0")
	p.do("wait 7 accepted")
	p.expect("state 7 accepted")

	send(&wire.AbortMsg{ID: 7, Cause: "the client went away"})
	if m, ok := recv().(*wire.AckMsg); !ok || m.ID != 7 || m.Of != wire.MsgAbort {
		t.Fatalf("abort answered %#v", m)
	}
	if f := p.expect("final 7 "); f[2] != "aborted" {
		t.Fatalf("peer: %q", f)
	}
	send(&handoff.ProposeMsg{ID: 7, Request: "seed=7", Blocks: 1, Envelope: env.Fingerprint()})
	if m, ok := recv().(*wire.RejectMsg); !ok || m.Code != wire.RejectDuplicate {
		t.Fatalf("a final id proposed again answered %#v", m)
	}
	wantStats(t, "peer destination", p.stats(), "free=64 leased=0 open=0 check=ok started=0")
	if n := p.saw("final "); n != 1 {
		t.Errorf("%d handoffs ended on the peer, want 1", n)
	}
}

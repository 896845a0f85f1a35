package ucx_test

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/ucx"
)

// The fault suite of the TCP transport, over UCX in two processes:
// clean, peer killed, peer stopped past the deadline then resumed, abort
// mid-read; each with the test process as the destination (the peer is
// the source) and as the source (the peer is the destination). Markers
// are checked on both sides: the delivered blocks on the destination,
// the untouched source blocks on the source.

const suiteBlocks = 8

// localDest is the test process as the destination.
type localDest struct {
	pool   *kvlease.Pool[[]byte]
	recv   *ucx.Receiver[[]byte]
	finals chan *handoff.Incoming[[]byte]
	served chan error
}

func newLocalDest(t *testing.T, conn net.Conn, cfg ucx.Config, deadline time.Duration) *localDest {
	t.Helper()
	d := &localDest{pool: hostPool(t, 64), finals: make(chan *handoff.Incoming[[]byte], 1), served: make(chan error, 1)}
	var err error
	if d.recv, err = ucx.NewReceiver(cfg, ucx.HostBytes); err != nil {
		t.Fatal(err)
	}
	dst, err := handoff.NewDestination(d.pool, d.recv, handoff.DestinationConfig[[]byte]{
		HalfConfig:  withAuth(handoff.HalfConfig{Envelope: env(64), Name: "decode", Peer: "prefill", Deadline: deadline}, keyFor(cfg)),
		OnDelivered: func(*handoff.Incoming[[]byte]) {},
		OnFinal:     func(in *handoff.Incoming[[]byte]) { d.finals <- in },
	})
	if err != nil {
		t.Fatal(err)
	}
	go func() { d.served <- dst.Serve(conn) }()
	t.Cleanup(func() {
		_ = conn.Close()
		<-d.served
		_ = d.recv.Close()
		if err := d.pool.Check(); err != nil {
			t.Error(err)
		}
	})
	return d
}

func (d *localDest) final(t *testing.T) *handoff.Incoming[[]byte] {
	t.Helper()
	select {
	case in := <-d.finals:
		return in
	case <-time.After(30 * time.Second):
		t.Fatal("the handoff never became final on the destination")
	}
	return nil
}

// stoppedShort waits for the handoff to become final and checks that it
// ended Aborted or Failed, every block of the pool back, and that the
// receiver's evidence was one revocation or cancel, not a completion.
func (d *localDest) stoppedShort(t *testing.T) {
	t.Helper()
	in := d.final(t)
	if st := in.State(); st != handoff.Aborted && st != handoff.Failed {
		t.Fatalf("destination %v: %v", st, in.History())
	}
	allFree(t, "destination", d.pool)
	if s := d.recv.Stats(); s.Revoked+s.Canceled != 1 || s.Completed != 0 {
		t.Fatalf("receiver %+v", s)
	}
}

// allFree checks that every block of the pool is back (none quarantined).
func allFree(t *testing.T, what string, p *kvlease.Pool[[]byte]) {
	t.Helper()
	if s := p.Stats(); s.Free != s.Capacity || s.Quarantined != 0 {
		t.Fatalf("%s pool: %+v", what, s)
	}
}

// localSource is the test process as the source.
type localSource struct {
	pool   *kvlease.Pool[[]byte]
	sender *ucx.Sender[[]byte]
	src    *handoff.Source[[]byte]
	lease  *kvlease.Lease[[]byte]
	mem    [][]byte // the lease's regions
}

func newLocalSource(t *testing.T, conn net.Conn, deadline time.Duration, seed uint32) *localSource {
	return newLocalSourceOf(t, conn, ucx.Config{}, deadline, seed)
}

func newLocalSourceOf(t *testing.T, conn net.Conn, cfg ucx.Config, deadline time.Duration, seed uint32) *localSource {
	t.Helper()
	s := &localSource{pool: hostPool(t, 64)}
	var err error
	if s.sender, err = ucx.NewSender(cfg, ucx.HostBytes); err != nil {
		t.Fatal(err)
	}
	if s.src, err = handoff.NewSource(conn, s.sender, withAuth(handoff.HalfConfig{Envelope: env(64), Name: "prefill", Peer: "decode", Deadline: deadline}, keyFor(cfg))); err != nil {
		t.Fatal(err)
	}
	if s.lease, err = s.pool.Acquire("r", suiteBlocks); err != nil {
		t.Fatal(err)
	}
	stamp(t, s.lease, seed)
	s.mem = regionsOf(t, s.lease)
	t.Cleanup(func() {
		_ = s.src.Close()
		_ = s.sender.Close()
		if err := s.pool.Check(); err != nil {
			t.Error(err)
		}
	})
	return s
}

// finish checks the source blocks still hold their markers, releases the
// lease and checks every block is back.
func (s *localSource) finish(t *testing.T, seed uint32) {
	t.Helper()
	if err := markedRegions(s.mem, seed); err != nil {
		t.Fatalf("source blocks changed: %v", err)
	}
	s.lease.Release()
	allFree(t, "source", s.pool)
}

func states(h []handoff.Step) []handoff.State {
	var out []handoff.State
	for _, s := range h {
		out = append(out, s.To)
	}
	return out
}

func TestProcsClean(t *testing.T) {
	t.Run("peer-is-source", func(t *testing.T) {
		p := startPeer(t, "source", "KVUCX_SEED=21", fmt.Sprint("KVUCX_BLOCKS=", suiteBlocks))
		d := newLocalDest(t, p.conn, ucx.Config{MaxGet: blockBytes, Window: 3}, 20*time.Second)
		in := d.final(t)
		if in.State() != handoff.Delivered {
			t.Fatalf("destination %v: %v", in.State(), in.History())
		}
		if err := marked(in.Lease(), 21); err != nil {
			t.Fatal(err)
		}
		in.Lease().Release()
		p.expect("source delivered markers ok")
		p.expect("pool free 64 quarantined 0")
		p.waitExit()
		allFree(t, "destination", d.pool)
		// Authenticated through the key the peer inherited: every block
		// checked against a MAC under the session.
		if s := d.recv.Stats(); s.Completed != 1 || s.Revoked != 0 || s.Bytes != suiteBlocks*blockBytes || s.Keyed != 1 {
			t.Fatalf("receiver %+v", s)
		}
	})
	t.Run("peer-is-destination", func(t *testing.T) {
		p := startPeer(t, "dest", "KVUCX_SEED=22")
		s := newLocalSource(t, p.conn, 20*time.Second, 22)
		o, err := s.src.Propose(1, "r", s.lease, nil)
		if err != nil {
			t.Fatal(err)
		}
		if st := o.Wait(30 * time.Second); st != handoff.Delivered {
			t.Fatalf("source %v: %v", st, o.History())
		}
		_ = s.src.Close() // the peer waits for the control connection to end
		p.expect("dest delivered markers ok")
		p.expect("pool free 64 quarantined 0")
		p.waitExit()
		s.finish(t, 22)
		if st := s.sender.Stats(); st.Completed != 1 || st.Revoked != 0 || st.Keyed != 1 {
			t.Fatalf("sender %+v", st)
		}
	})
}

func TestProcsPeerKilled(t *testing.T) {
	t.Run("peer-is-source", func(t *testing.T) {
		// The source dies after sending three blocks: the destination's
		// endpoint to it fails (UCX completes nothing for the receives
		// still posted: not evidence, so the destination revokes its
		// own side), or the lost control connection cancels first and
		// the receives no message matched are withdrawn.
		p := startPeer(t, "source", "KVUCX_SEED=31", "KVUCX_STALL=3")
		receiving := make(chan struct{})
		var once sync.Once
		d := newLocalDest(t, p.conn, ucx.Config{Window: 1, BeforeGet: func(handoff.PlaneID, int) {
			once.Do(func() { close(receiving) })
		}}, 20*time.Second)
		select {
		case <-receiving: // the destination attached and receives
		case <-time.After(30 * time.Second):
			t.Fatal("the destination never received")
		}
		p.expect("sending 3")
		p.kill()
		d.stoppedShort(t)
	})
	t.Run("peer-is-source/pull", func(t *testing.T) {
		// The source dies after the destination has read two blocks:
		// UCX completes the outstanding gets with an error, which is
		// not evidence; the destination revokes its own side.
		p := startPeer(t, "source", "KVUCX_SEED=31", "KVUCX_PULL=1")
		cfg := ucx.Config{Pull: true, MaxGet: blockBytes, Window: 1, BeforeGet: func(_ handoff.PlaneID, block int) {
			if block == 2 {
				p.kill()
			}
		}}
		d := newLocalDest(t, p.conn, cfg, 20*time.Second)
		// Evidence came from a revocation, or from a flush with nothing
		// outstanding (when the connection loss canceled the reader
		// before its next get); never from the failed gets.
		d.stoppedShort(t)
	})
	t.Run("peer-is-destination", func(t *testing.T) {
		// The destination dies in the middle of its reads: the control
		// connection ends, and the source revokes its registration.
		p := startPeer(t, "dest", "KVUCX_SEED=32", "KVUCX_STALL=3")
		s := newLocalSource(t, p.conn, 20*time.Second, 32)
		o, err := s.src.Propose(1, "r", s.lease, nil)
		if err != nil {
			t.Fatal(err)
		}
		p.expect("reading 3")
		p.kill()
		if st := o.Wait(30 * time.Second); st != handoff.Failed && st != handoff.Aborted {
			t.Fatalf("source %v: %v", st, o.History())
		}
		if err := o.Transfer().Err(); !errors.Is(err, ucx.ErrRevoked) {
			t.Fatalf("source transfer resolved with %v, want a revocation", err)
		}
		s.finish(t, 32)
	})
}

func TestProcsPeerStopped(t *testing.T) {
	t.Run("peer-is-source", func(t *testing.T) {
		// Pushed: the source stops (SIGSTOP) after its third block,
		// past the destination's deadline, which quarantines the blocks
		// and cancels. The cancel withdraws the receives no message
		// matched (ucp_request_cancel), and their completions are
		// evidence of our own: the quarantine lifts and the blocks come
		// back while the source is still stopped (pulled, they wait for
		// the source: see peer-is-source/pull). Resumed, the source
		// hears the abort and revokes.
		p := startPeer(t, "source", "KVUCX_SEED=43", "KVUCX_DEADLINE_MS=60000", "KVUCX_STALL=3")
		receiving := make(chan struct{})
		var once sync.Once
		d := newLocalDest(t, p.conn, ucx.Config{Window: 4, BeforeGet: func(handoff.PlaneID, int) {
			once.Do(func() { close(receiving) })
		}}, 300*time.Millisecond)
		select {
		case <-receiving: // the destination attached and receives
		case <-time.After(30 * time.Second):
			t.Fatal("the destination never received")
		}
		p.expect("sending 3")
		p.stop()
		in := d.final(t)
		if st := in.State(); st != handoff.Aborted {
			t.Fatalf("destination %v: %v", st, in.History())
		}
		allFree(t, "destination", d.pool)
		if s := d.recv.Stats(); s.Canceled != 1 || s.Revoked != 0 || s.Completed != 0 {
			t.Fatalf("receiver %+v", s)
		}
		p.tell("go")
		p.resume()
		p.expect("source aborted markers ok")
		p.expect("pool free 64 quarantined 0")
		p.waitExit()
	})
	t.Run("peer-is-source/pull", func(t *testing.T) {
		// Pulled: the source stops (SIGSTOP) with the destination's
		// gets outstanding, past the destination's deadline: the
		// destination's blocks are quarantined, and the cancel that the
		// deadline sends is not evidence. Resumed (SIGCONT), the source
		// serves the gets or revokes; either is late evidence that
		// lifts the quarantine.
		p := startPeer(t, "source", "KVUCX_SEED=41", "KVUCX_DEADLINE_MS=60000", "KVUCX_PULL=1")
		cfg := ucx.Config{Pull: true, MaxGet: blockBytes, Window: 4, BeforeGet: func(_ handoff.PlaneID, block int) {
			if block == 2 {
				p.stop()
			}
		}}
		d := newLocalDest(t, p.conn, cfg, 300*time.Millisecond)
		quarantined := false
		for range 2000 {
			if d.pool.Stats().Quarantined == suiteBlocks {
				quarantined = true
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		if !quarantined {
			t.Fatalf("destination never quarantined its blocks: %+v", d.pool.Stats())
		}
		select {
		case in := <-d.finals:
			t.Fatalf("destination final (%v) while its source is stopped", in.State())
		default:
		}
		p.resume()
		in := d.final(t)
		if st := in.State(); st != handoff.Aborted {
			t.Fatalf("destination %v: %v", st, in.History())
		}
		if !slices.Contains(states(in.History()), handoff.Quarantined) {
			t.Fatalf("no quarantine in %v", in.History())
		}
		allFree(t, "destination", d.pool)
		p.expect("source aborted markers ok")
		p.expect("pool free 64 quarantined 0")
		p.waitExit()
	})
	t.Run("peer-is-destination", func(t *testing.T) {
		// The destination stops in the middle of its reads: at the
		// source's deadline the source quarantines, revokes its
		// registration, and that revocation lifts the quarantine. The
		// resumed destination's remaining gets find nothing to read.
		p := startPeer(t, "dest", "KVUCX_SEED=42", "KVUCX_STALL=3", "KVUCX_DEADLINE_MS=60000")
		s := newLocalSource(t, p.conn, 300*time.Millisecond, 42)
		o, err := s.src.Propose(1, "r", s.lease, nil)
		if err != nil {
			t.Fatal(err)
		}
		p.expect("reading 3")
		p.stop()
		// Waits in the pipe until the peer runs again; the peer then
		// handles the source's deadline Abort before it reads on, so
		// whether it had every block's bytes by then (a run's message
		// may all be in its socket) does not decide its outcome.
		p.tell("go-after-abort")
		if st := o.Wait(30 * time.Second); st != handoff.Aborted {
			t.Fatalf("source %v: %v", st, o.History())
		}
		if !slices.Contains(states(o.History()), handoff.Quarantined) {
			t.Fatalf("no quarantine in %v", o.History())
		}
		if err := o.Transfer().Err(); !errors.Is(err, ucx.ErrRevoked) {
			t.Fatalf("source transfer resolved with %v, want a revocation", err)
		}
		p.resume()
		_ = s.src.Close()
		p.expectFinal("dest", handoff.Aborted, handoff.Failed)
		p.expect("pool free 64 quarantined 0")
		p.waitExit()
		s.finish(t, 42)
	})
	t.Run("peer-is-destination/released", func(t *testing.T) {
		// Issue 30, item 1: as peer-is-destination, but the source has
		// released its lease once the handoff was under way (rule 2).
		// The deadline cancels the transfer itself (aborting a closed
		// lease cancels nothing): the revocation lifts the quarantine
		// while the destination is still stopped, and an honest request
		// for the whole pool is served.
		p := startPeer(t, "dest", "KVUCX_SEED=44", "KVUCX_STALL=3", "KVUCX_DEADLINE_MS=60000")
		s := newLocalSource(t, p.conn, 300*time.Millisecond, 44)
		o, err := s.src.Propose(1, "r", s.lease, nil)
		if err != nil {
			t.Fatal(err)
		}
		p.expect("reading 3")
		p.stop()
		frozen := time.Now()
		s.lease.Release()
		select {
		case <-s.lease.Settled():
		case <-time.After(30 * time.Second):
			t.Fatalf("the released lease's blocks still held after 30s: %+v", s.pool.Stats())
		}
		if st := o.Wait(30 * time.Second); st != handoff.Aborted {
			t.Fatalf("source %v: %v", st, o.History())
		}
		if !slices.Contains(states(o.History()), handoff.Quarantined) {
			t.Fatalf("no quarantine in %v", o.History())
		}
		if err := o.Transfer().Err(); !errors.Is(err, ucx.ErrRevoked) {
			t.Fatalf("source transfer resolved with %v, want a revocation", err)
		}
		honest, err := s.pool.Acquire("honest", 64)
		if err != nil {
			t.Fatalf("an honest request for the whole pool, the destination still stopped: %v", err)
		}
		t.Logf("honest request for the whole pool served %v after the freeze", time.Since(frozen).Round(time.Millisecond))
		honest.Release()
		p.tell("go-after-abort")
		p.resume()
		_ = s.src.Close()
		p.expectFinal("dest", handoff.Aborted, handoff.Failed)
		p.expect("pool free 64 quarantined 0")
		p.waitExit()
		s.finish(t, 44)
	})
}

func TestProcsAbortMidRead(t *testing.T) {
	t.Run("peer-is-source", func(t *testing.T) {
		// The source's client goes away while the destination reads:
		// the source revokes (its evidence) and tells the destination,
		// whose remaining gets find nothing.
		p := startPeer(t, "source", "KVUCX_SEED=51", "KVUCX_ABORT=1")
		said := make(chan string, 1)
		cfg := ucx.Config{MaxGet: blockBytes, Window: 1, BeforeGet: func(_ handoff.PlaneID, block int) {
			if block == 3 {
				// On the reader's thread: no t.Fatal here.
				p.tell("abort")
				select {
				case line := <-p.lines:
					said <- line
				case <-time.After(30 * time.Second):
					said <- "silence"
				}
			}
		}}
		d := newLocalDest(t, p.conn, cfg, 20*time.Second)
		in := d.final(t)
		if line := <-said; line != "aborted aborted" {
			t.Fatalf("peer said %q after the abort", line)
		}
		if st := in.State(); st != handoff.Aborted && st != handoff.Failed {
			t.Fatalf("destination %v: %v", st, in.History())
		}
		allFree(t, "destination", d.pool)
		p.expect("source aborted markers ok")
		p.expect("pool free 64 quarantined 0")
		p.waitExit()
	})
	t.Run("peer-is-destination", func(t *testing.T) {
		p := startPeer(t, "dest", "KVUCX_SEED=52", "KVUCX_STALL=3")
		s := newLocalSource(t, p.conn, 20*time.Second, 52)
		o, err := s.src.Propose(1, "r", s.lease, nil)
		if err != nil {
			t.Fatal(err)
		}
		p.expect("reading 3")
		if err := o.Abort("frontend", errors.New("client went away")); err != nil {
			t.Fatal(err)
		}
		if st := o.Wait(30 * time.Second); st != handoff.Aborted {
			t.Fatalf("source %v: %v", st, o.History())
		}
		p.tell("go-after-abort")
		_ = s.src.Close()
		p.expectFinal("dest", handoff.Aborted, handoff.Failed)
		p.expect("pool free 64 quarantined 0")
		p.waitExit()
		s.finish(t, 52)
	})
}

func TestProcsHostileDestination(t *testing.T) {
	// A destination process that passed the authentication but does not
	// follow the protocol: given the Start bytes, it asks the source's
	// handoff worker for another request's block of the same pool (the
	// block right after the handoff's, whose address the test tells it:
	// a worst case of guessing). Pushed, it gets nothing: the source's
	// worker serves no get. Pulled (trusted networks only), it reads the
	// secret: why pull is opt-in.
	for _, pull := range []bool{false, true} {
		t.Run(fmt.Sprintf("pull=%v", pull), func(t *testing.T) {
			extra := []string{"KVUCX_SEED=61"}
			if pull {
				extra = append(extra, "KVUCX_PULL=1")
			}
			p := startPeer(t, "hostile", extra...)
			s := newLocalSourceOf(t, p.conn, ucx.Config{Pull: pull}, 20*time.Second, 61)
			secret, err := s.pool.Acquire("another request", 1)
			if err != nil {
				t.Fatal(err)
			}
			sr, _ := secret.Region(0)
			for i := range sr {
				sr[i] = 0x5E
			}
			p.tell(fmt.Sprintf("target %#x", uintptr(unsafe.Pointer(unsafe.SliceData(sr)))))
			o, err := s.src.Propose(1, "r", s.lease, nil)
			if err != nil {
				t.Fatal(err)
			}
			line := p.expect("stolen")
			if st := o.Wait(30 * time.Second); st != handoff.Delivered {
				t.Fatalf("source %v: %v", st, o.History())
			}
			p.expect("hostile delivered")
			leaked := strings.Contains(line, "5e5e5e5e")
			if !pull && leaked {
				t.Fatalf("the pushing source leaked another request's block: %q", line)
			}
			if !pull && !strings.HasPrefix(line, "stolen false") {
				t.Fatalf("the hostile get completed: %q", line)
			}
			if pull && !leaked {
				t.Fatalf("pulled, the hostile read got %q: UCX refuses it now, revisit Config.Pull", line)
			}
			_ = s.src.Close()
			p.tell("done")
			p.waitExit()
			secret.Release()
			s.finish(t, 61)
		})
	}
}

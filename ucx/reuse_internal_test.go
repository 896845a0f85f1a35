package ucx

import (
	"bytes"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// reusePlanes is a sender and a receiver whose blocks carry keyed sums
// (an authenticated session's), closed with the test.
func reusePlanes(t *testing.T, scfg, rcfg Config) (*Sender[[]byte], *Receiver[[]byte]) {
	t.Helper()
	s, err := NewSender(scfg, HostBytes)
	if err != nil {
		t.Fatal(err)
	}
	r, err := NewReceiver(rcfg, HostBytes)
	if err != nil {
		_ = s.Close()
		t.Fatal(err)
	}
	s.keys, r.keys = keyed([]byte("reuse test session secret 32 by")), keyed([]byte("reuse test session secret 32 by"))
	t.Cleanup(func() {
		_ = s.Close()
		_ = r.Close()
	})
	return s, r
}

// scatteredBlocks returns n blocks of runBlock bytes, no two adjacent
// (each its own message), filled with seed's pattern.
func scatteredBlocks(n int, seed byte) [][]byte {
	rs := everyOther(newRunArena(2*n).regions(seq(0, 2*n, 1)), 0)
	fillRuns(rs, seed)
	return rs
}

func emptyBlocks(n int) [][]byte { return everyOther(newRunArena(2*n).regions(seq(0, 2*n, 1)), 1) }

// handoffOnce is moveOnce that also returns the Accept bytes, and the
// source's outcome whatever it is.
func handoffOnce(s *Sender[[]byte], r *Receiver[[]byte], id handoff.PlaneID, src, dst [][]byte) ([]byte, error) {
	accept, st, dt, err := startOnce(s, r, id, src, dst)
	if err != nil {
		return accept, err
	}
	derr, serr := endOnce(s, id, st, dt)
	if derr != nil {
		return accept, derr
	}
	return accept, serr
}

// stopAt returns a BeforeSend hook that stops the source of handoff
// which (as it is when the hook runs) before block: it closes reached
// and waits for release (at most 20 s).
func stopAt(which *atomic.Uint64, block int, reached, release chan struct{}) func(handoff.PlaneID, int) {
	return func(id handoff.PlaneID, b int) {
		if id.Handoff == which.Load() && b == block {
			close(reached)
			select {
			case <-release:
			case <-time.After(20 * time.Second):
			}
		}
	}
}

// waitStats polls f's stats until ok holds (bounded: 10 s).
func waitStats(t *testing.T, what string, f func() Stats, ok func(Stats) bool) Stats {
	t.Helper()
	var st Stats
	for range 1000 {
		if st = f(); ok(st) {
			return st
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("%s: %+v", what, st)
	return st
}

func TestReuseSequential(t *testing.T) {
	// Handoffs one after the other in one session: one worker and one
	// connection a side, each handoff after the first reusing them, with
	// a salt of its own; the source's transfer resolves nil (its sends
	// completed) and every block arrives intact.
	const n, handoffs = 16, 6
	s, r := reusePlanes(t, Config{}, Config{})
	var salts []uint32
	for i := range handoffs {
		src, dst := scatteredBlocks(n, byte(i+1)), emptyBlocks(n)
		accept, err := handoffOnce(s, r, handoff.PlaneID{Session: 1, Handoff: uint64(i)}, src, dst)
		if err != nil {
			t.Fatalf("handoff %d: %v", i, err)
		}
		if err := sameRegions(dst, src); err != nil {
			t.Fatalf("handoff %d: %v", i, err)
		}
		acc, err := parsePushAccept(accept)
		if err != nil {
			t.Fatal(err)
		}
		salts = append(salts, acc.salt)
	}
	for i := 1; i < len(salts); i++ {
		if salts[i] == salts[i-1] {
			t.Fatalf("handoffs %d and %d share the salt %#x", i-1, i, salts[i])
		}
	}
	ss, rs := s.Stats(), r.Stats()
	if ss.Workers != 1 || ss.Connects != 1 || ss.Reuses != handoffs-1 || ss.Idle != 1 || ss.Completed != handoffs || ss.Revoked != 0 {
		t.Fatalf("source %+v, want 1 worker, 1 connect, %d reuses, 1 idle", ss, handoffs-1)
	}
	if rs.Workers != 1 || rs.Connects != 1 || rs.Reuses != handoffs-1 || rs.Idle != 1 || rs.Completed != handoffs || rs.Keyed != handoffs {
		t.Fatalf("destination %+v, want 1 worker, 1 connect, %d reuses, 1 idle", rs, handoffs-1)
	}
}

func TestReuseConcurrentBoundedIdle(t *testing.T) {
	// Concurrent handoffs of one session each hold a connection of their
	// own; afterwards at most MaxIdle stay idle a side, and the next
	// handoffs make no worker: the destination reuses one of its idle
	// workers, the source one of its own (reconnected to that worker if
	// the two sides kept different ones), and the handoff after reuses
	// both the workers and the endpoint.
	const n, conc, maxIdle = 8, 6, 2
	s, r := reusePlanes(t, Config{MaxIdle: maxIdle}, Config{MaxIdle: maxIdle})
	var wg sync.WaitGroup
	errs := make(chan error, conc)
	for i := range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			src, dst := scatteredBlocks(n, byte(i+1)), emptyBlocks(n)
			if _, err := handoffOnce(s, r, handoff.PlaneID{Session: 1, Handoff: uint64(i)}, src, dst); err != nil {
				errs <- fmt.Errorf("handoff %d: %w", i, err)
				return
			}
			if err := sameRegions(dst, src); err != nil {
				errs <- fmt.Errorf("handoff %d: %w", i, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	ss, rs := s.Stats(), r.Stats()
	if ss.Idle > maxIdle || rs.Idle > maxIdle || ss.Idle == 0 || rs.Idle == 0 {
		t.Fatalf("idle after %d concurrent handoffs: source %d, destination %d, want 1 to %d", conc, ss.Idle, rs.Idle, maxIdle)
	}
	if ss.Connects+ss.Reuses != conc || ss.Workers > ss.Connects || rs.Workers+rs.Reuses != conc {
		t.Fatalf("source %+v, destination %+v: each handoff a new or a reused connection", ss, rs)
	}
	src, dst := scatteredBlocks(n, 99), emptyBlocks(n)
	if _, err := handoffOnce(s, r, handoff.PlaneID{Session: 1, Handoff: conc}, src, dst); err != nil {
		t.Fatal(err)
	}
	if err := sameRegions(dst, src); err != nil {
		t.Fatal(err)
	}
	s2, r2 := s.Stats(), r.Stats()
	if s2.Workers != ss.Workers || s2.Reuses+s2.Connects != ss.Reuses+ss.Connects+1 || r2.Reuses != rs.Reuses+1 || r2.Workers != rs.Workers {
		t.Fatalf("the handoff after: source %+v, destination %+v, want no new worker", s2, r2)
	}
	src, dst = scatteredBlocks(n, 100), emptyBlocks(n)
	if _, err := handoffOnce(s, r, handoff.PlaneID{Session: 1, Handoff: conc + 1}, src, dst); err != nil {
		t.Fatal(err)
	}
	if err := sameRegions(dst, src); err != nil {
		t.Fatal(err)
	}
	if s3, r3 := s.Stats(), r.Stats(); s3.Reuses != s2.Reuses+1 || s3.Connects != s2.Connects || r3.Reuses != r2.Reuses+1 || r3.Connects != r2.Connects || s3.Workers != ss.Workers || r3.Workers != rs.Workers {
		t.Fatalf("the second handoff after: source %+v, destination %+v, want both reusing", s3, r3)
	}
}

func TestReuseIdleExpiry(t *testing.T) {
	// An idle connection is destroyed after IdleTimeout (the
	// destination's longer than the source's); the next handoff connects
	// afresh.
	const n = 4
	s, r := reusePlanes(t, Config{IdleTimeout: 30 * time.Millisecond}, Config{IdleTimeout: 60 * time.Millisecond})
	src, dst := scatteredBlocks(n, 1), emptyBlocks(n)
	if _, err := handoffOnce(s, r, handoff.PlaneID{Session: 1, Handoff: 1}, src, dst); err != nil {
		t.Fatal(err)
	}
	waitStats(t, "source never expired its connection", s.Stats, func(st Stats) bool { return st.Expired == 1 && st.Idle == 0 })
	waitStats(t, "destination never expired its worker", r.Stats, func(st Stats) bool { return st.Expired == 1 && st.Idle == 0 })
	src, dst = scatteredBlocks(n, 2), emptyBlocks(n)
	if _, err := handoffOnce(s, r, handoff.PlaneID{Session: 1, Handoff: 2}, src, dst); err != nil {
		t.Fatal(err)
	}
	if err := sameRegions(dst, src); err != nil {
		t.Fatal(err)
	}
	if ss, rs := s.Stats(), r.Stats(); ss.Workers != 2 || ss.Connects != 2 || ss.Reuses != 0 || rs.Workers != 2 || rs.Reuses != 0 {
		t.Fatalf("after expiry: source %+v, destination %+v, want fresh connections", ss, rs)
	}
}

func TestReuseOtherSessionConnects(t *testing.T) {
	// A connection serves one session: another session's handoff to the
	// same planes makes its own.
	const n = 4
	s, r := reusePlanes(t, Config{}, Config{})
	for i, sess := range []uint64{1, 2} {
		src, dst := scatteredBlocks(n, byte(i+1)), emptyBlocks(n)
		if _, err := handoffOnce(s, r, handoff.PlaneID{Session: sess, Handoff: 1}, src, dst); err != nil {
			t.Fatal(err)
		}
	}
	if ss, rs := s.Stats(), r.Stats(); ss.Connects != 2 || ss.Reuses != 0 || rs.Workers != 2 || rs.Reuses != 0 || ss.Idle != 2 {
		t.Fatalf("two sessions: source %+v, destination %+v", ss, rs)
	}
}

func TestReuseKilledEndpoint(t *testing.T) {
	// A handoff reusing a connection has it killed mid-send (its source
	// revoked: the connection's worker destroyed) while another handoff
	// of the session runs on a connection of its own: only the first
	// fails (the destination by its endpoint's failure, ErrRevoked), the
	// other delivers, the killed connection is never pooled again, and
	// the next handoff succeeds on a live one.
	const n = 8
	var blockA atomic.Uint64
	reached, release := make(chan struct{}), make(chan struct{})
	s, r := reusePlanes(t, Config{Window: 2, BeforeSend: stopAt(&blockA, 1, reached, release)}, Config{})
	// Handoff 1: clean, leaves a connection idle on each side.
	src, dst := scatteredBlocks(n, 1), emptyBlocks(n)
	if _, err := handoffOnce(s, r, handoff.PlaneID{Session: 1, Handoff: 1}, src, dst); err != nil {
		t.Fatal(err)
	}
	// Handoff 2 takes them and stops in its second block.
	blockA.Store(2)
	idA := handoff.PlaneID{Session: 1, Handoff: 2}
	srcA, dstA := scatteredBlocks(n, 2), emptyBlocks(n)
	_, st, dt, err := startOnce(s, r, idA, srcA, dstA)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-reached:
	case <-time.After(20 * time.Second):
		t.Fatal("handoff 2 never reached its second block")
	}
	if ss, rs := s.Stats(), r.Stats(); ss.Reuses != 1 || rs.Reuses != 1 {
		t.Fatalf("handoff 2 should reuse handoff 1's connections: source %+v, destination %+v", ss, rs)
	}
	// Handoff 3 meanwhile: a connection of its own, delivered.
	srcB, dstB := scatteredBlocks(n, 3), emptyBlocks(n)
	if _, err := handoffOnce(s, r, handoff.PlaneID{Session: 1, Handoff: 3}, srcB, dstB); err != nil {
		close(release)
		t.Fatal(err)
	}
	if err := sameRegions(dstB, srcB); err != nil {
		close(release)
		t.Fatal(err)
	}
	// Kill handoff 2's connection: its source revokes (it posts nothing
	// more, and its worker is destroyed once the hook returns).
	s.mu.Lock()
	jobA := s.jobs[idA]
	s.mu.Unlock()
	st.Cancel()
	for i := 0; !jobA.halt.Load(); i++ {
		if i == 2000 {
			close(release)
			t.Fatal("the canceled source never started its revocation")
		}
		time.Sleep(time.Millisecond)
	}
	close(release)
	for _, x := range []*kvlease.Transfer{st, dt} {
		select {
		case <-x.Done():
		case <-time.After(20 * time.Second):
			t.Fatal("handoff 2 did not resolve after its connection was killed")
		}
	}
	if err := st.Err(); !errors.Is(err, ErrRevoked) {
		t.Fatalf("source of handoff 2: %v, want ErrRevoked", err)
	}
	if err := dt.Err(); !errors.Is(err, ErrRevoked) {
		t.Fatalf("destination of handoff 2: %v, want ErrRevoked (its endpoint failed)", err)
	}
	s.Finish(idA, dt.Err())
	if ss, rs := s.Stats(), r.Stats(); ss.Idle != 1 || rs.Idle != 1 {
		t.Fatalf("after the kill: source %+v, destination %+v, want handoff 3's connection alone idle", ss, rs)
	}
	// The next handoff runs on handoff 3's connection.
	src, dst = scatteredBlocks(n, 4), emptyBlocks(n)
	if _, err := handoffOnce(s, r, handoff.PlaneID{Session: 1, Handoff: 4}, src, dst); err != nil {
		t.Fatal(err)
	}
	if err := sameRegions(dst, src); err != nil {
		t.Fatal(err)
	}
	if ss := s.Stats(); ss.Workers != 2 || ss.Reuses != 2 || ss.Revoked != 1 || ss.Completed != 3 {
		t.Fatalf("source %+v", ss)
	}
}

func TestReuseKilledPeer(t *testing.T) {
	// The destination goes away (its Receiver closed: every worker
	// destroyed) while the source holds an idle connection to it: the
	// source finds it broken and drops it, and its next handoff, to a new
	// destination, connects afresh and delivers.
	const n = 4
	s, err := NewSender(Config{IdleTimeout: 2 * time.Second}, HostBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	secret := []byte("reuse test session secret 32 by")
	s.keys = keyed(secret)
	r, err := NewReceiver(Config{}, HostBytes)
	if err != nil {
		t.Fatal(err)
	}
	r.keys = keyed(secret)
	src, dst := scatteredBlocks(n, 1), emptyBlocks(n)
	if _, err := handoffOnce(s, r, handoff.PlaneID{Session: 1, Handoff: 1}, src, dst); err != nil {
		t.Fatal(err)
	}
	_ = r.Close()
	waitStats(t, "the source never found its connection broken", s.Stats, func(st Stats) bool { return st.Broken == 1 && st.Idle == 0 })
	r2, err := NewReceiver(Config{}, HostBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	r2.keys = keyed(secret)
	src, dst = scatteredBlocks(n, 2), emptyBlocks(n)
	if _, err := handoffOnce(s, r2, handoff.PlaneID{Session: 1, Handoff: 2}, src, dst); err != nil {
		t.Fatal(err)
	}
	if err := sameRegions(dst, src); err != nil {
		t.Fatal(err)
	}
	if ss := s.Stats(); ss.Connects != 2 || ss.Expired != 0 {
		t.Fatalf("source %+v, want a second connect", ss)
	}
}

func TestReuseLateMessageOfAReusedConnection(t *testing.T) {
	// Handoff 1 ends cleanly and leaves its connections idle. Handoff 2
	// reuses them; before its first block, the source's reused endpoint
	// carries late messages of handoff 1 (its first block's tag and its
	// table's, garbage inside) to the same destination worker. Handoff
	// 2's receives carry its own salt: they never match handoff 1's
	// tags, so its blocks are its own and it delivers; the destination
	// then finds the strays waiting in its worker and does not keep it.
	const n = 4
	var inject atomic.Pointer[func()]
	s, r := reusePlanes(t, Config{BeforeSend: func(id handoff.PlaneID, block int) {
		if f := inject.Load(); f != nil && id.Handoff == 2 && block == 0 {
			(*f)()
		}
	}}, Config{})
	src, dst := scatteredBlocks(n, 1), emptyBlocks(n)
	accept, err := handoffOnce(s, r, handoff.PlaneID{Session: 1, Handoff: 1}, src, dst)
	if err != nil {
		t.Fatal(err)
	}
	acc1, err := parsePushAccept(accept)
	if err != nil {
		t.Fatal(err)
	}
	s.pool.mu.Lock()
	c := s.pool.idle[keyOf(handoff.PlaneID{Session: 1})][0].c
	s.pool.mu.Unlock()
	garbage := newCbuf(runBlock)
	defer garbage.free()
	for i := range garbage.bytes() {
		garbage.bytes()[i] = 0xEE
	}
	sent := newBatch()
	defer sent.free()
	posted := make(chan error, 1)
	f := func() { // on the connection's worker thread
		var err error
		for _, tag := range []uint64{tagOf(acc1.salt, 0), tagOf(acc1.salt, 1), tagOf(acc1.salt, tableIndex)} {
			if _, e := c.ep.send(garbage.addr(), garbage.n, false, tag, sent); e != nil {
				err = e
			}
		}
		posted <- err
	}
	inject.Store(&f)
	src, dst = scatteredBlocks(n, 2), emptyBlocks(n)
	accept, err = handoffOnce(s, r, handoff.PlaneID{Session: 1, Handoff: 2}, src, dst)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-posted; err != nil {
		t.Fatalf("the late messages were not sent: %v", err)
	}
	if err := sameRegions(dst, src); err != nil {
		t.Fatal(err)
	}
	for i, b := range dst {
		if bytes.Contains(b, bytes.Repeat([]byte{0xEE}, 64)) {
			t.Fatalf("block %d holds a late message of handoff 1", i)
		}
	}
	acc2, err := parsePushAccept(accept)
	if err != nil {
		t.Fatal(err)
	}
	if acc2.salt == acc1.salt {
		t.Fatalf("a reused worker repeated the salt %#x", acc1.salt)
	}
	// Handoff 2 reused both sides; its destination worker, holding the
	// stray messages, is not kept for a third.
	if ss, rs := s.Stats(), r.Stats(); ss.Reuses != 1 || rs.Reuses != 1 || rs.Connects != 1 || rs.Strays != 1 || rs.Idle != 0 {
		t.Fatalf("handoff 2 should reuse both sides, then drop the destination's worker: source %+v, destination %+v", ss, rs)
	}
	src, dst = scatteredBlocks(n, 3), emptyBlocks(n)
	if _, err := handoffOnce(s, r, handoff.PlaneID{Session: 1, Handoff: 3}, src, dst); err != nil {
		t.Fatal(err)
	}
	if err := sameRegions(dst, src); err != nil {
		t.Fatal(err)
	}
	if rs := r.Stats(); rs.Workers != 2 || rs.Strays != 1 {
		t.Fatalf("handoff 3: destination %+v, want a fresh worker", rs)
	}
}

func TestReuseLateMessageOfAnAbortedHandoff(t *testing.T) {
	// Handoff 1 reuses a connection, then is aborted while its source
	// still holds blocks to send (the destination cancels: its receives
	// are withdrawn). Neither side pools what it used: handoff 2 runs on
	// fresh connections while handoff 1's source is still stopped, and
	// once handoff 1's source resumes, its late messages go to a worker
	// that no longer exists: handoff 2's blocks stay its own.
	const n = 8
	reached, release := make(chan struct{}), make(chan struct{})
	var stopID atomic.Uint64
	s, r := reusePlanes(t, Config{Window: 2, BeforeSend: stopAt(&stopID, 2, reached, release)}, Config{})
	src, dst := scatteredBlocks(n, 1), emptyBlocks(n)
	if _, err := handoffOnce(s, r, handoff.PlaneID{Session: 1, Handoff: 100}, src, dst); err != nil {
		t.Fatal(err)
	}
	stopID.Store(1)
	id1 := handoff.PlaneID{Session: 1, Handoff: 1}
	src1, dst1 := scatteredBlocks(n, 0xAA), emptyBlocks(n)
	_, st, dt, err := startOnce(s, r, id1, src1, dst1)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-reached:
	case <-time.After(20 * time.Second):
		t.Fatal("handoff 1 never reached its third block")
	}
	dt.Cancel()
	select {
	case <-dt.Done():
	case <-time.After(20 * time.Second):
		close(release)
		t.Fatal("the canceled destination did not resolve")
	}
	if err := dt.Err(); !errors.Is(err, kvlease.ErrCanceled) {
		close(release)
		t.Fatalf("the canceled handoff: %v, want kvlease.ErrCanceled", err)
	}
	rs := r.Stats()
	if rs.Idle != 0 {
		close(release)
		t.Fatalf("destination %+v: the aborted handoff's worker was pooled", rs)
	}
	// Handoff 2 while handoff 1's source is stopped with blocks to send.
	src2, dst2 := scatteredBlocks(n, 2), emptyBlocks(n)
	if _, err := handoffOnce(s, r, handoff.PlaneID{Session: 1, Handoff: 2}, src2, dst2); err != nil {
		close(release)
		t.Fatal(err)
	}
	close(release) // handoff 1's source sends its late blocks
	s.Finish(id1, dt.Err())
	<-st.Done()
	if err := st.Err(); !errors.Is(err, ErrRevoked) {
		t.Fatalf("source of the aborted handoff: %v, want ErrRevoked", err)
	}
	if err := sameRegions(dst2, src2); err != nil {
		t.Fatal(err)
	}
	for i, b := range dst1[2:] { // the blocks the source sent late
		if !bytes.Equal(b, make([]byte, len(b))) {
			t.Fatalf("block %d of the aborted handoff was written after its cancel", i+2)
		}
	}
	if ss, r2 := s.Stats(), r.Stats(); ss.Workers != 2 || r2.Workers != 2 || r2.Reuses != 1 || ss.Idle != 1 || r2.Idle != 1 {
		t.Fatalf("source %+v, destination %+v: handoff 2 on fresh connections, only it pooled", ss, r2)
	}
	// A third handoff reuses handoff 2's connections and delivers.
	src3, dst3 := scatteredBlocks(n, 3), emptyBlocks(n)
	if _, err := handoffOnce(s, r, handoff.PlaneID{Session: 1, Handoff: 3}, src3, dst3); err != nil {
		t.Fatal(err)
	}
	if err := sameRegions(dst3, src3); err != nil {
		t.Fatal(err)
	}
}

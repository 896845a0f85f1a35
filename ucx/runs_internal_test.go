package ucx

import (
	"bytes"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// Runs: blocks adjacent in memory move as one message (push) or one
// registration and one get (pull); scattered blocks one each.

const runBlock = 4096

// runArena is host memory of n blocks of runBlock bytes.
type runArena struct{ mem []byte }

func newRunArena(n int) *runArena { return &runArena{mem: make([]byte, n*runBlock)} }

func (a *runArena) regions(ids []int) [][]byte {
	out := make([][]byte, len(ids))
	for i, id := range ids {
		out[i] = a.mem[id*runBlock : (id+1)*runBlock : (id+1)*runBlock]
	}
	return out
}

// untouched reports a byte of a outside blocks ids that is not zero.
func (a *runArena) untouched(ids []int) error {
	in := map[int]bool{}
	for _, id := range ids {
		in[id] = true
	}
	for id := range len(a.mem) / runBlock {
		if !in[id] && bytes.IndexFunc(a.mem[id*runBlock:(id+1)*runBlock], func(r rune) bool { return r != 0 }) >= 0 {
			return fmt.Errorf("block %d of the destination, not in the handoff, was written", id)
		}
	}
	return nil
}

func seq(from, n, step int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = from + i*step
	}
	return out
}

// fillRuns writes distinct bytes into every region (block i, seed).
func fillRuns(rs [][]byte, seed byte) {
	for i, r := range rs {
		for j := range r {
			r[j] = seed + byte(i) + byte(j/7) + byte(i>>8)
		}
	}
}

func sameRegions(got, want [][]byte) error {
	for i := range want {
		if !bytes.Equal(got[i], want[i]) {
			return fmt.Errorf("block %d differs", i)
		}
	}
	return nil
}

// pushTampered moves src into dst in the push model, passing the Start
// bytes through tamper (nil: as they are). It returns Receive's error or
// the destination's outcome.
func pushTampered(t *testing.T, s *Sender[[]byte], r *Receiver[[]byte], id handoff.PlaneID, src, dst [][]byte, tamper func(*pushStart)) error {
	t.Helper()
	return pushVia(t, s, r, id, id, src, dst, tamper)
}

func TestPushRuns(t *testing.T) {
	// Pushed, a run of blocks adjacent in the source's memory is one
	// message (cut at the smaller MaxGet of the two sides), a scattered
	// block one message; the destination takes a run into one buffer, or
	// scatters it into its own scattered blocks. Every block arrives
	// intact, nothing else of the destination is written, and the sums
	// are still checked per block.
	const n = 256
	mixed := append(append(append(seq(0, 3, 1), 5), seq(7, 2, 1)...), seq(20, 10, 1)...)
	for _, tc := range []struct {
		name             string
		src, dst         []int
		srcMax, dstMax   int
		messages         int
		keyed            bool
		srcArena, dstArn int
	}{
		{"contiguous", seq(0, n, 1), seq(0, n, 1), 0, 0, 1, true, n, n},
		{"contiguous/crc32c", seq(0, n, 1), seq(0, n, 1), 0, 0, 1, false, n, n},
		{"scattered", seq(0, n, 2), seq(1, n, 2), 0, 0, n, true, 2 * n, 2 * n},
		{"contiguous into scattered", seq(0, n, 1), seq(1, n, 2), 0, 0, 1, true, n, 2 * n},
		{"scattered into contiguous", seq(0, n, 2), seq(0, n, 1), 0, 0, n, true, 2 * n, n},
		{"source cuts at 64KiB", seq(0, n, 1), seq(0, n, 1), 64 << 10, 0, n / 16, true, n, n},
		{"destination cuts at 64KiB", seq(0, n, 1), seq(0, n, 1), 0, 64 << 10, n / 16, true, n, n},
		{"destination takes one block", seq(0, n, 1), seq(0, n, 1), 0, runBlock, n, false, n, n},
		// Runs of 3, 1, 2 and 10 blocks, cut at 4: 1+1+1+3 messages.
		{"mixed", mixed, seq(40, len(mixed), 1), 4 * runBlock, 0, 6, true, 32, 64},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := NewSender(Config{MaxGet: tc.srcMax}, HostBytes)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			r, err := NewReceiver(Config{MaxGet: tc.dstMax}, HostBytes)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			if tc.keyed {
				s.keys, r.keys = keyed(bytes.Repeat([]byte{3}, 32)), keyed(bytes.Repeat([]byte{3}, 32))
			}
			sa, da := newRunArena(tc.srcArena), newRunArena(tc.dstArn)
			src, dst := sa.regions(tc.src), da.regions(tc.dst)
			fillRuns(src, 11)
			if err := pushTampered(t, s, r, handoff.PlaneID{Session: 1, Handoff: 1}, src, dst, nil); err != nil {
				t.Fatal(err)
			}
			if err := sameRegions(dst, src); err != nil {
				t.Fatal(err)
			}
			if err := da.untouched(tc.dst); err != nil {
				t.Fatal(err)
			}
			if st := s.Stats(); st.Messages != tc.messages || st.Registrations != 0 {
				t.Fatalf("source %+v, want %d messages, no registration", st, tc.messages)
			}
			if st := r.Stats(); st.Messages != tc.messages || st.Registrations != 0 || st.Completed != 1 || st.Bytes != int64(len(tc.src)*runBlock) {
				t.Fatalf("destination %+v, want %d messages", st, tc.messages)
			}
			if tc.keyed {
				if st := r.Stats(); st.Keyed != 1 {
					t.Fatalf("destination %+v: not keyed", st)
				}
			}
		})
	}
}

func TestPushRunsOfALease(t *testing.T) {
	// A lease's runs (Lease.AppendRuns) are the push model's messages: a
	// lease of two runs of a pool whose free space is split is two
	// messages, whatever the lease's length.
	mem, err := kvlease.NewHostMemory(10, runBlock)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := kvlease.NewPool[[]byte](mem)
	if err != nil {
		t.Fatal(err)
	}
	var hold []*kvlease.Lease[[]byte]
	for i, n := range []int{3, 2, 3, 2} {
		l, err := pool.Acquire(fmt.Sprint("fill", i), n)
		if err != nil {
			t.Fatal(err)
		}
		hold = append(hold, l)
	}
	hold[1].Release()
	hold[3].Release()
	l, err := pool.Acquire("r", 4)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	runs := l.AppendRuns(nil, 0)
	if len(runs) < 2 {
		t.Fatalf("test setup: the lease is %d run(s), want a split one: %v", len(runs), runs)
	}
	var src [][]byte
	for i := range l.Len() {
		rg, err := l.Region(i)
		if err != nil {
			t.Fatal(err)
		}
		src = append(src, rg)
	}
	fillRuns(src, 5)
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
	da := newRunArena(8)
	dst := da.regions(seq(2, 4, 1))
	if err := pushTampered(t, s, r, handoff.PlaneID{Session: 1, Handoff: 1}, src, dst, nil); err != nil {
		t.Fatal(err)
	}
	if err := sameRegions(dst, src); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.Messages != len(runs) {
		t.Fatalf("source %+v, want one message per run of %v", st, runs)
	}
}

func TestPushRunsRefused(t *testing.T) {
	// A source whose messages do not match the runs its Start bytes list
	// (a bug, or a hostile source) fails the handoff with ErrCorrupt on
	// the destination, which withdraws its other receives: it never
	// hangs, and a message never lands outside the blocks of its receive.
	// A source whose messages are longer than the destination takes is
	// refused before anything is attached.
	const n = 8
	for _, tc := range []struct {
		name     string
		src      []int
		tamper   func(*pushStart)
		attached bool
	}{
		{"a run sent as one message, listed as none", seq(0, n, 1), func(st *pushStart) { st.runs = nil }, true},
		{"single blocks, listed as a run", seq(0, n, 2), func(st *pushStart) {
			st.runs = []blockRun{{first: 2, count: 3}}
			st.per = 4
		}, true},
		{"messages longer than the destination takes", seq(0, n, 1), func(st *pushStart) { st.per = 1 << 20 / runBlock * 2 }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := NewSender(Config{}, HostBytes)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			r, err := NewReceiver(Config{Window: 2}, HostBytes)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			sa, da := newRunArena(2*n), newRunArena(2*n)
			src, dst := sa.regions(tc.src), da.regions(seq(0, n, 2))
			fillRuns(src, 7)
			err = pushTampered(t, s, r, handoff.PlaneID{Session: 1, Handoff: 1}, src, dst, tc.tamper)
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("outcome %v, want ErrCorrupt", err)
			}
			if err := da.untouched(seq(0, n, 2)); err != nil {
				t.Fatal(err)
			}
			if st := r.Stats(); (st.Started == 1) != tc.attached {
				t.Fatalf("destination %+v: attached %v, want %v", st, st.Started == 1, tc.attached)
			}
		})
	}
}

func TestPullRuns(t *testing.T) {
	// Pulled, each side registers one ucp_mem_map per run of its blocks
	// and the destination reads what is adjacent on both sides with one
	// get (up to MaxGet).
	const n = 256
	for _, tc := range []struct {
		name                  string
		src, dst              []int
		maxGet                int
		srcRegs, dstRegs, get int
	}{
		{"contiguous", seq(0, n, 1), seq(0, n, 1), 0, 1, 1, 1},
		{"scattered", seq(0, n, 2), seq(1, n, 2), 0, n, n, n},
		{"contiguous into scattered", seq(0, n, 1), seq(1, n, 2), 0, 1, n, n},
		{"contiguous, gets of 64KiB", seq(0, n, 1), seq(0, n, 1), 64 << 10, 1, 1, n / 16},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := NewSender(Config{Pull: true}, HostBytes)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			r, err := NewReceiver(Config{Pull: true, MaxGet: tc.maxGet}, HostBytes)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			sa, da := newRunArena(2*n), newRunArena(2*n)
			src, dst := sa.regions(tc.src), da.regions(tc.dst)
			fillRuns(src, 13)
			if err := pushOnce(t, s, r, handoff.PlaneID{Session: 1, Handoff: 1}, handoff.PlaneID{Session: 1, Handoff: 1}, src, dst); err != nil {
				t.Fatal(err)
			}
			if err := sameRegions(dst, src); err != nil {
				t.Fatal(err)
			}
			if err := da.untouched(tc.dst); err != nil {
				t.Fatal(err)
			}
			if st := s.Stats(); st.Registrations != tc.srcRegs || st.RegisteredBytes != n*runBlock {
				t.Fatalf("source %+v, want %d registrations", st, tc.srcRegs)
			}
			if st := r.Stats(); st.Registrations != tc.dstRegs || st.Gets != tc.get || st.Messages != 0 {
				t.Fatalf("destination %+v, want %d registrations, %d gets", st, tc.dstRegs, tc.get)
			}
		})
	}
}

func TestPushRunsBeyondTheStartBytes(t *testing.T) {
	// More runs than the Start bytes hold: the longest that fit are
	// listed, the blocks of the others move one message each, and every
	// block still arrives.
	const runs = 600 // of 2 blocks, a block apart: about 500 fit
	var ids []int
	for i := range runs {
		ids = append(ids, 3*i, 3*i+1)
	}
	ids = append(ids, seq(3*runs, 5, 1)...) // and one run of 5 (kept: the longest)
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
	sa, da := newRunArena(3*runs+5), newRunArena(len(ids))
	src, dst := sa.regions(ids), da.regions(seq(0, len(ids), 1))
	fillRuns(src, 3)
	var listed []blockRun
	if err := pushTampered(t, s, r, handoff.PlaneID{Session: 1, Handoff: 1}, src, dst, func(st *pushStart) {
		listed = st.runs
		if n := len(appendPushStart(nil, st)); n > handoff.MaxPlane {
			t.Errorf("start bytes of %d", n)
		}
	}); err != nil {
		t.Fatal(err)
	}
	if err := sameRegions(dst, src); err != nil {
		t.Fatal(err)
	}
	if len(listed) >= runs || len(listed) < runs/2 || listed[len(listed)-1] != (blockRun{first: 2 * runs, count: 5}) {
		t.Fatalf("%d runs listed (last %v), want fewer than %d, the run of 5 among them", len(listed), listed[len(listed)-1], runs+1)
	}
	want := len(listed) + 2*(runs+1-len(listed))
	if st := s.Stats(); st.Messages != want {
		t.Fatalf("source %+v, want %d messages", st, want)
	}
}

func TestPushRunCanceledBeforeItsMessage(t *testing.T) {
	// A cancel withdraws a run's receive that no message matched yet:
	// the destination resolves with kvlease.ErrCanceled and none of the run's
	// blocks is written, then or once the source sends it. The handoff is
	// a run of n blocks and one block apart; the destination's hook for
	// that block runs once the run's receive is posted.
	const n = 8
	release := make(chan struct{})
	s, err := NewSender(Config{BeforeSend: func(_ handoff.PlaneID, block int) {
		if block == 0 {
			select {
			case <-release:
			case <-time.After(20 * time.Second):
			}
		}
	}}, HostBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	posted := make(chan struct{})
	r, err := NewReceiver(Config{BeforeGet: func(_ handoff.PlaneID, block int) {
		if block == n {
			close(posted)
		}
	}}, HostBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	sa, da := newRunArena(n+2), newRunArena(n+1)
	src, dst := sa.regions(append(seq(0, n, 1), n+1)), da.regions(seq(0, n+1, 1))
	fillRuns(src, 9)
	id := handoff.PlaneID{Session: 1, Handoff: 1}
	_, st, dt, err := startOnce(s, r, id, src, dst)
	if err != nil {
		close(release)
		t.Fatal(err)
	}
	select {
	case <-posted:
	case <-time.After(20 * time.Second):
		close(release)
		t.Fatal("the destination never posted the run's receive")
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
		t.Fatalf("destination outcome %v, want kvlease.ErrCanceled", err)
	}
	close(release) // the source now sends the run
	s.Finish(id, dt.Err())
	<-st.Done()
	if err := da.untouched(nil); err != nil {
		t.Fatal(err)
	}
	if got := r.Stats(); got.Canceled != 1 || got.Messages < 1 {
		t.Fatalf("destination %+v, want the run's receive posted, then canceled", got)
	}
}

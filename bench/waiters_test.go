package bench_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
)

// waitFor polls cond until it holds, failing after 10 s (a lost wake-up
// shows up as this timeout, never as a hang).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Microsecond)
	}
}

// splitmix is a tiny deterministic generator for test schedules.
type splitmix uint64

func (s *splitmix) intn(n int) int {
	*s += 0x9e3779b97f4a7c15
	x := uint64(*s)
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return int((x ^ x>>31) % uint64(n))
}

// TestAcquireWaitFIFOUnderContention queues waiters of mixed sizes in a
// known order on a full pool, then frees the blocks from many goroutines
// at once while served waiters give theirs back at once too. Every waiter
// must be served (no lost wake-up), in arrival order: lease ids are handed
// out under the pool's lock in serve order, so they must increase with
// arrival. A plain Acquire must not overtake the queue.
func TestAcquireWaitFIFOUnderContention(t *testing.T) {
	for seed := range 4 {
		rng := splitmix(seed)
		const capacity, waiters = 32, 24
		p := newPool(t, capacity)
		held := make([]*kvlease.Lease[[]byte], capacity)
		for i := range held {
			held[i], _ = p.Acquire("holder", 1)
		}
		type served struct {
			id  uint64
			err error
		}
		results := make([]chan served, waiters)
		sizes := make([]int, waiters)
		for i := range waiters {
			sizes[i] = 1 + rng.intn(8)
			results[i] = make(chan served, 1)
			hold := time.Duration(rng.intn(3)) * 10 * time.Microsecond
			go func() {
				l, err := p.AcquireWait(context.Background(), "waiter", sizes[i])
				if err != nil {
					results[i] <- served{err: err}
					return
				}
				results[i] <- served{id: l.ID()}
				time.Sleep(hold)
				l.Release()
			}()
			waitFor(t, "waiter to queue", func() bool { return p.Stats().Waiters == i+1 })
		}
		if _, err := p.Acquire("overtaker", 1); !errors.Is(err, kvlease.ErrExhausted) {
			t.Fatalf("plain Acquire with waiters queued: %v", err)
		}

		// The head needs sizes[0] blocks: free one fewer and nobody, not
		// even a smaller waiter behind it, may be served.
		for _, l := range held[:sizes[0]-1] {
			l.Release()
		}
		if st := p.Stats(); st.Waiters != waiters || st.Free != sizes[0]-1 {
			t.Fatalf("seed %d: head needs %d, %d free: served someone: %+v", seed, sizes[0], sizes[0]-1, st)
		}
		var wg sync.WaitGroup
		rest := held[sizes[0]-1:]
		for g := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := g; i < len(rest); i += 4 {
					rest[i].Release()
				}
			}()
		}
		wg.Wait()

		last := uint64(0)
		for i := range waiters {
			select {
			case s := <-results[i]:
				if s.err != nil {
					t.Fatalf("seed %d: waiter %d: %v", seed, i, s.err)
				}
				if s.id <= last {
					t.Fatalf("seed %d: waiter %d (size %d) got lease %d after an earlier waiter's %d: not FIFO",
						seed, i, sizes[i], s.id, last)
				}
				last = s.id
			case <-time.After(10 * time.Second):
				t.Fatalf("seed %d: waiter %d (size %d) never served: lost wake-up? %+v", seed, i, sizes[i], p.Stats())
			}
		}
		waitFor(t, "every block back", func() bool { return p.Stats().Free == capacity })
		if err := p.Check(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestAcquireWaitNoLostWakeups churns a small pool from many goroutines:
// waits that succeed, waits whose context is cancelled while queued, and
// plain acquires that may be refused. Every goroutine must finish (a lost
// wake-up would leave one waiting forever: the test fails after 10 s
// instead), cancelled waiters hold nothing, and at the end the pool is
// whole and consistent.
func TestAcquireWaitNoLostWakeups(t *testing.T) {
	const capacity, goroutines, iters = 16, 12, 150
	p := newPool(t, capacity)
	var wg sync.WaitGroup
	errs := make(chan error, goroutines)
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := splitmix(g)
			for range iters {
				n := 1 + rng.intn(capacity/2)
				switch rng.intn(8) {
				case 0: // a waiter that gives up
					ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rng.intn(50))*time.Microsecond)
					l, err := p.AcquireWait(ctx, "impatient", n)
					cancel()
					if err == nil {
						l.Release()
					} else if !errors.Is(err, context.DeadlineExceeded) {
						errs <- err
						return
					}
				case 1: // a plain acquire: refused while anyone waits
					if l, err := p.Acquire("plain", n); err == nil {
						l.Release()
					} else if !errors.Is(err, kvlease.ErrExhausted) {
						errs <- err
						return
					}
				default:
					l, err := p.AcquireWait(context.Background(), "patient", n)
					if err != nil {
						errs <- err
						return
					}
					if l.Len() != n {
						errs <- errors.New("lease of the wrong size")
					}
					if rng.intn(2) == 0 {
						time.Sleep(time.Duration(rng.intn(20)) * time.Microsecond)
					}
					l.Release()
				}
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("churn did not finish: lost wake-up? %+v", p.Stats())
	}
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	st := p.Stats()
	if st.Free != capacity || st.Waiters != 0 || st.OpenLeases != 0 {
		t.Fatalf("after the churn: %+v", st)
	}
	if err := p.Check(); err != nil {
		t.Fatal(err)
	}
}

// TestLeaseCycleAllocs guards the allocation budget: no
// allocation for a lease cycle of up to 64 blocks (leases come from slabs,
// amortised to nothing; the pool's event lists stay on the stack), one for
// a larger lease's block table, one for a transfer, none for a prefix
// cycle that hits and seals. (An event list that escaped to the heap once
// cost two allocations per plain cycle.) Production builds only: checked
// builds (-race) may allocate more.
func TestLeaseCycleAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts differ under -race")
	}
	p := newPool(t, 1024)
	w := newPrefixWorkload(64, 8, 2)
	next := 0
	for range 2 * len(w.hashes) {
		w.cycle(t, p, next, false)
		next++
	}
	for _, c := range []struct {
		name string
		max  float64
		f    func()
	}{
		{"cycle/1", 0, func() { l, _ := p.Acquire("a", 1); l.Release() }},
		{"cycle/16", 0, func() { l, _ := p.Acquire("a", 16); l.Release() }},
		{"cycle/256", 1, func() { l, _ := p.Acquire("a", 256); l.Release() }},
		{"transfer/16", 1, func() {
			l, _ := p.Acquire("a", 16)
			tr := kvlease.NewTransfer(nil)
			_ = l.AttachRange(tr, 0, 16, kvlease.Write)
			l.Release()
			tr.Resolve(nil)
		}},
		{"prefix/hit-seal", 0, func() { w.cycle(t, p, next, false); next++ }},
	} {
		if got := testing.AllocsPerRun(200, c.f); got > c.max {
			t.Errorf("%s: %.1f allocations per cycle, want ≤ %.0f", c.name, got, c.max)
		}
	}
	if err := p.Check(); err != nil {
		t.Fatal(err)
	}
}

package kvlease

import (
	"sync"
	"testing"
	"time"
)

// bareList is the baseline every core benchmark compares against: a
// mutex-guarded stack of free ids, the least an allocator can do (pop n
// ids, push n ids), with none of kvlease's bookkeeping.
type bareList struct {
	mu   sync.Mutex
	free []int32
}

func newBareList(n int) *bareList {
	l := &bareList{free: make([]int32, n)}
	for i := range l.free {
		l.free[i] = int32(i)
	}
	return l
}

func (l *bareList) pop(dst []int32, n int) []int32 {
	l.mu.Lock()
	top := len(l.free) - n
	dst = append(dst[:0], l.free[top:]...)
	l.free = l.free[:top]
	l.mu.Unlock()
	return dst
}

func (l *bareList) push(ids []int32) {
	l.mu.Lock()
	l.free = append(l.free, ids...)
	l.mu.Unlock()
}

// bareCycle returns the baseline operation: pop n ids off a bare list of
// capacity ids and push them back.
func bareCycle(capacity, n int) func() {
	bl := newBareList(capacity)
	ids := make([]int32, 0, n)
	return func() {
		ids = bl.pop(ids, n)
		bl.push(ids)
	}
}

// compare runs base and op for b.N iterations each, interleaved (see
// interleave), and reports op's cost as a ratio to base ("x-bare") next to
// base's own ns/op. ns/op and -benchmem's counts are op's alone.
func compare(b *testing.B, base, op func()) {
	b.Helper()
	report(b, interleave(b, op, base)[0])
}

// interleave runs op and each base for b.N iterations, in up to sixteen
// rounds so that drift on a noisy machine hits them all alike: in each
// round the benchmark timer is stopped while a chunk of every base runs
// under its own stopwatch, then restarted for the same number of op
// iterations. It returns the time each base took in all.
func interleave(b *testing.B, op func(), bases ...func()) []time.Duration {
	b.Helper()
	spent := make([]time.Duration, len(bases))
	rounds := min(16, b.N)
	done := 0
	b.ResetTimer()
	for r := range rounds {
		n := (b.N*(r+1))/rounds - done
		done += n
		b.StopTimer()
		for i, base := range bases {
			start := time.Now()
			for range n {
				base()
			}
			spent[i] += time.Since(start)
		}
		b.StartTimer()
		for range n {
			op()
		}
	}
	b.StopTimer()
	return spent
}

func report(b *testing.B, bare time.Duration) {
	b.ReportMetric(float64(bare.Nanoseconds())/float64(b.N), "bare-ns/op")
	b.ReportMetric(float64(b.Elapsed())/float64(bare), "x-bare")
}

func benchPool(b *testing.B, blocks int) *Pool[[]byte] {
	mem, err := NewHostMemory(blocks, 64)
	if err != nil {
		b.Fatal(err)
	}
	p, err := NewPool[[]byte](mem, WithLeakCheck(false))
	if err != nil {
		b.Fatal(err)
	}
	return p
}

// BenchmarkLeaseCycle is Acquire(n)+Release against the bare list popping
// and pushing n ids. Targets (issue 2): ≤ 3× for 1 block, ≤ 2× for 16.
func BenchmarkLeaseCycle(b *testing.B) {
	for _, n := range []int{1, 16, 256} {
		b.Run(sizeName(n), func(b *testing.B) {
			p := benchPool(b, 1024)
			compare(b, bareCycle(1024, n), func() {
				l, err := p.Acquire("bench", n)
				if err != nil {
					b.Fatal(err)
				}
				l.Release()
			})
		})
	}
}

// BenchmarkLeaseCycleTransfer adds one transfer attached over the whole
// lease and resolved after Release: the full deferred-reclamation path.
// Target (issue 2): ≤ 3× bare(16), at most 2 allocations per cycle.
func BenchmarkLeaseCycleTransfer(b *testing.B) {
	const n = 16
	p := benchPool(b, 1024)
	compare(b, bareCycle(1024, n), func() {
		l, err := p.Acquire("bench", n)
		if err != nil {
			b.Fatal(err)
		}
		t := NewTransfer(nil)
		if err := l.AttachRange(t, 0, n, Read); err != nil {
			b.Fatal(err)
		}
		l.Release()
		t.Resolve(nil)
	})
}

// BenchmarkLeaseCycleParallel runs Acquire(1)+Release on all cores against
// the bare list under the same parallelism. Target (issue 2): ≤ 3×.
func BenchmarkLeaseCycleParallel(b *testing.B) {
	p := benchPool(b, 4096)
	bl := newBareList(4096)
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		ids := make([]int32, 0, 1)
		for pb.Next() {
			ids = bl.pop(ids, 1)
			bl.push(ids)
		}
	})
	bare := time.Since(start)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			l, err := p.Acquire("bench", 1)
			if err != nil {
				b.Fatal(err)
			}
			l.Release()
		}
	})
	b.StopTimer()
	report(b, bare)
}

func sizeName(n int) string {
	switch n {
	case 1:
		return "blocks=1"
	case 16:
		return "blocks=16"
	case 256:
		return "blocks=256"
	}
	return "blocks=n"
}

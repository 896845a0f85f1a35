package kvlease

import (
	"fmt"
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

// slotList is the per-block floor, bench/baseline.SlotList written again
// here (the root package cannot import bench): bareList plus one packed
// word per slot, the generation in the high half and an in-use bit, bumped
// on hand-out and checked in one compare on return. Rule 5 needs at least
// that; no defer, no allocation.
type slotList struct {
	mu    sync.Mutex
	free  []int32
	slots []uint64
}

func newSlotList(n int) *slotList {
	l := &slotList{free: make([]int32, n), slots: make([]uint64, n)}
	for i := range l.free {
		l.free[i] = int32(n - 1 - i)
	}
	return l
}

func (l *slotList) pop(dst []BlockRef, n int) []BlockRef {
	l.mu.Lock()
	top := len(l.free) - n
	dst = dst[:n]
	slots := l.slots
	for i, id := range l.free[top:] {
		gen := uint32(slots[id]>>32) + 1
		if gen == 0 {
			gen = 1
		}
		slots[id] = uint64(gen)<<32 | 1
		dst[i] = BlockRef{ID: BlockID(id), Gen: gen}
	}
	l.free = l.free[:top]
	l.mu.Unlock()
	return dst
}

func (l *slotList) push(refs []BlockRef) bool {
	l.mu.Lock()
	slots, free := l.slots, l.free
	ok := true
	for i := len(refs) - 1; i >= 0; i-- {
		r := refs[i]
		want := uint64(r.Gen)<<32 | 1
		if slots[r.ID] != want {
			ok = false
			break
		}
		slots[r.ID] = want &^ 1
		free = append(free, int32(r.ID))
	}
	l.free = free
	l.mu.Unlock()
	return ok
}

// slotCycle returns the floor's operation: pop n refs off a slot list of
// capacity slots and push them back.
func slotCycle(tb testing.TB, capacity, n int) func() {
	sl := newSlotList(capacity)
	refs := make([]BlockRef, 0, n)
	return func() {
		refs = sl.pop(refs, n)
		if !sl.push(refs) {
			tb.Fatal("slot list: stale ref")
		}
	}
}

// compare runs op against the bare list and the slot list for b.N
// iterations each, interleaved (see interleave), and reports op's cost as
// ratios to both ("x-bare", "x-slots") next to their own ns/op. ns/op and
// -benchmem's counts are op's alone.
func compare(b *testing.B, capacity, n int, op func()) {
	b.Helper()
	spent := interleave(b, op, bareCycle(capacity, n), slotCycle(b, capacity, n))
	report(b, spent[0])
	reportRatio(b, "slots", spent[1])
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

func report(b *testing.B, bare time.Duration) { reportRatio(b, "bare", bare) }

// reportRatio reports a baseline's own ns/op ("NAME-ns/op") and op's ratio
// to it ("x-NAME").
func reportRatio(b *testing.B, name string, base time.Duration) {
	b.ReportMetric(float64(base.Nanoseconds())/float64(b.N), name+"-ns/op")
	b.ReportMetric(float64(b.Elapsed())/float64(base), "x-"+name)
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

// BenchmarkLeaseCycle is Acquire(n)+Release against the bare list and the
// slot list (the per-block floor) doing the same. Targets:
// x-bare ≤ 3 at 1 block, x-slots ≤ 2 at 16 blocks and ≤ 1.5 at 256; at
// most one allocation per cycle.
func BenchmarkLeaseCycle(b *testing.B) {
	for _, n := range []int{1, 16, 256} {
		b.Run(fmt.Sprintf("blocks=%d", n), func(b *testing.B) {
			p := benchPool(b, 1024)
			compare(b, 1024, n, func() {
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
// Target: x-slots ≤ 3 against slots(16), one allocation (the
// transfer).
func BenchmarkLeaseCycleTransfer(b *testing.B) {
	const n = 16
	p := benchPool(b, 1024)
	compare(b, 1024, n, func() {
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

// BenchmarkLeaseCycleParallel runs Acquire(4)+Release from every P
// (GOMAXPROCS as set: all cores by default) against the bare list under
// the same parallelism, run before and after it and averaged. Target:
// x-bare ≤ 3.
func BenchmarkLeaseCycleParallel(b *testing.B) {
	const n = 4
	p := benchPool(b, 4096)
	bl := newBareList(4096)
	bare := func() time.Duration {
		start := time.Now()
		b.RunParallel(func(pb *testing.PB) {
			ids := make([]int32, 0, n)
			for pb.Next() {
				ids = bl.pop(ids, n)
				bl.push(ids)
			}
		})
		return time.Since(start)
	}
	b.ReportAllocs()
	b.ResetTimer()
	b.StopTimer()
	spent := bare()
	b.StartTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			l, err := p.Acquire("bench", n)
			if err != nil {
				panic(err)
			}
			l.Release()
		}
	})
	b.StopTimer()
	spent += bare()
	report(b, spent/2)
}

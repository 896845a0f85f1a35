package kvlease

import "testing"

// BenchmarkRetentionChurn is BenchmarkEvictionChurn's cycle (acquire 8
// blocks, all evicted from the cache, seal them, release them cached)
// with the cache split across classes: half of it in the top class, so
// every eviction looks past an upper class's list to the default class's
// head. Its instructions per cycle, next to EvictionChurn's in the
// binary before retention classes, are the "within 1.10× of today's
// LRU" row of issue 24 (bench/README.md).
func BenchmarkRetentionChurn(b *testing.B) {
	const n = 8
	mem, _ := NewHostMemory(256, 64)
	p, _ := NewPool[[]byte](mem, WithLeakCheck(false))
	for i := range 256 / n {
		l, _ := p.Acquire("warm", n)
		if i%2 == 0 {
			_ = l.SetRetention(RetentionMax)
		}
		for j := range n {
			_ = l.Seal(j, BlockHash(1<<40+i*n+j))
		}
		l.Release()
	}
	mem2, _ := NewHostMemory(256, 64)
	q, _ := NewPool[[]byte](mem2, WithLeakCheck(false))
	i := 0
	bare := interleave(b, func() {
		l, err := p.Acquire("churn", n)
		if err != nil {
			b.Fatal(err)
		}
		for j := range n {
			_ = l.Seal(j, BlockHash(i*n+j+1))
		}
		l.Release()
		i++
	}, func() {
		l, _ := q.Acquire("plain", n)
		l.Release()
	})[0]
	if p.Stats().Evictions == 0 || p.CachedByRetention()[RetentionMax] != 128 {
		b.Fatal("no evictions, or the top class was evicted")
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/block")
	b.ReportMetric(float64(b.Elapsed())/float64(bare), "x-unsealed-cycle")
}

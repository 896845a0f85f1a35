package groups_test

import (
	"testing"
	"time"

	"github.com/kvlease/kvlease/groups"
)

// BenchmarkAcquire2Groups measures admitting and releasing a request of a
// 2-group model (full attention, 16-token blocks; sliding window of 128
// tokens, 16-token blocks) whose 512-token prompt is cached in both, next
// to its baseline measured in the same run: two separate AcquirePrefix
// calls (and releases) on the same pools with the same hashes. The ratio
// is reported as x-2acquire (target ≤ 1.3).
func BenchmarkAcquire2Groups(b *testing.B) {
	for _, cached := range []bool{true, false} {
		name := "cached"
		if !cached {
			name = "cold"
		}
		b.Run(name, func(b *testing.B) {
			full, sw := newPool(b, 4096), newPool(b, 4096)
			c, err := groups.New(
				groups.Group[[]byte]{Spec: groups.Spec{Name: "full", BlockTokens: 16}, Pool: full},
				groups.Group[[]byte]{Spec: groups.Spec{Name: "swa", BlockTokens: 16, Window: 128}, Pool: sw},
			)
			if err != nil {
				b.Fatal(err)
			}
			hs := c.Hashes(1, prompt(512))
			if cached {
				all := []int{}
				for k := range hs[0] {
					all = append(all, k)
				}
				cache(b, full, hs[0], all...)
				cache(b, sw, hs[1], all...)
			}
			const tokens = 520
			// The window group's share of the baseline: the blocks of the
			// window before the hit, as Acquire takes them.
			ws := (512 - 128) / 16
			if !cached {
				ws = 0
			}
			swHashes := hs[1][ws:]
			if !cached {
				swHashes = nil
			}
			base := func() {
				l1, _, err1 := full.AcquirePrefix("base", hs[0], 33)
				l2, _, err2 := sw.AcquirePrefix("base", swHashes, 33-ws)
				if err1 != nil || err2 != nil {
					b.Fatal(err1, err2)
				}
				l1.Release()
				l2.Release()
			}
			op := func() {
				r, _, err := c.Acquire("req", hs, tokens)
				if err != nil {
					b.Fatal(err)
				}
				r.Release()
			}
			// Interleave the baseline and the measured operation in
			// chunks of 32 so that a noisy neighbour slows both alike.
			var baseTime time.Duration
			const chunk = 32
			b.ResetTimer()
			for done := 0; done < b.N; {
				n := min(chunk, b.N-done)
				done += n
				b.StopTimer()
				start := time.Now()
				for range n {
					base()
				}
				baseTime += time.Since(start)
				b.StartTimer()
				for range n {
					op()
				}
			}
			b.StopTimer()
			baseNs := float64(baseTime.Nanoseconds()) / float64(b.N)
			b.ReportMetric(baseNs, "base-ns/op")
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/baseNs, "x-2acquire")
		})
	}
}

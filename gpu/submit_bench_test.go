package gpu

import (
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
)

// BenchmarkStateUnderSubmit measures how long e.Pending() (which takes the
// engine's state lock, as resolution does) waits while another goroutine
// keeps submitting 16384-copy transfers on the same engine: the time the
// state lock is held across an enqueue. Reported: p50 and p99 of Pending.
func BenchmarkStateUnderSubmit(b *testing.B) {
	for _, k := range deviceKinds {
		if k.name == "cuda" {
			continue
		}
		b.Run(k.name, func(b *testing.B) {
			d := k.open(b)
			const n = 16384
			r := newRig(b, d, n, 256)
			rng := rand.New(rand.NewPCG(2, 2))
			perm := rng.Perm(n)
			pairs := make([]cp[DevicePtr, []byte], n)
			for i := range pairs {
				pairs[i] = pair(r.dev.Region(kvlease.BlockID(perm[i])), r.pin.Region(kvlease.BlockID(i)))
			}
			stop := make(chan struct{})
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					select {
					case <-stop:
						return
					default:
					}
					tr, err := r.e.DeviceToHost().Start(pairs, noAttach)
					if err != nil {
						panic(err)
					}
					<-tr.Done()
				}
			}()
			lat := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for range b.N {
				t0 := time.Now()
				_ = r.e.Pending()
				lat = append(lat, time.Since(t0))
				time.Sleep(20 * time.Microsecond)
			}
			b.StopTimer()
			close(stop)
			wg.Wait()
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
			b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns")
		})
	}
}

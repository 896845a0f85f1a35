package gpu

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
)

// BenchmarkStart measures the engine's own cost per transfer: Start (validation,
// attach, enqueue) and resolution of a scattered device-to-host copy of
// small blocks, so the copy itself is cheap. allocs/op is the number to
// watch; on the fake driver it includes the cgo submission.
func BenchmarkStart(b *testing.B) {
	for _, k := range deviceKinds {
		if k.name == "cuda" {
			continue
		}
		b.Run(k.name, func(b *testing.B) {
			d := k.open(b)
			for _, n := range []int{8, 1024} {
				b.Run(fmt.Sprint(n), func(b *testing.B) {
					r := newRig(b, d, n, 256)
					rng := rand.New(rand.NewPCG(1, 1))
					perm := rng.Perm(n)
					pairs := make([]cp[DevicePtr, []byte], n)
					for i := range pairs {
						pairs[i] = pair(r.dev.Region(kvlease.BlockID(perm[i])), r.pin.Region(kvlease.BlockID(i)))
					}
					b.ReportAllocs()
					b.ResetTimer()
					for range b.N {
						tr, err := r.e.DeviceToHost().Start(pairs, noAttach)
						if err != nil {
							b.Fatal(err)
						}
						<-tr.Done()
					}
				})
			}
		})
	}
}

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

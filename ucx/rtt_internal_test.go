package ucx

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/kvlease/kvlease/handoff"
)

// tagRoundTrip sets up two workers of one push context, connected both
// ways (each endpoint flushed: the handshakes are done), the second
// echoing every 64-byte message tagged 1 back with tag 2 from its own
// thread. The returned function sends one message from the first
// worker's thread and progresses it until the echo lands: the small
// message round trip of the transport, with the echo side woken by its
// event fd as the planes' workers are.
func tagRoundTrip() (func() (time.Duration, error), func(), error) {
	ctx, err := newContext(false)
	if err != nil {
		return nil, nil, err
	}
	a, err := ctx.newWorker()
	if err != nil {
		ctx.close()
		return nil, nil, err
	}
	b, err := ctx.newWorker()
	if err != nil {
		a.destroy(nil)
		ctx.close()
		return nil, nil, err
	}
	var ab, ba *endpoint
	abuf, bbuf := newCbuf(64), newCbuf(64)
	arv, brv := newRecvs(1), newRecvs(1)
	sent, echoed := newBatch(), newBatch()
	release := func() {
		a.destroy(func() {
			if ab != nil {
				_ = a.closeEP(ab, true)
			}
			a.settle()
		})
		b.destroy(func() {
			if ba != nil {
				_ = b.closeEP(ba, true)
			}
			b.settle()
		})
		ctx.close()
		abuf.free()
		bbuf.free()
		arv.free()
		brv.free()
		sent.free()
		echoed.free()
	}
	var aAddr, bAddr []byte
	_ = a.call(func() { aAddr, err = a.address() })
	if err == nil {
		_ = b.call(func() { bAddr, err = b.address() })
	}
	if err == nil {
		_ = a.call(func() {
			if ab, err = a.connect(bAddr); err == nil {
				err = a.flushWait(ab, 1_000_000)
			}
		})
	}
	if err == nil {
		_ = b.call(func() {
			if ba, err = b.connect(aAddr); err == nil {
				err = b.flushWait(ba, 1_000_000)
			}
		})
	}
	var echoErr error
	if err == nil {
		_ = b.call(func() {
			if err = b.recv(brv, 0, bbuf.addr(), bbuf.n, false, 1); err != nil {
				return
			}
			b.pollers = append(b.pollers, func() bool {
				if done, _, rerr := brv.result(0); !done {
					return false
				} else if rerr != nil {
					echoErr = rerr
					return true
				}
				x := brv.at(0)
				x.done, x.req, x.status, x.length = 0, nil, 0, 0
				if _, serr := ba.send(bbuf.addr(), bbuf.n, false, 2, echoed); serr != nil {
					echoErr = serr
					return true
				}
				if rerr := b.recv(brv, 0, bbuf.addr(), bbuf.n, false, 1); rerr != nil {
					echoErr = rerr
					return true
				}
				return false
			})
		})
	}
	if err != nil {
		release()
		return nil, nil, err
	}
	rtt := func() (time.Duration, error) {
		var took time.Duration
		var rerr error
		if cerr := a.call(func() {
			x := arv.at(0)
			x.done, x.req, x.status, x.length = 0, nil, 0, 0
			start := time.Now()
			if rerr = a.recv(arv, 0, abuf.addr(), abuf.n, false, 2); rerr != nil {
				return
			}
			if _, rerr = ab.send(abuf.addr(), abuf.n, false, 1, sent); rerr != nil {
				return
			}
			for i := 0; i < 10_000_000; i++ {
				a.progressOnce()
				if done, _, e := arv.result(0); done {
					rerr = e
					took = time.Since(start)
					return
				}
			}
			rerr = errors.New("ucx: no echo")
		}); cerr != nil {
			return 0, cerr
		}
		if rerr == nil {
			rerr = echoErr
		}
		return took, rerr
	}
	return rtt, release, nil
}

// BenchmarkPlane16Latency is a 16-block handoff (4 KiB blocks, one run,
// keyed sums) through the planes alone, over UCX_TLS=tcp on loopback:
// from Prepare to the destination's evidence (delivered-µs) and on to
// the source's (sourced-µs: its Finish after the done), p50 and p99,
// with reused connections (the default) and with a worker and a connect
// per handoff (MaxIdle -1), alternating in the same run, next to the
// round trip of a 64-byte tagged message between two workers of the
// same transport (ucx-rtt), measured in the same run.
// reuse/ucx-rtt-p50 is the reused handoff's delivered p50 over the
// round trip's (the goal for a handoff is 3 or less).
func BenchmarkPlane16Latency(b *testing.B) {
	const n = 16
	secret := []byte("plane latency bench secret 32 by")
	type side struct {
		s   *Sender[[]byte]
		r   *Receiver[[]byte]
		del []time.Duration
		all []time.Duration
	}
	sides := []*side{{}, {}}
	for i, cfg := range []Config{{}, {MaxIdle: -1}} {
		s, err := NewSender(cfg, HostBytes)
		if err != nil {
			b.Fatal(err)
		}
		defer s.Close()
		r, err := NewReceiver(cfg, HostBytes)
		if err != nil {
			b.Fatal(err)
		}
		defer r.Close()
		s.keys, r.keys = keyed(secret), keyed(secret)
		sides[i].s, sides[i].r = s, r
	}
	rtt, release, err := tagRoundTrip()
	if err != nil {
		b.Fatal(err)
	}
	defer release()
	src, dst := newRunArena(n).regions(seq(0, n, 1)), newRunArena(n).regions(seq(0, n, 1))
	fillRuns(src, 5)
	next := uint64(0)
	once := func(sd *side) (time.Duration, time.Duration) {
		next++
		id := handoff.PlaneID{Session: 1, Handoff: next}
		t0 := time.Now()
		_, st, dt, err := startOnce(sd.s, sd.r, id, src, dst)
		if err != nil {
			b.Fatal(err)
		}
		<-dt.Done()
		t1 := time.Now()
		sd.s.Finish(id, dt.Err())
		<-st.Done()
		t2 := time.Now()
		if dt.Err() != nil || st.Err() != nil {
			b.Fatalf("handoff %d: destination %v, source %v", next, dt.Err(), st.Err())
		}
		return t1.Sub(t0), t2.Sub(t0)
	}
	for _, sd := range sides { // warm: the reusing side connects here
		once(sd)
	}
	var rtts []time.Duration
	b.ResetTimer()
	for k := range b.N {
		for j := range sides {
			sd := sides[(k+j)%len(sides)]
			d, a := once(sd)
			sd.del, sd.all = append(sd.del, d), append(sd.all, a)
		}
		d, err := rtt()
		if err != nil {
			b.Fatal(err)
		}
		rtts = append(rtts, d)
	}
	b.StopTimer()
	if err := sameRegions(dst, src); err != nil {
		b.Fatal(err)
	}
	pct := func(d []time.Duration) (float64, float64) {
		d = slices.Clone(d)
		slices.Sort(d)
		return float64(d[len(d)/2].Nanoseconds()) / 1e3, float64(d[min(len(d)-1, len(d)*99/100)].Nanoseconds()) / 1e3
	}
	u50, _ := pct(rtts)
	for i, name := range []string{"reuse", "fresh"} {
		d50, d99 := pct(sides[i].del)
		a50, a99 := pct(sides[i].all)
		b.ReportMetric(d50, name+"-delivered-p50-µs")
		b.ReportMetric(d99, name+"-delivered-p99-µs")
		b.ReportMetric(a50, name+"-sourced-p50-µs")
		b.ReportMetric(a99, name+"-sourced-p99-µs")
		if i == 0 {
			b.ReportMetric(d50/u50, "reuse/ucx-rtt-p50")
		}
	}
	b.ReportMetric(u50, "ucx-rtt-p50-µs")
	if st := sides[0].s.Stats(); st.Connects != 1 {
		b.Fatalf("reusing planes: %+v, want one connect", st)
	}
}

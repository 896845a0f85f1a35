package ucx

import (
	"errors"
	"os"
	"slices"
	"testing"
	"time"
	"unsafe"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// BenchmarkRegister256 is a handoff's registration cost: ucp_mem_map,
// ucp_rkey_pack and ucp_mem_unmap of 256 blocks of 64 KiB, as 256
// separate runs (the worst case: no two blocks adjacent) and as one run
// (a contiguous lease). Its baseline, in the same run, is one get of the
// same 16 MiB over UCX_TLS=tcp on loopback (reported as get-ns).
func BenchmarkRegister256(b *testing.B) {
	os.Setenv("UCX_TLS", "tcp")
	os.Setenv("UCX_NET_DEVICES", "lo")
	const n, size = 256, 64 << 10
	c, err := newContext(true)
	if err != nil {
		b.Fatal(err)
	}
	defer c.close()
	buf := make([]byte, n*size)
	base := uintptr(unsafe.Pointer(&buf[0]))
	getNs := oneGet(b, c, buf)
	for _, runs := range []int{n, 1} {
		b.Run(map[int]string{n: "runs=256", 1: "runs=1"}[runs], func(b *testing.B) {
			per := n * size / runs
			for range b.N {
				ms := make([]*memh, 0, runs)
				for i := range runs {
					m, err := c.memMap(base+uintptr(i*per), per, false)
					if err != nil {
						b.Fatal(err)
					}
					if _, err := c.rkeyPack(m); err != nil {
						b.Fatal(err)
					}
					ms = append(ms, m)
				}
				for _, m := range ms {
					if err := c.unmap(m); err != nil {
						b.Fatal(err)
					}
				}
			}
			b.ReportMetric(float64(getNs), "get-ns")
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(getNs), "ratio")
		})
	}
}

// oneGet times one get of all of src (one registration, one rkey) from a
// second worker, after the handshake: the baseline of BenchmarkRegister256.
func oneGet(b *testing.B, c *context, src []byte) int64 {
	b.Helper()
	sw, err := c.newWorker()
	if err != nil {
		b.Fatal(err)
	}
	defer sw.destroy(nil)
	dw, err := c.newWorker()
	if err != nil {
		b.Fatal(err)
	}
	defer dw.destroy(nil)
	m, err := c.memMap(uintptr(unsafe.Pointer(&src[0])), len(src), false)
	if err != nil {
		b.Fatal(err)
	}
	defer c.unmap(m)
	key, _ := c.rkeyPack(m)
	var addr []byte
	_ = sw.call(func() { addr, err = sw.address() })
	dst := make([]byte, len(src))
	dm, err := c.memMap(uintptr(unsafe.Pointer(&dst[0])), len(dst), false)
	if err != nil {
		b.Fatal(err)
	}
	defer c.unmap(dm)
	// The source worker must progress to serve the emulated get.
	stop := make(chan struct{})
	sw.do(func() {
		sw.pollers = append(sw.pollers, func() bool {
			select {
			case <-stop:
				return true
			default:
				return false
			}
		})
	})
	defer close(stop)
	var took time.Duration
	_ = dw.call(func() {
		ep, err := dw.connect(addr)
		if err != nil {
			b.Fatal(err)
		}
		if err := dw.flushWait(ep, 1<<30); err != nil {
			b.Fatal(err)
		}
		k, err := ep.unpack(key)
		if err != nil {
			b.Fatal(err)
		}
		bt := newBatch()
		defer bt.free()
		start := time.Now()
		done, err := ep.get(uintptr(unsafe.Pointer(&dst[0])), len(dst), dm, uint64(uintptr(unsafe.Pointer(&src[0]))), k, bt)
		if err != nil {
			b.Fatal(err)
		}
		for !done && bt.completed() == 0 {
			dw.progressOnce()
		}
		took = time.Since(start)
		k.destroy()
		_ = dw.closeEP(ep, true)
	})
	return took.Nanoseconds()
}

// BenchmarkPush256x64K is one handoff of 256 blocks of 64 KiB over
// UCX_TLS=tcp on loopback in the push model (the default): a worker per
// handoff on each side, the handshake, the tagged messages (the blocks
// are one run: 16 messages of 1 MiB, the default MaxGet) and the sums
// table, the destination's check of every block. Three modes in
// one run, in interleaved rounds (medians reported): insecure (crc32c
// sums), authenticated (GMAC sums under the session's key), and the pull
// model's gets of the same blocks (no sums) for reference. auth/insecure
// is the cost of authentication; insecure/pull the push model's.
func BenchmarkPush256x64K(b *testing.B) {
	os.Setenv("UCX_TLS", "tcp")
	os.Setenv("UCX_NET_DEVICES", "lo")
	const n, size, rounds = 256, 64 << 10, 5
	src, dst := make([]byte, n*size), make([]byte, n*size)
	for i := range src {
		src[i] = byte(i)
	}
	type mode struct {
		name string
		cfg  Config
		keys sessionKeys
		s    *Sender[[]byte]
		r    *Receiver[[]byte]
		mbs  []float64
	}
	modes := []*mode{
		{name: "insecure"},
		{name: "auth", keys: keyed(make([]byte, 32))},
		{name: "pull", cfg: Config{Pull: true}},
	}
	for _, m := range modes {
		var err error
		if m.s, err = NewSender(m.cfg, HostBytes); err != nil {
			b.Fatal(err)
		}
		defer m.s.Close()
		if m.r, err = NewReceiver(m.cfg, HostBytes); err != nil {
			b.Fatal(err)
		}
		defer m.r.Close()
		m.s.keys, m.r.keys = m.keys, m.keys
	}
	next := uint64(0) // ns/op covers one handoff of each mode
	done := 0
	b.ResetTimer()
	for round := range rounds {
		per := (b.N - done) / (rounds - round)
		if per == 0 {
			continue
		}
		for _, m := range modes {
			start := time.Now()
			for range per {
				next++
				id := handoff.PlaneID{Session: 1, Handoff: next}
				if err := pushOnce(b, m.s, m.r, id, id, blocksIn(src, n, size), blocksIn(dst, n, size)); err != nil {
					b.Fatal(err)
				}
			}
			m.mbs = append(m.mbs, float64(per)*n*size/time.Since(start).Seconds()/1e6)
		}
		done += per
	}
	b.StopTimer()
	med := map[string]float64{}
	for _, m := range modes {
		v := slices.Clone(m.mbs)
		slices.Sort(v)
		med[m.name] = v[len(v)/2]
		b.ReportMetric(med[m.name], m.name+"-MB/s")
	}
	b.ReportMetric(med["auth"]/med["insecure"], "auth/insecure")
	b.ReportMetric(med["insecure"]/med["pull"], "insecure/pull")
	if st := modes[1].r.Stats(); st.Keyed != st.Started {
		b.Fatalf("authenticated rows not keyed: %+v", st)
	}
}

// BenchmarkRuns256x4K is one handoff of 256 blocks of 4 KiB over
// UCX_TLS=tcp on loopback, in three layouts of the same bytes: scattered
// (every other block of an arena, on both sides: no two blocks
// adjacent), contiguous (one run of blocks on both sides, as a lease of
// consecutive ids) and one buffer (a single 1 MiB block), alternating
// in the same run; one sub-benchmark per model: push with crc32c sums
// (insecure), push with GMAC sums (authenticated), the same with a
// worker and a connect per handoff on each side (push-gmac-fresh:
// MaxIdle -1, what every handoff cost before connections were reused),
// pull (a worker per handoff: its revocation is the worker's
// destruction). Push reuses its connections: the first handoff of each
// layout, untimed, connects. Each layout
// has its own planes, so its descriptors are its own: regs/handoff
// counts ucp_mem_map calls of both sides, ops/handoff the messages
// (push) or gets (pull) of a handoff. contiguous-%-of-one-buffer is the
// contiguous layout's bandwidth as a percentage of the one-buffer
// layout's (goal: 80 % or more). SetBytes covers one handoff of each
// layout per op.
func BenchmarkRuns256x4K(b *testing.B) {
	os.Setenv("UCX_TLS", "tcp")
	os.Setenv("UCX_NET_DEVICES", "lo")
	const n, bb = 256, 4 << 10
	srcArena, dstArena := make([]byte, 2*n*bb), make([]byte, 2*n*bb)
	for i := range srcArena {
		srcArena[i] = byte(i*7 + i/bb)
	}
	layouts := []struct {
		name     string
		src, dst [][]byte
	}{
		{"scattered", everyOther(blocksIn(srcArena, 2*n, bb), 0), everyOther(blocksIn(dstArena, 2*n, bb), 1)},
		{"contiguous", blocksIn(srcArena, n, bb), blocksIn(dstArena[n*bb:], n, bb)},
		{"one-buffer", [][]byte{srcArena[: n*bb : n*bb]}, [][]byte{dstArena[: n*bb : n*bb]}},
	}
	for _, model := range []struct {
		name string
		cfg  Config
		keys sessionKeys
	}{
		{"push-crc32c", Config{}, nil},
		{"push-gmac", Config{}, keyed(make([]byte, 32))},
		{"push-gmac-fresh", Config{MaxIdle: -1}, keyed(make([]byte, 32))},
		{"pull", Config{Pull: true}, nil},
	} {
		b.Run(model.name, func(b *testing.B) {
			type planes struct {
				s *Sender[[]byte]
				r *Receiver[[]byte]
			}
			ps := make([]planes, len(layouts))
			for i := range ps {
				s, err := NewSender(model.cfg, HostBytes)
				if err != nil {
					b.Fatal(err)
				}
				defer s.Close()
				r, err := NewReceiver(model.cfg, HostBytes)
				if err != nil {
					b.Fatal(err)
				}
				defer r.Close()
				s.keys, r.keys = model.keys, model.keys
				ps[i] = planes{s, r}
			}
			next := uint64(0)
			move := func(i int) time.Duration {
				next++
				id := handoff.PlaneID{Session: 1, Handoff: next}
				start := time.Now()
				if err := moveOnce(ps[i].s, ps[i].r, id, layouts[i].src, layouts[i].dst); err != nil {
					b.Fatalf("%s: %v", layouts[i].name, err)
				}
				return time.Since(start)
			}
			for i, l := range layouts { // warm, and check the bytes once
				clear(dstArena)
				move(i)
				for k := range l.src {
					if string(l.dst[k]) != string(l.src[k]) {
						b.Fatalf("%s: block %d differs", l.name, k)
					}
				}
			}
			took := make([]time.Duration, len(layouts))
			b.SetBytes(int64(len(layouts) * n * bb))
			b.ResetTimer()
			for k := range b.N {
				for j := range layouts {
					i := (k + j) % len(layouts)
					took[i] += move(i)
				}
			}
			b.StopTimer()
			for i, l := range layouts {
				ss, rs := ps[i].s.Stats(), ps[i].r.Stats()
				h := float64(rs.Started)
				ops := ss.Messages
				if model.cfg.Pull {
					ops = rs.Gets
				}
				b.ReportMetric(float64(b.N)*n*bb/took[i].Seconds()/1e6, l.name+"-MB/s")
				b.ReportMetric(float64(ss.Registrations+rs.Registrations)/h, l.name+"-regs/handoff")
				b.ReportMetric(float64(ops)/h, l.name+"-ops/handoff")
				if i < 2 {
					b.ReportMetric(100*took[2].Seconds()/took[i].Seconds(), l.name+"-%-of-one-buffer")
				}
			}
		})
	}
}

// everyOther returns rs[from], rs[from+2], ...
func everyOther(rs [][]byte, from int) [][]byte {
	var out [][]byte
	for i := from; i < len(rs); i += 2 {
		out = append(out, rs[i])
	}
	return out
}

// startOnce starts handoff id through the planes alone: Prepare, Send
// and Receive, and returns the Accept bytes and both transfers,
// attached. On an error it undoes what it started (Forget, or Finish
// with the error and the source's outcome awaited).
func startOnce(s *Sender[[]byte], r *Receiver[[]byte], id handoff.PlaneID, src, dst [][]byte) (accept []byte, st, dt *kvlease.Transfer, err error) {
	if accept, err = r.Prepare(id, len(dst)); err != nil {
		return nil, nil, nil, err
	}
	start, err := s.Send(id, src, accept, func(t *kvlease.Transfer) error { st = t; return nil })
	if err != nil {
		r.Forget(id)
		return accept, nil, nil, err
	}
	if err := r.Receive(id, dst, start, func(t *kvlease.Transfer) error { dt = t; return nil }); err != nil {
		s.Finish(id, err)
		<-st.Done()
		return accept, nil, nil, err
	}
	return accept, st, dt, nil
}

// endOnce waits for a started handoff's destination, finishes the
// source with its outcome and waits for the source: it returns the
// destination's outcome, then the source's.
func endOnce(s *Sender[[]byte], id handoff.PlaneID, st, dt *kvlease.Transfer) (dst, src error) {
	<-dt.Done()
	s.Finish(id, dt.Err())
	<-st.Done()
	return dt.Err(), st.Err()
}

// moveOnce is one handoff through the planes alone: startOnce, the
// destination's evidence, Finish, the source's (a source revoked after
// the destination's done is no error).
func moveOnce(s *Sender[[]byte], r *Receiver[[]byte], id handoff.PlaneID, src, dst [][]byte) error {
	_, st, dt, err := startOnce(s, r, id, src, dst)
	if err != nil {
		return err
	}
	derr, serr := endOnce(s, id, st, dt)
	if derr != nil {
		return derr
	}
	if serr != nil && !errors.Is(serr, ErrRevoked) {
		return serr
	}
	return nil
}

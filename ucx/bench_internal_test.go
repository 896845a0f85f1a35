package ucx

import (
	"os"
	"testing"
	"time"
	"unsafe"

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
// handoff on each side, the handshake, one tagged message per block and
// the sums table, the destination's check of every block. Three rows in
// one run: insecure (crc32c sums), authenticated (GMAC sums under
// the session's key), and, as the baseline, the pull model's gets of the
// same blocks (no sums). ratio is each row's bandwidth over the
// baseline's, measured in the same run.
func BenchmarkPush256x64K(b *testing.B) {
	os.Setenv("UCX_TLS", "tcp")
	os.Setenv("UCX_NET_DEVICES", "lo")
	const n, size = 256, 64 << 10
	src, dst := make([]byte, n*size), make([]byte, n*size)
	for i := range src {
		src[i] = byte(i)
	}
	key := make([]byte, 32)
	run := func(b *testing.B, cfg Config, keys sessionKeys) float64 {
		s, err := NewSender(cfg)
		if err != nil {
			b.Fatal(err)
		}
		defer s.Close()
		r, err := NewReceiver(cfg)
		if err != nil {
			b.Fatal(err)
		}
		defer r.Close()
		s.keys, r.keys = keys, keys
		b.SetBytes(n * size)
		start := time.Now()
		for i := range b.N {
			id := handoff.PlaneID{Session: 1, Handoff: uint64(i)}
			if err := pushOnce(b, s, r, id, id, blocksIn(src, n, size), blocksIn(dst, n, size)); err != nil {
				b.Fatal(err)
			}
		}
		return float64(b.N) * n * size / time.Since(start).Seconds() / 1e6
	}
	var base float64
	b.Run("pull", func(b *testing.B) {
		base = run(b, Config{Pull: true}, nil)
		b.ReportMetric(base, "MB/s-measured")
	})
	for _, c := range []struct {
		name string
		keys sessionKeys
	}{{"insecure-crc32c", nil}, {"authenticated-gmac", keyed(key)}} {
		b.Run(c.name, func(b *testing.B) {
			mb := run(b, Config{}, c.keys)
			b.ReportMetric(mb, "MB/s-measured")
			if base > 0 {
				b.ReportMetric(mb/base, "ratio-to-pull")
			}
		})
	}
}

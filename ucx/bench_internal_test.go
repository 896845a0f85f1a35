package ucx

import (
	"os"
	"testing"
	"time"
	"unsafe"
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

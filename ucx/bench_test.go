package ucx_test

import (
	"bufio"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/ucx"
)

const (
	benchBlocks     = 256
	benchBlockBytes = 64 << 10
)

// perftestGetMBs runs ucx_perftest's get bandwidth test (server and
// client on loopback, UCX_TLS=tcp, messages of size bytes, window
// outstanding) and returns its final average bandwidth in MB/s.
func perftestGetMBs(b *testing.B, size, window, iters int) float64 {
	b.Helper()
	path, err := exec.LookPath("ucx_perftest")
	if err != nil {
		b.Fatalf("ucx_perftest (package ucx-utils) is the baseline: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	_ = ln.Close()
	env := append(os.Environ(), "UCX_TLS=tcp", "UCX_NET_DEVICES=lo")
	server := exec.Command(path, "-p", port)
	server.Env = env
	if err := server.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() { _ = server.Process.Kill(); _ = server.Wait() }()
	var out []byte
	for range 50 { // the server needs a moment to listen
		// -z: pre-registered memory, as the plane's gets use.
		client := exec.Command(path, "127.0.0.1", "-p", port, "-t", "ucp_get", "-z",
			"-s", strconv.Itoa(size), "-O", strconv.Itoa(window), "-n", strconv.Itoa(iters), "-w", "100")
		client.Env = env
		if out, err = client.CombinedOutput(); err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		b.Fatalf("ucx_perftest: %v\n%s", err, out)
	}
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		// Final: iterations, latency 50%, average, overall, bandwidth average, overall, ...
		if f := strings.Fields(sc.Text()); len(f) >= 7 && f[0] == "Final:" {
			if v, err := strconv.ParseFloat(f[5], 64); err == nil {
				return v
			}
		}
	}
	b.Fatalf("no Final line from ucx_perftest:\n%s", out)
	return 0
}

func benchRegions(n, size int) [][]byte {
	buf := make([]byte, n*size)
	out := make([][]byte, n)
	for i := range out {
		out[i] = buf[i*size : (i+1)*size : (i+1)*size]
	}
	return out
}

// BenchmarkPull256x64K is one handoff of 256 blocks of 64 KiB over
// UCX_TLS=tcp on loopback in the pull model (Config.Pull): a worker per handoff on each side, the
// handshake, the registrations, the gets and the flush, the revocation.
// Its baseline is ucx_perftest's get bandwidth at the same message size
// and window, measured in the same run, in rounds interleaved with ours
// (the medians of each are reported; ratio is ours over perftest).
func BenchmarkPull256x64K(b *testing.B) {
	for _, c := range []struct {
		name   string
		maxGet int
	}{{"get=64KiB", benchBlockBytes}, {"get=1MiB", 1 << 20}} {
		b.Run(c.name, func(b *testing.B) {
			const window, rounds = 16, 3
			s, err := ucx.NewSender(ucx.Config{Pull: true}, ucx.HostBytes)
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			r, err := ucx.NewReceiver(ucx.Config{Pull: true, Window: window, MaxGet: c.maxGet}, ucx.HostBytes)
			if err != nil {
				b.Fatal(err)
			}
			defer r.Close()
			src, dst := benchRegions(benchBlocks, benchBlockBytes), benchRegions(benchBlocks, benchBlockBytes)
			b.SetBytes(benchBlocks * benchBlockBytes)
			var base, ours []float64
			done := 0
			b.ResetTimer()
			for round := range rounds {
				b.StopTimer()
				base = append(base, perftestGetMBs(b, benchBlockBytes, window, 2*benchBlocks))
				b.StartTimer()
				n := (b.N - done) / (rounds - round)
				if n == 0 {
					continue
				}
				start := time.Now()
				for i := range n {
					moveOnce(b, s, r, handoff.PlaneID{Session: 1, Handoff: uint64(done + i)}, src, dst)
				}
				ours = append(ours, float64(n)*benchBlocks*benchBlockBytes/time.Since(start).Seconds()/1e6)
				done += n
			}
			b.StopTimer()
			mb, mo := median(base), median(ours)
			b.ReportMetric(mb, "perftest-MB/s")
			b.ReportMetric(mo, "ours-MB/s")
			b.ReportMetric(mo/mb, "ratio")
		})
	}
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	v = slices.Clone(v)
	slices.Sort(v)
	return v[len(v)/2]
}

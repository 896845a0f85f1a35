package handoff

import (
	"fmt"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/kvlease/kvlease/internal/testpki"
)

// BenchmarkHandshake: authenticating a control connection over
// 127.0.0.1 (the dial, NewSource's handshake against a Destination's
// Listen, its confirm), p50 and p99 per mode, the modes interleaved in
// one run (one handshake of each per iteration): none, psk with
// version 2's derivation (legacyPSK: no ephemeral share), psk as it is
// (X25519 shares: forward secrecy), and mutual TLS 1.3. psk/psk-v2 is
// the ratio of the medians: what the ephemeral share costs.
func BenchmarkHandshake(b *testing.B) {
	ca := testpki.NewCA(b, "ca")
	srcTLS, dstTLS := tlsPair(b, ca)
	modes := []struct {
		name     string
		src, dst Authenticator
	}{
		{"none", nil, nil},
		{"psk-v2", legacyPSK{testPSK}, legacyPSK{testPSK}},
		{"psk", testPSK, testPSK},
		{"tls", srcTLS, dstTLS},
	}
	addrs := make([]string, len(modes))
	for i, m := range modes {
		dst, err := NewDestination(newHostPool(b, 64, hbBytes), newManualPlane(), DestinationConfig[[]byte]{
			HalfConfig:  HalfConfig{Envelope: testEnvelope(), Auth: m.dst, Insecure: m.dst == nil, Logf: quiet},
			MaxSessions: -1, IdentityLimits: func(string) Limits { return Limits{Sessions: -1} }})
		if err != nil {
			b.Fatal(err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		go func() { _ = dst.Listen(ln) }()
		b.Cleanup(func() { _ = ln.Close() })
		addrs[i] = ln.Addr().String()
	}
	handshake := func(i int) time.Duration {
		start := time.Now()
		c, err := net.Dial("tcp", addrs[i])
		if err != nil {
			b.Fatal(err)
		}
		m := modes[i]
		src, err := NewSource(c, newManualPlane(), HalfConfig{Envelope: testEnvelope(), Auth: m.src, Insecure: m.src == nil, Logf: quiet})
		if err != nil {
			b.Fatal(err)
		}
		d := time.Since(start)
		_ = src.Close()
		return d
	}
	for i := range modes {
		handshake(i) // warm
	}
	hs := make([][]time.Duration, len(modes))
	b.ReportAllocs()
	b.ResetTimer()
	for k := range b.N {
		for j := range modes { // each iteration starts with another mode
			i := (k + j) % len(modes)
			hs[i] = append(hs[i], handshake(i))
		}
	}
	b.StopTimer()
	p50s := make([]time.Duration, len(modes))
	for i, m := range modes {
		s := slices.Clone(hs[i])
		slices.Sort(s)
		p50, p99 := s[len(s)/2], s[min(len(s)-1, len(s)*99/100)]
		p50s[i] = p50
		b.ReportMetric(float64(p50.Nanoseconds())/1e3, m.name+"-p50-µs")
		b.ReportMetric(float64(p99.Nanoseconds())/1e3, m.name+"-p99-µs")
	}
	b.ReportMetric(float64(p50s[2])/float64(p50s[1]), "psk/psk-v2-p50")
	if testing.Verbose() {
		fmt.Printf("handshake p50: none %v, psk-v2 %v, psk %v, tls %v\n", p50s[0], p50s[1], p50s[2], p50s[3])
	}
}

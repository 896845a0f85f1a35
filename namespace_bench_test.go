package kvlease

import "testing"

// BenchmarkSealKVEvents: a lease of 16 blocks sealed with SealTokens in a
// pool with KV events (the seal records' path), then released and the
// events drained; plain leases, and a tenant's (whose records and events
// carry its namespace).
func BenchmarkSealKVEvents(b *testing.B) {
	for _, mode := range []string{"plain", "tenant"} {
		b.Run(mode, func(b *testing.B) {
			mem, _ := NewHostMemory(64, 64)
			p, err := NewPool[[]byte](mem, WithBlockTokens(4), WithKVEvents(1024), WithTenantKey(nsKey))
			if err != nil {
				b.Fatal(err)
			}
			tn, _ := p.Tenant("acme")
			toks := make([]int32, 16*4)
			buf := make([]KVEvent, 0, 1024)
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				var l *Lease[[]byte]
				if mode == "tenant" {
					l, err = tn.Acquire("b", 16)
				} else {
					l, err = p.Acquire("b", 16)
				}
				if err != nil {
					b.Fatal(err)
				}
				parent := BlockHash(i)
				for k := range 16 {
					toks[4*k] = int32(i)
					if parent, err = l.SealTokens(k, parent, toks[4*k:4*k+4]); err != nil {
						b.Fatal(err)
					}
				}
				l.Release()
				buf, _ = p.DrainKVEvents(buf[:0])
			}
		})
	}
}

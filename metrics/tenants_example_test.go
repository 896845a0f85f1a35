package metrics_test

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/metrics"
)

// Per-tenant series of a pool: one line per registered tenant (up to
// MaxTenants) and tenant="other" for the rest.
func ExampleNewTenantCollector() {
	reg := prometheus.NewRegistry()
	c, _ := metrics.NewTenantCollector(reg, metrics.TenantOptions{MaxTenants: 16})
	mem, _ := kvlease.NewHostMemory(8, 64)
	pool, _ := kvlease.NewPool[[]byte](mem)
	_ = c.AddPool("gpu", pool)

	acme, _ := pool.Tenant("acme")
	_ = acme.SetQuota(kvlease.Quota{Cap: 4})
	l, _ := acme.Acquire("req-1", 3)
	defer l.Release()

	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != "kvlease_tenant_held_blocks" {
			continue
		}
		for _, m := range mf.GetMetric() {
			fmt.Println(m.GetLabel()[1].GetValue(), m.GetGauge().GetValue())
		}
	}
	// Output:
	// acme 3
	// other 0
}

package metrics

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
)

// Per-tenant series: a line per exported tenant and one for the rest
// (later tenants and blocks of none), values from the pool's
// TenantStats, lint clean.
func TestTenantCollector(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	c, err := NewTenantCollector(reg, TenantOptions{MaxTenants: 2, ConstLabels: prometheus.Labels{"engine": "e0"}})
	require.NoError(t, err)
	p := newPool(t, 16)
	require.NoError(t, c.AddPool("gpu", p))
	require.ErrorIs(t, c.AddPool("gpu", p), ErrInvalid)
	require.ErrorIs(t, c.AddPool("x", nil), kvlease.ErrInvalidArgument)

	a, _ := p.Tenant("a")
	require.NoError(t, a.SetQuota(kvlease.Quota{Cap: 4, Reserve: 2}))
	b, _ := p.Tenant("b")
	z, _ := p.Tenant("z") // past MaxTenants: counted in other
	seal := func(tn *kvlease.Tenant[[]byte], n int, base kvlease.BlockHash) {
		l, err := tn.Acquire("r", n)
		require.NoError(t, err)
		for i := range n {
			require.NoError(t, l.Seal(i, base+kvlease.BlockHash(i)))
		}
		l.Release()
	}
	seal(a, 3, 100)
	seal(b, 2, 200)
	seal(z, 1, 300)
	held, err := p.Acquire("none", 2) // no tenant: other
	require.NoError(t, err)
	defer held.Release()
	_, err = a.Acquire("big", 5)
	require.ErrorIs(t, err, kvlease.ErrQuota)

	want := `
# HELP kvlease_tenant_cached_blocks Cached blocks charged to the tenant.
# TYPE kvlease_tenant_cached_blocks gauge
kvlease_tenant_cached_blocks{engine="e0",pool="gpu",tenant="a"} 3
kvlease_tenant_cached_blocks{engine="e0",pool="gpu",tenant="b"} 2
kvlease_tenant_cached_blocks{engine="e0",pool="gpu",tenant="other"} 1
# HELP kvlease_tenant_held_blocks Blocks charged to the tenant: leased, draining, quarantined or cached.
# TYPE kvlease_tenant_held_blocks gauge
kvlease_tenant_held_blocks{engine="e0",pool="gpu",tenant="a"} 3
kvlease_tenant_held_blocks{engine="e0",pool="gpu",tenant="b"} 2
kvlease_tenant_held_blocks{engine="e0",pool="gpu",tenant="other"} 3
# HELP kvlease_tenant_quota_blocks The tenant's quota, by limit (cap: most blocks held, reserve: cached blocks others cannot evict); absent when 0.
# TYPE kvlease_tenant_quota_blocks gauge
kvlease_tenant_quota_blocks{engine="e0",limit="cap",pool="gpu",tenant="a"} 4
kvlease_tenant_quota_blocks{engine="e0",limit="reserve",pool="gpu",tenant="a"} 2
# HELP kvlease_tenant_quota_rejections_total The tenant's acquires refused by its cap (ErrQuota).
# TYPE kvlease_tenant_quota_rejections_total counter
kvlease_tenant_quota_rejections_total{engine="e0",pool="gpu",tenant="a"} 1
kvlease_tenant_quota_rejections_total{engine="e0",pool="gpu",tenant="b"} 0
kvlease_tenant_quota_rejections_total{engine="e0",pool="gpu",tenant="other"} 0
# HELP kvlease_tenant_reserved_blocks The tenant's cached blocks within its reservation (no other tenant evicts them).
# TYPE kvlease_tenant_reserved_blocks gauge
kvlease_tenant_reserved_blocks{engine="e0",pool="gpu",tenant="a"} 2
kvlease_tenant_reserved_blocks{engine="e0",pool="gpu",tenant="b"} 0
kvlease_tenant_reserved_blocks{engine="e0",pool="gpu",tenant="other"} 0
`
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want),
		"kvlease_tenant_held_blocks", "kvlease_tenant_cached_blocks", "kvlease_tenant_reserved_blocks",
		"kvlease_tenant_quota_blocks", "kvlease_tenant_quota_rejections_total"))
	problems, err := testutil.CollectAndLint(c)
	require.NoError(t, err)
	require.Empty(t, problems)
	// Three tenant lines, eight families: held, cached, reserved,
	// queries, hits, rejections and two eviction series each, and a's two
	// quota limits.
	require.Equal(t, 3*8+2, testutil.CollectAndCount(c))
	_, err = reg.Gather()
	require.NoError(t, err)

	_, err = NewTenantCollector(nil, TenantOptions{})
	require.ErrorIs(t, err, ErrInvalid)
	_, err = NewTenantCollector(prometheus.NewRegistry(), TenantOptions{MaxTenants: -1})
	require.ErrorIs(t, err, ErrInvalid)
}

package metrics

import (
	"fmt"
	"slices"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvlease/kvlease"
)

// TenantSource is what a pool exports per tenant: *kvlease.Pool of any
// region type (Pool.TenantStats).
type TenantSource interface {
	TenantStats(dst []kvlease.TenantStats) []kvlease.TenantStats
}

// DefaultMaxTenants is TenantOptions.MaxTenants' default.
const DefaultMaxTenants = 64

// OtherTenant is the tenant label of the series that add up everything
// charged to no exported tenant.
const OtherTenant = "other"

// TenantOptions configures a TenantCollector. The zero value is usable.
type TenantOptions struct {
	// Namespace prefixes every metric ("kvlease" when empty).
	Namespace string
	// ConstLabels are added to every metric.
	ConstLabels prometheus.Labels
	// MaxTenants bounds the values of the tenant label per pool (0:
	// DefaultMaxTenants): the first MaxTenants tenants the pool
	// registered have series of their own; every later one is added to
	// tenant="other" with the blocks of no registered tenant. The cut
	// follows registration order, never load, so a tenant's series never
	// moves and counters only grow.
	MaxTenants int
}

// TenantCollector is a prometheus.Collector of pools' per-tenant stats
// (kvlease.TenantStats): a snapshot per pool and scrape, nothing counted
// on the hot path. Its methods are safe for concurrent use.
type TenantCollector struct {
	max int

	mu    sync.Mutex
	pools []named[TenantSource]

	held, cached, reserved, quota        *prometheus.Desc
	queries, hits, rejections, evictions *prometheus.Desc
}

// NewTenantCollector makes a TenantCollector and registers it on reg.
func NewTenantCollector(reg prometheus.Registerer, opts TenantOptions) (*TenantCollector, error) {
	if reg == nil {
		return nil, fmt.Errorf("metrics: nil Registerer: %w", ErrInvalid)
	}
	if opts.MaxTenants < 0 {
		return nil, fmt.Errorf("metrics: MaxTenants %d: %w", opts.MaxTenants, ErrInvalid)
	}
	if opts.Namespace == "" {
		opts.Namespace = "kvlease"
	}
	if opts.MaxTenants == 0 {
		opts.MaxTenants = DefaultMaxTenants
	}
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(opts.Namespace, "tenant", name), help,
			append([]string{"pool", "tenant"}, labels...), opts.ConstLabels)
	}
	c := &TenantCollector{max: opts.MaxTenants,
		held:       d("held_blocks", "Blocks charged to the tenant: leased, draining, quarantined or cached."),
		cached:     d("cached_blocks", "Cached blocks charged to the tenant."),
		reserved:   d("reserved_blocks", "The tenant's cached blocks within its reservation (no other tenant evicts them)."),
		quota:      d("quota_blocks", "The tenant's quota, by limit (cap: most blocks held, reserve: cached blocks others cannot evict); absent when 0.", "limit"),
		queries:    d("prefix_queries_total", "Blocks looked up by the tenant's admitted prefix acquires."),
		hits:       d("prefix_hits_total", "Blocks of the tenant's admitted prefix acquires served from the cache."),
		rejections: d("quota_rejections_total", "The tenant's acquires refused by its cap (ErrQuota)."),
		evictions:  d("evictions_total", "The tenant's cached blocks evicted, by whose fill (others, own).", "by"),
	}
	if err := reg.Register(c); err != nil {
		return nil, fmt.Errorf("metrics: register: %w", err)
	}
	return c, nil
}

// AddPool exports pool's tenants under the label pool=name.
func (c *TenantCollector) AddPool(name string, pool TenantSource) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return addNamed(&c.pools, "pool", name, pool, pool == nil)
}

// Describe implements prometheus.Collector.
func (c *TenantCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.held, c.cached, c.reserved, c.quota, c.queries, c.hits, c.rejections, c.evictions} {
		ch <- d
	}
}

// Collect implements prometheus.Collector: one TenantStats snapshot per
// pool.
func (c *TenantCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	pools := slices.Clone(c.pools)
	c.mu.Unlock()
	var lines []kvlease.TenantStats
	for _, p := range pools {
		lines = p.src.TenantStats(lines[:0])
		if len(lines) == 0 {
			continue
		}
		// The pool's last line is everything of no registered tenant;
		// tenants past the cut (or named like the aggregate) join it.
		other := lines[len(lines)-1]
		other.Tenant = OtherTenant
		for i, s := range lines[:len(lines)-1] {
			if i < c.max && s.Tenant != OtherTenant {
				c.emit(ch, p.name, s)
				continue
			}
			other.Held += s.Held
			other.Cached += s.Cached
			other.Reserved += s.Reserved
			other.PrefixQueries += s.PrefixQueries
			other.PrefixHits += s.PrefixHits
			other.Rejected += s.Rejected
			other.Evicted += s.Evicted
			other.EvictedOwn += s.EvictedOwn
		}
		other.Quota = kvlease.Quota{}
		c.emit(ch, p.name, other)
	}
}

// emit sends tenant s's series of pool.
func (c *TenantCollector) emit(ch chan<- prometheus.Metric, pool string, s kvlease.TenantStats) {
	gauge := func(d *prometheus.Desc, v int, l ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), append([]string{pool, s.Tenant}, l...)...)
	}
	counter := func(d *prometheus.Desc, v uint64, l ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), append([]string{pool, s.Tenant}, l...)...)
	}
	gauge(c.held, s.Held)
	gauge(c.cached, s.Cached)
	gauge(c.reserved, s.Reserved)
	if s.Quota.Cap > 0 {
		gauge(c.quota, s.Quota.Cap, "cap")
	}
	if s.Quota.Reserve > 0 {
		gauge(c.quota, s.Quota.Reserve, "reserve")
	}
	counter(c.queries, s.PrefixQueries)
	counter(c.hits, s.PrefixHits)
	counter(c.rejections, s.Rejected)
	counter(c.evictions, s.Evicted, "others")
	counter(c.evictions, s.EvictedOwn, "own")
}

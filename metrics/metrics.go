// Package metrics exports kvlease pools, KV-event publishers and handoffs
// to Prometheus.
//
// A Collector reads, once per scrape, a snapshot of every source it was
// given: pools (their blocks by state, prefix queries and hits), KV-event
// publishers, the halves of cross-process handoffs (sessions, refusals
// by cause) and their data planes (data connections, transfers by
// outcome, bytes). Nothing is counted on the allocator's hot path for it.
// The three duration histograms (transfer, drain, quarantine) need to see
// transitions as they happen and are fed by the Observer a Collector
// hands out for each pool (kvlease.WithObserver). Handoff outcomes are
// counted by RecordHandoff or WatchHandoff.
//
// A TenantCollector exports each pool's per-tenant lines
// (kvlease.Pool.TenantStats) the same way. Tenant names become label
// values, so their number is bounded (TenantOptions.MaxTenants): tenants
// registered after the bound add up under tenant="other", in
// registration order, never by load, so no series moves.
//
// New registers the Collector on the Registerer it is given; the package
// keeps no global state and registers nothing by itself.
//
// With Options.VLLM set, each pool is also exported under vLLM's names
// (vllm:kv_cache_usage_perc, vllm:prefix_cache_queries_total and
// vllm:prefix_cache_hits_total in tokens, vllm:cache_config_info; or the
// subset VLLMOptions.Names chooses, for an engine exporting some itself), so a
// scheduler that scores vLLM engines from their /metrics (llm-d's) can
// score a Go engine unchanged. Those names contain colons, which
// Prometheus reserves for recording rules and its linter reports; that is
// vLLM's choice and the reason they are behind an option.
package metrics

import (
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/events"
	"github.com/kvlease/kvlease/handoff"
)

// ErrInvalid is wrapped by the errors of New, AddPool and AddPublisher
// for an argument they refuse (a nil source, a duplicate name). It wraps
// kvlease.ErrInvalidArgument, so either sentinel matches with errors.Is.
var ErrInvalid = fmt.Errorf("metrics: invalid argument: %w", kvlease.ErrInvalidArgument)

// StatsSource is what a pool exports: *kvlease.Pool of any region type.
type StatsSource interface {
	Stats() kvlease.Stats
}

// PublisherSource is what a KV-event publisher exports: *events.Publisher.
type PublisherSource interface {
	Stats() events.Stats
}

// HalfSource is what a half of a cross-process handoff exports:
// *handoff.Destination or *handoff.Source of any region type.
type HalfSource interface {
	Stats() handoff.HalfStats
}

// PlaneSource is what a data plane exports: *tcp.Receiver, *tcp.Sender
// (package handoff/tcp), or any plane that counts into a
// handoff.PlaneStats.
type PlaneSource interface {
	Stats() handoff.PlaneStats
}

// DefaultBuckets are the duration histograms' buckets, in seconds: 10µs
// to about 42s, a factor of 4 apart.
var DefaultBuckets = prometheus.ExponentialBuckets(1e-5, 4, 12)

// Options configures a Collector. The zero value is usable.
type Options struct {
	// Namespace prefixes every kvlease metric ("kvlease" when empty).
	Namespace string
	// ConstLabels are added to every metric (for example the engine's pod).
	ConstLabels prometheus.Labels
	// Buckets of the duration histograms in seconds (DefaultBuckets when nil).
	Buckets []float64
	// VLLM, when set, also exports each pool under vLLM's metric names.
	VLLM *VLLMOptions
}

// VLLMOptions names what vLLM's metrics carry that a pool does not know.
type VLLMOptions struct {
	// Model is the model_name label.
	Model string
	// BlockTokens is the tokens per block: prefix queries and hits are
	// counted in tokens, and it is cache_config_info's block_size.
	BlockTokens int
	// Names, when set, chooses which of VLLMNames to export; nil exports
	// them all. An engine that exports some vllm: names itself lists the
	// others here, so no name is registered twice. An unknown or repeated
	// name is refused (ErrInvalid); an empty list exports none.
	Names []string
}

// vLLM's metric names a Collector can export (VLLMOptions.Names).
const (
	VLLMKVCacheUsage       = "vllm:kv_cache_usage_perc"
	VLLMPrefixCacheQueries = "vllm:prefix_cache_queries_total"
	VLLMPrefixCacheHits    = "vllm:prefix_cache_hits_total"
	VLLMCacheConfigInfo    = "vllm:cache_config_info"
)

// VLLMNames lists every vLLM name a Collector can export, in order.
var VLLMNames = []string{VLLMKVCacheUsage, VLLMPrefixCacheQueries, VLLMPrefixCacheHits, VLLMCacheConfigInfo}

// Collector is a prometheus.Collector over kvlease pools, KV-event
// publishers and handoffs. Its methods are safe for concurrent use.
type Collector struct {
	opts Options
	now  func() time.Time

	mu     sync.Mutex
	pools  []named[StatsSource]
	pubs   []named[PublisherSource]
	halves []named[HalfSource]
	planes []named[PlaneSource]
	obs    map[string]*poolObserver

	d descs

	transfer, drain, quarantine *prometheus.HistogramVec
	handoffs                    *prometheus.CounterVec
}

// named is a source exported under a label value.
type named[S any] struct {
	name string
	src  S
}

// addNamed appends src to *list as name, refusing an empty name, a nil
// source (isNil) or a name already in the list; what names a kind of
// source ("pool", "publisher") in the errors.
func addNamed[S any](list *[]named[S], what, name string, src S, isNil bool) error {
	if isNil || name == "" {
		return fmt.Errorf("metrics: add %s %q: need a name and a %s: %w", what, name, what, ErrInvalid)
	}
	if slices.ContainsFunc(*list, func(n named[S]) bool { return n.name == name }) {
		return fmt.Errorf("metrics: %s %q added twice: %w", what, name, ErrInvalid)
	}
	*list = append(*list, named[S]{name, src})
	return nil
}

type descs struct {
	blocks, capacity, usable, quarLeased, openLeases, waiters   *prometheus.Desc
	acquires, rejections                                        *prometheus.Desc
	prefixQueries, prefixHits, prefixRefused                    *prometheus.Desc
	evictions, dupSeals, verifyMismatches                       *prometheus.Desc
	transfers, quarantines, quarantineLifts, leaked             *prometheus.Desc
	evPublished, evBatches, evBlocks, evDropped, evBatchDropped *prometheus.Desc
	evUnpublishable, evResyncs                                  *prometheus.Desc
	evSubDrops, evPeerRefused, evBadReplays                     *prometheus.Desc
	vUsage, vQueries, vHits, vConfig                            *prometheus.Desc
	hSessions, hRefusals, hQuarantined, pRefusals, pAcceptErrs  *prometheus.Desc
	pConns, pIdle, pTransfers, pBytes                           *prometheus.Desc
	hIdleClosed, hCrossed                                       *prometheus.Desc // collectSessionBounds
}

// New makes a Collector and registers it on reg.
func New(reg prometheus.Registerer, opts Options) (*Collector, error) {
	if reg == nil {
		return nil, fmt.Errorf("metrics: nil Registerer: %w", ErrInvalid)
	}
	if opts.VLLM != nil && opts.VLLM.BlockTokens <= 0 {
		return nil, fmt.Errorf("metrics: VLLM.BlockTokens %d must be positive: %w", opts.VLLM.BlockTokens, ErrInvalid)
	}
	if opts.Namespace == "" {
		opts.Namespace = "kvlease"
	}
	if opts.Buckets == nil {
		opts.Buckets = DefaultBuckets
	}
	c := &Collector{opts: opts, now: time.Now, obs: map[string]*poolObserver{}}
	ns, cl := opts.Namespace, opts.ConstLabels
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(ns, "", name), help, labels, cl)
	}
	pl := "pool"
	c.d = descs{
		blocks:           d("blocks", "Blocks by state (free, cached, leased, draining, quarantined); they sum to the capacity.", pl, "state"),
		capacity:         d("capacity_blocks", "Blocks the pool owns.", pl),
		usable:           d("usable_blocks", "Capacity minus quarantined blocks: the most that could be free while the quarantine lasts.", pl),
		quarLeased:       d("quarantined_leased_blocks", "Quarantined blocks an open lease still holds.", pl),
		openLeases:       d("open_leases", "Leases acquired and not yet closed.", pl),
		waiters:          d("waiters", "Callers queued in AcquireWait.", pl),
		acquires:         d("acquires_total", "Leases handed out.", pl),
		rejections:       d("rejections_total", "Acquires that failed and allocated nothing, by reason.", pl, "reason"),
		prefixQueries:    d("prefix_queries_total", "Blocks looked up by admitted prefix acquires.", pl),
		prefixHits:       d("prefix_hits_total", "Blocks of admitted prefix acquires served from the cache.", pl),
		prefixRefused:    d("prefix_refused_total", "Blocks looked up by prefix acquires that were then refused.", pl),
		evictions:        d("evictions_total", "Cached blocks evicted to make room.", pl),
		dupSeals:         d("duplicate_seals_total", "Seals whose hash was already findable in another block.", pl),
		verifyMismatches: d("verify_mismatches_total", "Verified lookups whose hash matched but whose tokens did not.", pl),
		transfers:        d("transfers_total", "Transfers ended, once per lease they gated, by outcome (resolved, failed, quarantined).", pl, "outcome"),
		quarantines:      d("quarantines_total", "Leases that entered the quarantined state.", pl),
		quarantineLifts:  d("quarantine_lifts_total", "Leases late evidence brought out of quarantine.", pl),
		leaked:           d("leaked_leases_total", "Leases found unreachable while open (their blocks stay leased).", pl),

		evPublished:     d("kv_events_published_total", "KV events handed to the PUB socket (a merged chain counts once).", "publisher"),
		evBatches:       d("kv_event_batches_total", "KV event batches handed to the PUB socket.", "publisher"),
		evBlocks:        d("kv_event_blocks_total", "Block hashes announced stored or removed.", "publisher"),
		evDropped:       d("kv_events_dropped_total", "KV events the pools' rings dropped before the publisher drained them.", "publisher"),
		evBatchDropped:  d("kv_event_batches_dropped_total", "KV event batches dropped because the queue to the socket was full.", "publisher"),
		evUnpublishable: d("kv_events_unpublishable_total", "Stored events without tokens, which routers cannot key (not sent).", "publisher"),
		evResyncs:       d("kv_event_resyncs_total", "AllBlocksCleared plus re-announcements sent after a loss.", "publisher"),
		evSubDrops:      d("kv_event_subscriber_drops_total", "Messages dropped for one subscriber whose queue was at its high-water mark.", "publisher"),
		evPeerRefused:   d("kv_event_peers_refused_total", "Subscriber and replay connections refused over a cap or closed in their handshake (timeout, protocol violation).", "publisher"),
		evBadReplays:    d("kv_event_malformed_replays_total", "Replay requests of the wrong shape, ignored.", "publisher"),

		hSessions:    d("handoff_sessions_total", "Control sessions a handoff half authenticated (or began, insecure).", "half"),
		hRefusals:    d("handoff_refusals_total", "What a handoff half refused, by reason (auth, downgrade, frame, limit, start_timeout, duplicate, unauthorized, busy, accept_error, identity_limit, session_limit).", "half", "reason"),
		hQuarantined: d("handoff_quarantined_total", "Handoffs of a half that became quarantined.", "half"),
		pRefusals:    d("handoff_data_refusals_total", "Data connections a TCP plane refused, by reason (auth, busy, address, other).", "plane", "reason"),
		pAcceptErrs:  d("handoff_data_accept_errors_total", "Failed accepts of a TCP plane's listener, retried after a backoff.", "plane"),
		pConns:       d("handoff_data_connections_total", "A TCP plane's data connections, by event: dial (dialled or accepted), reuse (a handoff on a connection that had carried one), idle_expired (closed idle), stale (found closed by the peer before reuse).", "plane", "event"),
		pIdle:        d("handoff_data_idle_connections", "A TCP plane's data connections idle now, waiting for their next handoff.", "plane"),
		pTransfers:   d("handoff_data_transfers_total", "Transfers a TCP plane ran, by outcome (completed, failed, canceled).", "plane", "outcome"),
		pBytes:       d("handoff_data_bytes_total", "Block bytes a TCP plane moved.", "plane"),
		hIdleClosed:  d("handoff_sessions_idle_closed_total", "Control sessions a handoff destination closed after its SessionIdleTimeout with nothing in flight.", "half"),
		hCrossed:     d("handoff_messages_crossed_total", "Control messages that crossed this half's end of their handoff (an Accept, Reject or Done crossing the source's abort; a Start crossing the destination's abort or reject): expected, dropped, not protocol errors.", "half"),
	}
	if v := opts.VLLM; v != nil {
		names := v.Names
		if names == nil {
			names = VLLMNames
		}
		vl := []string{"engine", "model_name"}
		for i, name := range names {
			var d **prometheus.Desc
			var desc *prometheus.Desc
			switch name {
			case VLLMKVCacheUsage:
				d, desc = &c.d.vUsage, prometheus.NewDesc(name, "KV-cache usage. 1 means 100 percent usage.", vl, cl)
			case VLLMPrefixCacheQueries:
				d, desc = &c.d.vQueries, prometheus.NewDesc(name, "Prefix cache queries, in terms of number of queried tokens.", vl, cl)
			case VLLMPrefixCacheHits:
				d, desc = &c.d.vHits, prometheus.NewDesc(name, "Prefix cache hits, in terms of number of cached tokens.", vl, cl)
			case VLLMCacheConfigInfo:
				d, desc = &c.d.vConfig, prometheus.NewDesc(name, "Information of the LLMEngine CacheConfig.",
					[]string{"engine", "model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"}, cl)
			default:
				return nil, fmt.Errorf("metrics: VLLM.Names[%d] %q is not one of %v: %w", i, name, VLLMNames, ErrInvalid)
			}
			if *d != nil {
				return nil, fmt.Errorf("metrics: VLLM.Names lists %q twice: %w", name, ErrInvalid)
			}
			*d = desc
		}
	}
	hist := func(name, help string) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: ns, Name: name, Help: help, ConstLabels: cl, Buckets: opts.Buckets,
		}, []string{pl})
	}
	c.transfer = hist("transfer_duration_seconds", "From a transfer's attachment to a lease until it resolved or was quarantined.")
	c.drain = hist("drain_duration_seconds", "From the close of a lease with transfers still pending until it settled.")
	c.quarantine = hist("quarantine_duration_seconds", "From a lease entering quarantine until late evidence lifted it.")
	c.handoffs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: ns, Name: "handoffs_total", ConstLabels: cl,
		Help: "Handoffs by outcome (delivered, rejected, failed, aborted, quarantined).",
	}, []string{"outcome"})
	for _, o := range handoffOutcomes {
		c.handoffs.WithLabelValues(o.String())
	}
	if err := reg.Register(c); err != nil {
		return nil, fmt.Errorf("metrics: register: %w", err)
	}
	return c, nil
}

// AddPool exports pool under the label pool=name.
func (c *Collector) AddPool(name string, pool StatsSource) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return addNamed(&c.pools, "pool", name, pool, pool == nil)
}

// AddPublisher exports a KV-event publisher under the label publisher=name.
func (c *Collector) AddPublisher(name string, p PublisherSource) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return addNamed(&c.pubs, "publisher", name, p, p == nil)
}

// AddHalf exports a handoff half's refusals under the label half=name.
func (c *Collector) AddHalf(name string, h HalfSource) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return addNamed(&c.halves, "half", name, h, h == nil)
}

// AddPlane exports a TCP data plane's refusals, its data connections
// (dials, reuses, idle expiries, stale ones, idle now) and its transfers
// and bytes under the label plane=name.
func (c *Collector) AddPlane(name string, p PlaneSource) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return addNamed(&c.planes, "plane", name, p, p == nil)
}

// The outcomes handoffs_total counts: the final states and Quarantined.
var handoffOutcomes = []handoff.State{handoff.Delivered, handoff.Rejected, handoff.Failed, handoff.Aborted, handoff.Quarantined}

// RecordHandoff counts one handoff that ended in s. Only final states and
// Quarantined are outcomes; it reports false (and counts nothing) for
// any other state.
func (c *Collector) RecordHandoff(s handoff.State) bool {
	if !slices.Contains(handoffOutcomes, s) {
		return false
	}
	c.handoffs.WithLabelValues(s.String()).Inc()
	return true
}

// Handoff is what WatchHandoff follows: *handoff.Handoff, *handoff.Outgoing
// and *handoff.Incoming.
type Handoff interface {
	Done() <-chan struct{}
	State() handoff.State
}

// WatchHandoff counts h's outcome once it is done (a final state). The
// goroutine it starts ends with h; a handoff that stays quarantined is
// never done, so its goroutine waits for late evidence (use RecordHandoff
// to count quarantines as they happen).
func (c *Collector) WatchHandoff(h Handoff) {
	go func() {
		<-h.Done()
		c.RecordHandoff(h.State())
	}()
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{
		c.d.blocks, c.d.capacity, c.d.usable, c.d.quarLeased, c.d.openLeases, c.d.waiters,
		c.d.acquires, c.d.rejections, c.d.prefixQueries, c.d.prefixHits, c.d.prefixRefused,
		c.d.evictions, c.d.dupSeals, c.d.verifyMismatches,
		c.d.transfers, c.d.quarantines, c.d.quarantineLifts, c.d.leaked,
		c.d.evPublished, c.d.evBatches, c.d.evBlocks, c.d.evDropped, c.d.evBatchDropped,
		c.d.evUnpublishable, c.d.evResyncs, c.d.evSubDrops, c.d.evPeerRefused, c.d.evBadReplays,
		c.d.hSessions, c.d.hRefusals, c.d.hQuarantined, c.d.pRefusals, c.d.pAcceptErrs,
		c.d.pConns, c.d.pIdle, c.d.pTransfers, c.d.pBytes,
	} {
		ch <- d
	}
	ch <- c.d.hIdleClosed
	ch <- c.d.hCrossed
	for _, d := range []*prometheus.Desc{c.d.vUsage, c.d.vQueries, c.d.vHits, c.d.vConfig} {
		if d != nil { // only the chosen vLLM names
			ch <- d
		}
	}
	c.transfer.Describe(ch)
	c.drain.Describe(ch)
	c.quarantine.Describe(ch)
	c.handoffs.Describe(ch)
}

// Collect implements prometheus.Collector: one Stats snapshot per source.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	pools := slices.Clone(c.pools)
	pubs := slices.Clone(c.pubs)
	halves := slices.Clone(c.halves)
	planes := slices.Clone(c.planes)
	c.mu.Unlock()
	gauge := func(d *prometheus.Desc, v float64, l ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, l...)
	}
	counter := func(d *prometheus.Desc, v uint64, l ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), l...)
	}
	for _, p := range pools {
		st := p.src.Stats()
		n := p.name
		gauge(c.d.blocks, float64(st.Free), n, "free")
		gauge(c.d.blocks, float64(st.Cached), n, "cached")
		gauge(c.d.blocks, float64(st.Leased), n, "leased")
		gauge(c.d.blocks, float64(st.Draining), n, "draining")
		gauge(c.d.blocks, float64(st.Quarantined), n, "quarantined")
		gauge(c.d.capacity, float64(st.Capacity), n)
		gauge(c.d.usable, float64(st.Usable), n)
		gauge(c.d.quarLeased, float64(st.QuarantinedLeased), n)
		gauge(c.d.openLeases, float64(st.OpenLeases), n)
		gauge(c.d.waiters, float64(st.Waiters), n)
		counter(c.d.acquires, st.Acquires, n)
		counter(c.d.rejections, st.RejectedExhausted, n, "exhausted")
		counter(c.d.rejections, st.RejectedQuarantineBound, n, "quarantine_bound")
		counter(c.d.rejections, st.RejectedCanceled, n, "canceled")
		counter(c.d.rejections, st.RejectedClosed, n, "closed")
		counter(c.d.rejections, st.RejectedInvalid, n, "invalid")
		counter(c.d.rejections, st.RejectedQuota, n, "quota")
		counter(c.d.prefixQueries, st.PrefixQueries, n)
		counter(c.d.prefixHits, st.PrefixHits, n)
		counter(c.d.prefixRefused, st.PrefixRefused, n)
		counter(c.d.evictions, st.Evictions, n)
		counter(c.d.dupSeals, st.DuplicateSeals, n)
		counter(c.d.verifyMismatches, st.VerifyMismatches, n)
		counter(c.d.transfers, st.TransfersResolved, n, "resolved")
		counter(c.d.transfers, st.TransfersFailed, n, "failed")
		counter(c.d.transfers, st.TransfersQuarantined, n, "quarantined")
		counter(c.d.quarantines, st.Quarantines, n)
		counter(c.d.quarantineLifts, st.QuarantineLifts, n)
		counter(c.d.leaked, st.LeakedLeases, n)
		if v := c.opts.VLLM; v != nil {
			used := 0.0
			if st.Capacity > 0 {
				// vLLM counts cached (evictable) blocks as free.
				used = float64(st.Capacity-st.Free-st.Cached) / float64(st.Capacity)
			}
			bt := uint64(v.BlockTokens)
			if c.d.vUsage != nil {
				gauge(c.d.vUsage, used, n, v.Model)
			}
			if c.d.vQueries != nil {
				counter(c.d.vQueries, st.PrefixQueries*bt, n, v.Model)
			}
			if c.d.vHits != nil {
				counter(c.d.vHits, st.PrefixHits*bt, n, v.Model)
			}
			if c.d.vConfig != nil {
				gauge(c.d.vConfig, 1, n, v.Model, strconv.Itoa(v.BlockTokens), strconv.Itoa(st.Capacity), "True")
			}
		}
	}
	for _, p := range pubs {
		st := p.src.Stats()
		n := p.name
		counter(c.d.evPublished, st.Events, n)
		counter(c.d.evBatches, st.Batches, n)
		counter(c.d.evBlocks, st.Blocks, n)
		counter(c.d.evDropped, st.DroppedEvents, n)
		counter(c.d.evBatchDropped, st.DroppedBatches, n)
		counter(c.d.evUnpublishable, st.Unpublishable, n)
		counter(c.d.evResyncs, st.Resyncs, n)
		counter(c.d.evSubDrops, st.SubscriberDrops, n)
		counter(c.d.evPeerRefused, st.Refused, n)
		counter(c.d.evBadReplays, st.MalformedReplays, n)
	}
	for _, h := range halves {
		st, n := h.src.Stats(), h.name
		ci := func(d *prometheus.Desc, v int64, l ...string) { counter(d, uint64(max(v, 0)), l...) }
		ci(c.d.hSessions, st.Sessions, n)
		ci(c.d.hQuarantined, st.Quarantined, n)
		for _, r := range []struct {
			reason string
			v      int64
		}{
			{"auth", st.AuthRefused - st.Downgrades}, {"downgrade", st.Downgrades}, {"frame", st.FramesRefused},
			{"limit", st.LimitRefused}, {"start_timeout", st.StartTimeouts}, {"duplicate", st.Duplicates},
			{"unauthorized", st.Unauthorized}, {"busy", st.Busy}, {"accept_error", st.AcceptErrors},
		} {
			ci(c.d.hRefusals, r.v, n, r.reason)
		}
		c.collectSessionBounds(ch, st, n)
	}
	for _, p := range planes {
		st, n := p.src.Stats(), p.name
		ci := func(d *prometheus.Desc, v int, l ...string) { counter(d, uint64(max(v, 0)), l...) }
		ci(c.d.pRefusals, st.RefusedAuth, n, "auth")
		ci(c.d.pRefusals, st.RefusedBusy, n, "busy")
		ci(c.d.pRefusals, st.RefusedAddr, n, "address")
		ci(c.d.pRefusals, st.Refused-st.RefusedAuth-st.RefusedBusy, n, "other")
		ci(c.d.pAcceptErrs, st.AcceptErrors, n)
		ci(c.d.pConns, st.Dials, n, "dial")
		ci(c.d.pConns, st.Reuses, n, "reuse")
		ci(c.d.pConns, st.IdleExpired, n, "idle_expired")
		ci(c.d.pConns, st.Stale, n, "stale")
		gauge(c.d.pIdle, float64(st.Idle), n)
		ci(c.d.pTransfers, st.Completed, n, "completed")
		ci(c.d.pTransfers, st.Failed, n, "failed")
		ci(c.d.pTransfers, st.Canceled, n, "canceled")
		counter(c.d.pBytes, uint64(max(st.Bytes, 0)), n)
	}
	c.transfer.Collect(ch)
	c.drain.Collect(ch)
	c.quarantine.Collect(ch)
	c.handoffs.Collect(ch)
}

// collectSessionBounds exports what a half's per-identity and session
// bounds did: proposals refused by an identity's caps
// (reason="identity_limit"), sessions refused by MaxSessions or an
// identity's session cap (reason="session_limit"), sessions closed
// idle, and the messages that crossed an end of their handoff.
func (c *Collector) collectSessionBounds(ch chan<- prometheus.Metric, st handoff.HalfStats, half string) {
	counter := func(d *prometheus.Desc, v int64, l ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(max(v, 0)), l...)
	}
	counter(c.d.hRefusals, st.IdentityRefused, half, "identity_limit")
	counter(c.d.hRefusals, st.SessionsRefused, half, "session_limit")
	counter(c.d.hIdleClosed, st.IdleClosed, half)
	counter(c.d.hCrossed, st.Crossed, half)
}

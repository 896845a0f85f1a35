package metrics

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/events"
	"github.com/kvlease/kvlease/handoff"
)

// clock is a manual clock for the histograms.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func newCollector(t *testing.T, opts Options) (*Collector, *prometheus.Registry, *clock) {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	c, err := New(reg, opts)
	require.NoError(t, err)
	clk := &clock{t: time.Unix(1000, 0)}
	c.now = clk.now
	return c, reg, clk
}

func newPool(t *testing.T, n int, opts ...kvlease.Option) *kvlease.Pool[[]byte] {
	t.Helper()
	mem, err := kvlease.NewHostMemory(n, 16)
	require.NoError(t, err)
	p, err := kvlease.NewPool[[]byte](mem, opts...)
	require.NoError(t, err)
	return p
}

// A pool taken through a resolved transfer, a drain and a quarantine
// that late evidence lifts: the state gauges, outcome counters and the
// three histograms read what happened.
func TestCollectorPoolScenario(t *testing.T) {
	c, reg, clk := newCollector(t, Options{Buckets: []float64{0.2, 0.4, 1, 4}})
	p := newPool(t, 8, kvlease.WithObserver(c.Observer("gpu")))
	require.NoError(t, c.AddPool("gpu", p))

	// A transfer resolved after 250ms; the lease closes after it: no drain.
	l1, err := p.Acquire("a", 2)
	require.NoError(t, err)
	t1 := kvlease.NewTransfer(nil)
	require.NoError(t, l1.Attach(t1))
	clk.advance(250 * time.Millisecond)
	t1.Resolve(nil)
	l1.Release()

	// Closed while its transfer is pending: a 500ms drain (and transfer).
	l2, err := p.Acquire("b", 2)
	require.NoError(t, err)
	t2 := kvlease.NewTransfer(nil)
	require.NoError(t, l2.Attach(t2))
	l2.Release()
	clk.advance(500 * time.Millisecond)
	t2.Resolve(errors.New("peer reset"))

	// Quarantined after 125ms, lifted by late evidence 2s later.
	l3, err := p.Acquire("c", 1)
	require.NoError(t, err)
	t3 := kvlease.NewTransfer(nil)
	require.NoError(t, l3.Attach(t3))
	clk.advance(125 * time.Millisecond)
	t3.Quarantine(nil)
	l3.Release()
	clk.advance(2 * time.Second)
	t3.Resolve(nil)

	_, err = p.Acquire("x", 9)
	require.ErrorIs(t, err, kvlease.ErrExceedsCapacity)
	open, err := p.Acquire("d", 1)
	require.NoError(t, err)
	defer open.Release()

	const want = `
# HELP kvlease_blocks Blocks by state (free, cached, leased, draining, quarantined); they sum to the capacity.
# TYPE kvlease_blocks gauge
kvlease_blocks{pool="gpu",state="cached"} 0
kvlease_blocks{pool="gpu",state="draining"} 0
kvlease_blocks{pool="gpu",state="free"} 7
kvlease_blocks{pool="gpu",state="leased"} 1
kvlease_blocks{pool="gpu",state="quarantined"} 0
# HELP kvlease_acquires_total Leases handed out.
# TYPE kvlease_acquires_total counter
kvlease_acquires_total{pool="gpu"} 4
# HELP kvlease_open_leases Leases acquired and not yet closed.
# TYPE kvlease_open_leases gauge
kvlease_open_leases{pool="gpu"} 1
# HELP kvlease_rejections_total Acquires that failed and allocated nothing, by reason.
# TYPE kvlease_rejections_total counter
kvlease_rejections_total{pool="gpu",reason="canceled"} 0
kvlease_rejections_total{pool="gpu",reason="closed"} 0
kvlease_rejections_total{pool="gpu",reason="exhausted"} 0
kvlease_rejections_total{pool="gpu",reason="invalid"} 1
kvlease_rejections_total{pool="gpu",reason="quarantine_bound"} 0
kvlease_rejections_total{pool="gpu",reason="quota"} 0
# HELP kvlease_transfers_total Transfers ended, once per lease they gated, by outcome (resolved, failed, quarantined).
# TYPE kvlease_transfers_total counter
kvlease_transfers_total{outcome="failed",pool="gpu"} 1
kvlease_transfers_total{outcome="quarantined",pool="gpu"} 1
kvlease_transfers_total{outcome="resolved",pool="gpu"} 1
# HELP kvlease_quarantines_total Leases that entered the quarantined state.
# TYPE kvlease_quarantines_total counter
kvlease_quarantines_total{pool="gpu"} 1
# HELP kvlease_quarantine_lifts_total Leases late evidence brought out of quarantine.
# TYPE kvlease_quarantine_lifts_total counter
kvlease_quarantine_lifts_total{pool="gpu"} 1
# HELP kvlease_transfer_duration_seconds From a transfer's attachment to a lease until it resolved or was quarantined.
# TYPE kvlease_transfer_duration_seconds histogram
kvlease_transfer_duration_seconds_bucket{pool="gpu",le="0.2"} 1
kvlease_transfer_duration_seconds_bucket{pool="gpu",le="0.4"} 2
kvlease_transfer_duration_seconds_bucket{pool="gpu",le="1"} 3
kvlease_transfer_duration_seconds_bucket{pool="gpu",le="4"} 3
kvlease_transfer_duration_seconds_bucket{pool="gpu",le="+Inf"} 3
kvlease_transfer_duration_seconds_sum{pool="gpu"} 0.875
kvlease_transfer_duration_seconds_count{pool="gpu"} 3
# HELP kvlease_drain_duration_seconds From the close of a lease with transfers still pending until it settled.
# TYPE kvlease_drain_duration_seconds histogram
kvlease_drain_duration_seconds_bucket{pool="gpu",le="0.2"} 0
kvlease_drain_duration_seconds_bucket{pool="gpu",le="0.4"} 0
kvlease_drain_duration_seconds_bucket{pool="gpu",le="1"} 1
kvlease_drain_duration_seconds_bucket{pool="gpu",le="4"} 1
kvlease_drain_duration_seconds_bucket{pool="gpu",le="+Inf"} 1
kvlease_drain_duration_seconds_sum{pool="gpu"} 0.5
kvlease_drain_duration_seconds_count{pool="gpu"} 1
# HELP kvlease_quarantine_duration_seconds From a lease entering quarantine until late evidence lifted it.
# TYPE kvlease_quarantine_duration_seconds histogram
kvlease_quarantine_duration_seconds_bucket{pool="gpu",le="0.2"} 0
kvlease_quarantine_duration_seconds_bucket{pool="gpu",le="0.4"} 0
kvlease_quarantine_duration_seconds_bucket{pool="gpu",le="1"} 0
kvlease_quarantine_duration_seconds_bucket{pool="gpu",le="4"} 1
kvlease_quarantine_duration_seconds_bucket{pool="gpu",le="+Inf"} 1
kvlease_quarantine_duration_seconds_sum{pool="gpu"} 2
kvlease_quarantine_duration_seconds_count{pool="gpu"} 1
`
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want),
		"kvlease_blocks", "kvlease_acquires_total", "kvlease_open_leases", "kvlease_rejections_total",
		"kvlease_transfers_total", "kvlease_quarantines_total", "kvlease_quarantine_lifts_total",
		"kvlease_transfer_duration_seconds", "kvlease_drain_duration_seconds", "kvlease_quarantine_duration_seconds"))

	// The same through the registry (pedantic: consistent descriptions).
	n, err := testutil.GatherAndCount(reg, "kvlease_blocks")
	require.NoError(t, err)
	require.Equal(t, 5, n)

	// Every interval ended: the observer keeps nothing.
	att, leases := c.Observer("gpu").(*poolObserver).tracked()
	require.Zero(t, att)
	require.Zero(t, leases)
	require.NoError(t, p.Check())
}

// The default metrics, with pools, publishers and handoffs, lint clean.
func TestCollectorLint(t *testing.T) {
	c, _, _ := newCollector(t, Options{ConstLabels: prometheus.Labels{"engine": "e0"}})
	p := newPool(t, 4, kvlease.WithObserver(c.Observer("gpu")))
	require.NoError(t, c.AddPool("gpu", p))
	require.NoError(t, c.AddPublisher("kv", fakePublisher{}))
	c.RecordHandoff(handoff.Delivered)
	_ = c.Observer("gpu").(*poolObserver) // histograms have a series
	problems, err := testutil.CollectAndLint(c)
	require.NoError(t, err)
	require.Empty(t, problems)
	n := testutil.CollectAndCount(c)
	require.Greater(t, n, 40, "every family has series")
}

// vLLM's names: usage counts cached blocks as free, queries and hits are
// in tokens, cache_config_info names the block size and block count. The
// linter objects only to the colons vLLM's names carry.
func TestCollectorVLLMNames(t *testing.T) {
	c, _, _ := newCollector(t, Options{VLLM: &VLLMOptions{Model: "llama", BlockTokens: 16}})
	p := newPool(t, 8, kvlease.WithBlockTokens(16))
	require.NoError(t, c.AddPool("0", p))

	tokens := make([]int32, 48)
	for i := range tokens {
		tokens[i] = int32(i + 1)
	}
	l, hits, err := p.AcquirePrefixTokens("a", 0, tokens, 3)
	require.NoError(t, err)
	require.Zero(t, hits)
	var parent kvlease.BlockHash
	for i := range 3 {
		parent, err = l.SealTokens(i, parent, tokens[16*i:16*(i+1)])
		require.NoError(t, err)
	}
	l.Release()
	l, hits, err = p.AcquirePrefixTokens("b", 0, tokens, 4)
	require.NoError(t, err)
	require.Equal(t, 2, hits, "never the block of the prompt's last token")
	defer l.Release()
	st := p.Stats()
	require.Equal(t, 4, st.Leased)
	require.Equal(t, 1, st.Cached)

	const want = `
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.5
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="llama"} 32
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="llama"} 64
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig.
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",model_name="llama",num_gpu_blocks="8"} 1
`
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want),
		"vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:cache_config_info"))

	problems, err := testutil.CollectAndLint(c)
	require.NoError(t, err)
	require.NotEmpty(t, problems)
	for _, pr := range problems {
		require.True(t, strings.HasPrefix(pr.Metric, "vllm:"), "%+v", pr)
	}
}

type fakePublisher struct{ st events.Stats }

func (f fakePublisher) Stats() events.Stats { return f.st }

// Publisher counters are read from the publisher's Stats.
func TestCollectorPublisher(t *testing.T) {
	c, _, _ := newCollector(t, Options{})
	require.NoError(t, c.AddPublisher("engine-0", fakePublisher{events.Stats{
		Batches: 3, Events: 10, Blocks: 40, DroppedBatches: 1, DroppedEvents: 7, Unpublishable: 2, Resyncs: 1,
		SubscriberDrops: 5, Refused: 1000, MalformedReplays: 4,
	}}))
	const want = `
# HELP kvlease_kv_events_published_total KV events handed to the PUB socket (a merged chain counts once).
# TYPE kvlease_kv_events_published_total counter
kvlease_kv_events_published_total{publisher="engine-0"} 10
# HELP kvlease_kv_events_dropped_total KV events the pools' rings dropped before the publisher drained them.
# TYPE kvlease_kv_events_dropped_total counter
kvlease_kv_events_dropped_total{publisher="engine-0"} 7
# HELP kvlease_kv_event_batches_dropped_total KV event batches dropped because the queue to the socket was full.
# TYPE kvlease_kv_event_batches_dropped_total counter
kvlease_kv_event_batches_dropped_total{publisher="engine-0"} 1
# HELP kvlease_kv_events_unpublishable_total Stored events without tokens, which routers cannot key (not sent).
# TYPE kvlease_kv_events_unpublishable_total counter
kvlease_kv_events_unpublishable_total{publisher="engine-0"} 2
# HELP kvlease_kv_event_resyncs_total AllBlocksCleared plus re-announcements sent after a loss.
# TYPE kvlease_kv_event_resyncs_total counter
kvlease_kv_event_resyncs_total{publisher="engine-0"} 1
# HELP kvlease_kv_event_subscriber_drops_total Messages dropped for one subscriber whose queue was at its high-water mark.
# TYPE kvlease_kv_event_subscriber_drops_total counter
kvlease_kv_event_subscriber_drops_total{publisher="engine-0"} 5
# HELP kvlease_kv_event_peers_refused_total Subscriber and replay connections refused over a cap or closed in their handshake (timeout, protocol violation).
# TYPE kvlease_kv_event_peers_refused_total counter
kvlease_kv_event_peers_refused_total{publisher="engine-0"} 1000
# HELP kvlease_kv_event_malformed_replays_total Replay requests of the wrong shape, ignored.
# TYPE kvlease_kv_event_malformed_replays_total counter
kvlease_kv_event_malformed_replays_total{publisher="engine-0"} 4
`
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want),
		"kvlease_kv_events_published_total", "kvlease_kv_events_dropped_total", "kvlease_kv_event_batches_dropped_total",
		"kvlease_kv_events_unpublishable_total", "kvlease_kv_event_resyncs_total",
		"kvlease_kv_event_subscriber_drops_total", "kvlease_kv_event_peers_refused_total", "kvlease_kv_event_malformed_replays_total"))
}

type fakeHandoff struct {
	done  chan struct{}
	state handoff.State
}

func (f *fakeHandoff) Done() <-chan struct{} { return f.done }
func (f *fakeHandoff) State() handoff.State  { return f.state }

// Handoff outcomes: final states and Quarantined count, others do not;
// WatchHandoff counts once the handoff is done.
func TestCollectorHandoffs(t *testing.T) {
	c, _, _ := newCollector(t, Options{})
	require.True(t, c.RecordHandoff(handoff.Delivered))
	require.True(t, c.RecordHandoff(handoff.Quarantined))
	require.False(t, c.RecordHandoff(handoff.Transferring))
	h := &fakeHandoff{done: make(chan struct{}), state: handoff.Failed}
	c.WatchHandoff(h)
	close(h.done)
	require.Eventually(t, func() bool {
		return testutil.ToFloat64(c.handoffs.WithLabelValues("failed")) == 1
	}, 10*time.Second, time.Millisecond)
	const want = `
# HELP kvlease_handoffs_total Handoffs by outcome (delivered, rejected, failed, aborted, quarantined).
# TYPE kvlease_handoffs_total counter
kvlease_handoffs_total{outcome="aborted"} 0
kvlease_handoffs_total{outcome="delivered"} 1
kvlease_handoffs_total{outcome="failed"} 1
kvlease_handoffs_total{outcome="quarantined"} 1
kvlease_handoffs_total{outcome="rejected"} 0
`
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want), "kvlease_handoffs_total"))
}

// Bad arguments are refused with ErrInvalid; registering two collectors
// of one namespace on one registry fails.
func TestCollectorErrors(t *testing.T) {
	_, err := New(nil, Options{})
	require.ErrorIs(t, err, ErrInvalid)
	require.ErrorIs(t, err, kvlease.ErrInvalidArgument)
	_, err = New(prometheus.NewRegistry(), Options{VLLM: &VLLMOptions{Model: "m"}})
	require.ErrorIs(t, err, ErrInvalid)
	reg := prometheus.NewRegistry()
	c, err := New(reg, Options{})
	require.NoError(t, err)
	_, err = New(reg, Options{})
	require.Error(t, err, "same descriptors twice")
	p := newPool(t, 2)
	require.NoError(t, c.AddPool("gpu", p))
	require.ErrorIs(t, c.AddPool("gpu", p), ErrInvalid)
	require.ErrorIs(t, c.AddPool("", p), ErrInvalid)
	require.ErrorIs(t, c.AddPool("cpu", nil), ErrInvalid)
	require.ErrorIs(t, c.AddPublisher("kv", nil), ErrInvalid)
	require.NoError(t, c.AddPublisher("kv", fakePublisher{}))
	require.ErrorIs(t, c.AddPublisher("kv", fakePublisher{}), ErrInvalid)
	require.Same(t, c.Observer("gpu"), c.Observer("gpu"))
}

// Concurrent leases, transfers and scrapes: every transfer is timed once,
// every drain once, and the observer ends holding nothing.
func TestCollectorConcurrent(t *testing.T) {
	c, reg, _ := newCollector(t, Options{})
	c.now = time.Now
	obs := c.Observer("gpu")
	p := newPool(t, 64, kvlease.WithObserver(obs))
	require.NoError(t, c.AddPool("gpu", p))
	const workers, rounds = 4, 200
	var wg sync.WaitGroup
	ctx, cancel := context.WithCancel(context.Background())
	scraped := make(chan struct{})
	go func() {
		defer close(scraped)
		for ctx.Err() == nil {
			if _, err := reg.Gather(); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range rounds {
				l, err := p.AcquireWait(context.Background(), "w", 2)
				if err != nil {
					t.Error(err)
					return
				}
				tr := kvlease.NewTransfer(nil)
				if err := l.Attach(tr); err != nil {
					t.Error(err)
					return
				}
				if (i+w)%2 == 0 {
					l.Release() // drains until the transfer resolves
					tr.Resolve(nil)
				} else {
					tr.Resolve(nil)
					l.Release()
				}
			}
		}()
	}
	wg.Wait()
	cancel()
	<-scraped
	hist := func(h *prometheus.HistogramVec) uint64 {
		m := &dtoMetric{}
		m.read(t, h.WithLabelValues("gpu"))
		return m.count
	}
	require.Equal(t, uint64(workers*rounds), hist(c.transfer))
	require.Equal(t, uint64(workers*rounds/2), hist(c.drain))
	att, leases := obs.(*poolObserver).tracked()
	require.Zero(t, att)
	require.Zero(t, leases)
	st := p.Stats()
	require.Equal(t, uint64(workers*rounds), st.TransfersResolved)
	require.Equal(t, 64, st.Free)
}

type fakeHalf struct{ s handoff.HalfStats }

func (f fakeHalf) Stats() handoff.HalfStats { return f.s }

type fakePlane struct{ s handoff.PlaneStats }

func (f fakePlane) Stats() handoff.PlaneStats { return f.s }

// TestCollectorHandoffRefusals: a half's and a data plane's refusals are
// exported by reason; the families lint clean.
func TestCollectorHandoffRefusals(t *testing.T) {
	c, _, _ := newCollector(t, Options{})
	require.NoError(t, c.AddHalf("decode", fakeHalf{handoff.HalfStats{Sessions: 3, AuthRefused: 5, Downgrades: 2, FramesRefused: 1,
		LimitRefused: 4, StartTimeouts: 1, Quarantined: 2, IdentityRefused: 6, SessionsRefused: 7, IdleClosed: 8, Crossed: 5}}))
	require.NoError(t, c.AddPlane("decode", fakePlane{handoff.PlaneStats{Refused: 9, RefusedAuth: 3, RefusedBusy: 4, AcceptErrors: 1,
		Dials: 2, Reuses: 7, IdleExpired: 1, Stale: 1, Idle: 1, Completed: 8, Failed: 1, Bytes: 1 << 20}}))
	require.ErrorIs(t, c.AddHalf("decode", fakeHalf{}), ErrInvalid)
	const want = `
# HELP kvlease_handoff_refusals_total What a handoff half refused, by reason (auth, downgrade, frame, limit, start_timeout, duplicate, unauthorized, busy, accept_error, identity_limit, session_limit).
# TYPE kvlease_handoff_refusals_total counter
kvlease_handoff_refusals_total{half="decode",reason="accept_error"} 0
kvlease_handoff_refusals_total{half="decode",reason="auth"} 3
kvlease_handoff_refusals_total{half="decode",reason="busy"} 0
kvlease_handoff_refusals_total{half="decode",reason="downgrade"} 2
kvlease_handoff_refusals_total{half="decode",reason="duplicate"} 0
kvlease_handoff_refusals_total{half="decode",reason="frame"} 1
kvlease_handoff_refusals_total{half="decode",reason="identity_limit"} 6
kvlease_handoff_refusals_total{half="decode",reason="limit"} 4
kvlease_handoff_refusals_total{half="decode",reason="session_limit"} 7
kvlease_handoff_refusals_total{half="decode",reason="start_timeout"} 1
kvlease_handoff_refusals_total{half="decode",reason="unauthorized"} 0
# HELP kvlease_handoff_sessions_idle_closed_total Control sessions a handoff destination closed after its SessionIdleTimeout with nothing in flight.
# TYPE kvlease_handoff_sessions_idle_closed_total counter
kvlease_handoff_sessions_idle_closed_total{half="decode"} 8
# HELP kvlease_handoff_messages_crossed_total Control messages that crossed this half's end of their handoff (an Accept, Reject or Done crossing the source's abort; a Start crossing the destination's abort or reject): expected, dropped, not protocol errors.
# TYPE kvlease_handoff_messages_crossed_total counter
kvlease_handoff_messages_crossed_total{half="decode"} 5
# HELP kvlease_handoff_data_refusals_total Data connections a TCP plane refused, by reason (auth, busy, address, other).
# TYPE kvlease_handoff_data_refusals_total counter
kvlease_handoff_data_refusals_total{plane="decode",reason="address"} 0
kvlease_handoff_data_refusals_total{plane="decode",reason="auth"} 3
kvlease_handoff_data_refusals_total{plane="decode",reason="busy"} 4
kvlease_handoff_data_refusals_total{plane="decode",reason="other"} 2
# HELP kvlease_handoff_data_connections_total A TCP plane's data connections, by event: dial (dialled or accepted), reuse (a handoff on a connection that had carried one), idle_expired (closed idle), stale (found closed by the peer before reuse).
# TYPE kvlease_handoff_data_connections_total counter
kvlease_handoff_data_connections_total{event="dial",plane="decode"} 2
kvlease_handoff_data_connections_total{event="idle_expired",plane="decode"} 1
kvlease_handoff_data_connections_total{event="reuse",plane="decode"} 7
kvlease_handoff_data_connections_total{event="stale",plane="decode"} 1
# HELP kvlease_handoff_data_idle_connections A TCP plane's data connections idle now, waiting for their next handoff.
# TYPE kvlease_handoff_data_idle_connections gauge
kvlease_handoff_data_idle_connections{plane="decode"} 1
# HELP kvlease_handoff_data_transfers_total Transfers a TCP plane ran, by outcome (completed, failed, canceled).
# TYPE kvlease_handoff_data_transfers_total counter
kvlease_handoff_data_transfers_total{outcome="canceled",plane="decode"} 0
kvlease_handoff_data_transfers_total{outcome="completed",plane="decode"} 8
kvlease_handoff_data_transfers_total{outcome="failed",plane="decode"} 1
# HELP kvlease_handoff_data_bytes_total Block bytes a TCP plane moved.
# TYPE kvlease_handoff_data_bytes_total counter
kvlease_handoff_data_bytes_total{plane="decode"} 1.048576e+06
`
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want), "kvlease_handoff_refusals_total", "kvlease_handoff_sessions_idle_closed_total", "kvlease_handoff_messages_crossed_total", "kvlease_handoff_data_refusals_total",
		"kvlease_handoff_data_connections_total", "kvlease_handoff_data_idle_connections", "kvlease_handoff_data_transfers_total", "kvlease_handoff_data_bytes_total"))
	problems, err := testutil.CollectAndLint(c)
	require.NoError(t, err)
	require.Empty(t, problems)
}

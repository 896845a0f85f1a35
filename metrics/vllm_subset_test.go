package metrics

import (
	"errors"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
)

// An engine that exports vllm:kv_cache_usage_perc and
// vllm:cache_config_info itself chooses the other two: both register on
// one registry without a collision, and only the chosen names appear.
func TestCollectorVLLMSubset(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	own := prometheus.NewGauge(prometheus.GaugeOpts{Name: VLLMKVCacheUsage, Help: "the engine's own"})
	require.NoError(t, reg.Register(own))
	require.NoError(t, reg.Register(prometheus.NewGauge(prometheus.GaugeOpts{Name: VLLMCacheConfigInfo, Help: "the engine's own"})))
	c, err := New(reg, Options{VLLM: &VLLMOptions{Model: "m", BlockTokens: 4,
		Names: []string{VLLMPrefixCacheQueries, VLLMPrefixCacheHits}}})
	require.NoError(t, err)
	p := newPool(t, 4, kvlease.WithBlockTokens(4))
	require.NoError(t, c.AddPool("0", p))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	var vllm []string
	for _, mf := range mfs {
		if strings.HasPrefix(mf.GetName(), "vllm:") {
			vllm = append(vllm, mf.GetName())
		}
	}
	require.ElementsMatch(t, []string{VLLMKVCacheUsage, VLLMCacheConfigInfo, VLLMPrefixCacheQueries, VLLMPrefixCacheHits}, vllm)
	require.Equal(t, 2, testutil.CollectAndCount(c, VLLMPrefixCacheQueries, VLLMPrefixCacheHits))
	require.Zero(t, testutil.CollectAndCount(c, VLLMKVCacheUsage, VLLMCacheConfigInfo))

	// All four on a registry that has one already: the collision New reports.
	_, err = New(reg, Options{Namespace: "x", VLLM: &VLLMOptions{Model: "m", BlockTokens: 4}})
	require.Error(t, err)

	// An empty list exports none; unknown or repeated names are refused.
	c2, err := New(prometheus.NewPedanticRegistry(), Options{VLLM: &VLLMOptions{Model: "m", BlockTokens: 4, Names: []string{}}})
	require.NoError(t, err)
	require.NoError(t, c2.AddPool("0", p))
	require.Zero(t, testutil.CollectAndCount(c2, VLLMNames...))
	for _, names := range [][]string{{"vllm:num_requests_running"}, {VLLMPrefixCacheHits, VLLMPrefixCacheHits}} {
		_, err := New(prometheus.NewPedanticRegistry(), Options{VLLM: &VLLMOptions{Model: "m", BlockTokens: 4, Names: names}})
		require.True(t, errors.Is(err, ErrInvalid) && errors.Is(err, kvlease.ErrInvalidArgument), "%v: %v", names, err)
	}
}

package metrics_test

import (
	"fmt"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/metrics"
)

// An engine that reports vllm:kv_cache_usage_perc itself takes only the
// prefix-cache counters from the collector.
func ExampleVLLMOptions() {
	reg := prometheus.NewRegistry()
	reg.MustRegister(prometheus.NewGauge(prometheus.GaugeOpts{Name: metrics.VLLMKVCacheUsage, Help: "the engine's own"}))
	c, err := metrics.New(reg, metrics.Options{VLLM: &metrics.VLLMOptions{
		Model: "llama", BlockTokens: 16,
		Names: []string{metrics.VLLMPrefixCacheQueries, metrics.VLLMPrefixCacheHits},
	}})
	if err != nil {
		panic(err)
	}
	mem, _ := kvlease.NewHostMemory(8, 64)
	pool, _ := kvlease.NewPool[[]byte](mem)
	_ = c.AddPool("gpu", pool)
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if strings.HasPrefix(mf.GetName(), "vllm:") {
			fmt.Println(mf.GetName())
		}
	}
	// Output:
	// vllm:kv_cache_usage_perc
	// vllm:prefix_cache_hits_total
	// vllm:prefix_cache_queries_total
}

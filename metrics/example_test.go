package metrics_test

import (
	"bufio"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/metrics"
)

// A pool exported on a registry of the caller's, served over HTTP the
// usual way (promhttp); the histograms are fed by the collector's
// observer.
func Example() {
	reg := prometheus.NewRegistry()
	c, err := metrics.New(reg, metrics.Options{})
	if err != nil {
		panic(err)
	}
	mem, err := kvlease.NewHostMemory(8, 4096)
	if err != nil {
		panic(err)
	}
	pool, err := kvlease.NewPool[[]byte](mem, kvlease.WithObserver(c.Observer("gpu")))
	if err != nil {
		panic(err)
	}
	if err := c.AddPool("gpu", pool); err != nil {
		panic(err)
	}
	l, err := pool.Acquire("req-1", 3)
	if err != nil {
		panic(err)
	}
	defer l.Release()

	// An engine serves it with http.Handle("/metrics", h); here a test server.
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	resp, err := http.Get(srv.URL + "/metrics")
	if err != nil {
		panic(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "kvlease_blocks{") {
			fmt.Println(sc.Text())
		}
	}
	// Output:
	// kvlease_blocks{pool="gpu",state="cached"} 0
	// kvlease_blocks{pool="gpu",state="draining"} 0
	// kvlease_blocks{pool="gpu",state="free"} 5
	// kvlease_blocks{pool="gpu",state="leased"} 3
	// kvlease_blocks{pool="gpu",state="quarantined"} 0
}

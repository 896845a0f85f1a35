// Command fleet runs a few engines' KV-cache workloads in one process,
// publishes each engine's KV events in vLLM's wire format (map-encoded,
// topic kv@<engine>@<model>) for a router to subscribe to, and serves
// Prometheus metrics. It stops by itself after -duration:
//
//	go run ./examples/fleet -events tcp://*:5557 -metrics 127.0.0.1:9400 -duration 10s
//
// One -events endpoint, several engines. Each engine has its own PUB
// socket and its own topic, following vLLM's rule for bind vs connect:
//
//   - an endpoint that binds (it contains "*" or "::", or is ipc://) is
//     the first engine's; engine i binds the same host at PORT+i, as vLLM
//     offsets the port for data-parallel ranks (a free port when PORT is
//     0 or PORT+i is taken; ipc paths get a "-i" suffix). A router dials
//     every engine.
//   - an endpoint that connects (tcp://127.0.0.1:PORT) is the router's:
//     the router binds it and every engine dials it, told apart by
//     topic.
//
// A publisher sends only to the subscribers it knows of: a router that
// joins late misses the first events (ZeroMQ's slow joiner; -replay lets
// it ask for them again). -wait-subscriber D holds the workloads until
// every engine has a subscriber, at most D. The test (main_test.go) is
// such a router: a ZeroMQ SUB socket that indexes the events and checks
// which engine holds the longest prefix of a few prompts.
//
// Without -events every engine binds a free port on 127.0.0.1 only, and
// so does the metrics server; the addresses are printed. tcp://*:PORT
// binds every interface: any host that reaches the port reads the token
// ids of every cached prompt, so the publisher logs that choice. Metrics are served at
// http://ADDR/metrics under kvlease's names and vLLM's
// (vllm:kv_cache_usage_perc and friends, engine label = engine name);
// -vllm-metrics=false leaves vLLM's out (their colons are reserved for
// recording rules: promtool check metrics reports them).
//
// -replay tcp://HOST:PORT binds each engine's replay ROUTER (engine i at
// PORT+i, as its PUB socket): a router that missed batches asks for them
// again from a sequence number (events.Config.ReplayEndpoint).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/events"
	"github.com/kvlease/kvlease/metrics"
)

const (
	blockTokens  = 16
	poolBlocks   = 64
	familyBlocks = 6 // a family's shared prefix after the system block
	suffixBlocks = 2 // each request's own tokens
)

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "fleet:", err)
		os.Exit(1)
	}
}

type engine struct {
	name   string
	pool   *kvlease.Pool[[]byte]
	pub    *events.Publisher
	family []int32
}

func run(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("fleet", flag.ContinueOnError)
	eventsEP := fs.String("events", "", "first engine's PUB endpoint (binds with * or ::, connects otherwise; empty: binds 127.0.0.1, free ports)")
	metricsAddr := fs.String("metrics", "127.0.0.1:0", "address of the Prometheus /metrics server")
	duration := fs.Duration("duration", 5*time.Second, "how long the workloads run")
	nEngines := fs.Int("engines", 3, "number of engines")
	model := fs.String("model", "llama", "model name (topic kv@<engine>@<model>)")
	seed := fs.Uint64("seed", 1, "workload seed")
	replayEP := fs.String("replay", "", "first engine's replay ROUTER endpoint to bind (engine i: PORT+i; empty: none)")
	vllmNames := fs.Bool("vllm-metrics", true, "also export vLLM's metric names (vllm:...)")
	waitSub := fs.Duration("wait-subscriber", 0, "before the workloads start, wait up to this long for a subscriber on every engine (0: start at once)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *nEngines < 1 || *nEngines > 16 {
		return fmt.Errorf("-engines %d: want 1..16", *nEngines)
	}
	if *duration <= 0 {
		return fmt.Errorf("-duration %v: want a positive duration", *duration)
	}

	reg := prometheus.NewRegistry()
	var mopts metrics.Options
	if *vllmNames {
		mopts.VLLM = &metrics.VLLMOptions{Model: *model, BlockTokens: blockTokens}
	}
	col, err := metrics.New(reg, mopts)
	if err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if *eventsEP == "" {
		*eventsEP = "tcp://127.0.0.1:0"
	}
	bind := *eventsEP == "tcp://127.0.0.1:0" || events.ShouldBind(*eventsEP)

	_, families := prompts(*seed, *nEngines)
	var engines []*engine
	defer func() {
		for _, e := range engines {
			_ = e.pub.Close()
		}
	}()
	for i := range *nEngines {
		e := &engine{name: fmt.Sprintf("engine-%d", i), family: families[i]}
		mem, err := kvlease.NewHostMemory(poolBlocks, 1024)
		if err != nil {
			return err
		}
		e.pool, err = kvlease.NewPool[[]byte](mem, kvlease.WithKVEvents(1<<14), kvlease.WithBlockTokens(blockTokens),
			kvlease.WithObserver(col.Observer(e.name)))
		if err != nil {
			return err
		}
		cfg := events.Config{Pod: e.name, Model: *model}
		if bind {
			e.pub, err = bindEngine(ctx, cfg, *eventsEP, *replayEP, i, e.pool)
		} else {
			cfg.Endpoint = *eventsEP
			if cfg.ReplayEndpoint, err = offsetEndpoint(*replayEP, i); err == nil {
				e.pub, err = events.Start(ctx, cfg, events.Source{Pool: e.pool})
			}
		}
		if err != nil {
			return fmt.Errorf("%s: %w", e.name, err)
		}
		engines = append(engines, e)
		where := "dials " + *eventsEP
		if bind {
			where = "binds " + dialAddr(e.pub, cfg.Endpoint)
		}
		fmt.Fprintf(out, "engine %s events %s topic %s\n", e.name, where, e.pub.Topic())
		if a := e.pub.ReplayAddr(); a != nil {
			fmt.Fprintf(out, "engine %s replay tcp://%s\n", e.name, a)
		}
		if err := col.AddPool(e.name, e.pool); err != nil {
			return err
		}
		if err := col.AddPublisher(e.name, e.pub); err != nil {
			return err
		}
	}

	ln, err := net.Listen("tcp", *metricsAddr)
	if err != nil {
		return fmt.Errorf("metrics listen %s: %w", *metricsAddr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	fmt.Fprintf(out, "metrics http://%s/metrics\n", ln.Addr())

	// A publisher only sends to subscribers it knows of: with
	// -wait-subscriber, wait for the router, or its first events would be
	// lost (ZeroMQ's slow joiner).
	if *waitSub > 0 {
		for _, e := range engines {
			if err := waitFor(*waitSub, func() bool { return len(e.pub.Subscriptions()) > 0 }); err != nil {
				return fmt.Errorf("%s: no subscriber within %v: %w", e.name, *waitSub, err)
			}
		}
	}

	fmt.Fprintf(out, "running %d engines for %v\n", len(engines), *duration)
	wctx, wcancel := context.WithTimeout(ctx, *duration)
	defer wcancel()
	var wg sync.WaitGroup
	for i, e := range engines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			workload(wctx, e, rand.New(rand.NewPCG(*seed, uint64(i)+1)))
		}()
	}
	wg.Wait()

	// Drain: every batch published has gone out to the subscribers.
	for _, e := range engines {
		fctx, fcancel := context.WithTimeout(ctx, 10*time.Second)
		err := e.pub.Flush(fctx)
		fcancel()
		if err != nil {
			return fmt.Errorf("%s: flush: %w", e.name, err)
		}
	}
	for _, e := range engines {
		if err := e.pool.CheckQuiescent(); err != nil { // the workload ended: nothing held
			return fmt.Errorf("%s: %w", e.name, err)
		}
		st := e.pub.Stats()
		ps := e.pool.Stats()
		fmt.Fprintf(out, "events %s published %d in %d batches, dropped %d, subscribers %d, blocks cached %d evicted %d\n",
			e.name, st.Events, st.Batches, st.DroppedBatches+st.DroppedEvents, len(e.pub.Subscriptions()), ps.Cached, ps.Evictions)
	}
	_ = srv.Close()
	for _, e := range engines {
		_ = e.pub.Close()
	}
	fmt.Fprintln(out, "fleet: done")
	return nil
}

// bindEngine binds engine i's publisher (and its replay socket, when rep
// is set): the endpoints themselves for engine 0, PORT+i for the others,
// or free ports on the same hosts when those are taken.
func bindEngine(ctx context.Context, cfg events.Config, ep, rep string, i int, pool *kvlease.Pool[[]byte]) (*events.Publisher, error) {
	cfg.Bind = true
	var err error
	if cfg.Endpoint, err = offsetEndpoint(ep, i); err != nil {
		return nil, err
	}
	if cfg.ReplayEndpoint, err = offsetEndpoint(rep, i); err != nil {
		return nil, err
	}
	p, err := events.Start(ctx, cfg, events.Source{Pool: pool})
	if err == nil || i == 0 || strings.HasPrefix(ep, "ipc://") {
		return p, err
	}
	cfg.Endpoint, cfg.ReplayEndpoint = freeEndpoint(ep), freeEndpoint(rep)
	return events.Start(ctx, cfg, events.Source{Pool: pool})
}

// offsetEndpoint is engine i's endpoint from the first engine's: PORT+i
// (a free port stays free), an ipc path with "-i"; "" stays "".
func offsetEndpoint(ep string, i int) (string, error) {
	switch {
	case ep == "" || i == 0:
		return ep, nil
	case strings.HasPrefix(ep, "ipc://"):
		return ep + "-" + strconv.Itoa(i), nil
	}
	host, port, err := splitTCP(ep)
	if err != nil || port == 0 {
		return ep, err
	}
	return fmt.Sprintf("tcp://%s:%d", host, port+i), nil
}

// freeEndpoint is ep's host with a free port ("" stays "").
func freeEndpoint(ep string) string {
	host, _, err := splitTCP(ep)
	if err != nil {
		return ep
	}
	return fmt.Sprintf("tcp://%s:0", host)
}

func splitTCP(ep string) (string, int, error) {
	rest, ok := strings.CutPrefix(ep, "tcp://")
	if !ok {
		return "", 0, fmt.Errorf("endpoint %q: want tcp://HOST:PORT, ipc:// or inproc://", ep)
	}
	i := strings.LastIndex(rest, ":")
	if i < 0 {
		return "", 0, fmt.Errorf("endpoint %q: no port", ep)
	}
	port, err := strconv.Atoi(rest[i+1:])
	if err != nil || port < 0 || port > 65535 {
		return "", 0, fmt.Errorf("endpoint %q: bad port", ep)
	}
	return rest[:i], port, nil
}

// dialAddr is where a local subscriber reaches a bound publisher.
func dialAddr(p *events.Publisher, ep string) string {
	if a, ok := p.Addr().(*net.TCPAddr); ok {
		if a.IP == nil || a.IP.IsUnspecified() {
			if strings.Contains(ep, "::") {
				return fmt.Sprintf("tcp://[::1]:%d", a.Port)
			}
			return fmt.Sprintf("tcp://127.0.0.1:%d", a.Port)
		}
		return "tcp://" + a.String()
	}
	return ep
}

// prompts draws, from seed, the system prompt every engine shares (one
// block) and each engine's family: the system prompt and the shared
// prefix of that engine's requests. A router that knows the seed (the
// test) builds the same prompts to route.
func prompts(seed uint64, engines int) (system []int32, families [][]int32) {
	rng := rand.New(rand.NewPCG(seed, 0))
	system = randomTokens(rng, blockTokens)
	for range engines {
		families = append(families, append(slices.Clone(system), randomTokens(rng, familyBlocks*blockTokens)...))
	}
	return system, families
}

func randomTokens(rng *rand.Rand, n int) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = rng.Int32N(32000)
	}
	return t
}

// workload serves requests of the engine's family until ctx ends: each
// prompt is the family prefix plus tokens of its own, looked up in the
// prefix cache, sealed where it missed, held a moment and released.
func workload(ctx context.Context, e *engine, rng *rand.Rand) {
	for r := 0; ctx.Err() == nil; r++ {
		prompt := append(slices.Clone(e.family), randomTokens(rng, suffixBlocks*blockTokens)...)
		full := len(prompt) / blockTokens
		l, hits, err := e.pool.AcquirePrefixTokens(fmt.Sprintf("%s/req-%d", e.name, r), 0, prompt, full+1)
		if err != nil {
			time.Sleep(time.Millisecond)
			continue
		}
		hashes := kvlease.ChainHashes(0, prompt, blockTokens)
		for b := hits; b < full; b++ {
			var parent kvlease.BlockHash
			if b > 0 {
				parent = hashes[b-1]
			}
			if _, err := l.SealTokens(b, parent, prompt[b*blockTokens:(b+1)*blockTokens]); err != nil {
				break
			}
		}
		select { // decoding
		case <-ctx.Done():
		case <-time.After(time.Millisecond):
		}
		l.Release()
	}
}

func waitFor(limit time.Duration, ok func() bool) error {
	deadline := time.Now().Add(limit)
	for !ok() {
		if time.Now().After(deadline) {
			return errors.New("timed out")
		}
		time.Sleep(2 * time.Millisecond)
	}
	return nil
}

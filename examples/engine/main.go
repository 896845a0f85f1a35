// Command engine is a reference serving engine on kvlease: an OpenAI-style
// completions API over a simulated model, built the way a real Go engine
// would use the library. It is the file to copy from.
//
//	go run ./examples/engine                       # serves http://127.0.0.1:8000
//	go run ./examples/engine -addr 127.0.0.1:0 -events 'tcp://*:5557' -metrics 127.0.0.1:9400
//
//	curl -s 127.0.0.1:8000/v1/models
//	curl -s 127.0.0.1:8000/v1/completions -d '{"model":"sim-1","prompt":"the same system prompt then a question","max_tokens":8}'
//	curl -sN 127.0.0.1:8000/v1/completions -d '{"prompt":[1,2,3,4,5],"stream":true,"stream_options":{"include_usage":true}}'
//
// What each piece of kvlease does here:
//
//   - kvlease.Pool with WithBlockTokens: the KV blocks; Pool.NewSequence
//     admits a request with its prefix hits (usage.prompt_tokens_details.
//     cached_tokens is Sequence.CachedTokens), and the Sequence grows the
//     lease and seals each block as the scheduler commits tokens.
//   - handoff.Envelope: the limits; CheckRequest refuses a request that could
//     never fit before anything is queued or acquired.
//   - a continuous-batching scheduler (engine.go) with a running limit,
//     chunked prefill and a reservation of each running request's growth.
//   - the client's context: when it goes away, the scheduler aborts the
//     request's lease at the next step; its sealed blocks stay cached.
//   - LoRA adapters (-lora): one pool serves them all; each request's lease
//     carries its adapter's tag, so its blocks' KV events say lora_id and
//     lora_name; /v1/unload_lora_adapter lowers the adapter's blocks to
//     the first evicted retention class (Pool.SetAdapterRetention).
//   - tenants (-api-keys FILE): a bearer key names a tenant, and
//     Pool.TenantSeed derives the tenant's namespace from a secret the
//     pool holds: tenants never hit or time each other's prefixes, even
//     with the same cache_salt.
//   - events.Publisher (-events): KV events for a cache-aware router.
//   - metrics.Collector (/metrics, and -metrics for a second listener):
//     per-state block gauges and vLLM's names for a scheduler that scores
//     engines.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/events"
	"github.com/kvlease/kvlease/metrics"
)

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "engine:", err)
		os.Exit(1)
	}
}

// options are the command's flags.
type options struct {
	addr, events, metrics string
	eventsBind            bool // bind -events whatever vLLM's rule says (tests bind 127.0.0.1:0)
	cfg                   Config
	duration              time.Duration
}

func parseFlags(args []string, out io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("engine", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.StringVar(&o.addr, "addr", "127.0.0.1:8000", "where the API listens (127.0.0.1:0: a free port)")
	fs.StringVar(&o.events, "events", "", "KV events PUB endpoint for a router, e.g. tcp://*:5557 (empty: none)")
	fs.StringVar(&o.metrics, "metrics", "", "a second listener for /metrics only (it is also on -addr)")
	fs.StringVar(&o.cfg.Model, "model", "sim-1", "the base model's served name")
	adapters := fs.String("lora", "sim-1-sql,sim-1-chat", "LoRA adapters served on the base model, comma-separated")
	fs.IntVar(&o.cfg.Blocks, "blocks", 4096, "KV blocks in the pool")
	fs.IntVar(&o.cfg.BlockTokens, "block-tokens", 16, "tokens per block")
	fs.IntVar(&o.cfg.MaxRunning, "max-running", 64, "requests in the running batch")
	fs.IntVar(&o.cfg.MaxContext, "max-context", 8192, "prompt plus generated tokens, at most")
	fs.IntVar(&o.cfg.PrefillChunk, "prefill-chunk", 512, "prompt tokens one request prefills per step")
	fs.DurationVar(&o.cfg.PrefillBlockTime, "prefill-block-time", 100*time.Microsecond, "simulated time to prefill one block")
	fs.DurationVar(&o.cfg.DecodeTokenTime, "decode-token-time", 200*time.Microsecond, "simulated time to decode one token of one request")
	keysFile := fs.String("api-keys", "", "a file of KEY=TENANT lines, private to its user: requests need a bearer key and each tenant's prefixes are isolated (empty: open, one namespace per model)")
	fs.DurationVar(&o.duration, "duration", 0, "exit after this long (0: run until interrupted)")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	for _, a := range strings.Split(*adapters, ",") {
		if a = strings.TrimSpace(a); a != "" {
			o.cfg.Adapters = append(o.cfg.Adapters, a)
		}
	}
	if *keysFile != "" {
		keys, err := readAPIKeys(*keysFile)
		if err != nil {
			return o, err
		}
		o.cfg.APIKeys = keys
	}
	return o, nil
}

// maxKeysFile bounds the API keys file.
const maxKeysFile = 1 << 20

// readAPIKeys reads KEY=TENANT lines (blank lines and # comments
// skipped). Keys are secrets: they never go on a command line, and the
// file must not be readable by anyone but its owner.
func readAPIKeys(path string) (map[string]string, error) {
	// One open: the mode checked is the mode of the file read.
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("-api-keys %s: mode %v lets others read the keys; chmod 600 it", path, fi.Mode().Perm())
	}
	if fi.Size() > maxKeysFile {
		return nil, fmt.Errorf("-api-keys %s: %d bytes, more than %d", path, fi.Size(), maxKeysFile)
	}
	data, err := io.ReadAll(io.LimitReader(f, maxKeysFile))
	if err != nil {
		return nil, err
	}
	keys := map[string]string{}
	for i, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, t, ok := strings.Cut(line, "=")
		if k, t = strings.TrimSpace(k), strings.TrimSpace(t); !ok || k == "" || t == "" {
			return nil, fmt.Errorf("-api-keys %s:%d: not KEY=TENANT", path, i+1)
		}
		keys[k] = t
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("-api-keys %s: no keys", path)
	}
	return keys, nil
}

// app is a running engine with its listeners.
type app struct {
	engine  *Engine
	pub     *events.Publisher
	srv     *http.Server
	addr    net.Addr
	msrv    *http.Server
	maddr   net.Addr
	reg     *prometheus.Registry
	collect *metrics.Collector
}

// start builds the engine, its publisher and its metrics, and serves.
func start(o options) (*app, error) {
	a := &app{reg: prometheus.NewRegistry()}
	var err error
	a.collect, err = metrics.New(a.reg, metrics.Options{
		VLLM: &metrics.VLLMOptions{Model: o.cfg.Model, BlockTokens: o.cfg.BlockTokens},
	})
	if err != nil {
		return nil, err
	}
	cfg := o.cfg
	cfg.PoolOptions = append(cfg.PoolOptions, kvlease.WithObserver(a.collect.Observer("gpu")))
	if o.events != "" {
		cfg.PoolOptions = append(cfg.PoolOptions, kvlease.WithKVEvents(1<<16))
	}
	a.engine, err = NewEngine(cfg)
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			a.Close()
		}
	}()
	if err := a.collect.AddPool("gpu", a.engine.Pool()); err != nil {
		return nil, err
	}
	if o.events != "" {
		a.pub, err = events.NewPublisher(events.Config{Endpoint: o.events, Bind: o.eventsBind, Pod: "engine-0", Model: o.cfg.Model},
			events.Source{Pool: a.engine.Pool()})
		if err != nil {
			return nil, fmt.Errorf("events %s: %w", o.events, err)
		}
		if err := a.collect.AddPublisher("engine-0", a.pub); err != nil {
			return nil, err
		}
	}
	mh := promhttp.HandlerFor(a.reg, promhttp.HandlerOpts{})
	mux := http.NewServeMux()
	(&server{e: a.engine, now: time.Now}).routes(mux)
	mux.Handle("GET /metrics", mh)
	if a.srv, a.addr, err = serve(o.addr, mux); err != nil {
		return nil, err
	}
	if o.metrics != "" {
		mm := http.NewServeMux()
		mm.Handle("GET /metrics", mh)
		if a.msrv, a.maddr, err = serve(o.metrics, mm); err != nil {
			return nil, err
		}
	}
	ok = true
	return a, nil
}

func serve(addr string, h http.Handler) (*http.Server, net.Addr, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, nil, err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: time.Minute}
	go func() { _ = srv.Serve(ln) }()
	return srv, ln.Addr(), nil
}

// Close stops the listeners, then the scheduler (requests in flight end
// and release their leases), then the publisher.
func (a *app) Close() {
	if a.srv != nil {
		_ = a.srv.Close()
	}
	if a.msrv != nil {
		_ = a.msrv.Close()
	}
	if a.engine != nil {
		a.engine.Close()
	}
	if a.pub != nil {
		_ = a.pub.Close()
	}
}

func run(ctx context.Context, args []string, out io.Writer) error {
	o, err := parseFlags(args, out)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	a, err := start(o)
	if err != nil {
		return err
	}
	defer a.Close()
	fmt.Fprintf(out, "engine serving %s on http://%s/v1/completions (models: %s)\n",
		o.cfg.Model, a.addr, strings.Join(a.engine.Models(), ", "))
	fmt.Fprintf(out, "metrics http://%s/metrics\n", a.addr)
	if a.maddr != nil {
		fmt.Fprintf(out, "metrics http://%s/metrics\n", a.maddr)
	}
	if a.pub != nil {
		fmt.Fprintf(out, "events %s topic %s\n", a.pub.Addr(), a.pub.Topic())
	}
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt)
	defer stop()
	if o.duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, o.duration)
		defer cancel()
	}
	<-ctx.Done()
	a.engine.Close() // requests in flight end: the pool must be at rest (CheckQuiescent)
	st := a.engine.Pool().Stats()
	fmt.Fprintf(out, "engine: finished %d aborted %d kv mismatches %d; blocks leased %d draining %d; check %v\n",
		a.engine.finished.Load(), a.engine.aborted.Load(), a.engine.kvMismatches.Load(), st.Leased, st.Draining, a.engine.Pool().CheckQuiescent())
	return nil
}

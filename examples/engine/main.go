// Command engine is a reference serving engine on kvlease: an OpenAI-style
// API (completions and chat completions) over a simulated model, built
// the way a real Go engine would use the library. It is the file to copy
// from. Any OpenAI client can use it (the official Node SDK is tested
// against it in .ci/steps/72-openai-node.sh).
//
//	go run ./examples/engine                       # serves http://127.0.0.1:8000
//	go run ./examples/engine -addr 127.0.0.1:0 -events tcp://127.0.0.1:5557 -replay tcp://127.0.0.1:5558 -metrics 127.0.0.1:9400
//
//	curl -s 127.0.0.1:8000/v1/models
//	P="a system prompt long enough to fill one block of sixteen tokens and then some more words, then the question"
//	curl -s 127.0.0.1:8000/v1/completions -d '{"model":"sim-1","prompt":"'"$P"'","max_tokens":8}'  # twice: the second has cached_tokens 16
//	curl -s 127.0.0.1:8000/v1/chat/completions -d '{"messages":[{"role":"user","content":"hello there"}]}'
//	curl -sN 127.0.0.1:8000/v1/completions -d '{"prompt":[1,2,3,4,5],"stream":true,"stream_options":{"include_usage":true}}'
//
// What each piece of kvlease does here:
//
//   - kvlease.Pool with WithBlockTokens: the KV blocks; Pool.Admit
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
//     with the same cache_salt. Each tenant is registered with the pool
//     (Pool.Tenant) and its requests run under it (SequenceSpec.Tenant):
//     its blocks are charged to it under the quota the key file gives
//     (kvlease.Quota: a cap on the blocks it holds, a reservation of its
//     cached blocks that other tenants' demand cannot evict), their KV
//     events carry its public namespace identifier (Tenant.Namespace,
//     never its name), and the -metrics listener's /metrics reports each
//     tenant's usage (metrics.NewTenantCollector: the first 64 tenants by
//     name, the rest as tenant="other"); the API address's /metrics, which
//     every tenant's key reaches, has no per-tenant series.
//
// The API key file (-api-keys) holds one key a line, private to its user
// (mode 0600 or stricter; at most 1 MiB); blank lines and lines starting
// with # are skipped:
//
//	KEY=TENANT [cap=N] [reserve=M]
//
// KEY is the bearer token a client sends, TENANT the name its requests
// run under (several keys may name one tenant). cap=N caps the KV blocks
// the tenant holds at once, its running requests' and its cached ones
// (0 or absent: no cap); a request that could not fit within the cap,
// with its max_tokens, beside the tenant's running requests is refused
// with HTTP 429 (insufficient_quota). reserve=M keeps the tenant's M most
// recently cached blocks from other tenants' evictions (at most the cap
// when there is one). A tenant's quota may be given on any of its lines;
// two lines that give it different quotas are refused. Old files of
// KEY=TENANT lines alone work as before: tenants without quotas.
//   - events.Publisher (-events, bound where it says, loopback included;
//     -replay for its replay ROUTER): KV events for a cache-aware router.
//   - metrics.Collector (/metrics, and -metrics for a second listener):
//     per-state block gauges and vLLM's names for a scheduler that scores
//     engines (-vllm-metrics=false leaves those out: their colons are
//     reserved for recording rules, and promtool reports them).
//
// What a client cannot do to it: send a body without a key (the key is
// checked before the body is read), trickle a body (-read-timeout), hold
// more than -max-conns-per-addr connections from one address, queue more
// than -max-waiting requests (503 with Retry-After), make a request
// reserve memory for its max_tokens (a request's output waits in a small
// fixed buffer; a client that does not read stalls only its own
// request), or touch the adapter endpoints without the admin key
// (-admin-key-file; refused when there is none, unless -open-admin).
package main

import (
	"context"
	"crypto/sha256"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
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
	addr, events, replay, metrics string
	eventsConnect                 bool // dial -events (a router's bound SUB) instead of binding it
	vllmMetrics                   bool
	readTimeout                   time.Duration
	connsPerAddr                  int
	adminKey                      string // the adapter endpoints' key ("" with openAdmin or refused)
	openAdmin                     bool
	cfg                           Config
	duration                      time.Duration
}

func parseFlags(args []string, out io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("engine", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.StringVar(&o.addr, "addr", "127.0.0.1:8000", "where the API listens (127.0.0.1:0: a free port)")
	fs.StringVar(&o.events, "events", "", "KV events PUB endpoint to bind, e.g. tcp://127.0.0.1:5557, or tcp://*:5557 for every interface (empty: none)")
	fs.BoolVar(&o.eventsConnect, "events-connect", false, "dial -events (a router's bound SUB socket) instead of binding it")
	fs.StringVar(&o.replay, "replay", "", "KV events replay ROUTER endpoint to bind, e.g. tcp://127.0.0.1:5558 (needs -events)")
	fs.StringVar(&o.metrics, "metrics", "", "a second listener for /metrics only (it is also on -addr)")
	fs.BoolVar(&o.vllmMetrics, "vllm-metrics", true, "also export vLLM's metric names (vllm:...) for schedulers that score vLLM engines")
	fs.StringVar(&o.cfg.Model, "model", "sim-1", "the base model's served name")
	adapters := fs.String("lora", "sim-1-sql,sim-1-chat", "LoRA adapters served on the base model, comma-separated")
	fs.IntVar(&o.cfg.Blocks, "blocks", 4096, "KV blocks in the pool")
	fs.IntVar(&o.cfg.BlockTokens, "block-tokens", 16, "tokens per block")
	fs.IntVar(&o.cfg.MaxRunning, "max-running", 64, "requests in the running batch")
	fs.IntVar(&o.cfg.MaxContext, "max-context", 8192, "prompt plus generated tokens, at most")
	fs.IntVar(&o.cfg.PrefillChunk, "prefill-chunk", 512, "prompt tokens one request prefills per step")
	fs.DurationVar(&o.cfg.PrefillBlockTime, "prefill-block-time", 100*time.Microsecond, "simulated time to prefill one block")
	fs.DurationVar(&o.cfg.DecodeTokenTime, "decode-token-time", 200*time.Microsecond, "simulated time to decode one token of one request")
	keysFile := fs.String("api-keys", "", "a file of KEY=TENANT [cap=N] [reserve=M] lines, private to its user: requests need a bearer key, each tenant's prefixes are isolated and its blocks held under its quota (empty: open, one namespace per model)")
	adminFile := fs.String("admin-key-file", "", "a file holding the key the adapter endpoints require, private to its user")
	fs.BoolVar(&o.openAdmin, "open-admin", false, "serve the adapter endpoints to anyone, without a key")
	fs.DurationVar(&o.readTimeout, "read-timeout", 30*time.Second, "how long a client may take to send a request's headers and body")
	fs.IntVar(&o.connsPerAddr, "max-conns-per-addr", 64, "connections one remote address may hold open")
	fs.IntVar(&o.cfg.MaxWaiting, "max-waiting", 256, "requests waiting for the running batch; more are answered 503 with Retry-After")
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
		keys, quotas, err := readAPIKeys(*keysFile)
		if err != nil {
			return o, err
		}
		o.cfg.APIKeys, o.cfg.Quotas = keys, quotas
	}
	if *adminFile != "" {
		key, err := readAdminKey(*adminFile)
		if err != nil {
			return o, err
		}
		o.adminKey = key
	}
	switch {
	case o.replay != "" && o.events == "":
		return o, errors.New("-replay needs -events")
	case o.readTimeout <= 0:
		return o, fmt.Errorf("-read-timeout %v: want a positive duration", o.readTimeout)
	case o.connsPerAddr < 1:
		return o, fmt.Errorf("-max-conns-per-addr %d: want at least 1", o.connsPerAddr)
	}
	return o, nil
}

// maxKeysFile bounds the API keys file.
const maxKeysFile = 1 << 20

// readSecretFile reads a file of secrets (for flag): it must not be
// readable by anyone but its owner, and at most maxKeysFile bytes. Keys
// never go on a command line.
func readSecretFile(flag, path string) ([]byte, error) {
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
		return nil, fmt.Errorf("-%s %s: mode %v lets others read the keys; chmod 600 it", flag, path, fi.Mode().Perm())
	}
	if fi.Size() > maxKeysFile {
		return nil, fmt.Errorf("-%s %s: %d bytes, more than %d", flag, path, fi.Size(), maxKeysFile)
	}
	return io.ReadAll(io.LimitReader(f, maxKeysFile))
}

// readAdminKey reads the admin key: the file's one non-blank line.
func readAdminKey(path string) (string, error) {
	data, err := readSecretFile("admin-key-file", path)
	if err != nil {
		return "", err
	}
	key := strings.TrimSpace(string(data))
	if key == "" || strings.ContainsAny(key, "\r\n") {
		return "", fmt.Errorf("-admin-key-file %s: want one key on one line", path)
	}
	return key, nil
}

// readAPIKeys reads KEY=TENANT [cap=N] [reserve=M] lines (blank lines
// and # comments skipped), from a file only its owner can read: the keys'
// tenants, and the tenants' quotas.
func readAPIKeys(path string) (map[string]string, map[string]kvlease.Quota, error) {
	data, err := readSecretFile("api-keys", path)
	if err != nil {
		return nil, nil, err
	}
	keys := map[string]string{}
	quotas := map[string]kvlease.Quota{}
	for i, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		// (No key or tenant in an error: the file is a secret.)
		k, rest, ok := strings.Cut(line, "=")
		fields := strings.Fields(rest)
		if k = strings.TrimSpace(k); !ok || k == "" || len(fields) == 0 {
			return nil, nil, fmt.Errorf("-api-keys %s:%d: not KEY=TENANT [cap=N] [reserve=M]", path, i+1)
		}
		t := fields[0]
		q, given, err := parseQuota(fields[1:])
		if err != nil {
			return nil, nil, fmt.Errorf("-api-keys %s:%d: %v", path, i+1, err)
		}
		if given {
			if old, dup := quotas[t]; dup && old != q {
				return nil, nil, fmt.Errorf("-api-keys %s:%d: the tenant's quota differs from an earlier line's", path, i+1)
			}
			quotas[t] = q
		}
		keys[k] = t
	}
	if len(keys) == 0 {
		return nil, nil, fmt.Errorf("-api-keys %s: no keys", path)
	}
	return keys, quotas, nil
}

// parseQuota reads a key line's cap=N and reserve=M fields (each at most
// once, non-negative integers); given says whether there were any.
func parseQuota(fields []string) (q kvlease.Quota, given bool, err error) {
	seen := map[string]bool{}
	for _, f := range fields {
		name, v, ok := strings.Cut(f, "=")
		n, perr := strconv.Atoi(v)
		if !ok || perr != nil || n < 0 || seen[name] || (name != "cap" && name != "reserve") {
			return kvlease.Quota{}, false, fmt.Errorf("%q: want cap=N or reserve=M, each at most once, N and M whole numbers of blocks", f)
		}
		seen[name] = true
		if name == "cap" {
			q.Cap = n
		} else {
			q.Reserve = n
		}
	}
	if q.Cap > 0 && q.Reserve > q.Cap {
		return kvlease.Quota{}, false, fmt.Errorf("reserve=%d above cap=%d", q.Reserve, q.Cap)
	}
	return q, len(fields) > 0, nil
}

// app is a running engine with its listeners.
type app struct {
	engine  *Engine
	pub     *events.Publisher
	srv     *http.Server
	addr    net.Addr
	conns   *connLimiter
	msrv    *http.Server
	maddr   net.Addr
	reg     *prometheus.Registry
	collect *metrics.Collector
}

// start builds the engine, its publisher and its metrics, and serves.
func start(o options) (*app, error) {
	a := &app{reg: prometheus.NewRegistry()}
	var err error
	var mopts metrics.Options
	if o.vllmMetrics {
		mopts.VLLM = &metrics.VLLMOptions{Model: o.cfg.Model, BlockTokens: o.cfg.BlockTokens}
	}
	if a.collect, err = metrics.New(a.reg, mopts); err != nil {
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
	treg := prometheus.NewRegistry()
	if len(cfg.APIKeys) > 0 {
		// Per-tenant usage: bounded series (the first tenants registered,
		// then tenant="other"), a snapshot per scrape. They name tenants,
		// so they are served only on the operator's -metrics listener,
		// never on the API address that every tenant's key reaches.
		tc, err := metrics.NewTenantCollector(treg, metrics.TenantOptions{})
		if err != nil {
			return nil, err
		}
		if err := tc.AddPool("gpu", a.engine.Pool()); err != nil {
			return nil, err
		}
	}
	if o.events != "" {
		// The engine's PUB socket binds where -events says, loopback
		// included (vLLM's rule would dial an endpoint without "*"):
		// -events-connect dials it instead.
		a.pub, err = events.NewPublisher(events.Config{Endpoint: o.events, Bind: !o.eventsConnect, ReplayEndpoint: o.replay,
			Pod: "engine-0", Model: o.cfg.Model}, events.Source{Pool: a.engine.Pool()})
		if err != nil {
			return nil, fmt.Errorf("events %s: %w", o.events, err)
		}
		if err := a.collect.AddPublisher("engine-0", a.pub); err != nil {
			return nil, err
		}
	}
	mh := promhttp.HandlerFor(a.reg, promhttp.HandlerOpts{})
	s := &server{e: a.engine, now: time.Now, openAdmin: o.openAdmin}
	if o.adminKey != "" {
		d := sha256.Sum256([]byte(o.adminKey))
		s.adminKey = &d
	}
	mux := http.NewServeMux()
	s.routes(mux, map[string]http.Handler{"/metrics": mh})
	if a.srv, a.addr, a.conns, err = serve(o.addr, mux, o); err != nil {
		return nil, err
	}
	if o.metrics != "" {
		mm := http.NewServeMux()
		all := promhttp.HandlerFor(prometheus.Gatherers{a.reg, treg}, promhttp.HandlerOpts{})
		route(mm, "/metrics", map[string]http.HandlerFunc{"GET": all.ServeHTTP})
		route(mm, "/", nil)
		if a.msrv, a.maddr, _, err = serve(o.metrics, mm, o); err != nil {
			return nil, err
		}
	}
	ok = true
	return a, nil
}

// serve listens on addr and serves h: a client has readTimeout to send a
// request's headers and body (net/http lifts the deadline once the body
// is read, so a long stream is not cut) and holds at most connsPerAddr
// connections.
func serve(addr string, h http.Handler, o options) (*http.Server, net.Addr, *connLimiter, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, nil, nil, err
	}
	lim := limitConns(ln, o.connsPerAddr)
	srv := &http.Server{Handler: h, ReadHeaderTimeout: min(10*time.Second, o.readTimeout), ReadTimeout: o.readTimeout,
		IdleTimeout: time.Minute}
	go func() { _ = srv.Serve(lim) }()
	return srv, ln.Addr(), lim, nil
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
	switch {
	case a.pub != nil && o.eventsConnect:
		fmt.Fprintf(out, "events dials %s topic %s\n", o.events, a.pub.Topic())
	case a.pub != nil:
		fmt.Fprintf(out, "events %s topic %s\n", a.pub.Addr(), a.pub.Topic())
	}
	if a.pub != nil && a.pub.ReplayAddr() != nil {
		fmt.Fprintf(out, "replay %s\n", a.pub.ReplayAddr())
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

package main

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"

	"go.uber.org/atomic"
)

// Config is the engine's shape: its pool, its batch and its simulated
// model's speed.
type Config struct {
	Model       string   // the base model's served name
	Adapters    []string // LoRA adapters served on top of it (ids 1, 2, ... in this order)
	Blocks      int      // KV blocks in the pool
	BlockTokens int      // tokens per block
	MaxRunning  int      // requests in the running batch at once
	MaxContext  int      // prompt plus generated tokens, at most
	// PrefillChunk is the most prompt tokens one request prefills in one
	// step (chunked prefill); the envelope's MaxPrefillTokens.
	PrefillChunk int
	// PrefillBlockTime and DecodeTokenTime are the simulated model's
	// speed: one step lasts PrefillBlockTime per block of prompt it
	// prefills (rounded up per request) plus DecodeTokenTime per request
	// it decodes a token for.
	PrefillBlockTime time.Duration
	DecodeTokenTime  time.Duration
	// MaxWaiting bounds the requests queued for the running batch: one
	// more is refused at once (errBusy: HTTP 503 with Retry-After) rather
	// than held, so a burst costs a bounded amount of memory.
	MaxWaiting int
	// APIKeys maps a bearer token to its tenant. When set, every request
	// must carry one, and each tenant's prompts live in a namespace
	// derived from a secret the pool holds (Pool.TenantSeed): tenants
	// never hit, or time, each other's prefixes, whatever cache_salt they
	// send. Requests of one tenant share as usual.
	APIKeys map[string]string
	// Quotas gives tenants of APIKeys their quotas (kvlease.Quota):
	// a tenant's requests are charged to it (SequenceSpec.Tenant), and
	// one that could not fit within its cap beside its running requests
	// is refused (kvlease.ErrQuota; HTTP 429). A tenant without one has
	// no cap and no reservation.
	Quotas map[string]kvlease.Quota
	// PoolOptions are added to the pool's (WithKVEvents for a publisher,
	// an observer for metrics).
	PoolOptions []kvlease.Option
}

// Engine is a continuous-batching scheduler over one kvlease pool: the
// shape of a real serving engine, with a simulated model. Requests come
// in through Submit; one goroutine (run) admits them into the running
// batch, steps the model over the batch, and hands each request its
// tokens on a channel.
type Engine struct {
	cfg   Config
	env   handoff.Envelope
	pool  *kvlease.Pool[[]byte]
	seeds map[string]kvlease.BlockHash // model name → its namespace
	// tenants maps the SHA-256 of each API key to its tenant: a lookup
	// compares digests, never the secret itself byte by byte.
	tenants map[[sha256.Size]byte]string
	quotaed map[string]*kvlease.Tenant[[]byte] // tenants with a cap, by name
	loras   map[string]kvlease.Adapter         // adapter name → its tag (lora_id from 1)

	submit chan *request
	wake   chan struct{} // a client took output or went away: a stalled request may move
	quit   chan struct{}
	done   chan struct{}
	ids    atomic.Uint64
	queued atomic.Int64 // submitted and not yet running or dropped (≤ MaxWaiting)

	// Read by tests and the log; written by the scheduler.
	running, waiting atomic.Int64
	kvMismatches     atomic.Int64 // prefix hits whose KV was not the prompt's (must stay 0)
	finished         atomic.Int64
	aborted          atomic.Int64 // clients gone before their request finished
	closeOnce        sync.Once
}

// A request is one completion as the scheduler sees it.
type request struct {
	ctx       context.Context // the client's: when it ends, the request is aborted
	id        string
	model     string
	seed      kvlease.BlockHash // the namespace its prefix is looked up and sealed in
	tenant    string            // its API key's tenant ("" without keys): charged for its blocks
	prompt    []uint32
	maxTokens int
	ignoreEOS bool
	// out carries the tokens, at most outBuffer waiting, whatever
	// max_tokens says: the scheduler never waits on a client, it only
	// decodes for a request whose client has taken enough of its output
	// (a client that stops reading stalls its own request, nobody else's).
	out    chan output
	failed chan struct{} // closed after err is set: the request ended without finishing
	err    error
	once   sync.Once

	seq       *kvlease.Sequence[[]byte] // set at admission
	generated int
}

// outBuffer is how many tokens wait for a request's client at most.
const outBuffer = 16

// output is what the scheduler hands a request's client: a token, and
// with the last one the finish reason and the usage.
type output struct {
	token  uint32
	finish string // "length", "stop" or "" (more to come)
	usage  usage
}

// fail ends r without finishing it: its client reads err once failed is
// closed (after the tokens already in out). Idempotent.
func (r *request) fail(err error) {
	r.once.Do(func() {
		r.err = err
		close(r.failed)
	})
}

// room reports whether r's client has taken enough output for r to
// decode a token.
func (r *request) room() bool { return len(r.out) < cap(r.out) }

// errShutdown ends requests still in flight when the engine closes.
var errShutdown = errors.New("engine shutting down")

// errBusy refuses a request when MaxWaiting requests already wait.
var errBusy = errors.New("waiting queue full")

// NewEngine builds the pool and the envelope and starts the scheduler.
func NewEngine(cfg Config) (*Engine, error) {
	env := handoff.Envelope{
		BlockTokens:        cfg.BlockTokens,
		BlockBytes:         4 * cfg.BlockTokens, // the simulated KV: one token id per slot
		PoolBlocks:         cfg.Blocks,
		MaxContextTokens:   cfg.MaxContext,
		MaxPrefillTokens:   cfg.PrefillChunk,
		MaxRunningRequests: cfg.MaxRunning,
	}
	if err := env.Validate(); err != nil {
		return nil, err
	}
	if cfg.MaxWaiting < 1 {
		return nil, fmt.Errorf("MaxWaiting %d: want at least 1", cfg.MaxWaiting)
	}
	mem, err := kvlease.NewHostMemory(cfg.Blocks, env.BlockBytes)
	if err != nil {
		return nil, err
	}
	opts := append([]kvlease.Option{kvlease.WithBlockTokens(cfg.BlockTokens)}, cfg.PoolOptions...)
	if len(cfg.APIKeys) > 0 {
		key := make([]byte, 32) // a fresh secret per process: namespaces die with the cache
		if _, err := rand.Read(key); err != nil {
			return nil, err
		}
		opts = append(opts, kvlease.WithTenantKey(key))
	}
	pool, err := kvlease.NewPool[[]byte](mem, opts...)
	if err != nil {
		return nil, err
	}
	e := &Engine{
		cfg: cfg, env: env, pool: pool,
		seeds:   map[string]kvlease.BlockHash{},
		tenants: make(map[[sha256.Size]byte]string, len(cfg.APIKeys)),
		quotaed: map[string]*kvlease.Tenant[[]byte]{},
		loras:   map[string]kvlease.Adapter{},
		submit:  make(chan *request),
		wake:    make(chan struct{}, 1),
		quit:    make(chan struct{}),
		done:    make(chan struct{}),
	}
	for k, t := range cfg.APIKeys {
		e.tenants[sha256.Sum256([]byte(k))] = t
		tn, err := pool.Tenant(t) // the engine's own tenants, never a request's name
		if err != nil {
			return nil, err
		}
		if q, ok := cfg.Quotas[t]; ok {
			if err := tn.SetQuota(q); err != nil {
				return nil, fmt.Errorf("tenant quota: %w", err)
			}
			if q.Cap > 0 {
				e.quotaed[t] = tn
			}
		}
	}
	for t := range cfg.Quotas {
		if _, ok := pool.LookupTenant(t); !ok {
			return nil, fmt.Errorf("a quota for a tenant no API key names")
		}
	}
	// Each served model is its own namespace: the same prompt under two
	// adapters shares no KV.
	for _, m := range append([]string{cfg.Model}, cfg.Adapters...) {
		h := fnv.New64a()
		h.Write([]byte(m))
		e.seeds[m] = kvlease.BlockHash(h.Sum64())
	}
	for i, a := range cfg.Adapters {
		e.loras[a] = kvlease.Adapter{ID: i + 1, Name: a}
	}
	go e.run()
	return e, nil
}

// Models returns the served names: the base model, then its adapters.
func (e *Engine) Models() []string { return append([]string{e.cfg.Model}, e.cfg.Adapters...) }

// Pool returns the engine's pool.
func (e *Engine) Pool() *kvlease.Pool[[]byte] { return e.pool }

// Submit admits a request against the envelope and queues it for the
// scheduler, or refuses it with errBusy when MaxWaiting requests already
// wait. The request's tokens arrive on r.out (its client calls Taken
// after each), its failure on r.failed; when ctx ends, the scheduler
// aborts it.
//
// The request's namespace is its model's; a cache_salt (vLLM's field)
// makes a sub-namespace of it; a tenant (authenticated by the caller,
// empty when tenants are off) a secret one (Pool.TenantSeed).
func (e *Engine) Submit(ctx context.Context, tenant, model, cacheSalt string, prompt []uint32, maxTokens int, ignoreEOS bool) (*request, error) {
	seed, ok := e.seeds[model]
	if !ok {
		return nil, fmt.Errorf("model %q: %w", model, errNoModel)
	}
	if err := e.env.CheckRequest(len(prompt), maxTokens); err != nil {
		return nil, err
	}
	if cacheSalt != "" {
		h := fnv.New64a()
		binary.Write(h, binary.LittleEndian, uint64(seed))
		h.Write([]byte(cacheSalt))
		seed = kvlease.BlockHash(h.Sum64())
	}
	if tenant != "" {
		var err error
		if seed, err = e.pool.TenantSeed(tenant, seed); err != nil {
			return nil, err
		}
	}
	if e.queued.Add(1) > int64(e.cfg.MaxWaiting) {
		e.queued.Add(-1)
		return nil, errBusy
	}
	r := &request{
		ctx: ctx, id: strconv.FormatUint(e.ids.Add(1), 10), model: model, seed: seed, tenant: tenant,
		prompt: prompt, maxTokens: maxTokens, ignoreEOS: ignoreEOS,
		out: make(chan output, outBuffer), failed: make(chan struct{}),
	}
	select {
	case e.submit <- r:
		return r, nil
	case <-e.quit:
		e.queued.Add(-1)
		return nil, errShutdown
	case <-ctx.Done():
		e.queued.Add(-1)
		return nil, ctx.Err()
	}
}

// Taken tells the scheduler that a client took output from its request,
// or went away: a request stalled on its client's output may go on.
func (e *Engine) Taken() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

var errNoModel = errors.New("model not served")

// SetAdapterLoaded marks a LoRA adapter loaded or unloaded: an unloaded
// adapter's cached blocks become the first evicted (RetentionMin), a
// loaded one's return to the default class. vLLM's
// /v1/unload_lora_adapter and /v1/load_lora_adapter call it.
func (e *Engine) SetAdapterLoaded(name string, loaded bool) error {
	a, ok := e.loras[name]
	if !ok {
		return fmt.Errorf("adapter %q: %w", name, errNoModel)
	}
	r := kvlease.RetentionMin
	if loaded {
		r = kvlease.RetentionDefault
	}
	return e.pool.SetAdapterRetention(a.Name, r)
}

// Close stops the scheduler: requests in flight end with errShutdown and
// release their leases.
func (e *Engine) Close() {
	e.closeOnce.Do(func() { close(e.quit) })
	<-e.done
}

// run is the scheduler: admit, step, repeat. It alone touches the
// sequences; clients only read their channels and end their contexts.
func (e *Engine) run() {
	defer close(e.done)
	var waiting, running []*request
	var ended []ending // reused from step to step
	defer func() {
		for _, r := range append(waiting, running...) {
			if r.seq != nil {
				r.seq.Lease().Abort(errShutdown)
			} else {
				e.queued.Add(-1)
			}
			r.fail(errShutdown)
		}
		e.running.Store(0)
		e.waiting.Store(0)
	}()
	for {
		// Take new requests; block only when there is nothing to do.
		if len(waiting)+len(running) == 0 {
			select {
			case r := <-e.submit:
				waiting = append(waiting, r)
			case <-e.quit:
				return
			}
		}
	drain:
		for {
			select {
			case r := <-e.submit:
				waiting = append(waiting, r)
			case <-e.quit:
				return
			default:
				break drain
			}
		}
		// Clients that went away while queued hold nothing: drop them.
		waiting = deleteFunc(waiting, func(r *request) bool {
			if r.ctx.Err() != nil {
				e.queued.Add(-1)
				e.aborted.Add(1)
				return true
			}
			return false
		})
		running = e.admit(&waiting, running)
		e.waiting.Store(int64(len(waiting)))
		e.running.Store(int64(len(running)))
		if len(running) == 0 {
			if len(waiting) > 0 {
				// Nothing runs and the head does not fit yet: blocks are
				// held by nothing we schedule (cannot happen with one
				// scheduler per pool), so wait a little rather than spin.
				time.Sleep(time.Millisecond)
			}
			continue
		}
		var stepped int
		running, stepped, ended = e.step(running, ended[:0])
		e.running.Store(int64(len(running)))
		// Clients hear that their requests ended only now, once the
		// leases are released and the batch no longer counts them: what a
		// client sees last, the metrics already show.
		for _, x := range ended {
			x.tell()
		}
		clear(ended) // hold no request past its end
		if stepped == 0 {
			// Every running request waits for its client to take its
			// output: sleep until one does (or goes away), or work comes.
			select {
			case <-e.wake:
			case r := <-e.submit:
				waiting = append(waiting, r)
			case <-e.quit:
				return
			case <-time.After(100 * time.Millisecond): // a missed wake-up costs this much, never a hang
			}
		}
	}
}

// admit moves requests from the head of waiting into running while the
// batch has room and the pool can hold each one's whole future: every
// running request's growth up to its max_tokens is reserved, so a
// running request never finds the pool exhausted mid-decode (no
// preemption needed). Arrival order is kept: a large request at the head
// is not overtaken.
func (e *Engine) admit(waiting *[]*request, running []*request) []*request {
	bt := e.cfg.BlockTokens
	reserved := 0
	var growth map[string]int // per tenant with a cap: its running requests' growth still to come
	for _, r := range running {
		g := e.env.BlocksFor(len(r.prompt)+r.maxTokens) - r.seq.Lease().Len()
		reserved += g
		if e.quotaed[r.tenant] != nil {
			if growth == nil {
				growth = map[string]int{}
			}
			growth[r.tenant] += g
		}
	}
	for len(*waiting) > 0 && len(running) < e.cfg.MaxRunning {
		r := (*waiting)[0]
		need := e.env.BlocksFor(len(r.prompt) + r.maxTokens)
		if e.pool.Available()-reserved < need {
			break
		}
		// A tenant's cap covers its running requests' whole future too,
		// so none of them meets its cap mid-decode: a request that does
		// not fit beside them is refused now (429), not queued ahead of
		// other tenants' requests.
		if err := e.quotaFits(r, need, growth[r.tenant]); err != nil {
			*waiting = (*waiting)[1:]
			e.queued.Add(-1)
			r.fail(err)
			continue
		}
		// The adapter's tag goes on the lease: the blocks it seals are
		// announced under the adapter (lora_id, lora_name), so a router
		// indexes them there, in a pool shared by every adapter. The
		// tenant's name charges the blocks to it, under its quota.
		seq, err := e.pool.Admit(kvlease.SequenceSpec{Owner: r.id, Seed: r.seed, Tenant: r.tenant,
			Prompt: kvlease.TokensInt32(r.prompt), Adapter: e.loras[r.model], MaxTokens: len(r.prompt) + r.maxTokens})
		if errors.Is(err, kvlease.ErrExhausted) && !errors.Is(err, kvlease.ErrQuota) {
			break
		}
		*waiting = (*waiting)[1:]
		e.queued.Add(-1)
		if err != nil {
			r.fail(err)
			continue
		}
		// A prefix hit serves another request's KV: check it is this
		// prompt's (a real engine need not; this example proves it).
		for k := range seq.Hits() {
			reg, err := seq.Lease().ReadRegion(k)
			if err != nil || !kvMatches(reg, r.prompt[k*bt:(k+1)*bt]) {
				e.kvMismatches.Add(1)
			}
		}
		r.seq = seq
		reserved += need - seq.Lease().Len()
		if e.quotaed[r.tenant] != nil {
			if growth == nil {
				growth = map[string]int{}
			}
			growth[r.tenant] += need - seq.Lease().Len()
		}
		running = append(running, r)
	}
	return running
}

// quotaFits refuses request r, of need blocks in all, when its tenant's
// cap cannot hold it beside what the tenant's running requests hold and
// will grow to (growth): the tenant's held blocks less its cached ones
// (those it may evict for itself), and their growth.
func (e *Engine) quotaFits(r *request, need, growth int) error {
	tn := e.quotaed[r.tenant]
	if tn == nil {
		return nil
	}
	st := tn.Stats()
	if room := st.Quota.Cap - (st.Held - st.Cached) - growth; need > room {
		return fmt.Errorf("%d blocks with %d of the tenant's cap of %d free: %w", need, max(room, 0), st.Quota.Cap, kvlease.ErrQuota)
	}
	return nil
}

// step runs the model once over the batch: a chunk of prefill for the
// requests still prefilling, one decoded token for the others whose
// clients have room for it. Then it hands out the tokens, finishes
// requests and drops those whose clients left. It returns the batch left
// and how many requests it stepped, and ended with the requests that
// ended appended (their clients not yet told).
func (e *Engine) step(running []*request, ended []ending) ([]*request, int, []ending) {
	bt := e.cfg.BlockTokens
	var cost time.Duration
	stepped := 0
	for _, r := range running {
		switch s := r.seq; {
		case s.Computed() < s.PromptLen():
			n := min(e.cfg.PrefillChunk, s.PromptLen()-s.Computed())
			cost += time.Duration((n+bt-1)/bt) * e.cfg.PrefillBlockTime
		case r.room():
			cost += e.cfg.DecodeTokenTime
		default:
			continue // its client has not taken its last outBuffer tokens
		}
		stepped++
	}
	if cost > 0 {
		time.Sleep(cost)
	}
	return deleteFunc(running, func(r *request) bool {
		if r.ctx.Err() != nil {
			// The client went away: abort. The lease's blocks return now
			// (no transfer gates them); sealed blocks stay cached.
			r.seq.Lease().Abort(r.ctx.Err())
			e.aborted.Add(1)
			return true
		}
		if s := r.seq; s.Computed() >= s.PromptLen() && !r.room() {
			return false // stalled on its client this step
		}
		last, err := e.advance(r)
		if err != nil {
			r.seq.Lease().Abort(err)
			ended = append(ended, ending{r: r, err: err})
			return true
		}
		if last.finish != "" {
			r.seq.Lease().Release()
			e.finished.Add(1)
			ended = append(ended, ending{r: r, last: last})
			return true
		}
		return false
	}), stepped, ended
}

// ending is a request that left the batch: its last output, or the error
// that failed it.
type ending struct {
	r    *request
	last output
	err  error
}

// tell hands the client its request's end. The send never blocks: the
// request stepped only with room in its buffer.
func (x ending) tell() {
	if x.err != nil {
		x.r.fail(x.err)
		return
	}
	x.r.out <- x.last
}

// advance applies one step to r: the KV of the tokens the step computed is
// written and committed (sealing every block that filled), and when the
// prompt is done a token is sampled and handed out. Once r is done it
// returns the last output (its finish set) instead, for the caller to
// hand out after the lease is released.
func (e *Engine) advance(r *request) (output, error) {
	s := r.seq
	n := 1 // a decode step computes the last sampled token
	if s.Computed() < s.PromptLen() {
		n = min(e.cfg.PrefillChunk, s.PromptLen()-s.Computed())
	}
	if err := e.writeKV(s, n); err != nil {
		return output{}, err
	}
	if err := s.Commit(n); err != nil {
		return output{}, err
	}
	if s.Computed() < s.PromptLen() {
		return output{}, nil // still prefilling
	}
	tokens := kvlease.TokensUint32(s.Tokens())
	t := sample(tokens[len(tokens)-1], len(tokens))
	r.generated++
	finish := ""
	switch {
	case t == eos && !r.ignoreEOS:
		finish = "stop"
	case r.generated == r.maxTokens:
		finish = "length"
	}
	if finish != "" {
		return output{token: t, finish: finish, usage: e.usage(r)}, nil
	}
	// The token's KV is computed by the next step: give it a slot.
	if err := s.Append(int32(t)); err != nil {
		return output{}, fmt.Errorf("no block for the next token: %w", err)
	}
	r.out <- output{token: t}
	return output{}, nil
}

// writeKV writes the simulated KV of the next n uncomputed tokens into
// their blocks, which are still private: a block is sealed (read-only)
// only after its last token's KV is written and committed.
func (e *Engine) writeKV(s *kvlease.Sequence[[]byte], n int) error {
	bt := e.cfg.BlockTokens
	tokens := kvlease.TokensUint32(s.Tokens())
	for p := s.Computed(); p < s.Computed()+n; {
		k := p / bt
		reg, err := s.Lease().Region(k)
		if err != nil {
			return err
		}
		for ; p < s.Computed()+n && p/bt == k; p++ {
			writeKV(reg, p%bt, tokens[p])
		}
	}
	return nil
}

func (e *Engine) usage(r *request) usage {
	u := usage{PromptTokens: len(r.prompt), CompletionTokens: r.generated}
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	u.PromptTokensDetails = &promptTokensDetails{CachedTokens: r.seq.CachedTokens()}
	return u
}

// deleteFunc is slices.DeleteFunc that also clears the tail, so dropped
// requests are not kept alive by the backing array.
func deleteFunc(rs []*request, del func(*request) bool) []*request {
	out := rs[:0]
	for _, r := range rs {
		if !del(r) {
			out = append(out, r)
		}
	}
	clear(rs[len(out):])
	return out
}

package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/events"
)

func testOptions() options {
	return options{
		addr: "127.0.0.1:0", vllmMetrics: true, readTimeout: 30 * time.Second, connsPerAddr: 64,
		cfg: Config{
			Model: "sim-1", Adapters: []string{"sim-1-sql", "sim-1-chat"},
			Blocks: 16384, BlockTokens: 16, MaxRunning: 32, MaxContext: 2048, PrefillChunk: 64,
			PrefillBlockTime: 10 * time.Microsecond, DecodeTokenTime: 10 * time.Microsecond,
			MaxWaiting: 4096,
		},
	}
}

func startTest(t *testing.T, o options) *app {
	t.Helper()
	a, err := start(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	return a
}

type result struct {
	status int
	body   completion
	text   string
	chunks int
}

// complete posts a completion request and reads the answer; streamed
// answers are reassembled (text, finish reason, usage). cancelAfter > 0
// cancels the request after that many streamed chunks.
func complete(ctx context.Context, c *http.Client, base string, req map[string]any, cancelAfter int) (result, error) {
	var res result
	b, _ := json.Marshal(req)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	hr, err := http.NewRequestWithContext(ctx, "POST", base+"/v1/completions", bytes.NewReader(b))
	if err != nil {
		return res, err
	}
	resp, err := c.Do(hr)
	if err != nil {
		return res, err
	}
	defer resp.Body.Close()
	res.status = resp.StatusCode
	if stream, _ := req["stream"].(bool); !stream || resp.StatusCode != http.StatusOK {
		err := json.NewDecoder(resp.Body).Decode(&res.body)
		if len(res.body.Choices) > 0 {
			res.text = res.body.Choices[0].Text
		}
		return res, err
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			return res, nil
		}
		var c completion
		if err := json.Unmarshal([]byte(line), &c); err != nil {
			return res, fmt.Errorf("chunk %q: %w", line, err)
		}
		res.chunks++
		res.body.ID = c.ID
		if c.Usage != nil {
			res.body.Usage = c.Usage
		}
		if len(c.Choices) > 0 {
			res.text += c.Choices[0].Text
			if c.Choices[0].FinishReason != nil {
				res.body.Choices = []choice{{FinishReason: c.Choices[0].FinishReason}}
			}
		}
		if cancelAfter > 0 && res.chunks == cancelAfter {
			cancel() // the client goes away mid-stream
			_, _ = io.Copy(io.Discard, resp.Body)
			return res, context.Canceled
		}
	}
	return res, fmt.Errorf("stream ended without [DONE]: %v", sc.Err())
}

// subscriber indexes the engine's KV events as a router would.
type subscriber struct {
	mu       sync.Mutex
	stored   map[uint64]bool
	loras    map[string]int // BlockStored blocks per lora_name ("" for the base model)
	batches  int
	badBatch error
}

func (s *subscriber) consume(sock zmq4.Socket) {
	for {
		msg, err := sock.Recv()
		if err != nil {
			return
		}
		s.mu.Lock()
		if len(msg.Frames) != 3 || len(msg.Frames[1]) != 8 {
			s.badBatch = fmt.Errorf("message of %d frames", len(msg.Frames))
			s.mu.Unlock()
			continue
		}
		_ = binary.BigEndian.Uint64(msg.Frames[1])
		b, err := events.DecodeBatch(msg.Frames[2])
		if err != nil {
			s.badBatch = err
		}
		s.batches++
		for _, ev := range b.Events {
			switch ev.Type {
			case "BlockStored":
				if len(ev.TokenIDs) != ev.BlockSize*len(ev.BlockHashes) {
					s.badBatch = fmt.Errorf("stored %d blocks with %d tokens", len(ev.BlockHashes), len(ev.TokenIDs))
				}
				for _, h := range ev.BlockHashes {
					s.stored[h] = true
				}
				s.loras[ev.LoraName] += len(ev.BlockHashes)
				if (ev.LoraName == "") != (ev.LoraID == nil) {
					s.badBatch = fmt.Errorf("lora_name %q with lora_id %v", ev.LoraName, ev.LoraID)
				}
			case "BlockRemoved":
				for _, h := range ev.BlockHashes {
					delete(s.stored, h)
				}
			case "AllBlocksCleared":
				clear(s.stored)
			}
		}
		s.mu.Unlock()
	}
}

// TestEngineLoad drives the engine over loopback with a few hundred
// requests sharing prefixes (text and token-id prompts, three served
// models, streamed or not, a third of the streamed ones cancelled
// mid-stream) and checks: every finished request's cached_tokens is what
// its shared prefix predicts, nothing is leased or draining at the end,
// Pool.Check is nil, no prefix hit served foreign KV, and a router's view
// built from the decoded events equals the pool's cache.
func TestEngineLoad(t *testing.T) {
	o := testOptions()
	o.events = "tcp://127.0.0.1:0" // bound: the engine binds -events, loopback included
	a := startTest(t, o)
	base := "http://" + a.addr.String()
	bt := o.cfg.BlockTokens

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	sub := &subscriber{stored: map[uint64]bool{}, loras: map[string]int{}}
	sock := zmq4.NewSub(ctx)
	defer sock.Close()
	if err := sock.Dial("tcp://" + a.pub.Addr().String()); err != nil {
		t.Fatal(err)
	}
	if err := sock.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	go sub.consume(sock)
	for i := 0; len(a.pub.Subscriptions()) == 0; i++ {
		if i == 500 {
			t.Fatal("subscriber never seen by the publisher")
		}
		time.Sleep(10 * time.Millisecond)
	}

	rng := rand.New(rand.NewPCG(24, 1))
	prefixLens := []int{40, 64, 100, 137, 200, 15}
	prefixes := make([][]uint32, len(prefixLens))
	for i, n := range prefixLens {
		for range n {
			prefixes[i] = append(prefixes[i], 3+rng.Uint32N(9000))
		}
	}
	models := []string{"sim-1", "sim-1-sql", "sim-1-chat"}
	type job struct {
		prompt    []uint32
		prefix    int
		model     string
		stream    bool
		text      bool
		cancel    bool
		maxTokens int
	}
	mk := func(i, p int, model string, suffixBase uint32) job {
		j := job{prefix: p, model: model, maxTokens: 4 + i%13}
		j.prompt = append(slices.Clone(prefixes[p]), suffixBase+uint32(i))
		for range rng.IntN(40) {
			j.prompt = append(j.prompt, 3+rng.Uint32N(9000))
		}
		return j
	}
	body := func(j job) map[string]any {
		req := map[string]any{"model": j.model, "max_tokens": j.maxTokens, "ignore_eos": true}
		if j.text {
			words := make([]string, len(j.prompt))
			for i, id := range j.prompt {
				words[i] = "w" + strconv.FormatUint(uint64(id), 10)
			}
			req["prompt"] = strings.Join(words, " ")
		} else {
			req["prompt"] = j.prompt
		}
		if j.stream {
			req["stream"] = true
			req["stream_options"] = map[string]any{"include_usage": true}
		}
		return req
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 32}}
	defer client.CloseIdleConnections()

	// Warm-up: one request per prefix and model, one at a time, so every
	// shared prefix is cached before the load (and the prediction exact).
	warm := 0
	for p := range prefixes {
		for _, m := range models {
			res, err := complete(ctx, client, base, body(mk(warm, p, m, 20000)), 0)
			if err != nil || res.status != http.StatusOK {
				t.Fatalf("warm-up %d: %v %d", warm, err, res.status)
			}
			warm++
		}
	}

	total := 300 // .ci/steps/70-engine.sh runs more (KVLEASE_ENGINE_LOAD)
	if n, err := strconv.Atoi(os.Getenv("KVLEASE_ENGINE_LOAD")); err == nil && n > 0 {
		total = min(n, 3000) // the pool holds every prefix up to about that
	}
	jobs := make([]job, total)
	cancels := 0
	for i := range jobs {
		j := mk(i, i%len(prefixes), models[(i/len(prefixes))%len(models)], 10000)
		j.stream = i%2 == 0
		j.text = i%4 < 2
		if j.stream && i%3 == 0 { // a third of the streamed ones
			j.cancel, j.maxTokens = true, 1000
			cancels++
		}
		jobs[i] = j
	}
	var wg sync.WaitGroup
	errs := make(chan error, total)
	next := make(chan int)
	for range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				j := jobs[i]
				after := 0
				if j.cancel {
					after = 2
				}
				res, err := complete(ctx, client, base, body(j), after)
				if j.cancel {
					if !errors.Is(err, context.Canceled) {
						errs <- fmt.Errorf("job %d: cancelled stream ended with %v", i, err)
					}
					continue
				}
				if err != nil || res.status != http.StatusOK {
					errs <- fmt.Errorf("job %d: %v status %d", i, err, res.status)
					continue
				}
				u := res.body.Usage
				want := min(prefixLens[j.prefix]/bt, (len(j.prompt)-1)/bt) * bt
				switch {
				case u == nil || u.PromptTokensDetails == nil:
					errs <- fmt.Errorf("job %d: no usage", i)
				case u.PromptTokensDetails.CachedTokens != want:
					errs <- fmt.Errorf("job %d: cached_tokens %d, the shared prefix predicts %d (prompt %d, prefix %d)",
						i, u.PromptTokensDetails.CachedTokens, want, len(j.prompt), prefixLens[j.prefix])
				case u.PromptTokens != len(j.prompt) || u.CompletionTokens != j.maxTokens || u.TotalTokens != u.PromptTokens+u.CompletionTokens:
					errs <- fmt.Errorf("job %d: usage %+v", i, *u)
				case len(strings.Fields(res.text)) != j.maxTokens || *res.body.Choices[0].FinishReason != "length":
					errs <- fmt.Errorf("job %d: text %q", i, res.text)
				}
			}
		}()
	}
	for i := range total {
		next <- i
	}
	close(next)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if t.Failed() {
		return
	}

	// Every aborted request has left the batch within a bounded wait.
	e := a.engine
	for i := 0; e.running.Load()+e.waiting.Load() > 0 || e.finished.Load()+e.aborted.Load() < int64(warm+total); i++ {
		if i == 1000 {
			t.Fatalf("engine still busy: running %d waiting %d finished %d aborted %d",
				e.running.Load(), e.waiting.Load(), e.finished.Load(), e.aborted.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	p := e.Pool()
	st := p.Stats()
	if err := p.CheckQuiescent(); err != nil { // consistent, nothing held
		t.Fatal(err)
	}
	if st.Leased != 0 || st.Draining != 0 || st.OpenLeases != 0 || st.Quarantined != 0 {
		t.Fatalf("left behind: %+v", st)
	}
	if st.Evictions != 0 {
		t.Fatalf("%d evictions: the pool was meant to hold every prefix", st.Evictions)
	}
	if n := e.kvMismatches.Load(); n != 0 {
		t.Fatalf("%d prefix hits served KV of other tokens", n)
	}
	// Every request ended once, finished or aborted. A cancelled stream
	// is aborted unless its request finished before the server saw the
	// client go (possible on a starved machine, though it asks for 1000
	// tokens): either way its blocks came back, checked above.
	if got, fin := e.aborted.Load(), e.finished.Load(); got < 1 || got > int64(cancels) || got+fin != int64(warm+total) {
		t.Fatalf("aborted %d, finished %d: want 1..%d aborted and %d in all", got, fin, cancels, warm+total)
	}

	// The router's view converges on the pool's cache.
	if err := a.pub.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	_, cached := p.SnapshotKVBlocks(nil)
	for i := 0; ; i++ {
		sub.mu.Lock()
		n, bad := len(sub.stored), sub.badBatch
		same := n == len(cached)
		for _, e := range cached {
			same = same && sub.stored[uint64(e.BlockHash)]
		}
		sub.mu.Unlock()
		if bad != nil {
			t.Fatal(bad)
		}
		if same {
			break
		}
		if i == 500 {
			t.Fatalf("router holds %d blocks, the pool %d", n, len(cached))
		}
		time.Sleep(10 * time.Millisecond)
	}
	sub.mu.Lock()
	loras := maps.Clone(sub.loras)
	sub.mu.Unlock()
	if len(loras) != 3 || loras[""] == 0 || loras["sim-1-sql"] == 0 || loras["sim-1-chat"] == 0 {
		t.Fatalf("blocks by lora_name %v: want the base model and both adapters", loras)
	}
	t.Logf("%d requests (%d warm-up, %d cancelled), %d cached blocks announced in %d batches, prefix hits %d of %d blocks",
		warm+total, warm, cancels, len(cached), sub.batches, st.PrefixHits, st.PrefixQueries)
}

// TestAPI: the models list, both prompt forms, and refusals with their
// status codes.
func TestAPI(t *testing.T) {
	o := testOptions()
	o.cfg.MaxContext = 64
	o.openAdmin = true // TestAdminKey covers the key
	a := startTest(t, o)
	base := "http://" + a.addr.String()
	resp, err := http.Get(base + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var models struct {
		Data []struct {
			ID     string  `json:"id"`
			Parent *string `json:"parent"`
		} `json:"data"`
	}
	err = json.NewDecoder(resp.Body).Decode(&models)
	resp.Body.Close()
	if err != nil || len(models.Data) != 3 || models.Data[0].ID != "sim-1" || models.Data[1].Parent == nil || *models.Data[1].Parent != "sim-1" {
		t.Fatalf("models %+v %v", models, err)
	}
	ctx := context.Background()
	c := http.DefaultClient
	// The same prompt as text and as ids: the second hits the first's blocks.
	text := strings.Repeat("w7 ", 40)
	r1, err := complete(ctx, c, base, map[string]any{"prompt": text, "max_tokens": 2}, 0)
	if err != nil || r1.status != 200 || r1.body.Usage.PromptTokens != 40 || r1.body.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Fatalf("text prompt: %+v %v", r1, err)
	}
	ids := make([]uint32, 40)
	for i := range ids {
		ids[i] = 7
	}
	r2, err := complete(ctx, c, base, map[string]any{"prompt": ids, "max_tokens": 2}, 0)
	if err != nil || r2.status != 200 || r2.body.Usage.PromptTokensDetails.CachedTokens != 32 {
		t.Fatalf("token prompt: %+v %v", r2, err)
	}
	// Another model is another namespace.
	r3, err := complete(ctx, c, base, map[string]any{"model": "sim-1-sql", "prompt": ids, "max_tokens": 1}, 0)
	if err != nil || r3.status != 200 || r3.body.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Fatalf("adapter: %+v %v", r3, err)
	}
	// Unloading an adapter makes its cached blocks the first evicted.
	adapterPost := func(path, name string) int {
		resp, err := http.Post(base+path, "application/json", strings.NewReader(`{"lora_name":"`+name+`"}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := adapterPost("/v1/unload_lora_adapter", "sim-1-sql"); code != 200 {
		t.Fatalf("unload: %d", code)
	}
	if by := a.engine.Pool().CachedByRetention(); by[kvlease.RetentionMin] != 2 {
		t.Fatalf("after unloading sim-1-sql: cached by class %v, want its 2 blocks in the lowest", by)
	}
	if code := adapterPost("/v1/load_lora_adapter", "sim-1-sql"); code != 200 {
		t.Fatalf("load: %d", code)
	}
	if by := a.engine.Pool().CachedByRetention(); by[kvlease.RetentionMin] != 0 {
		t.Fatalf("after loading: %v", by)
	}
	if code := adapterPost("/v1/unload_lora_adapter", "nope"); code != 404 {
		t.Fatalf("unknown adapter: %d", code)
	}
	for _, tc := range []struct {
		req  map[string]any
		code int
	}{
		{map[string]any{"prompt": "a b", "model": "nope"}, 404},
		{map[string]any{"prompt": ""}, 400},
		{map[string]any{"prompt": []int{1, 2, vocab}}, 400},
		{map[string]any{"prompt": []int{1, -2}}, 400},
		{map[string]any{"prompt": []string{"a", "b"}}, 400},
		{map[string]any{"prompt": "a", "max_tokens": 0}, 400},
		{map[string]any{"prompt": strings.Repeat("a ", 60), "max_tokens": 10}, 400}, // over the envelope's context
		{map[string]any{"prompt": map[string]any{}}, 400},
	} {
		res, _ := complete(ctx, c, base, tc.req, 0)
		if res.status != tc.code {
			t.Errorf("%v: status %d, want %d", tc.req, res.status, tc.code)
		}
	}
	resp, err = http.Post(base+"/v1/completions", "application/json", strings.NewReader("{"))
	if err != nil || resp.StatusCode != 400 {
		t.Fatalf("malformed body: %v %v", resp.StatusCode, err)
	}
	resp.Body.Close()
	resp, err = http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	m, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`kvlease_blocks{pool="gpu",state="cached"} 4`, `kvlease_blocks{pool="gpu",state="leased"} 0`, "vllm:prefix_cache_hits_total"} {
		if !strings.Contains(string(m), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
}

// TestRunFlags: the command line parses its flags and serves until its
// duration ends.
func TestRunFlags(t *testing.T) {
	var out bytes.Buffer
	err := run(context.Background(), []string{"-addr", "127.0.0.1:0", "-metrics", "127.0.0.1:0", "-duration", "50ms", "-lora", ""}, &out)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"engine serving sim-1 on http://127.0.0.1:", "metrics http://127.0.0.1:", "check <nil>"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	if err := run(context.Background(), []string{"-blocks", "0", "-addr", "127.0.0.1:0"}, &out); err == nil {
		t.Fatal("an empty pool was accepted")
	}
}

func FuzzParseCompletion(f *testing.F) {
	f.Add([]byte(`{"prompt":"a b c","max_tokens":3}`))
	f.Add([]byte(`{"prompt":[1,2,3],"stream":true,"stream_options":{"include_usage":true}}`))
	f.Add([]byte(`{"prompt":["x"]}`))
	f.Add([]byte(`{"prompt":[[1]]}`))
	f.Add([]byte(`{"prompt":"a","n":2}`))
	f.Add([]byte(`{"prompt":"a","max_tokens":"8"}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		req, prompt, err := parseCompletion(body)
		if err != nil {
			var ae *apiError
			if !errors.As(err, &ae) || ae.status != http.StatusBadRequest || ae.typ != invalidRequest || ae.msg == "" {
				t.Fatalf("error %#v is not a 400 for the client", err)
			}
			if strings.Contains(ae.msg, "Go ") || strings.Contains(ae.msg, "Request") || strings.Contains(ae.msg, "json:") {
				t.Fatalf("error %q shows Go internals", ae.msg)
			}
			return
		}
		if len(prompt) == 0 || *req.MaxTokens < 1 {
			t.Fatalf("accepted %q: prompt %v max_tokens %d", body, prompt, *req.MaxTokens)
		}
		for _, id := range prompt {
			if id >= vocab {
				t.Fatalf("accepted token %d", id)
			}
		}
	})
}

// TestTenants: with API keys, two tenants sending the same prompt with
// the same public cache_salt never hit each other's blocks; one tenant's
// second request hits its first's. Keys come from a private file only.
func TestTenants(t *testing.T) {
	dir := t.TempDir()
	path := dir + "/keys"
	if err := os.WriteFile(path, []byte("# key=tenant\nk-alice=alice\nk-bob = bob\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	o, err := parseFlags([]string{"-api-keys", path, "-addr", "127.0.0.1:0"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	o.cfg.PrefillBlockTime, o.cfg.DecodeTokenTime = 0, 0
	a := startTest(t, o)
	base := "http://" + a.addr.String()
	post := func(key string) (result, error) {
		b, _ := json.Marshal(map[string]any{"prompt": strings.Repeat("w9 ", 50), "max_tokens": 1, "cache_salt": "public"})
		req, _ := http.NewRequest("POST", base+"/v1/completions", bytes.NewReader(b))
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return result{}, err
		}
		defer resp.Body.Close()
		res := result{status: resp.StatusCode}
		return res, json.NewDecoder(resp.Body).Decode(&res.body)
	}
	cached := func(key string) int {
		t.Helper()
		res, err := post(key)
		if err != nil || res.status != 200 {
			t.Fatalf("%s: %v %d", key, err, res.status)
		}
		return res.body.Usage.PromptTokensDetails.CachedTokens
	}
	if n := cached("k-alice"); n != 0 {
		t.Fatalf("alice's first request hit %d", n)
	}
	if n := cached("k-bob"); n != 0 {
		t.Fatalf("bob hit %d tokens of alice's prompt with her cache_salt", n)
	}
	if n := cached("k-alice"); n != 48 {
		t.Fatalf("alice's second request: %d cached, want 48", n)
	}
	for _, key := range []string{"", "k-eve"} {
		if res, _ := post(key); res.status != http.StatusUnauthorized {
			t.Fatalf("key %q: status %d", key, res.status)
		}
	}
	// Keys in a file others can read are refused.
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := parseFlags([]string{"-api-keys", path}, io.Discard); err == nil {
		t.Fatal("a world-readable key file was accepted")
	}
	// A private file past the size bound is refused before it is read.
	big := dir + "/big"
	if err := os.WriteFile(big, bytes.Repeat([]byte("k=t\n"), maxKeysFile/4+1), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := parseFlags([]string{"-api-keys", big}, io.Discard); err == nil || !strings.Contains(err.Error(), "more than") {
		t.Fatalf("an oversized key file: %v", err)
	}
}

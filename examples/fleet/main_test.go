package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/events"
)

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// runFleet runs the example with args; scrape is called with the
// /metrics URL while the workloads run, and line (if set) with every
// line as it is printed. It returns the output lines.
func runFleet(t *testing.T, args []string, scrape func(url string), line ...func(string)) []string {
	t.Helper()
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		err := run(args, pw)
		pw.CloseWithError(err)
		done <- err
	}()
	var lines []string
	metricsLine := regexp.MustCompile(`^metrics (http://\S+/metrics)$`)
	url := ""
	sc := bufio.NewScanner(pr)
	for sc.Scan() {
		text := sc.Text()
		lines = append(lines, text)
		for _, f := range line {
			f(text)
		}
		if m := metricsLine.FindStringSubmatch(text); m != nil {
			url = m[1]
		}
		if strings.HasPrefix(text, "running ") {
			require.NotEmpty(t, url, "metrics line before running")
			scrape(url)
		}
	}
	select {
	case err := <-done:
		require.NoError(t, err, "output:\n%s", strings.Join(lines, "\n"))
	case <-time.After(60 * time.Second):
		t.Fatal("the example did not stop by itself")
	}
	return lines
}

func get(t *testing.T, url string) string {
	t.Helper()
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(b)
}

// The command line outside checks run: the first engine binds the given
// endpoint, the others PORT+i; /metrics serves kvlease's and vLLM's
// names while it runs; it stops by itself. Without a router it runs all
// the same; with one (a ZeroMQ SUB dialling every engine), each family's
// prompt routes to its engine.
func TestFleetCommandLine(t *testing.T) {
	port, mport := freePort(t), freePort(t)
	args := []string{
		"-events", fmt.Sprintf("tcp://*:%d", port),
		"-metrics", fmt.Sprintf("127.0.0.1:%d", mport),
		"-duration", "1500ms",
	}
	var body string
	lines := runFleet(t, args, func(url string) {
		require.Equal(t, fmt.Sprintf("http://127.0.0.1:%d/metrics", mport), url)
		body = get(t, url)
	})
	out := strings.Join(lines, "\n")
	require.Contains(t, out, fmt.Sprintf("engine engine-0 events binds tcp://127.0.0.1:%d topic kv@engine-0@llama", port))
	require.Regexp(t, `engine engine-1 events binds tcp://127\.0\.0\.1:\d+ topic kv@engine-1@llama`, out)
	require.Regexp(t, `engine engine-2 events binds tcp://127\.0\.0\.1:\d+ topic kv@engine-2@llama`, out)
	for i := range 3 {
		require.Regexp(t, fmt.Sprintf(`(?m)^events engine-%d published \d+ in \d+ batches, dropped \d+, subscribers 0,`, i), out)
	}
	require.Equal(t, "fleet: done", lines[len(lines)-1])

	// The same run with a router: it dials every engine as its line
	// says where it binds, and -wait-subscriber holds the workloads for it.
	r := newRouter(t)
	lines = runFleet(t, []string{"-events", fmt.Sprintf("tcp://*:%d", freePort(t)), "-duration", "500ms", "-wait-subscriber", "10s"},
		func(string) {}, r.dialBound)
	r.check(t, lines, 3)

	for _, name := range []string{
		`kvlease_blocks{pool="engine-0",state="cached"} `,
		`kvlease_capacity_blocks{pool="engine-2"} 64`,
		`kvlease_acquires_total{pool="engine-1"} `,
		`kvlease_rejections_total{pool="engine-0",reason="exhausted"} `,
		`kvlease_evictions_total{pool="engine-0"} `,
		`kvlease_transfers_total{outcome="quarantined",pool="engine-0"} `,
		`kvlease_kv_events_published_total{publisher="engine-0"} `,
		`kvlease_kv_events_dropped_total{publisher="engine-1"} `,
		`kvlease_kv_events_unpublishable_total{publisher="engine-2"} `,
		`kvlease_transfer_duration_seconds_count{pool="engine-0"} `,
		`kvlease_drain_duration_seconds_bucket{pool="engine-0",le="+Inf"} `,
		`kvlease_handoffs_total{outcome="delivered"} `,
		`vllm:kv_cache_usage_perc{engine="engine-0",model_name="llama"} `,
		`vllm:prefix_cache_queries_total{engine="engine-1",model_name="llama"} `,
		`vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="engine-2",model_name="llama",num_gpu_blocks="64"} 1`,
		`# TYPE kvlease_quarantine_duration_seconds histogram`,
	} {
		require.Contains(t, body, "\n"+name, "scrape lacks %q", name)
	}
}

// Without flags every port is free; with a connecting endpoint the
// router binds it and the engines dial in.
func TestFleetFreePortsAndConnect(t *testing.T) {
	lines := runFleet(t, []string{"-duration", "300ms", "-engines", "2"}, func(url string) {
		require.Contains(t, get(t, url), "kvlease_blocks")
	})
	out := strings.Join(lines, "\n")
	require.Regexp(t, `engine engine-0 events binds tcp://127\.0\.0\.1:[1-9]\d* topic`, out)
	require.Regexp(t, `(?m)^metrics http://127\.0\.0\.1:[1-9]\d*/metrics$`, out)
	require.Contains(t, out, "fleet: done")

	ep := fmt.Sprintf("tcp://127.0.0.1:%d", freePort(t))
	r := newRouter(t)
	require.NoError(t, r.sub.Listen(ep))
	lines = runFleet(t, []string{"-events", ep, "-duration", "300ms", "-engines", "2", "-wait-subscriber", "10s"}, func(string) {})
	out = strings.Join(lines, "\n")
	require.Contains(t, out, "engine engine-1 events dials "+ep+" topic kv@engine-1@llama")
	r.check(t, lines, 2)
}

// router is a router-like subscriber, as an llm-d scheduler would run: a
// ZeroMQ SUB socket (a real ZeroMQ peer, not this module's code) and an
// index of the blocks each engine announced.
type router struct {
	sub  zmq4.Socket
	idx  *indexer
	done chan struct{}
}

func newRouter(t *testing.T) *router {
	ctx, cancel := context.WithCancel(context.Background())
	r := &router{sub: zmq4.NewSub(ctx), idx: newIndexer(), done: make(chan struct{})}
	require.NoError(t, r.sub.SetOption(zmq4.OptionSubscribe, "kv@"))
	go func() {
		defer close(r.done)
		r.idx.consume(r.sub)
	}()
	t.Cleanup(func() {
		_ = r.sub.Close()
		cancel()
		<-r.done
	})
	return r
}

var bindsLine = regexp.MustCompile(`^engine \S+ events binds (tcp://\S+) topic`)

// dialBound dials the engine a line says binds.
func (r *router) dialBound(line string) {
	if m := bindsLine.FindStringSubmatch(line); m != nil {
		_ = r.sub.Dial(m[1]) // a failure shows as a missing subscriber
	}
}

var publishedLine = regexp.MustCompile(`^events (\S+) published \d+ in (\d+) batches, dropped 0, subscribers 1,`)

// check waits (bounded) until the index has every batch the output says
// each of the engines published (none dropped, to one subscriber), then
// routes each family's prompt, and one only the system prompt is shared
// with.
func (r *router) check(t *testing.T, lines []string, engines int) {
	t.Helper()
	want := map[string]uint64{}
	for _, l := range lines {
		if m := publishedLine.FindStringSubmatch(l); m != nil {
			n, err := strconv.ParseUint(m[2], 10, 64)
			require.NoError(t, err)
			want["kv@"+m[1]+"@llama"] = n
		}
	}
	require.Len(t, want, engines, "every engine published, dropped nothing, to one subscriber:\n%s", strings.Join(lines, "\n"))
	// A SUB socket may drop what it cannot queue: wait (bounded) for
	// every batch, then route with what arrived, as a router does.
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(2 * time.Millisecond) {
		caughtUp := true
		for topic, n := range want {
			caughtUp = caughtUp && r.idx.batches(topic) >= n
		}
		if caughtUp {
			break
		}
	}
	require.Zero(t, r.idx.badTokens(), "stored blocks whose tokens do not hash to their block hash")
	system, families := prompts(1, engines)
	rng := rand.New(rand.NewPCG(99, 0))
	for i, f := range families {
		prompt := append(slices.Clone(f), randomTokens(rng, suffixBlocks*blockTokens)...)
		best, n := r.route(engines, prompt)
		require.Equal(t, []string{fmt.Sprintf("engine-%d", i)}, best, "family of engine-%d", i)
		require.Equal(t, 1+familyBlocks, n)
	}
	best, n := r.route(engines, append(slices.Clone(system), randomTokens(rng, 4*blockTokens)...))
	require.Len(t, best, engines, "only the system prompt is shared: a tie")
	require.Equal(t, 1, n)
}

// route returns the engines holding the longest prefix of prompt, and
// its length in blocks.
func (r *router) route(engines int, prompt []int32) (best []string, n int) {
	hashes := kvlease.ChainHashes(0, prompt, blockTokens)
	n = -1
	for i := range engines {
		name := fmt.Sprintf("engine-%d", i)
		switch k := r.idx.prefix("kv@"+name+"@llama", hashes); {
		case k > n:
			best, n = []string{name}, k
		case k == n:
			best = append(best, name)
		}
	}
	return best, n
}

// indexer is a minimal router-side index: per topic, the block hashes an
// engine announced stored and not yet removed, checked against their
// tokens (a router recomputes keys from tokens).
type indexer struct {
	mu     sync.Mutex
	topics map[string]*engineIndex
	bad    int
}

type engineIndex struct {
	blocks  map[uint64]struct{}
	batches uint64
}

func newIndexer() *indexer { return &indexer{topics: map[string]*engineIndex{}} }

func (x *indexer) consume(sub zmq4.Socket) {
	for {
		msg, err := sub.Recv()
		if err != nil {
			return // closed
		}
		if len(msg.Frames) != 3 || len(msg.Frames[1]) != 8 {
			continue
		}
		if b, err := events.DecodeBatch(msg.Frames[2]); err == nil {
			x.apply(string(msg.Frames[0]), b)
		}
	}
}

func (x *indexer) apply(topic string, b events.Batch) {
	x.mu.Lock()
	defer x.mu.Unlock()
	ei := x.topics[topic]
	if ei == nil {
		ei = &engineIndex{blocks: map[uint64]struct{}{}}
		x.topics[topic] = ei
	}
	ei.batches++
	for _, ev := range b.Events {
		switch ev.Type {
		case "BlockStored":
			parent := kvlease.BlockHash(0)
			if ev.ParentBlockHash != nil {
				parent = kvlease.BlockHash(*ev.ParentBlockHash)
			}
			for k, h := range ev.BlockHashes {
				lo, hi := k*ev.BlockSize, (k+1)*ev.BlockSize
				if hi > len(ev.TokenIDs) || uint64(kvlease.HashBlock(parent, ev.TokenIDs[lo:hi])) != h {
					x.bad++
					break
				}
				ei.blocks[h] = struct{}{}
				parent = kvlease.BlockHash(h)
			}
		case "BlockRemoved":
			for _, h := range ev.BlockHashes {
				delete(ei.blocks, h)
			}
		case "AllBlocksCleared":
			clear(ei.blocks)
		}
	}
}

func (x *indexer) batches(topic string) uint64 {
	x.mu.Lock()
	defer x.mu.Unlock()
	if ei := x.topics[topic]; ei != nil {
		return ei.batches
	}
	return 0
}

func (x *indexer) badTokens() int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.bad
}

// prefix counts the leading hashes the topic's engine holds.
func (x *indexer) prefix(topic string, hashes []kvlease.BlockHash) int {
	x.mu.Lock()
	defer x.mu.Unlock()
	ei := x.topics[topic]
	if ei == nil {
		return 0
	}
	n := 0
	for _, h := range hashes {
		if _, ok := ei.blocks[uint64(h)]; !ok {
			break
		}
		n++
	}
	return n
}

// Bad flags are errors, not panics.
func TestFleetBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-engines", "0"},
		{"-duration", "0s"},
		{"-events", "tcp://*:notaport", "-duration", "100ms"},
		{"-metrics", "256.0.0.1:1", "-duration", "100ms"},
	} {
		require.Error(t, run(args, io.Discard), "%v", args)
	}
}

// -replay binds each engine's replay ROUTER (engine i at PORT+i): a
// DEALER asking from seq 0 while the workloads run gets batches back;
// -vllm-metrics=false leaves vLLM's names out and the scrape lints clean
// (promlint: what promtool check metrics runs).
func TestFleetReplayAndPlainMetrics(t *testing.T) {
	rport := freePort(t)
	var body string
	replayed := 0
	lines := runFleet(t, []string{"-replay", fmt.Sprintf("tcp://127.0.0.1:%d", rport), "-vllm-metrics=false",
		"-duration", "1s", "-engines", "2"}, func(url string) {
		body = get(t, url)
		for try := 0; try < 200 && replayed == 0; try++ {
			replayed = replayBatches(t, fmt.Sprintf("tcp://127.0.0.1:%d", rport))
			time.Sleep(5 * time.Millisecond)
		}
	})
	out := strings.Join(lines, "\n")
	require.Contains(t, out, fmt.Sprintf("engine engine-0 replay tcp://127.0.0.1:%d", rport))
	require.Regexp(t, `(?m)^engine engine-1 replay tcp://127\.0\.0\.1:\d+$`, out)
	require.Positive(t, replayed, "the replay socket answered with batches while the workloads ran")
	require.NotContains(t, body, "vllm:")
	problems, err := promlint.New(strings.NewReader(body)).Lint()
	require.NoError(t, err)
	require.Empty(t, problems)
}

// replayBatches asks ep for every batch from seq 0 and counts them.
func replayBatches(t *testing.T, ep string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d := zmq4.NewDealer(ctx, zmq4.WithID(zmq4.SocketIdentity("test")))
	defer d.Close()
	require.NoError(t, d.Dial(ep))
	require.NoError(t, d.Send(zmq4.NewMsgFrom(nil, binary.BigEndian.AppendUint64(nil, 0))))
	n := 0
	for range 100_000 {
		m, err := d.Recv()
		require.NoError(t, err)
		require.Len(t, m.Frames, 4)
		if binary.BigEndian.Uint64(m.Frames[2]) == ^uint64(0) {
			return n
		}
		n++
	}
	t.Fatal("no end of replay")
	return n
}

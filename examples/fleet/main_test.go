package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	"github.com/stretchr/testify/require"
)

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// runFleet runs the example with args; scrape is called with the
// /metrics URL while the workloads run. It returns the output lines.
func runFleet(t *testing.T, args []string, scrape func(url string)) []string {
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
		line := sc.Text()
		lines = append(lines, line)
		if m := metricsLine.FindStringSubmatch(line); m != nil {
			url = m[1]
		}
		if strings.HasPrefix(line, "running ") {
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
// names while it runs; each family's prompt routes to its engine; it
// stops by itself.
func TestFleetCommandLine(t *testing.T) {
	port, mport := freePort(t), freePort(t)
	var body string
	lines := runFleet(t, []string{
		"-events", fmt.Sprintf("tcp://*:%d", port),
		"-metrics", fmt.Sprintf("127.0.0.1:%d", mport),
		"-duration", "1500ms",
	}, func(url string) {
		require.Equal(t, fmt.Sprintf("http://127.0.0.1:%d/metrics", mport), url)
		body = get(t, url)
	})
	out := strings.Join(lines, "\n")
	require.Contains(t, out, fmt.Sprintf("engine engine-0 events binds tcp://127.0.0.1:%d topic kv@engine-0@llama", port))
	require.Regexp(t, `engine engine-1 events binds tcp://127\.0\.0\.1:\d+ topic kv@engine-1@llama`, out)
	require.Regexp(t, `engine engine-2 events binds tcp://127\.0\.0\.1:\d+ topic kv@engine-2@llama`, out)
	for i := range 3 {
		require.Regexp(t, fmt.Sprintf(`(?m)^events engine-%d published \d+ in \d+ batches, dropped \d+, received \d+ batches`, i), out)
		require.Regexp(t, fmt.Sprintf(`(?m)^prompt "family of engine-%d" \(9 blocks\): longest prefix on engine-%d, 7 blocks`, i, i), out)
	}
	require.Regexp(t, `(?m)^prompt "unseen" \(5 blocks\): longest prefix on engine-0 = engine-1 = engine-2 \(tie\), 1 blocks`, out)
	require.Equal(t, "fleet: done", lines[len(lines)-1])

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
// subscriber binds it and the engines dial in.
func TestFleetFreePortsAndConnect(t *testing.T) {
	lines := runFleet(t, []string{"-duration", "300ms", "-engines", "2"}, func(url string) {
		require.Contains(t, get(t, url), "kvlease_blocks")
	})
	out := strings.Join(lines, "\n")
	require.Regexp(t, `engine engine-0 events binds tcp://127\.0\.0\.1:[1-9]\d* topic`, out)
	require.Regexp(t, `(?m)^metrics http://127\.0\.0\.1:[1-9]\d*/metrics$`, out)
	require.Contains(t, out, "fleet: done")

	ep := fmt.Sprintf("tcp://127.0.0.1:%d", freePort(t))
	lines = runFleet(t, []string{"-events", ep, "-duration", "300ms", "-engines", "2"}, func(string) {})
	out = strings.Join(lines, "\n")
	require.Contains(t, out, "router subscriber bound "+ep)
	require.Contains(t, out, "engine engine-1 events dials "+ep+" topic kv@engine-1@llama")
	require.Regexp(t, `(?m)^prompt "family of engine-1" \(9 blocks\): longest prefix on engine-1, 7 blocks`, out)
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

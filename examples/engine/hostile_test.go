package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
)

// The reference engine under a hostile client (issue 30, item 6): each
// test plays one abuse and fails without the bound that stops it.

// dialFrom connects to addr from a local address (all of 127/8 is
// loopback on Linux: 127.0.0.2 is another client).
func dialFrom(t *testing.T, from string, addr net.Addr) net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}, Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", addr.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// readResponse reads one HTTP response from c, waiting at most 10 s (a
// liveness bound: the tests' verdicts are what arrives, not when).
func readResponse(t *testing.T, c net.Conn) (*http.Response, errorBody) {
	t.Helper()
	if err := c.SetReadDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("no response: %v", err)
	}
	defer resp.Body.Close()
	var eb errorBody
	_ = json.NewDecoder(resp.Body).Decode(&eb)
	return resp, eb
}

// A request without a key is refused from its headers: the server
// answers 401 while the 4 MiB body it announced was never sent. (Before,
// the body was read first: 8 such requests grew the process by 187 MiB.)
func TestAuthBeforeBody(t *testing.T) {
	o := testOptions()
	o.cfg.APIKeys = map[string]string{"k-alice": "alice"}
	a := startTest(t, o)
	for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
		for _, auth := range []string{"", "Authorization: Bearer k-eve\r\n"} {
			c := dialFrom(t, "127.0.0.1", a.addr)
			_, err := fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n",
				path, auth, maxBody)
			if err != nil {
				t.Fatal(err)
			}
			resp, eb := readResponse(t, c)
			if resp.StatusCode != http.StatusUnauthorized || eb.Error.Type != authError {
				t.Fatalf("%s %q: %d %+v", path, auth, resp.StatusCode, eb)
			}
		}
	}
}

// The adapter endpoints re-class every tenant's blocks of an adapter:
// they need the admin key, and are refused when none is configured
// (unless -open-admin).
func TestAdminKey(t *testing.T) {
	unload := func(a *app, key string) (int, errorBody) {
		req, _ := http.NewRequest("POST", "http://"+a.addr.String()+"/v1/unload_lora_adapter", strings.NewReader(`{"lora_name":"sim-1-sql"}`))
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var eb errorBody
		_ = json.NewDecoder(resp.Body).Decode(&eb)
		return resp.StatusCode, eb
	}
	// None configured: refused, whoever asks.
	a := startTest(t, testOptions())
	if code, eb := unload(a, "anything"); code != http.StatusForbidden || eb.Error.Type != permissionErr {
		t.Fatalf("no admin key configured: %d %+v", code, eb)
	}

	dir := t.TempDir()
	path := dir + "/admin"
	if err := os.WriteFile(path, []byte("adm-secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	keys := dir + "/keys"
	if err := os.WriteFile(keys, []byte("k-alice=alice\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	o, err := parseFlags([]string{"-admin-key-file", path, "-api-keys", keys, "-addr", "127.0.0.1:0"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	a = startTest(t, o)
	for _, key := range []string{"", "k-alice", "adm-secre", "adm-secret2"} {
		if code, eb := unload(a, key); code != http.StatusUnauthorized || eb.Error.Type != authError {
			t.Fatalf("key %q: %d %+v", key, code, eb)
		}
	}
	if code, _ := unload(a, "adm-secret"); code != http.StatusOK {
		t.Fatalf("the admin key: %d", code)
	}
	// A key file others can read is refused, as are API keys'.
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := parseFlags([]string{"-admin-key-file", path}, io.Discard); err == nil {
		t.Fatal("a world-readable admin key file was accepted")
	}
}

// A body that trickles is cut at -read-timeout: the connection ends long
// before the body would have arrived (1,000 bytes at one per 50 ms).
// Before, 50 such connections were all still open after 13 s.
func TestBodyReadTimeout(t *testing.T) {
	o := testOptions()
	o.readTimeout = 300 * time.Millisecond
	a := startTest(t, o)
	c := dialFrom(t, "127.0.0.1", a.addr)
	if _, err := fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: engine\r\nContent-Length: 1000\r\n\r\n{"); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	trickled := make(chan int, 1)
	go func() {
		n := 0
		defer func() { trickled <- n }()
		for ; n < 1000; n++ {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			if _, err := c.Write([]byte(" ")); err != nil {
				return
			}
		}
	}()
	if err := c.SetReadDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	_, err := io.Copy(io.Discard, c) // a 400, then the end; or just the end
	close(stop)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatal("the trickling connection is still open after 10 s")
	}
	if n := <-trickled; n >= 1000 {
		t.Fatalf("the whole body trickled in (%d bytes) before the server gave up", n)
	}
}

// The read deadline covers the request, not the response: a stream that
// lasts far longer than -read-timeout completes (net/http watches for a
// client going away by reading the connection, and lifts the deadline
// for that read: this test keeps it so).
func TestLongStreamOutlivesReadTimeout(t *testing.T) {
	o := testOptions()
	o.readTimeout = 200 * time.Millisecond
	o.cfg.DecodeTokenTime = 20 * time.Millisecond // 30 tokens: at least 600 ms
	a := startTest(t, o)
	base := "http://" + a.addr.String()
	for _, stream := range []bool{true, false} {
		req := map[string]any{"prompt": "a b c", "max_tokens": 30, "ignore_eos": true, "stream": stream}
		res, err := complete(context.Background(), http.DefaultClient, base, req, 0)
		if err != nil || res.status != 200 || len(strings.Fields(res.text)) != 30 {
			t.Fatalf("stream=%v: %v status %d text %q", stream, err, res.status, res.text)
		}
	}
	if n := a.engine.aborted.Load(); n != 0 {
		t.Fatalf("%d requests aborted", n)
	}
}

// One address holds at most -max-conns-per-addr connections: one more
// is answered 503 with Retry-After before anything of it is read; other
// addresses are served meanwhile, and the address gets its place back
// when one of its connections closes.
func TestConnCapPerAddress(t *testing.T) {
	o := testOptions()
	o.connsPerAddr = 4
	a := startTest(t, o)
	const attacker = "127.0.0.2"
	var held []net.Conn
	for range 4 {
		held = append(held, dialFrom(t, attacker, a.addr))
	}
	for i := 0; a.conns.held(attacker) < 4; i++ {
		if i == 1000 {
			t.Fatalf("the server holds %d of the attacker's connections", a.conns.held(attacker))
		}
		time.Sleep(10 * time.Millisecond)
	}
	resp, eb := readResponse(t, dialFrom(t, attacker, a.addr))
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" || eb.Error.Code == nil {
		t.Fatalf("fifth connection: %d %v %+v", resp.StatusCode, resp.Header, eb)
	}
	res, err := complete(context.Background(), http.DefaultClient, "http://"+a.addr.String(), map[string]any{"prompt": "a b"}, 0)
	if err != nil || res.status != 200 {
		t.Fatalf("another address: %v %d", err, res.status)
	}
	held[0].Close()
	for i := 0; a.conns.held(attacker) > 3; i++ {
		if i == 1000 {
			t.Fatal("a closed connection still counts")
		}
		time.Sleep(10 * time.Millisecond)
	}
	c := dialFrom(t, attacker, a.addr)
	if _, err := fmt.Fprintf(c, "GET /health HTTP/1.1\r\nHost: engine\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	if resp, _ := readResponse(t, c); resp.StatusCode != http.StatusOK {
		t.Fatalf("after one closed: %d", resp.StatusCode)
	}
}

// stalled submits a request that will never be read (its output fills
// outBuffer and it stops decoding), and waits until it has.
func stalled(t *testing.T, e *Engine, ctx context.Context) *request {
	t.Helper()
	r, err := e.Submit(ctx, "", "sim-1", "", []uint32{5, 6, 7, 8}, 8000, true)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; len(r.out) < cap(r.out); i++ {
		if i == 1000 {
			t.Fatalf("the request made %d tokens", len(r.out))
		}
		time.Sleep(10 * time.Millisecond)
	}
	return r
}

// A request's output waits in a buffer of outBuffer tokens, whatever its
// max_tokens: a client that does not read stalls its own request, not
// the scheduler, and takes the rest when it reads. 400 requests waiting
// with max_tokens 8000 hold a few MiB (before: a buffer of max_tokens
// each, +140 MiB).
func TestFixedOutputBuffer(t *testing.T) {
	o := testOptions()
	o.cfg.MaxContext, o.cfg.MaxRunning, o.cfg.MaxWaiting = 8192, 2, 400
	a := startTest(t, o)
	e := a.engine
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r1 := stalled(t, e, ctx)
	if cap(r1.out) != outBuffer {
		t.Fatalf("output buffer of %d for max_tokens 8000", cap(r1.out))
	}
	stalledHolds := e.Pool().Stats().Leased // r1 stalled: it grows no more
	// The scheduler serves another request meanwhile.
	res, err := complete(ctx, http.DefaultClient, "http://"+a.addr.String(), map[string]any{"prompt": "a b", "max_tokens": 50, "ignore_eos": true}, 0)
	if err != nil || res.status != 200 || len(strings.Fields(res.text)) != 50 {
		t.Fatalf("beside a stalled request: %v %d", err, res.status)
	}
	// A client hears its request's end only after the request has left
	// the batch and released its lease: the batch and the pool are the
	// stalled request's alone by now.
	if len(r1.out) != outBuffer || e.running.Load() != 1 {
		t.Fatalf("the stalled request moved: %d buffered, %d running", len(r1.out), e.running.Load())
	}
	if got := e.Pool().Stats().Leased; got != stalledHolds {
		t.Fatalf("%d blocks leased after the response, the stalled request alone holds %d", got, stalledHolds)
	}

	// 400 more wait behind two stalled ones.
	r2 := stalled(t, e, ctx)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var waiting []*request
	for range 400 {
		r, err := e.Submit(ctx, "", "sim-1", "", []uint32{9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9}, 8000, true)
		if err != nil {
			t.Fatal(err)
		}
		waiting = append(waiting, r)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	grew := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("400 waiting requests with max_tokens 8000: heap +%.2f MiB", float64(grew)/(1<<20))
	if grew > 16<<20 {
		t.Fatalf("400 waiting requests hold %d bytes", grew)
	}

	// The first client reads at last: all 8000 tokens arrive.
	n := 0
	for done := false; !done; {
		select {
		case out := <-r1.out:
			e.Taken()
			n++
			done = out.finish != ""
		case <-r1.failed:
			t.Fatal(r1.err)
		case <-time.After(30 * time.Second):
			t.Fatalf("stuck after %d tokens", n)
		}
	}
	if n != 8000 {
		t.Fatalf("%d tokens", n)
	}
	_ = r2
	_ = waiting
	cancel()
	e.Close()
	if st := e.Pool().Stats(); st.Leased != 0 || st.Draining != 0 {
		t.Fatalf("left behind: %+v", st)
	}
}

// At most MaxWaiting requests wait for the running batch: one more is
// refused at once, 503 with Retry-After; a place frees when a waiting
// client leaves.
func TestWaitingQueueBound(t *testing.T) {
	o := testOptions()
	o.cfg.MaxContext, o.cfg.MaxRunning, o.cfg.MaxWaiting = 8192, 1, 2
	a := startTest(t, o)
	e := a.engine
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stalled(t, e, ctx) // the batch is full and stays so
	ctx2, cancel2 := context.WithCancel(ctx)
	for _, c := range []context.Context{ctx2, ctx} {
		if _, err := e.Submit(c, "", "sim-1", "", []uint32{1, 2}, 1, false); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.Submit(ctx, "", "sim-1", "", []uint32{1, 2}, 1, false); !errors.Is(err, errBusy) {
		t.Fatalf("a third waiting request: %v", err)
	}
	for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
		body := `{"prompt":"a"}`
		if strings.Contains(path, "chat") {
			body = `{"messages":[{"role":"user","content":"a"}]}`
		}
		resp, err := http.Post("http://"+a.addr.String()+path, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		var eb errorBody
		_ = json.NewDecoder(resp.Body).Decode(&eb)
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "1" || eb.Error.Type != serverError {
			t.Fatalf("%s with the queue full: %d %v %+v", path, resp.StatusCode, resp.Header, eb)
		}
	}
	cancel2() // one waiting client leaves
	for i := 0; e.queued.Load() != 1; i++ {
		if i == 1000 {
			t.Fatalf("%d still queued", e.queued.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	r, err := e.Submit(ctx, "", "sim-1", "", []uint32{1, 2}, 1, false)
	if err != nil || r == nil {
		t.Fatalf("after a place freed: %v", err)
	}
	cancel()
	e.Close()
	if e.queued.Load() != 0 {
		t.Fatalf("%d counted queued after close", e.queued.Load())
	}
	if st := e.Pool().Stats(); st.Leased != 0 || st.Draining != 0 {
		t.Fatalf("left behind: %+v", st)
	}
}

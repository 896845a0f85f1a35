package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"

	"github.com/kvlease/kvlease/events"
)

// call sends method path with body (JSON, or nil) and returns the status,
// the headers and the body.
func call(t *testing.T, base, method, path string, body any) (int, http.Header, []byte) {
	t.Helper()
	var r io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		r = strings.NewReader(b)
	default:
		j, _ := json.Marshal(b)
		r = bytes.NewReader(j)
	}
	req, err := http.NewRequest(method, base+path, r)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header, data
}

// Every refusal is OpenAI's error shape, as JSON, with the parameter it
// is about and a message for the client (no Go type or field names, no
// library internals); unsupported parameters are refused by name, not
// ignored; unknown paths and methods answer JSON too.
func TestOpenAIErrors(t *testing.T) {
	o := testOptions()
	o.cfg.MaxContext = 64
	a := startTest(t, o)
	base := "http://" + a.addr.String()
	chat := func(extra map[string]any) map[string]any {
		m := map[string]any{"messages": []any{map[string]any{"role": "user", "content": "hi"}}}
		for k, v := range extra {
			m[k] = v
		}
		return m
	}
	for _, c := range []struct {
		method, path string
		body         any
		status       int
		typ, param   string
		code         string
	}{
		{"GET", "/v1/nope", nil, 404, invalidRequest, "", "unknown_url"},
		{"POST", "/", nil, 404, invalidRequest, "", "unknown_url"},
		{"GET", "/v1/completions", nil, 405, invalidRequest, "", "method_not_allowed"},
		{"POST", "/v1/models", nil, 405, invalidRequest, "", "method_not_allowed"},
		{"DELETE", "/v1/chat/completions", nil, 405, invalidRequest, "", "method_not_allowed"},
		{"POST", "/v1/completions", "{", 400, invalidRequest, "", "invalid_json"},
		{"POST", "/v1/completions", "", 400, invalidRequest, "", "invalid_json"},
		{"POST", "/v1/completions", "[1]", 400, invalidRequest, "", "invalid_type"},
		{"POST", "/v1/completions", `{"prompt":"a"} {}`, 400, invalidRequest, "", "invalid_json"},
		{"POST", "/v1/completions", `{"prompt":"a","max_tokens":"8"}`, 400, invalidRequest, "max_tokens", "invalid_type"},
		{"POST", "/v1/completions", `{"prompt":"a","stream":"yes"}`, 400, invalidRequest, "stream", "invalid_type"},
		{"POST", "/v1/completions", `{"prompt":"a","stream_options":{"include_usage":1}}`, 400, invalidRequest, "stream_options.include_usage", "invalid_type"},
		{"POST", "/v1/completions", map[string]any{"prompt": "a", "model": "nope"}, 404, invalidRequest, "model", "model_not_found"},
		{"POST", "/v1/completions", map[string]any{}, 400, invalidRequest, "prompt", "missing_required_parameter"},
		{"POST", "/v1/completions", map[string]any{"prompt": ""}, 400, invalidRequest, "prompt", "invalid_value"},
		{"POST", "/v1/completions", map[string]any{"prompt": []int{1, vocab}}, 400, invalidRequest, "prompt", "invalid_value"},
		{"POST", "/v1/completions", map[string]any{"prompt": []int{1, -2}}, 400, invalidRequest, "prompt", "invalid_type"},
		{"POST", "/v1/completions", map[string]any{"prompt": []string{"a", "b"}}, 400, invalidRequest, "prompt", "unsupported_parameter"},
		{"POST", "/v1/completions", map[string]any{"prompt": [][]int{{1}, {2}}}, 400, invalidRequest, "prompt", "unsupported_parameter"},
		{"POST", "/v1/completions", map[string]any{"prompt": "a", "max_tokens": 0}, 400, invalidRequest, "max_tokens", "invalid_value"},
		{"POST", "/v1/completions", map[string]any{"prompt": strings.Repeat("a ", 60), "max_tokens": 10}, 400, invalidRequest, "max_tokens", "context_length_exceeded"},
		{"POST", "/v1/completions", map[string]any{"prompt": "a", "n": 2}, 400, invalidRequest, "n", "unsupported_parameter"},
		{"POST", "/v1/completions", map[string]any{"prompt": "a", "n": 2, "stream": true}, 400, invalidRequest, "n", "unsupported_parameter"},
		{"POST", "/v1/completions", map[string]any{"prompt": "a", "echo": true}, 400, invalidRequest, "echo", "unsupported_parameter"},
		{"POST", "/v1/completions", map[string]any{"prompt": "a", "best_of": 3}, 400, invalidRequest, "best_of", "unsupported_parameter"},
		{"POST", "/v1/completions", map[string]any{"prompt": "a", "logprobs": 0}, 400, invalidRequest, "logprobs", "unsupported_parameter"},
		{"POST", "/v1/completions", map[string]any{"prompt": "a", "suffix": "z"}, 400, invalidRequest, "suffix", "unsupported_parameter"},
		{"POST", "/v1/completions", map[string]any{"prompt": "a", "stop": []string{"."}}, 400, invalidRequest, "stop", "unsupported_parameter"},
		{"POST", "/v1/completions", map[string]any{"prompt": "a", "logit_bias": map[string]int{"5": 1}}, 400, invalidRequest, "logit_bias", "unsupported_parameter"},
		{"POST", "/v1/chat/completions", chat(map[string]any{"n": 3}), 400, invalidRequest, "n", "unsupported_parameter"},
		{"POST", "/v1/chat/completions", chat(map[string]any{"logprobs": true}), 400, invalidRequest, "logprobs", "unsupported_parameter"},
		{"POST", "/v1/chat/completions", chat(map[string]any{"top_logprobs": 2}), 400, invalidRequest, "top_logprobs", "unsupported_parameter"},
		{"POST", "/v1/chat/completions", chat(map[string]any{"tools": []any{map[string]any{"type": "function"}}}), 400, invalidRequest, "tools", "unsupported_parameter"},
		{"POST", "/v1/chat/completions", chat(map[string]any{"tool_choice": "auto"}), 400, invalidRequest, "tool_choice", "unsupported_parameter"},
		{"POST", "/v1/chat/completions", chat(map[string]any{"response_format": map[string]any{"type": "json_object"}}), 400, invalidRequest, "response_format", "unsupported_parameter"},
		{"POST", "/v1/chat/completions", chat(map[string]any{"max_completion_tokens": 0}), 400, invalidRequest, "max_completion_tokens", "invalid_value"},
		{"POST", "/v1/chat/completions", chat(map[string]any{"model": "nope"}), 404, invalidRequest, "model", "model_not_found"},
		{"POST", "/v1/chat/completions", map[string]any{"messages": []any{}}, 400, invalidRequest, "messages", "missing_required_parameter"},
		{"POST", "/v1/chat/completions", map[string]any{"messages": []any{map[string]any{"role": "robot", "content": "x"}}}, 400, invalidRequest, "messages[0].role", "invalid_value"},
		{"POST", "/v1/chat/completions", map[string]any{"messages": []any{map[string]any{"role": "user",
			"content": []any{map[string]any{"type": "image_url", "image_url": map[string]any{"url": "x"}}}}}}, 400, invalidRequest, "messages[0].content[0].type", "unsupported_parameter"},
		{"POST", "/v1/chat/completions", `{"messages":[{"role":"user","content":7}]}`, 400, invalidRequest, "messages[0].content", "invalid_type"},
		{"POST", "/v1/completions", `{"prompt":"` + strings.Repeat("a", maxBody) + `"}`, 413, invalidRequest, "", "request_too_large"},
		{"POST", "/v1/unload_lora_adapter", map[string]any{"lora_name": "sim-1-sql"}, 403, permissionErr, "", "admin_disabled"},
	} {
		status, hdr, data := call(t, base, c.method, c.path, c.body)
		name := fmt.Sprintf("%s %s %.80v", c.method, c.path, c.body)
		if ct := hdr.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
			t.Errorf("%s: Content-Type %q", name, ct)
		}
		var eb errorBody
		if err := json.Unmarshal(data, &eb); err != nil {
			t.Errorf("%s: body %q: %v", name, data, err)
			continue
		}
		var raw map[string]map[string]any
		_ = json.Unmarshal(data, &raw)
		for _, k := range []string{"message", "type", "param", "code"} {
			if _, ok := raw["error"][k]; !ok {
				t.Errorf("%s: error has no %q: %s", name, k, data)
			}
		}
		param, code := "", ""
		if eb.Error.Param != nil {
			param = *eb.Error.Param
		}
		if eb.Error.Code != nil {
			code = *eb.Error.Code
		}
		if status != c.status || eb.Error.Type != c.typ || param != c.param || code != c.code || eb.Error.Message == "" {
			t.Errorf("%s: %d %s, want %d type %s param %q code %q", name, status, data, c.status, c.typ, c.param, c.code)
		}
		for _, leak := range []string{"json:", "Go struct", "Go value", "kvlease", "handoff", "completionRequest", "chatRequest", "commonRequest", "uint32", "%!"} {
			if strings.Contains(eb.Error.Message, leak) {
				t.Errorf("%s: message %q shows %q", name, eb.Error.Message, leak)
			}
		}
		if status == 405 && hdr.Get("Allow") == "" {
			t.Errorf("%s: 405 without Allow", name)
		}
	}
	// Parameters that only shape a real model's sampling are accepted.
	status, _, data := call(t, base, "POST", "/v1/chat/completions", chat(map[string]any{
		"temperature": 0.2, "top_p": 0.9, "seed": 7, "presence_penalty": 0.1, "frequency_penalty": 0.1, "user": "u",
		"n": 1, "logprobs": false, "stop": nil, "tool_choice": "none", "response_format": map[string]any{"type": "text"},
		"unknown_field": true, "max_completion_tokens": 3}))
	if status != 200 {
		t.Fatalf("accepted parameters: %d %s", status, data)
	}
}

// chatRequestBody is a chat request: a system prompt of n words and a
// user turn.
func chatRequestBody(system, user string, extra map[string]any) map[string]any {
	m := map[string]any{"model": "sim-1", "max_tokens": 4, "ignore_eos": true, "messages": []any{
		map[string]any{"role": "system", "content": system},
		map[string]any{"role": "user", "content": []any{map[string]any{"type": "text", "text": user}}},
	}}
	for k, v := range extra {
		m[k] = v
	}
	return m
}

// Chat completions, streamed and not: OpenAI's objects, the chat
// template over the tokenizer, and usage with cached tokens: a second
// conversation with the same system prompt hits its blocks.
func TestChatCompletions(t *testing.T) {
	a := startTest(t, testOptions())
	base := "http://" + a.addr.String()
	system := strings.Repeat("w11 ", 40) // + "<|system|>", "<|user|>": 42 shared tokens, 2 blocks of 16

	status, _, data := call(t, base, "POST", "/v1/chat/completions", chatRequestBody(system, "first question", nil))
	if status != 200 {
		t.Fatalf("%d %s", status, data)
	}
	var c chatCompletion
	if err := json.Unmarshal(data, &c); err != nil {
		t.Fatal(err)
	}
	// <|system|> + 40 + <|user|> + 2 words + <|assistant|>
	if c.Object != "chat.completion" || !strings.HasPrefix(c.ID, "chatcmpl-") || len(c.Choices) != 1 ||
		c.Choices[0].Message == nil || c.Choices[0].Message.Role != "assistant" || c.Choices[0].Message.Content == nil ||
		len(strings.Fields(*c.Choices[0].Message.Content)) != 4 || *c.Choices[0].FinishReason != "length" ||
		c.Usage.PromptTokens != 45 || c.Usage.CompletionTokens != 4 || c.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Fatalf("first: %s", data)
	}

	// The second conversation, streamed, with usage.
	req := chatRequestBody(system, "second question here", map[string]any{"stream": true, "stream_options": map[string]any{"include_usage": true}})
	j, _ := json.Marshal(req)
	resp, err := http.Post(base+"/v1/chat/completions", "application/json", bytes.NewReader(j))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("Content-Type %q", resp.Header.Get("Content-Type"))
	}
	var text strings.Builder
	var u *usage
	roles, finishes, done := 0, 0, false
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			done = true
			break
		}
		var ch chatCompletion
		if err := json.Unmarshal([]byte(line), &ch); err != nil {
			t.Fatal(err)
		}
		if ch.Object != "chat.completion.chunk" {
			t.Fatalf("chunk %s", line)
		}
		if ch.Usage != nil {
			u = ch.Usage
			continue
		}
		d := ch.Choices[0].Delta
		if d.Role == "assistant" {
			roles++
		}
		if d.Content != nil {
			text.WriteString(*d.Content)
		}
		if ch.Choices[0].FinishReason != nil {
			finishes++
		}
	}
	if !done || roles != 1 || finishes != 1 || len(strings.Fields(text.String())) != 4 || u == nil ||
		u.PromptTokens != 46 || u.PromptTokensDetails.CachedTokens != 32 {
		t.Fatalf("stream: done %v roles %d finishes %d text %q usage %+v", done, roles, finishes, text.String(), u)
	}
}

// -events binds a fixed loopback port (tcp://127.0.0.1:P), -replay
// exposes the replay socket, and the output names both (it printed
// "events %!s(<nil>)" when a loopback endpoint meant "dial").
func TestEventsLoopbackAndReplay(t *testing.T) {
	port, rport := freePort(t), freePort(t)
	var out bytes.Buffer
	err := run(context.Background(), []string{"-addr", "127.0.0.1:0", "-duration", "100ms",
		"-events", fmt.Sprintf("tcp://127.0.0.1:%d", port), "-replay", fmt.Sprintf("tcp://127.0.0.1:%d", rport)}, &out)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{fmt.Sprintf("events 127.0.0.1:%d topic kv@engine-0@sim-1\n", port), fmt.Sprintf("replay 127.0.0.1:%d\n", rport)} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "%!") {
		t.Errorf("a formatting error in the output:\n%s", out.String())
	}
	if _, err := parseFlags([]string{"-replay", "tcp://127.0.0.1:1"}, io.Discard); err == nil {
		t.Error("-replay without -events was accepted")
	}
	// -events-connect dials a router's bound SUB instead (none here: it
	// keeps redialling until the engine stops).
	out.Reset()
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", freePort(t))
	if err := run(context.Background(), []string{"-addr", "127.0.0.1:0", "-duration", "100ms", "-events", ep, "-events-connect"}, &out); err != nil {
		t.Fatal(err)
	}
	if want := "events dials " + ep + " topic kv@engine-0@sim-1\n"; !strings.Contains(out.String(), want) || strings.Contains(out.String(), "%!") {
		t.Errorf("output lacks %q:\n%s", want, out.String())
	}

	// The replay socket answers a DEALER with the batches of a request.
	o := testOptions()
	o.events, o.replay = "tcp://127.0.0.1:0", "tcp://127.0.0.1:0"
	a := startTest(t, o)
	res, err := complete(context.Background(), http.DefaultClient, "http://"+a.addr.String(), map[string]any{"prompt": strings.Repeat("w5 ", 40), "max_tokens": 1}, 0)
	if err != nil || res.status != 200 {
		t.Fatalf("%v %d", err, res.status)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := a.pub.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	dealer := zmq4.NewDealer(ctx, zmq4.WithID(zmq4.SocketIdentity("router")))
	defer dealer.Close()
	if err := dealer.Dial("tcp://" + a.pub.ReplayAddr().String()); err != nil {
		t.Fatal(err)
	}
	if err := dealer.Send(zmq4.NewMsgFrom(nil, binary.BigEndian.AppendUint64(nil, 0))); err != nil {
		t.Fatal(err)
	}
	stored := 0
	for range 100 {
		m, err := dealer.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if len(m.Frames) != 4 {
			t.Fatalf("%d frames", len(m.Frames))
		}
		if binary.BigEndian.Uint64(m.Frames[2]) == ^uint64(0) {
			break
		}
		b, err := events.DecodeBatch(m.Frames[3])
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range b.Events {
			if e.Type == "BlockStored" {
				stored += len(e.BlockHashes)
			}
		}
	}
	if stored != 2 {
		t.Fatalf("replayed %d stored blocks, want the prompt's 2", stored)
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// With -vllm-metrics=false the scrape lints clean (promlint, what
// promtool check metrics runs); with vLLM's names it does not (their
// colons), which is why the flag exists.
func TestMetricsLintWithoutVLLMNames(t *testing.T) {
	for _, withVLLM := range []bool{false, true} {
		o := testOptions()
		o.vllmMetrics = withVLLM
		a := startTest(t, o)
		if _, err := complete(context.Background(), http.DefaultClient, "http://"+a.addr.String(), map[string]any{"prompt": "a b"}, 0); err != nil {
			t.Fatal(err)
		}
		status, _, data := call(t, "http://"+a.addr.String(), "GET", "/metrics", nil)
		if status != 200 {
			t.Fatal(status)
		}
		problems, err := promlint.New(bytes.NewReader(data)).Lint()
		if err != nil {
			t.Fatal(err)
		}
		if withVLLM != (len(problems) > 0) || withVLLM != strings.Contains(string(data), "vllm:") {
			t.Fatalf("vllm names %v: %d problems %v", withVLLM, len(problems), problems)
		}
	}
}

// FuzzParseChat: any body is a chat request with a prompt from its
// messages, or a 400 for the client whose message shows no Go internals.
func FuzzParseChat(f *testing.F) {
	f.Add([]byte(`{"messages":[{"role":"user","content":"hi"}]}`))
	f.Add([]byte(`{"messages":[{"role":"system","content":[{"type":"text","text":"a b"}]},{"role":"user","content":null}],"max_completion_tokens":3}`))
	f.Add([]byte(`{"messages":[{"role":"user","content":[{"type":"image_url"}]}],"n":2}`))
	f.Add([]byte(`{"messages":"x","tools":[1]}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		req, prompt, err := parseChat(body)
		if err != nil {
			ae, ok := err.(*apiError)
			if !ok || ae.status != http.StatusBadRequest || ae.typ != invalidRequest || ae.msg == "" {
				t.Fatalf("error %#v is not a 400 for the client", err)
			}
			for _, leak := range []string{"json:", "Go ", "commonRequest", "chatRequest", "chatMessage"} {
				if strings.Contains(ae.msg, leak) || strings.Contains(ae.param, leak) {
					t.Fatalf("error %q (param %q) shows %q", ae.msg, ae.param, leak)
				}
			}
			return
		}
		if len(prompt) == 0 || *req.MaxTokens < 1 || len(req.Messages) == 0 {
			t.Fatalf("accepted %q: prompt %v max_tokens %d", body, prompt, *req.MaxTokens)
		}
		for _, id := range prompt {
			if id >= vocab {
				t.Fatalf("accepted token %d", id)
			}
		}
	})
}

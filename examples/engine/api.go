package main

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/kvlease/kvlease"
)

// The OpenAI-style API: GET /v1/models, POST /v1/completions and POST
// /v1/chat/completions, streamed (server-sent events) or not, with usage
// as vLLM reports it; vLLM's adapter endpoints for an admin. Every
// answer that is not a success is OpenAI's JSON error (apierror.go),
// unknown paths and methods included.

type usage struct {
	PromptTokens        int                  `json:"prompt_tokens"`
	CompletionTokens    int                  `json:"completion_tokens"`
	TotalTokens         int                  `json:"total_tokens"`
	PromptTokensDetails *promptTokensDetails `json:"prompt_tokens_details,omitempty"`
}

type promptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

type choice struct {
	Index        int     `json:"index"`
	Text         string  `json:"text"`
	Logprobs     any     `json:"logprobs"`
	FinishReason *string `json:"finish_reason"`
}

type completion struct {
	ID      string   `json:"id"`
	Object  string   `json:"object"`
	Created int64    `json:"created"`
	Model   string   `json:"model"`
	Choices []choice `json:"choices"`
	Usage   *usage   `json:"usage,omitempty"`
}

type chatMessageOut struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

type chatChoice struct {
	Index        int             `json:"index"`
	Message      *chatMessageOut `json:"message,omitempty"`
	Delta        *chatMessageOut `json:"delta,omitempty"`
	Logprobs     any             `json:"logprobs"`
	FinishReason *string         `json:"finish_reason"`
}

type chatCompletion struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"`
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []chatChoice `json:"choices"`
	Usage   *usage       `json:"usage,omitempty"`
}

// server is the HTTP face of an Engine.
type server struct {
	e   *Engine
	now func() time.Time
	// adminKey is the SHA-256 of the key the adapter endpoints require;
	// openAdmin serves them to anyone; with neither they are refused.
	adminKey  *[sha256.Size]byte
	openAdmin bool
}

// routes registers the API on mux, with extra GET endpoints (/metrics).
func (s *server) routes(mux *http.ServeMux, extra map[string]http.Handler) {
	route(mux, "/v1/models", map[string]http.HandlerFunc{"GET": s.models})
	route(mux, "/v1/completions", map[string]http.HandlerFunc{"POST": s.completions})
	route(mux, "/v1/chat/completions", map[string]http.HandlerFunc{"POST": s.chat})
	route(mux, "/v1/load_lora_adapter", map[string]http.HandlerFunc{"POST": s.loadAdapter(true)})
	route(mux, "/v1/unload_lora_adapter", map[string]http.HandlerFunc{"POST": s.loadAdapter(false)})
	route(mux, "/health", map[string]http.HandlerFunc{"GET": func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) }})
	for path, h := range extra {
		route(mux, path, map[string]http.HandlerFunc{"GET": h.ServeHTTP})
	}
	route(mux, "/", nil)
}

// route serves path's methods on mux, and answers any other method with
// a JSON 405 (Allow listing the served ones). Path "/" with no methods
// is the catch-all: a JSON 404 for every path nothing else serves.
func route(mux *http.ServeMux, path string, methods map[string]http.HandlerFunc) {
	if methods == nil {
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
			writeError(w, &apiError{status: http.StatusNotFound, typ: invalidRequest, code: "unknown_url",
				msg: fmt.Sprintf("no such endpoint: %s %s", r.Method, r.URL.Path)})
		})
		return
	}
	var allow []string
	for m := range methods {
		allow = append(allow, m)
	}
	slices.Sort(allow)
	mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
		m := r.Method
		if m == http.MethodHead {
			m = http.MethodGet // net/http writes no body for a HEAD
		}
		if h, ok := methods[m]; ok {
			h(w, r)
			return
		}
		w.Header().Set("Allow", strings.Join(allow, ", "))
		writeError(w, &apiError{status: http.StatusMethodNotAllowed, typ: invalidRequest, code: "method_not_allowed",
			msg: fmt.Sprintf("%s %s is not served (%s is)", r.Method, path, strings.Join(allow, ", "))})
	})
}

// bearer is the request's bearer token ("" when it has none).
func bearer(r *http.Request) string {
	b, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	return b
}

// tenant authenticates the request's bearer key when tenants are on: it
// runs before the body is read, so a client without a key costs its
// headers and no more.
func (s *server) tenant(r *http.Request) (string, error) {
	if len(s.e.tenants) == 0 {
		return "", nil
	}
	key := bearer(r)
	t, ok := s.e.tenants[sha256.Sum256([]byte(key))]
	if !ok || key == "" {
		return "", errUnauthorized
	}
	return t, nil
}

// admin authorizes the adapter endpoints: the admin key, compared by
// digest in constant time; refused outright when none is configured,
// unless the engine was started with them open.
func (s *server) admin(r *http.Request) error {
	switch {
	case s.openAdmin:
		return nil
	case s.adminKey == nil:
		return errAdminDisabled
	}
	got := sha256.Sum256([]byte(bearer(r)))
	if bearer(r) == "" || subtle.ConstantTimeCompare(got[:], s.adminKey[:]) != 1 {
		return errAdminKey
	}
	return nil
}

// loadAdapter serves vLLM's adapter endpoints for the adapters this
// engine serves: unloading lowers the adapter's cached blocks to the first
// evicted, loading raises them back. (The simulated model has no weights
// to load.) Only an admin may: either call re-classes the blocks of every
// tenant that used the adapter.
func (s *server) loadAdapter(loaded bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if err := s.admin(r); err != nil {
			writeError(w, err)
			return
		}
		var req struct {
			LoraName string `json:"lora_name"`
		}
		data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 64<<10))
		if err != nil {
			writeError(w, errTooLarge)
			return
		}
		if err := decode(data, &req); err != nil {
			writeError(w, err)
			return
		}
		if err := s.e.SetAdapterLoaded(req.LoraName, loaded); err != nil {
			writeError(w, &apiError{status: http.StatusNotFound, typ: invalidRequest, code: "adapter_not_found", param: "lora_name",
				msg: fmt.Sprintf("the adapter %q is not served", req.LoraName)})
			return
		}
		w.WriteHeader(http.StatusOK)
	}
}

func (s *server) models(w http.ResponseWriter, _ *http.Request) {
	type model struct {
		ID      string  `json:"id"`
		Object  string  `json:"object"`
		Created int64   `json:"created"`
		OwnedBy string  `json:"owned_by"`
		Root    string  `json:"root"`
		Parent  *string `json:"parent"`
	}
	var out struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}
	out.Object = "list"
	base := s.e.cfg.Model
	for i, name := range s.e.Models() {
		m := model{ID: name, Object: "model", Created: s.now().Unix(), OwnedBy: "kvlease", Root: base}
		if i > 0 {
			m.Parent = &base // a LoRA adapter of the base model
		}
		out.Data = append(out.Data, m)
	}
	writeJSON(w, http.StatusOK, out)
}

// accepted is a request the engine took: its parameters and its
// scheduler request.
type accepted struct {
	model        string
	stream       bool
	includeUsage bool
	rq           *request
	created      int64
}

// submit authenticates, reads and parses a request (parse is the
// endpoint's parser) and submits it to the engine; nil after it has
// answered with an error.
func (s *server) submit(w http.ResponseWriter, r *http.Request, parse func([]byte) (commonRequest, []uint32, error)) *accepted {
	tenant, err := s.tenant(r) // before a byte of the body is read
	if err != nil {
		writeError(w, err)
		return nil
	}
	data, err := readBody(w, r)
	if err != nil {
		writeError(w, err)
		return nil
	}
	req, prompt, err := parse(data)
	if err != nil {
		writeError(w, err)
		return nil
	}
	if req.Model == "" {
		req.Model = s.e.cfg.Model
	}
	if _, ok := s.e.seeds[req.Model]; !ok {
		writeError(w, notFoundModel(req.Model))
		return nil
	}
	if n, limit := len(prompt)+*req.MaxTokens, s.e.cfg.MaxContext; n > limit {
		writeError(w, badParam("max_tokens", "context_length_exceeded",
			"this model's maximum context length is %d tokens; the request asks for %d (%d in the prompt, %d to generate)",
			limit, n, len(prompt), *req.MaxTokens))
		return nil
	}
	rq, err := s.e.Submit(r.Context(), tenant, req.Model, req.CacheSalt, prompt, *req.MaxTokens, req.IgnoreEOS)
	switch {
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return nil // the client is gone
	case errors.Is(err, kvlease.ErrInvalidArgument), errors.Is(err, kvlease.ErrExceedsCapacity):
		writeError(w, badParam("", "invalid_value", "the engine's limits refuse this request (prompt %d tokens, max_tokens %d)",
			len(prompt), *req.MaxTokens))
		return nil
	case err != nil:
		writeError(w, err)
		return nil
	}
	return &accepted{model: req.Model, stream: req.Stream, rq: rq, created: s.now().Unix(),
		includeUsage: req.StreamOptions != nil && req.StreamOptions.IncludeUsage}
}

func (s *server) completions(w http.ResponseWriter, r *http.Request) {
	a := s.submit(w, r, func(data []byte) (commonRequest, []uint32, error) {
		req, prompt, err := parseCompletion(data)
		return req.commonRequest, prompt, err
	})
	if a == nil {
		return
	}
	base := completion{ID: "cmpl-" + a.rq.id, Object: "text_completion", Created: a.created, Model: a.model}
	s.respond(w, r, a, func(text string, finish *string, u *usage) any {
		c := base
		c.Choices = []choice{{Text: text, FinishReason: finish}}
		if u != nil && finish == nil { // the stream's usage chunk
			c.Choices = []choice{}
		}
		c.Usage = u
		return c
	})
}

func (s *server) chat(w http.ResponseWriter, r *http.Request) {
	a := s.submit(w, r, func(data []byte) (commonRequest, []uint32, error) {
		req, prompt, err := parseChat(data)
		return req.commonRequest, prompt, err
	})
	if a == nil {
		return
	}
	base := chatCompletion{ID: "chatcmpl-" + a.rq.id, Object: "chat.completion", Created: a.created, Model: a.model}
	if a.stream {
		base.Object = "chat.completion.chunk"
	}
	first := true
	s.respond(w, r, a, func(text string, finish *string, u *usage) any {
		c := base
		switch {
		case !a.stream:
			c.Choices = []chatChoice{{Message: &chatMessageOut{Role: "assistant", Content: &text}, FinishReason: finish}}
			c.Usage = u
		case u != nil && finish == nil: // the stream's usage chunk
			c.Choices, c.Usage = []chatChoice{}, u
		default:
			d := &chatMessageOut{Content: &text}
			if first {
				d.Role, first = "assistant", false
			}
			c.Choices = []chatChoice{{Delta: d, FinishReason: finish}}
		}
		return c
	})
}

// respond hands a request's output to its client: one JSON answer when
// it finishes, or server-sent events as tokens come; shape builds each
// object from the text, the finish reason (nil: more to come) and the
// usage (with the finish; alone, it is the stream's usage chunk).
func (s *server) respond(w http.ResponseWriter, r *http.Request, a *accepted, shape func(text string, finish *string, u *usage) any) {
	ctx, rq := r.Context(), a.rq
	defer s.e.Taken() // gone or done: the scheduler may have work to drop
	if !a.stream {
		var text strings.Builder
		for {
			select {
			case o := <-rq.out:
				s.e.Taken()
				text.WriteString(detokenize(o.token))
				if o.finish != "" {
					writeJSON(w, http.StatusOK, shape(text.String(), &o.finish, &o.usage))
					return
				}
			case <-rq.failed:
				writeError(w, rq.err)
				return
			case <-ctx.Done():
				return
			}
		}
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	send := func(v any) bool {
		b, _ := json.Marshal(v)
		// A client that takes no byte for a minute is gone: its request
		// ends like any other whose client left.
		_ = rc.SetWriteDeadline(time.Now().Add(time.Minute))
		if _, err := fmt.Fprintf(w, "data: %s\n\n", b); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	for {
		select {
		case o := <-rq.out:
			s.e.Taken()
			var finish *string
			if o.finish != "" {
				finish = &o.finish
			}
			if !send(shape(detokenize(o.token), finish, nil)) {
				return // the client is gone; ctx ends and the scheduler aborts
			}
			if finish != nil {
				if a.includeUsage {
					send(shape("", nil, &o.usage))
				}
				fmt.Fprint(w, "data: [DONE]\n\n")
				return
			}
		case <-rq.failed:
			// The tokens it made before it failed go first.
			for len(rq.out) > 0 {
				if !send(shape(detokenize((<-rq.out).token), nil, nil)) {
					return
				}
			}
			send(toAPIError(rq.err).body())
			return
		case <-ctx.Done():
			return
		}
	}
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

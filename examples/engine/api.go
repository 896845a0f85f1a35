package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/kvlease/kvlease"
)

// The OpenAI-style API: GET /v1/models and POST /v1/completions, streamed
// (server-sent events) or not, with usage as vLLM reports it.

// maxBody bounds a request body: a prompt of MaxContext token ids written
// as 10-digit numbers fits many times over.
const maxBody = 4 << 20

type completionRequest struct {
	Model         string          `json:"model"`
	Prompt        json.RawMessage `json:"prompt"`
	MaxTokens     *int            `json:"max_tokens"`
	Stream        bool            `json:"stream"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	IgnoreEOS bool   `json:"ignore_eos"` // vLLM's extension
	CacheSalt string `json:"cache_salt"` // vLLM's: a namespace within the model (public, so not isolation)
}

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

type apiError struct {
	Error struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    int    `json:"code"`
	} `json:"error"`
}

// errBadRequest marks a request the client must fix (HTTP 400).
var errBadRequest = errors.New("invalid request")

// parseCompletion reads and checks a completion request: the body at most
// maxBody bytes, one prompt (a string, or an array of token ids each
// below the vocabulary), max_tokens (default 16) at least 1. Every
// refusal wraps errBadRequest.
func parseCompletion(body io.Reader) (completionRequest, []uint32, error) {
	var req completionRequest
	data, err := io.ReadAll(io.LimitReader(body, maxBody+1))
	if err != nil {
		return req, nil, fmt.Errorf("read body: %v: %w", err, errBadRequest)
	}
	if len(data) > maxBody {
		return req, nil, fmt.Errorf("body over %d bytes: %w", maxBody, errBadRequest)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&req); err != nil {
		return req, nil, fmt.Errorf("body is not a completion request: %v: %w", err, errBadRequest)
	}
	if req.MaxTokens == nil {
		n := 16
		req.MaxTokens = &n
	}
	if *req.MaxTokens < 1 {
		return req, nil, fmt.Errorf("max_tokens %d must be at least 1: %w", *req.MaxTokens, errBadRequest)
	}
	prompt, err := parsePrompt(req.Prompt)
	if err != nil {
		return req, nil, err
	}
	return req, prompt, nil
}

// parsePrompt accepts a string, a one-element array of strings, or an
// array of token ids (OpenAI's forms for one prompt).
func parsePrompt(raw json.RawMessage) ([]uint32, error) {
	raw = bytes.TrimSpace(raw)
	var prompt []uint32
	switch {
	case len(raw) == 0 || string(raw) == "null":
		return nil, fmt.Errorf("no prompt: %w", errBadRequest)
	case raw[0] == '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return nil, fmt.Errorf("prompt: %v: %w", err, errBadRequest)
		}
		prompt = tokenize(s)
	case raw[0] == '[':
		var ids []uint32
		if err := json.Unmarshal(raw, &ids); err == nil {
			prompt = ids
			break
		}
		var texts []string
		if err := json.Unmarshal(raw, &texts); err != nil || len(texts) != 1 {
			return nil, fmt.Errorf("prompt must be a string, one string in an array, or token ids (batched prompts are not served): %w", errBadRequest)
		}
		prompt = tokenize(texts[0])
	default:
		return nil, fmt.Errorf("prompt must be a string or token ids: %w", errBadRequest)
	}
	if len(prompt) == 0 {
		return nil, fmt.Errorf("empty prompt: %w", errBadRequest)
	}
	for i, id := range prompt {
		if id >= vocab {
			return nil, fmt.Errorf("token %d of the prompt is %d, the vocabulary has %d: %w", i, id, vocab, errBadRequest)
		}
	}
	return prompt, nil
}

// server is the HTTP face of an Engine.
type server struct {
	e   *Engine
	now func() time.Time
}

func (s *server) routes(mux *http.ServeMux) {
	mux.HandleFunc("GET /v1/models", s.models)
	mux.HandleFunc("POST /v1/completions", s.completions)
	mux.HandleFunc("POST /v1/load_lora_adapter", s.loadAdapter(true))
	mux.HandleFunc("POST /v1/unload_lora_adapter", s.loadAdapter(false))
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
}

// loadAdapter serves vLLM's adapter endpoints for the adapters this
// engine serves: unloading lowers the adapter's cached blocks to the first
// evicted, loading raises them back. (The simulated model has no weights
// to load.)
func (s *server) loadAdapter(loaded bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			LoraName string `json:"lora_name"`
		}
		if err := json.NewDecoder(io.LimitReader(r.Body, 64<<10)).Decode(&req); err != nil {
			writeError(w, http.StatusBadRequest, fmt.Errorf("%v: %w", err, errBadRequest))
			return
		}
		if err := s.e.SetAdapterLoaded(req.LoraName, loaded); err != nil {
			writeError(w, http.StatusNotFound, err)
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

func (s *server) completions(w http.ResponseWriter, r *http.Request) {
	req, prompt, err := parseCompletion(http.MaxBytesReader(w, r.Body, maxBody+1))
	if err != nil {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	if req.Model == "" {
		req.Model = s.e.cfg.Model
	}
	tenant := ""
	if len(s.e.tenants) > 0 {
		bearer, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		var ok bool
		if tenant, ok = s.e.tenants[sha256.Sum256([]byte(bearer))]; !ok || bearer == "" {
			writeError(w, http.StatusUnauthorized, errors.New("a valid API key is required"))
			return
		}
	}
	ctx := r.Context() // ends when the client goes away: the scheduler then aborts the request
	rq, err := s.e.Submit(ctx, tenant, req.Model, req.CacheSalt, prompt, *req.MaxTokens, req.IgnoreEOS)
	switch {
	case errors.Is(err, errNoModel):
		writeError(w, http.StatusNotFound, err)
		return
	case errors.Is(err, kvlease.ErrInvalidArgument), errors.Is(err, kvlease.ErrExceedsCapacity):
		writeError(w, http.StatusBadRequest, err) // the envelope refused it: it can never run here
		return
	case err != nil:
		writeError(w, http.StatusServiceUnavailable, err)
		return
	}
	base := completion{ID: rq.id, Object: "text_completion", Created: s.now().Unix(), Model: req.Model}
	if !req.Stream {
		var text strings.Builder
		for {
			select {
			case o := <-rq.out:
				if o.err != nil {
					writeError(w, http.StatusServiceUnavailable, o.err)
					return
				}
				text.WriteString(detokenize(o.token))
				if o.finish != "" {
					base.Choices = []choice{{Text: text.String(), FinishReason: &o.finish}}
					base.Usage = &o.usage
					writeJSON(w, http.StatusOK, base)
					return
				}
			case <-ctx.Done():
				return
			}
		}
	}
	includeUsage := req.StreamOptions != nil && req.StreamOptions.IncludeUsage
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	flusher, _ := w.(http.Flusher)
	send := func(c completion) bool {
		b, _ := json.Marshal(c)
		if _, err := fmt.Fprintf(w, "data: %s\n\n", b); err != nil {
			return false
		}
		if flusher != nil {
			flusher.Flush()
		}
		return true
	}
	for {
		select {
		case o := <-rq.out:
			if o.err != nil {
				var e apiError
				e.Error.Message, e.Error.Type, e.Error.Code = o.err.Error(), "server_error", http.StatusServiceUnavailable
				b, _ := json.Marshal(e)
				fmt.Fprintf(w, "data: %s\n\n", b)
				return
			}
			c := base
			ch := choice{Text: detokenize(o.token)}
			if o.finish != "" {
				ch.FinishReason = &o.finish
			}
			c.Choices = []choice{ch}
			if !send(c) {
				return // the client is gone; ctx ends and the scheduler aborts
			}
			if o.finish != "" {
				if includeUsage {
					c := base
					c.Choices = []choice{}
					c.Usage = &o.usage
					send(c)
				}
				fmt.Fprint(w, "data: [DONE]\n\n")
				return
			}
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

func writeError(w http.ResponseWriter, code int, err error) {
	var e apiError
	e.Error.Message = err.Error()
	e.Error.Type = map[int]string{400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}[code]
	if e.Error.Type == "" {
		e.Error.Type = "ServiceUnavailableError"
	}
	e.Error.Code = code
	writeJSON(w, code, e)
}

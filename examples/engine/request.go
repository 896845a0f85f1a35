package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// The requests of the OpenAI-style API: POST /v1/completions and POST
// /v1/chat/completions, as far as a simulated model can honour them.
// What it cannot honour (several choices, echo, log probabilities, stop
// sequences, tools, ...) is refused with a 400 naming the parameter,
// never silently ignored; sampling knobs that only shape a real model's
// distribution (temperature, top_p, seed, penalties) are accepted and
// have no effect on the simulated sampler; unknown fields are ignored,
// as OpenAI's and vLLM's servers do.

// maxBody bounds a request body: a prompt of MaxContext token ids written
// as 10-digit numbers fits many times over.
const maxBody = 4 << 20

// defaultMaxTokens is max_tokens when a request leaves it out.
const defaultMaxTokens = 16

// commonRequest holds the fields both endpoints share.
type commonRequest struct {
	Model         string `json:"model"`
	MaxTokens     *int   `json:"max_tokens"`
	Stream        bool   `json:"stream"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	IgnoreEOS bool   `json:"ignore_eos"` // vLLM's extension
	CacheSalt string `json:"cache_salt"` // vLLM's: a namespace within the model (public, so not isolation)

	// Known, and refused unless they ask for the default.
	N           *int            `json:"n"`
	Logprobs    json.RawMessage `json:"logprobs"` // completions: an integer; chat: a boolean
	TopLogprobs *int            `json:"top_logprobs"`
	Stop        json.RawMessage `json:"stop"`
	LogitBias   json.RawMessage `json:"logit_bias"`
}

type completionRequest struct {
	commonRequest
	Prompt json.RawMessage `json:"prompt"`
	Echo   bool            `json:"echo"`
	BestOf *int            `json:"best_of"`
	Suffix *string         `json:"suffix"`
}

type chatRequest struct {
	commonRequest
	Messages            []chatMessage   `json:"messages"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	Tools               json.RawMessage `json:"tools"`
	ToolChoice          json.RawMessage `json:"tool_choice"`
	Functions           json.RawMessage `json:"functions"`
	FunctionCall        json.RawMessage `json:"function_call"`
	ResponseFormat      *struct {
		Type string `json:"type"`
	} `json:"response_format"`
	Modalities []string        `json:"modalities"`
	Audio      json.RawMessage `json:"audio"`
	Prediction json.RawMessage `json:"prediction"`
}

type chatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// isNull reports a parameter left out or sent as null.
func isNull(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) == 0 || string(raw) == "null"
}

// isEmpty reports null, "", [] or {}: a parameter that asks for nothing.
func isEmpty(raw json.RawMessage) bool {
	s := string(bytes.TrimSpace(raw))
	return isNull(raw) || s == `""` || s == "[]" || s == "{}" || s == "false"
}

// readBody reads a request body of at most maxBody bytes.
func readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		return nil, errTooLarge
	case err != nil:
		return nil, badParam("", "invalid_body", "the request body could not be read")
	}
	return data, nil
}

// decode decodes a JSON object body into v.
func decode(data []byte, v any) error {
	if len(bytes.TrimSpace(data)) == 0 {
		return badParam("", "invalid_json", "the request body is empty; it must be a JSON object")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(v); err != nil {
		return jsonError(err)
	}
	if dec.More() {
		return badParam("", "invalid_json", "the request body holds more than one JSON value")
	}
	return nil
}

// check validates what both endpoints share and fills the defaults:
// max_tokens (defaultMaxTokens) at least 1, and the refusals.
func (c *commonRequest) check(maxTokens **int) error {
	if *maxTokens == nil {
		n := defaultMaxTokens
		*maxTokens = &n
	}
	if **maxTokens < 1 {
		return badParam("max_tokens", "invalid_value", "max_tokens must be at least 1, not %d", **maxTokens)
	}
	switch {
	case c.N != nil && *c.N != 1:
		return unsupported("n", "n=%d is not supported: this engine returns one choice per request", *c.N)
	case c.TopLogprobs != nil && *c.TopLogprobs != 0:
		return unsupported("top_logprobs", "top_logprobs is not supported: the simulated model has no probabilities")
	case !isEmpty(c.Logprobs):
		return unsupported("logprobs", "logprobs is not supported: the simulated model has no probabilities")
	case !isEmpty(c.Stop):
		return unsupported("stop", "stop sequences are not supported; generation ends at max_tokens or the end-of-sequence token")
	case !isEmpty(c.LogitBias):
		return unsupported("logit_bias", "logit_bias is not supported")
	}
	return nil
}

// parseCompletion reads and checks a completion request body: one prompt
// (a string, or token ids each below the vocabulary, or either in a
// one-element array) and the common parameters. Every refusal is an
// *apiError.
func parseCompletion(data []byte) (completionRequest, []uint32, error) {
	var req completionRequest
	if err := decode(data, &req); err != nil {
		return req, nil, err
	}
	if err := req.check(&req.MaxTokens); err != nil {
		return req, nil, err
	}
	switch {
	case req.Echo:
		return req, nil, unsupported("echo", "echo is not supported")
	case req.BestOf != nil && *req.BestOf != 1:
		return req, nil, unsupported("best_of", "best_of=%d is not supported: this engine returns one choice per request", *req.BestOf)
	case req.Suffix != nil && *req.Suffix != "":
		return req, nil, unsupported("suffix", "suffix is not supported")
	}
	prompt, err := parsePrompt(req.Prompt)
	if err != nil {
		return req, nil, err
	}
	return req, prompt, nil
}

// parsePrompt accepts a string, token ids, or one of either in an array
// (OpenAI's forms for one prompt); batched prompts are refused.
func parsePrompt(raw json.RawMessage) ([]uint32, error) {
	raw = bytes.TrimSpace(raw)
	var prompt []uint32
	switch {
	case isNull(raw):
		return nil, badParam("prompt", "missing_required_parameter", "prompt is required")
	case raw[0] == '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return nil, badParam("prompt", "invalid_type", "prompt is not a valid JSON string")
		}
		prompt = tokenize(s)
	case raw[0] == '[':
		ids, isIDs := unmarshalAs[[]uint32](raw)
		texts, isTexts := unmarshalAs[[]string](raw)
		lists, isLists := unmarshalAs[[][]uint32](raw)
		switch {
		case isIDs:
			prompt = ids
		case isTexts && len(texts) == 1:
			prompt = tokenize(texts[0])
		case isLists && len(lists) == 1:
			prompt = lists[0]
		case isTexts || isLists:
			return nil, unsupported("prompt", "batched prompts are not supported: send one prompt per request")
		default:
			return nil, badParam("prompt", "invalid_type", "prompt must be a string or an array of token ids (non-negative integers)")
		}
	default:
		return nil, badParam("prompt", "invalid_type", "prompt must be a string or an array of token ids")
	}
	return checkPrompt(prompt, "prompt")
}

// unmarshalAs decodes raw as a T; ok is false when it is not one.
func unmarshalAs[T any](raw json.RawMessage) (T, bool) {
	var v T
	if err := json.Unmarshal(raw, &v); err != nil {
		var zero T
		return zero, false
	}
	return v, true
}

func checkPrompt(prompt []uint32, param string) ([]uint32, error) {
	if len(prompt) == 0 {
		return nil, badParam(param, "invalid_value", "the prompt is empty")
	}
	for i, id := range prompt {
		if id >= vocab {
			return nil, badParam(param, "invalid_value", "token %d of the prompt is %d; the vocabulary has %d tokens", i, id, vocab)
		}
	}
	return prompt, nil
}

// The chat template: each message as a role marker and its text, then
// the assistant's marker the reply follows. The markers are words of the
// tokenizer like any other, so a conversation that grows by a turn shares
// its earlier turns' tokens, and their cached blocks, with the turn before.
const (
	roleOpen  = "<|"
	roleClose = "|>"
)

var chatRoles = map[string]bool{"system": true, "developer": true, "user": true, "assistant": true, "tool": true}

// parseChat reads and checks a chat completion request body and renders
// its messages through the chat template into prompt tokens.
func parseChat(data []byte) (chatRequest, []uint32, error) {
	var req chatRequest
	if err := decode(data, &req); err != nil {
		return req, nil, err
	}
	if req.MaxCompletionTokens != nil {
		req.MaxTokens = req.MaxCompletionTokens // the newer name wins
	}
	if err := req.check(&req.MaxTokens); err != nil {
		if ae, ok := err.(*apiError); ok && ae.param == "max_tokens" && req.MaxCompletionTokens != nil {
			ae.param, ae.msg = "max_completion_tokens", strings.Replace(ae.msg, "max_tokens", "max_completion_tokens", 1)
		}
		return req, nil, err
	}
	switch {
	case !isEmpty(req.Tools):
		return req, nil, unsupported("tools", "tools are not supported")
	case !isEmpty(req.Functions):
		return req, nil, unsupported("functions", "functions are not supported")
	case !isNull(req.ToolChoice) && string(bytes.TrimSpace(req.ToolChoice)) != `"none"`:
		return req, nil, unsupported("tool_choice", "tool_choice is not supported")
	case !isNull(req.FunctionCall) && string(bytes.TrimSpace(req.FunctionCall)) != `"none"`:
		return req, nil, unsupported("function_call", "function_call is not supported")
	case req.ResponseFormat != nil && req.ResponseFormat.Type != "" && req.ResponseFormat.Type != "text":
		return req, nil, unsupported("response_format", "response_format %q is not supported (only text)", req.ResponseFormat.Type)
	case len(req.Modalities) > 0 && (len(req.Modalities) != 1 || req.Modalities[0] != "text"):
		return req, nil, unsupported("modalities", "only the text modality is supported")
	case !isNull(req.Audio):
		return req, nil, unsupported("audio", "audio output is not supported")
	case !isNull(req.Prediction):
		return req, nil, unsupported("prediction", "predicted outputs are not supported")
	case len(req.Messages) == 0:
		return req, nil, badParam("messages", "missing_required_parameter", "messages must hold at least one message")
	}
	var text strings.Builder
	for i, m := range req.Messages {
		if !chatRoles[m.Role] {
			return req, nil, badParam(fmt.Sprintf("messages[%d].role", i), "invalid_value",
				"messages[%d].role must be system, developer, user, assistant or tool", i)
		}
		content, err := messageText(m.Content, i)
		if err != nil {
			return req, nil, err
		}
		text.WriteString(roleOpen + m.Role + roleClose + " " + content + "\n")
	}
	text.WriteString(roleOpen + "assistant" + roleClose)
	prompt, err := checkPrompt(tokenize(text.String()), "messages")
	return req, prompt, err
}

// messageText is a message's content: a string, null (an assistant turn
// that only called tools), or an array of text parts; other parts
// (images, audio, files) are refused.
func messageText(raw json.RawMessage, i int) (string, error) {
	raw = bytes.TrimSpace(raw)
	param := fmt.Sprintf("messages[%d].content", i)
	switch {
	case isNull(raw):
		return "", nil
	case raw[0] == '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", badParam(param, "invalid_type", "%s is not a valid JSON string", param)
		}
		return s, nil
	case raw[0] == '[':
		var parts []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		}
		if err := json.Unmarshal(raw, &parts); err != nil {
			return "", badParam(param, "invalid_type", "%s must be a string or an array of content parts", param)
		}
		var texts []string
		for j, p := range parts {
			if p.Type != "text" {
				return "", unsupported(fmt.Sprintf("%s[%d].type", param, j), "content parts of type %q are not supported (only text)", p.Type)
			}
			texts = append(texts, p.Text)
		}
		return strings.Join(texts, " "), nil
	}
	return "", badParam(param, "invalid_type", "%s must be a string or an array of content parts", param)
}

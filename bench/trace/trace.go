// Package trace is the request trace format that bench/replay replays,
// and a deterministic generator of synthetic traces.
//
// # Format
//
// A trace is JSON lines (one JSON object per line, UTF-8). The first line
// may be a header, recognised by its "format" key:
//
//	{"format":"kvlease-trace/1","generator":{...},"note":"..."}
//
// Every other line is one request:
//
//	{"id":7,"arrival":3,"prompt":{"prefix_id":2,"prefix_len":512,"suffix_len":90,"seed":41},"max_new":128,"events":[{"step":40,"kind":"abort"}]}
//
// Its keys:
//
//   - id: unique non-negative integer naming the request.
//   - arrival: the engine step at which the request arrives (≥ 0). Lines
//     are in arrival order: arrivals never decrease, and requests arriving
//     in the same step queue in line order.
//   - prompt: either explicit token ids ({"tokens":[1,2,3]}) or a compact
//     description: prefix_len tokens of the shared stream prefix_id (a
//     system prompt or document many requests start with), followed by
//     suffix_len tokens of the private stream seed. Streams are infinite
//     and deterministic (see PrefixToken and SuffixToken), so two prompts
//     with the same prefix_id share their first min(prefix_len) tokens and
//     two with the same seed share the first min(suffix_len) tokens of
//     their suffix. A multi-turn conversation is a seed whose suffix_len
//     grows turn by turn.
//   - max_new: tokens to generate (≥ 1). Output token j of a request is
//     SuffixToken(seed, suffix_len+j) (for explicit prompts,
//     SuffixToken(seed, len(tokens)+j)): a request's output continues its
//     suffix stream, so the next turn of a conversation, whose suffix
//     covers the previous prompt and answer, hits the answer's blocks in
//     the prefix cache, as it would with greedy decoding.
//   - events: optional. {"step":k,"kind":"abort"} aborts the request once
//     it has generated k tokens (k = 0: right after admission, before its
//     first decode step), as a client disconnect would. k < max_new.
//
// Unknown keys are errors, so typos do not pass silently. Read and Write
// round-trip a trace exactly.
package trace

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// Format is the header's format string.
const Format = "kvlease-trace/1"

// Vocab is the size of the synthetic vocabulary: stream tokens lie in
// [0, Vocab).
const Vocab = 32000

// Header is the optional first line of a trace.
type Header struct {
	Format    string     `json:"format"`
	Generator *GenConfig `json:"generator,omitempty"` // set when Generate made the trace
	Note      string     `json:"note,omitempty"`
}

// Request is one line of a trace.
type Request struct {
	ID      int     `json:"id"`
	Arrival int     `json:"arrival"`
	Prompt  Prompt  `json:"prompt"`
	MaxNew  int     `json:"max_new"`
	Events  []Event `json:"events,omitempty"`
}

// Prompt describes a request's prompt: explicit Tokens, or PrefixLen
// tokens of shared stream PrefixID followed by SuffixLen tokens of private
// stream Seed.
type Prompt struct {
	PrefixID  int     `json:"prefix_id,omitempty"`
	PrefixLen int     `json:"prefix_len,omitempty"`
	SuffixLen int     `json:"suffix_len,omitempty"`
	Seed      uint64  `json:"seed,omitempty"`
	Tokens    []int32 `json:"tokens,omitempty"`
	// HashIDs, with HashLen, is a prompt converted from a Mooncake trace
	// (see FromMooncake): HashLen tokens made of blocks of
	// MooncakeBlockTokens tokens, block k being HashToken(HashIDs[k], i).
	HashIDs []int64 `json:"hash_ids,omitempty"`
	HashLen int     `json:"hash_len,omitempty"`
}

// Event is something that happens to a running request.
type Event struct {
	Step int    `json:"step"` // tokens generated when it fires
	Kind string `json:"kind"` // EventAbort
}

// EventAbort aborts the request (a client disconnect).
const EventAbort = "abort"

// Trace is a header and the requests in arrival order.
type Trace struct {
	Header   Header
	Requests []Request
}

// Len returns the prompt's length in tokens.
func (p Prompt) Len() int {
	if p.Tokens != nil {
		return len(p.Tokens)
	}
	if p.HashIDs != nil {
		return p.HashLen
	}
	return p.PrefixLen + p.SuffixLen
}

// AppendTokens appends the prompt's token ids to dst.
func (p Prompt) AppendTokens(dst []int32) []int32 {
	if p.Tokens != nil {
		return append(dst, p.Tokens...)
	}
	if p.HashIDs != nil {
		for i := range p.HashLen {
			dst = append(dst, HashToken(p.HashIDs[i/MooncakeBlockTokens], i%MooncakeBlockTokens))
		}
		return dst
	}
	for i := range p.PrefixLen {
		dst = append(dst, PrefixToken(p.PrefixID, i))
	}
	for i := range p.SuffixLen {
		dst = append(dst, SuffixToken(p.Seed, i))
	}
	return dst
}

// OutputToken returns the j-th token the request generates (j from 0).
func (r *Request) OutputToken(j int) int32 {
	if r.Prompt.Tokens != nil || r.Prompt.HashIDs != nil {
		return SuffixToken(r.Prompt.Seed, r.Prompt.Len()+j)
	}
	return SuffixToken(r.Prompt.Seed, r.Prompt.SuffixLen+j)
}

// AbortAt returns the step of the request's first abort event, or -1.
func (r *Request) AbortAt() int {
	for _, e := range r.Events {
		if e.Kind == EventAbort {
			return e.Step
		}
	}
	return -1
}

// PrefixToken is token i of shared stream id.
func PrefixToken(id, i int) int32 {
	return int32(mix(0x5f3759df00000000^uint64(id)*0x9e3779b97f4a7c15+uint64(i)) % Vocab)
}

// SuffixToken is token i of private stream seed.
func SuffixToken(seed uint64, i int) int32 {
	return int32(mix(0xa0761d6478bd642f^seed*0xe7037ed1a0b428db+uint64(i)) % Vocab)
}

// mix is splitmix64's finaliser.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// Validate reports every problem with the trace: a bad header format,
// repeated or negative ids, decreasing arrivals, empty prompts, negative
// lengths, max_new < 1, unknown event kinds or steps outside
// [0, max_new).
func (t *Trace) Validate() error {
	var errs []error
	if t.Header.Format != "" && t.Header.Format != Format {
		errs = append(errs, fmt.Errorf("header: format %q, want %q", t.Header.Format, Format))
	}
	seen := make(map[int]bool, len(t.Requests))
	last := 0
	for i := range t.Requests {
		r := &t.Requests[i]
		bad := func(format string, args ...any) {
			errs = append(errs, fmt.Errorf("request %d (line %d): %s", r.ID, i+1, fmt.Sprintf(format, args...)))
		}
		if r.ID < 0 || seen[r.ID] {
			bad("id negative or repeated")
		}
		seen[r.ID] = true
		if r.Arrival < last {
			bad("arrival %d before the previous line's %d", r.Arrival, last)
		}
		last = r.Arrival
		p := r.Prompt
		if p.Tokens != nil && (p.PrefixLen != 0 || p.SuffixLen != 0 || p.PrefixID != 0) {
			bad("prompt has both tokens and a description")
		}
		if p.PrefixLen < 0 || p.SuffixLen < 0 || p.PrefixID < 0 {
			bad("negative prompt length or prefix id")
		}
		if p.HashIDs != nil {
			if p.Tokens != nil || p.PrefixLen != 0 || p.SuffixLen != 0 {
				bad("prompt has both hash ids and tokens or a description")
			}
			if want := (p.HashLen + MooncakeBlockTokens - 1) / MooncakeBlockTokens; len(p.HashIDs) != want {
				bad("%d hash ids for %d tokens, want %d", len(p.HashIDs), p.HashLen, want)
			}
		} else if p.HashLen != 0 {
			bad("hash_len without hash_ids")
		}
		if p.Len() <= 0 {
			bad("empty prompt")
		}
		if r.MaxNew < 1 {
			bad("max_new %d < 1", r.MaxNew)
		}
		for _, e := range r.Events {
			if e.Kind != EventAbort {
				bad("unknown event kind %q", e.Kind)
			} else if e.Step < 0 || e.Step >= r.MaxNew {
				bad("abort at step %d outside [0, max_new=%d)", e.Step, r.MaxNew)
			}
		}
		if len(errs) > 20 {
			break
		}
	}
	return errors.Join(errs...)
}

// Write writes t as JSON lines: the header (with Format filled in), then
// one line per request.
func Write(w io.Writer, t *Trace) error {
	bw := bufio.NewWriter(w)
	enc := json.NewEncoder(bw)
	h := t.Header
	h.Format = Format
	if err := enc.Encode(h); err != nil {
		return err
	}
	for i := range t.Requests {
		if err := enc.Encode(&t.Requests[i]); err != nil {
			return err
		}
	}
	return bw.Flush()
}

// line is a header or a request: whichever keys it has.
type line struct {
	Format    string     `json:"format"`
	Generator *GenConfig `json:"generator"`
	Note      string     `json:"note"`
	Request
}

// Read parses a trace written by Write or by hand, then validates it. The
// header line is optional; lines may be any length.
func Read(r io.Reader) (*Trace, error) {
	dec := json.NewDecoder(bufio.NewReader(r))
	dec.DisallowUnknownFields()
	t := &Trace{}
	for n := 1; ; n++ {
		var l line
		err := dec.Decode(&l)
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("trace: object %d: %w", n, err)
		}
		if l.Format != "" {
			if n != 1 {
				return nil, fmt.Errorf("trace: object %d: header after the first line", n)
			}
			t.Header = Header{Format: l.Format, Generator: l.Generator, Note: l.Note}
			continue
		}
		t.Requests = append(t.Requests, l.Request)
	}
	if err := t.Validate(); err != nil {
		return nil, fmt.Errorf("trace: %w", err)
	}
	return t, nil
}

package trace

import (
	"bytes"
	"reflect"
	"strings"
	"testing"
)

func TestGenerateDeterministic(t *testing.T) {
	cfg := DefaultGenConfig()
	cfg.Requests = 500
	a, b := Generate(cfg), Generate(cfg)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("same seed, different traces")
	}
	cfg.Seed++
	if c := Generate(cfg); reflect.DeepEqual(a.Requests, c.Requests) {
		t.Fatal("different seeds, same trace")
	}
	if err := a.Validate(); err != nil {
		t.Fatal(err)
	}
	if len(a.Requests) != 500 {
		t.Fatalf("%d requests, want 500", len(a.Requests))
	}
	// The mix has what the config asks for.
	var shared, convTurns, long, aborts int
	seeds := map[uint64]int{}
	for _, r := range a.Requests {
		if r.Prompt.PrefixLen > 0 {
			shared++
		}
		if r.Prompt.SuffixLen > 4096 {
			long++
		}
		if r.AbortAt() >= 0 {
			aborts++
		}
		seeds[r.Prompt.Seed]++
	}
	for _, n := range seeds {
		if n > 1 {
			convTurns += n
		}
	}
	if shared == 0 || convTurns == 0 || long == 0 || aborts == 0 {
		t.Fatalf("mix: shared=%d conversation turns=%d long=%d aborts=%d", shared, convTurns, long, aborts)
	}
}

// Pin the generator's output: a change to it changes every recorded
// benchmark, so it must be deliberate.
func TestGeneratePinned(t *testing.T) {
	cfg := DefaultGenConfig()
	cfg.Requests = 3
	cfg.Seed = 42
	var buf bytes.Buffer
	if err := Write(&buf, Generate(cfg)); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 4 {
		t.Fatalf("%d lines", len(lines))
	}
	const want = `{"id":1,"arrival":115,"prompt":{"prefix_id":2,"prefix_len":512,"suffix_len":265,"seed":2949826092126892291},"max_new":106}`
	if lines[2] != want {
		t.Errorf("generator output changed:\n got %s\nwant %s", lines[2], want)
	}
	if PrefixToken(1, 0) != 5663 || SuffixToken(42, 7) != 28021 {
		t.Fatalf("stream tokens changed: %d %d", PrefixToken(1, 0), SuffixToken(42, 7))
	}
}

func TestRoundTrip(t *testing.T) {
	cfg := DefaultGenConfig()
	cfg.Requests = 300
	tr := Generate(cfg)
	tr.Requests = append(tr.Requests, Request{ID: 300, Arrival: tr.Requests[299].Arrival,
		Prompt: Prompt{Tokens: []int32{1, 2, 3, -4}, Seed: 9}, MaxNew: 2})
	var buf bytes.Buffer
	if err := Write(&buf, tr); err != nil {
		t.Fatal(err)
	}
	got, err := Read(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(tr, got) {
		t.Fatal("trace changed in a JSON round trip")
	}
}

func TestReadHandWritten(t *testing.T) {
	in := `{"id":1,"arrival":0,"prompt":{"prefix_id":2,"prefix_len":32,"suffix_len":5,"seed":7},"max_new":4}
{"id":2,"arrival":0,"prompt":{"tokens":[5,6,7]},"max_new":3,"events":[{"step":1,"kind":"abort"}]}
`
	tr, err := Read(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	if len(tr.Requests) != 2 || tr.Requests[1].AbortAt() != 1 || tr.Requests[0].AbortAt() != -1 {
		t.Fatalf("%+v", tr.Requests)
	}
	toks := tr.Requests[0].Prompt.AppendTokens(nil)
	if len(toks) != 37 || toks[0] != PrefixToken(2, 0) || toks[32] != SuffixToken(7, 0) {
		t.Fatalf("tokens %v", toks)
	}
	if tr.Requests[0].OutputToken(0) != SuffixToken(7, 5) {
		t.Fatal("output does not continue the suffix stream")
	}
}

func TestReadRejects(t *testing.T) {
	for name, in := range map[string]string{
		"unknown key":    `{"id":1,"arrival":0,"prompt":{"suffix_len":3},"max_new":1,"colour":"red"}`,
		"empty prompt":   `{"id":1,"arrival":0,"prompt":{},"max_new":1}`,
		"max_new":        `{"id":1,"arrival":0,"prompt":{"suffix_len":3},"max_new":0}`,
		"repeated id":    `{"id":1,"arrival":0,"prompt":{"suffix_len":3},"max_new":1}` + "\n" + `{"id":1,"arrival":0,"prompt":{"suffix_len":3},"max_new":1}`,
		"arrival order":  `{"id":1,"arrival":5,"prompt":{"suffix_len":3},"max_new":1}` + "\n" + `{"id":2,"arrival":4,"prompt":{"suffix_len":3},"max_new":1}`,
		"event kind":     `{"id":1,"arrival":0,"prompt":{"suffix_len":3},"max_new":2,"events":[{"step":1,"kind":"explode"}]}`,
		"abort step":     `{"id":1,"arrival":0,"prompt":{"suffix_len":3},"max_new":2,"events":[{"step":2,"kind":"abort"}]}`,
		"both":           `{"id":1,"arrival":0,"prompt":{"suffix_len":3,"tokens":[1]},"max_new":1}`,
		"late header":    `{"id":1,"arrival":0,"prompt":{"suffix_len":3},"max_new":1}` + "\n" + `{"format":"kvlease-trace/1"}`,
		"format":         `{"format":"kvlease-trace/9"}`,
		"not json":       `{"id":1,`,
		"negative seeds": `{"id":1,"arrival":0,"prompt":{"suffix_len":-3},"max_new":1}`,
	} {
		if _, err := Read(strings.NewReader(in)); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

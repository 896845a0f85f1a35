package handoff_test

import (
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// goodEnvelope is a small valid envelope: 16-token blocks of 64 bytes, 64
// blocks, 512-token context, 128-token prefill chunks, 8 running requests.
func goodEnvelope() handoff.Envelope {
	return handoff.Envelope{
		BlockTokens:        16,
		BlockBytes:         64,
		PoolBlocks:         64,
		MaxContextTokens:   512,
		MaxPrefillTokens:   128,
		MaxRunningRequests: 8,
	}
}

func problems(t *testing.T, err error) []handoff.EnvelopeProblem {
	t.Helper()
	if err == nil {
		return nil
	}
	if !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("error %v does not wrap ErrInvalidArgument", err)
	}
	var ee *handoff.EnvelopeError
	if !errors.As(err, &ee) {
		t.Fatalf("error %v is not an *EnvelopeError", err)
	}
	return ee.Problems
}

func fields(ps []handoff.EnvelopeProblem) []string {
	var out []string
	for _, p := range ps {
		out = append(out, p.Field)
	}
	return out
}

func TestEnvelopeValidate(t *testing.T) {
	tests := []struct {
		name   string
		edit   func(*handoff.Envelope)
		fields []string // the fields reported, in order
		want   []string // substrings the details must carry (the numbers)
	}{
		{"valid", func(*handoff.Envelope) {}, nil, nil},
		{"all zero", func(e *handoff.Envelope) { *e = handoff.Envelope{} },
			[]string{"BlockTokens", "BlockBytes", "PoolBlocks", "MaxContextTokens", "MaxPrefillTokens", "MaxRunningRequests"},
			[]string{"must be positive, got 0"}},
		{"negative", func(e *handoff.Envelope) { e.BlockTokens = -16; e.MaxRunningRequests = -1 },
			[]string{"BlockTokens", "MaxRunningRequests"}, []string{"got -16", "got -1"}},
		{"context larger than pool", func(e *handoff.Envelope) { e.MaxContextTokens = 1025 },
			[]string{"MaxContextTokens"}, []string{"1025-token request needs 65 blocks", "the pool has 64"}},
		{"context exactly the pool", func(e *handoff.Envelope) { e.MaxContextTokens = 1024; e.MaxPrefillTokens = 1024 }, nil, nil},
		{"prefill larger than context", func(e *handoff.Envelope) { e.MaxPrefillTokens = 513 },
			[]string{"MaxPrefillTokens"}, []string{"513 tokens exceeds the context limit of 512"}},
		{"more running requests than blocks", func(e *handoff.Envelope) { e.MaxRunningRequests = 65 },
			[]string{"MaxRunningRequests"}, []string{"65 running requests", "the pool has 64"}},
		{"bytes per token not whole", func(e *handoff.Envelope) { e.BlockBytes = 100 },
			[]string{"BlockBytes"}, []string{"100 bytes", "16 tokens"}},
		{"several relations at once", func(e *handoff.Envelope) {
			e.PoolBlocks = 4
			e.MaxPrefillTokens = 1000
		}, []string{"MaxContextTokens", "MaxPrefillTokens", "MaxRunningRequests"}, []string{"needs 32 blocks", "1000 tokens", "8 running"}},
		{"huge context does not overflow", func(e *handoff.Envelope) { e.MaxContextTokens = math.MaxInt },
			[]string{"MaxContextTokens"}, []string{"the pool has 64"}},
		{"zero block tokens skips relations on it", func(e *handoff.Envelope) { e.BlockTokens = 0; e.MaxContextTokens = 1 << 20 },
			[]string{"BlockTokens"}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := goodEnvelope()
			tt.edit(&e)
			err := e.Validate()
			ps := problems(t, err)
			if got := fields(ps); !reflect.DeepEqual(got, tt.fields) {
				t.Fatalf("fields = %v, want %v (err: %v)", got, tt.fields, err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
}

func TestEnvelopeCheckRequest(t *testing.T) {
	e := goodEnvelope()
	tests := []struct {
		prompt, maxNew int
		want           error
	}{
		{1, 0, nil},
		{100, 412, nil},
		{512, 0, nil},
		{100, 413, kvlease.ErrExceedsCapacity},
		{513, 0, kvlease.ErrExceedsCapacity},
		{math.MaxInt, math.MaxInt, kvlease.ErrExceedsCapacity},
		{1, math.MaxInt, kvlease.ErrExceedsCapacity},
		{0, 10, kvlease.ErrInvalidArgument},
		{-5, 10, kvlease.ErrInvalidArgument},
		{10, -1, kvlease.ErrInvalidArgument},
	}
	for _, tt := range tests {
		err := e.CheckRequest(tt.prompt, tt.maxNew)
		if (tt.want == nil) != (err == nil) || (tt.want != nil && !errors.Is(err, tt.want)) {
			t.Errorf("CheckRequest(%d, %d) = %v, want %v", tt.prompt, tt.maxNew, err, tt.want)
		}
	}
	bad := e
	bad.PoolBlocks = 0
	err := bad.CheckRequest(10, 10)
	if !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("CheckRequest on an invalid envelope = %v, want ErrInvalidArgument", err)
	}
	var ee *handoff.EnvelopeError
	if !errors.As(err, &ee) || ee.Problems[0].Field != "PoolBlocks" {
		t.Fatalf("CheckRequest on an invalid envelope does not carry the envelope's problems: %v", err)
	}
}

func TestEnvelopeCheckRequestAllocatesNothing(t *testing.T) {
	e := goodEnvelope()
	if n := testing.AllocsPerRun(100, func() { _ = e.CheckRequest(300, 200) }); n != 0 {
		t.Fatalf("CheckRequest allocates %v times per call", n)
	}
}

func TestEnvelopeBlocksFor(t *testing.T) {
	e := goodEnvelope()
	for _, tt := range []struct{ tokens, blocks, steps int }{
		{-3, 0, 0}, {0, 0, 0}, {1, 1, 1}, {16, 1, 1}, {17, 2, 1}, {128, 8, 1}, {129, 9, 2},
		{math.MaxInt, math.MaxInt/16 + 1, math.MaxInt/128 + 1},
	} {
		if got := e.BlocksFor(tt.tokens); got != tt.blocks {
			t.Errorf("BlocksFor(%d) = %d, want %d", tt.tokens, got, tt.blocks)
		}
		if got := e.PrefillSteps(tt.tokens); got != tt.steps {
			t.Errorf("PrefillSteps(%d) = %d, want %d", tt.tokens, got, tt.steps)
		}
	}
	for name, f := range map[string]func(){
		"BlocksFor":    func() { handoff.Envelope{}.BlocksFor(1) },
		"PrefillSteps": func() { handoff.Envelope{}.PrefillSteps(1) },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s on a zero envelope did not panic", name)
				}
			}()
			f()
		}()
	}
}

func TestAgreeEnvelopes(t *testing.T) {
	front := goodEnvelope()
	sched := goodEnvelope()
	prefill := goodEnvelope()
	prefill.PoolBlocks = 128 // pools may differ in size
	decode := goodEnvelope()

	if err := handoff.AgreeEnvelopes(
		handoff.NamedEnvelope{Name: "frontend", Envelope: front},
		handoff.NamedEnvelope{Name: "scheduler", Envelope: sched},
		handoff.NamedEnvelope{Name: "prefill", Envelope: prefill},
		handoff.NamedEnvelope{Name: "decode", Envelope: decode},
	); err != nil {
		t.Fatalf("agreeing envelopes: %v", err)
	}

	// The incident's shape: the front end admits a longer context than the
	// decode pool can hold, and the decode side uses another block size.
	front.MaxContextTokens = 2048
	decode.BlockTokens = 32
	decode.BlockBytes = 128
	err := handoff.AgreeEnvelopes(
		handoff.NamedEnvelope{Name: "frontend", Envelope: front},
		handoff.NamedEnvelope{Name: "scheduler", Envelope: sched},
		handoff.NamedEnvelope{Name: "prefill", Envelope: prefill},
		handoff.NamedEnvelope{Name: "decode", Envelope: decode},
	)
	ps := problems(t, err)
	want := []handoff.EnvelopeProblem{
		{"BlockTokens", "components disagree: frontend=16 scheduler=16 prefill=16 decode=32"},
		{"BlockBytes", "components disagree: frontend=64 scheduler=64 prefill=64 decode=128"},
		{"MaxContextTokens", "components disagree: frontend=2048 scheduler=512 prefill=512 decode=512"},
		{"MaxContextTokens", "frontend: a 2048-token request needs 128 blocks of 16 tokens, the pool has 64 (PoolBlocks)"},
	}
	if !reflect.DeepEqual(ps, want) {
		t.Fatalf("problems:\n%v\nwant:\n%v", strings.Join(lines(ps), "\n"), strings.Join(lines(want), "\n"))
	}

	for _, tt := range []struct {
		name string
		cs   []handoff.NamedEnvelope
		want string
	}{
		{"none", nil, "no component"},
		{"unnamed", []handoff.NamedEnvelope{{Envelope: sched}}, "has no name"},
		{"twice", []handoff.NamedEnvelope{{"a", sched}, {"a", sched}}, `"a" appears twice`},
	} {
		err := handoff.AgreeEnvelopes(tt.cs...)
		if !errors.Is(err, kvlease.ErrInvalidArgument) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: %v, want ErrInvalidArgument mentioning %q", tt.name, err, tt.want)
		}
	}
}

func lines(ps []handoff.EnvelopeProblem) []string {
	var out []string
	for _, p := range ps {
		out = append(out, p.String())
	}
	return out
}

package kvlease

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// TestSequenceSpecChecked: every size, count and range of a spec is
// checked before anything is sized: a refused spec returns an error
// wrapping ErrInvalidArgument or ErrExceedsCapacity, counts a rejection
// and holds nothing. (MaxTokens: 1<<50 panicked in makeslice before.)
func TestSequenceSpecChecked(t *testing.T) {
	const bt = 4
	p := seqPool(t, 8, WithBlockTokens(bt))
	ok := seqTokens(6, 1)
	long := strings.Repeat("k", maxExtraKeyBytes+1)
	many := make([]ExtraKey, maxExtraKeys+1)
	for i := range many {
		many[i] = ExtraKey{Start: i, End: i + 1, Key: "k"}
	}
	for _, c := range []struct {
		name string
		spec SequenceSpec
		want error
	}{
		{"empty owner", SequenceSpec{Prompt: ok}, ErrInvalidArgument},
		{"empty prompt", SequenceSpec{Owner: "a"}, ErrInvalidArgument},
		{"negative max tokens", SequenceSpec{Owner: "a", Prompt: ok, MaxTokens: -1}, ErrInvalidArgument},
		{"huge max tokens", SequenceSpec{Owner: "a", Prompt: ok, MaxTokens: 1 << 50}, ErrExceedsCapacity},
		{"max int max tokens", SequenceSpec{Owner: "a", Prompt: ok, MaxTokens: math.MaxInt}, ErrExceedsCapacity},
		{"max tokens one past the pool", SequenceSpec{Owner: "a", Prompt: ok, MaxTokens: 8*bt + 1}, ErrExceedsCapacity},
		{"prompt past the pool", SequenceSpec{Owner: "a", Prompt: seqTokens(8*bt+1, 0)}, ErrExceedsCapacity},
		{"negative window", SequenceSpec{Owner: "a", Prompt: ok, Window: -4}, ErrInvalidArgument},
		{"negative start", SequenceSpec{Owner: "a", Prompt: ok, Extra: []ExtraKey{{-1, 3, "k"}}}, ErrInvalidArgument},
		{"end before start", SequenceSpec{Owner: "a", Prompt: ok, Extra: []ExtraKey{{5, 3, "k"}}}, ErrInvalidArgument},
		{"min int start", SequenceSpec{Owner: "a", Prompt: ok, Extra: []ExtraKey{{math.MinInt, math.MaxInt, "k"}}}, ErrInvalidArgument},
		{"a key too long", SequenceSpec{Owner: "a", Prompt: ok, Extra: []ExtraKey{{0, 3, long}}}, ErrInvalidArgument},
		{"too many keys", SequenceSpec{Owner: "a", Prompt: ok, Extra: many}, ErrInvalidArgument},
		{"adapter id without a name", SequenceSpec{Owner: "a", Prompt: ok, Adapter: Adapter{ID: 3}}, ErrInvalidArgument},
	} {
		before := p.Stats().Rejections
		s, err := p.Admit(c.spec)
		if !errors.Is(err, c.want) || s != nil {
			t.Fatalf("%s: %v, want %v", c.name, err, c.want)
		}
		if p.Stats().Rejections != before+1 {
			t.Fatalf("%s: rejection not counted", c.name)
		}
		if err := p.CheckQuiescent(); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
	}
	plain := seqPool(t, 8)
	if _, err := plain.Admit(SequenceSpec{Owner: "a", Prompt: ok}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("no block size: %v", err)
	}
	if _, err := p.AdmitWith(SequenceSpec{Owner: "a", Prompt: ok}, nil); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("AdmitWith nil: %v", err)
	}

	// The largest reservation the pool allows is admitted; a sliding
	// window may reserve past it (its lease trims), sized no larger than
	// the pool's tokens.
	s, err := p.Admit(SequenceSpec{Owner: "a", Prompt: ok, MaxTokens: 8 * bt})
	if err != nil {
		t.Fatal(err)
	}
	if cap(s.Tokens()) != 8*bt {
		t.Fatalf("reserved %d tokens, want %d", cap(s.Tokens()), 8*bt)
	}
	s.Lease().Release()
	w, err := p.Admit(SequenceSpec{Owner: "w", Prompt: ok, MaxTokens: 1 << 50, Window: 8})
	if err != nil {
		t.Fatal(err)
	}
	if cap(w.Tokens()) != 8*bt {
		t.Fatalf("window reserve: cap %d", cap(w.Tokens()))
	}
	w.Lease().Release()
	if err := p.CheckQuiescent(); err != nil {
		t.Fatal(err)
	}
}

// TestSequenceEmptyExtraRange: an extra key over an empty range covers no
// token and is ignored (as llm-d ignores it), not a refusal: the hashes
// are those of the prompt without it.
func TestSequenceEmptyExtraRange(t *testing.T) {
	p := seqPool(t, 16, WithBlockTokens(4))
	prompt := seqTokens(9, 1)
	extra := []ExtraKey{{3, 3, "empty"}, {4, 6, "img"}, {9, 9, "past"}}
	s, err := p.Admit(SequenceSpec{Owner: "a", Seed: 2, Prompt: prompt, Extra: extra})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(s.Len()); err != nil {
		t.Fatal(err)
	}
	h0 := HashBlock(2, prompt[:4])
	if want := []BlockHash{h0, HashBlock(h0, prompt[4:8], []string{"img"}...)}; !slices.Equal(s.BlockHashes(), want) {
		t.Fatalf("hashes %x, want %x", s.BlockHashes(), want)
	}
	extra[1].Key = "changed" // the sequence keeps its own copy
	if err := s.AppendComputed(seqTokens(4, 70)...); err != nil {
		t.Fatal(err)
	}
	s.Lease().Release()
	if err := p.CheckQuiescent(); err != nil {
		t.Fatal(err)
	}
}

// TestAdmitWith: a sequence over a lease taken by the caller's acquire
// function gets the hashes vLLM's last-token rule allows and keeps the
// hits acquire reports; a lease that does not fit is refused and released.
func TestAdmitWith(t *testing.T) {
	const bt = 4
	p := seqPool(t, 16, WithBlockTokens(bt))
	prompt := seqTokens(12, 1) // 3 full blocks: at most 2 may hit
	warm, _ := p.Admit(SequenceSpec{Owner: "warm", Seed: 1, Prompt: prompt})
	_ = warm.Commit(warm.Len())
	warm.Lease().Release()

	var seen []BlockHash
	s, err := p.AdmitWith(SequenceSpec{Owner: "r", Seed: 1, Prompt: prompt}, func(hashes []BlockHash, n int) (*Lease[[]byte], int, error) {
		seen = slices.Clone(hashes)
		return p.AcquirePrefix("r", hashes, n)
	})
	if err != nil {
		t.Fatal(err)
	}
	if want := ChainHashes(1, prompt, bt)[:2]; !slices.Equal(seen, want) || s.Hits() != 2 || s.Computed() != 8 {
		t.Fatalf("acquire saw %x (want %x), hits %d computed %d", seen, want, s.Hits(), s.Computed())
	}
	if err := s.Commit(4); err != nil || len(s.BlockHashes()) != 3 {
		t.Fatalf("commit: %v, sealed %d", err, len(s.BlockHashes()))
	}
	s.Lease().Release()

	other := seqPool(t, 16, WithBlockTokens(bt))
	var foreign *Lease[[]byte]
	boom := errors.New("tier lookup failed")
	for _, c := range []struct {
		name    string
		acquire func([]BlockHash, int) (*Lease[[]byte], int, error)
		want    error
	}{
		{"error", func([]BlockHash, int) (*Lease[[]byte], int, error) { return nil, 0, boom }, boom},
		{"nil lease", func([]BlockHash, int) (*Lease[[]byte], int, error) { return nil, 0, nil }, ErrInvalidArgument},
		{"short lease", func(_ []BlockHash, n int) (*Lease[[]byte], int, error) {
			l, err := p.Acquire("r", n-1)
			return l, 0, err
		}, ErrInvalidArgument},
		{"too many hits", func(h []BlockHash, n int) (*Lease[[]byte], int, error) {
			l, err := p.Acquire("r", n)
			return l, len(h) + 1, err
		}, ErrInvalidArgument},
		{"another pool's lease", func(_ []BlockHash, n int) (*Lease[[]byte], int, error) {
			l, err := other.Acquire("r", n)
			foreign = l
			return l, 0, err
		}, ErrInvalidArgument},
	} {
		if _, err := p.AdmitWith(SequenceSpec{Owner: "r", Seed: 1, Prompt: prompt}, c.acquire); !errors.Is(err, c.want) {
			t.Fatalf("%s: %v, want %v", c.name, err, c.want)
		}
		if err := p.CheckQuiescent(); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
	}
	foreign.Release() // not AdmitWith's to release
	if _, err := p.AdmitWith(SequenceSpec{Owner: "r", Prompt: prompt, Window: 8}, func([]BlockHash, int) (*Lease[[]byte], int, error) {
		t.Fatal("acquire called for a refused spec")
		return nil, 0, nil
	}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("window: %v", err)
	}
}

// specModel is what a spec's admission must do: nil for a spec that is
// admitted (the pool having room), else the sentinel it is refused with.
func specModel(spec SequenceSpec, bt, capacity int) error {
	switch {
	case spec.Owner == "" || len(spec.Prompt) == 0 || spec.MaxTokens < 0 || spec.Window < 0 || len(spec.Extra) > maxExtraKeys:
		return ErrInvalidArgument
	case spec.Adapter.Name == "" && spec.Adapter.ID != 0:
		return ErrInvalidArgument
	case (len(spec.Prompt)+bt-1)/bt > capacity:
		return ErrExceedsCapacity
	case spec.Window == 0 && spec.MaxTokens > capacity*bt:
		return ErrExceedsCapacity
	}
	for _, e := range spec.Extra {
		if e.Start < 0 || e.End < e.Start || len(e.Key) > maxExtraKeyBytes {
			return ErrInvalidArgument
		}
	}
	return nil
}

// modelHashes is the chain a sequence of tokens under spec must seal:
// each block's hash mixes the keys of the non-empty spans over it, in
// order.
func modelHashes(seed BlockHash, tokens []int32, bt int, extra []ExtraKey) []BlockHash {
	var out []BlockHash
	parent := seed
	for k := 0; (k+1)*bt <= len(tokens); k++ {
		var keys []string
		for _, e := range extra {
			if e.End > e.Start && e.Start < (k+1)*bt && e.End > k*bt {
				keys = append(keys, e.Key)
			}
		}
		parent = HashBlock(parent, tokens[k*bt:(k+1)*bt], keys...)
		out = append(out, parent)
	}
	return out
}

// FuzzSequenceSpec fuzzes the specs Admit takes (sizes,
// ranges, adapters, extra keys, windows, reservations) against a small
// pool and a model of what must be admitted: no spec panics, a refused
// one wraps the sentinel the model names and holds nothing, an admitted
// one seals the model's hashes as it is driven, and the pool is
// quiescent once every request has ended.
func FuzzSequenceSpec(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11})
	f.Add([]byte{255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255, 255})
	f.Add([]byte{1, 40, 9, 3, 0, 7, 200, 2, 5, 9, 1, 1, 3, 8, 2, 6, 0, 0})
	f.Fuzz(fuzzSpecOnce)
}

func fuzzSpecOnce(t *testing.T, data []byte) {
	in := fzIn{b: data}
	bt := 1 + in.u8()%5
	const capacity = 12
	opts := []Option{WithBlockTokens(bt)}
	if in.u8()%3 == 0 {
		opts = []Option{WithVerifiedPrefix(bt)}
	}
	p := seqPool(t, capacity, opts...)
	size := func() int { // a size of every magnitude and sign
		v := in.u8()
		switch v % 8 {
		case 0:
			return -int(in.u8())
		case 1:
			return math.MaxInt - int(in.u8())
		case 2:
			return 1 << (20 + in.u8()%43)
		case 3:
			return math.MinInt + int(in.u8())
		}
		return int(in.u8()) % (capacity*bt + 8)
	}
	var live []*Sequence[[]byte]
	for req := 0; in.more() && req < 6; req++ {
		spec := SequenceSpec{Owner: "r", Seed: BlockHash(in.u8() % 3)}
		if in.u8() == 0 {
			spec.Owner = ""
		}
		n := int(in.u8()) % (capacity*bt + 4)
		spec.Prompt = seqTokens(n, int32(in.u8()%4))
		if in.u8()%2 == 0 {
			spec.MaxTokens = size()
		}
		if in.u8()%3 == 0 {
			spec.Window = size() % 64
		}
		for range in.u8() % 4 {
			e := ExtraKey{Start: size(), End: size(), Key: "img" + string(rune('a'+in.u8()%3))}
			if in.u8()%2 == 0 {
				e.End = e.Start + in.u8()%9 // mostly small, some empty
			}
			spec.Extra = append(spec.Extra, e)
		}
		switch in.u8() % 4 {
		case 1:
			spec.Adapter = Adapter{ID: 1, Name: "sql"}
		case 2:
			spec.Adapter = Adapter{ID: int(in.u8())}
		case 3:
			spec.Adapter = Adapter{Name: "named"}
		}
		want := specModel(spec, bt, capacity)
		s, err := p.Admit(spec)
		if want != nil {
			if !errors.Is(err, want) || s != nil {
				t.Fatalf("spec %+v: %v, want %v", spec, err, want)
			}
			continue
		}
		if err != nil {
			// A valid spec may still find the pool full now.
			if !errors.Is(err, ErrExhausted) {
				t.Fatalf("spec %+v: %v", spec, err)
			}
			continue
		}
		// Drive it: prefill, then a few decoded tokens.
		if err := s.Commit(s.Len() - s.Computed()); err != nil {
			t.Fatal(err)
		}
		for i := range in.u8() % 12 {
			if err := s.AppendComputed(int32(500 + i)); err != nil {
				if !errors.Is(err, ErrExhausted) && !errors.Is(err, ErrExceedsCapacity) {
					t.Fatal(err)
				}
				break
			}
		}
		if want := modelHashes(spec.Seed, s.Tokens()[:s.Computed()], bt, spec.Extra); !slices.Equal(s.BlockHashes(), want) {
			t.Fatalf("spec %+v: hashes %x, want %x", spec, s.BlockHashes(), want)
		}
		if in.u8()%2 == 0 {
			s.Lease().Release()
		} else {
			live = append(live, s)
		}
	}
	if err := p.Check(); err != nil {
		t.Fatal(err)
	}
	for _, s := range live {
		s.Lease().Abort(nil)
	}
	if err := p.CheckQuiescent(); err != nil {
		t.Fatal(err)
	}
}

// TestSequenceSpecRandom runs FuzzSequenceSpec's body over random inputs
// beyond its seed corpus, so every test run covers more than the seeds.
func TestSequenceSpecRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(31, 7))
	for range 300 {
		b := make([]byte, 10+rng.IntN(80))
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		t.Run("", func(t *testing.T) { fuzzSpecOnce(t, b) })
	}
}

// TestSequenceOnboarded: blocks onboarded after the hits become hits and
// computed, sealed with their chain hashes; a count past the blocks a
// prefix may hit, or after anything was committed, is refused.
func TestSequenceOnboarded(t *testing.T) {
	p := seqPool(t, 16, WithBlockTokens(4))
	prompt := seqTokens(14, 1) // 3 blocks may hit
	s, err := p.Admit(SequenceSpec{Owner: "a", Seed: 1, Prompt: prompt})
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{-1, 4} {
		if err := s.Onboarded(n); !errors.Is(err, ErrInvalidArgument) {
			t.Fatalf("onboarded %d: %v", n, err)
		}
	}
	if err := s.Onboarded(2); err != nil || s.Hits() != 2 || s.CachedTokens() != 8 || s.Computed() != 8 || len(s.BlockHashes()) != 2 {
		t.Fatalf("onboarded 2: %v, hits %d computed %d sealed %d", err, s.Hits(), s.Computed(), len(s.BlockHashes()))
	}
	if err := s.Commit(1); err != nil {
		t.Fatal(err)
	}
	if err := s.Onboarded(1); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("onboarded after a commit: %v", err)
	}
	if err := s.Commit(s.Len() - s.Computed()); err != nil {
		t.Fatal(err)
	}
	if want := ChainHashes(1, prompt, 4); !slices.Equal(s.BlockHashes(), want) {
		t.Fatalf("hashes %x, want %x", s.BlockHashes(), want)
	}
	s.Lease().Release()
	if err := p.CheckQuiescent(); err != nil {
		t.Fatal(err)
	}
}

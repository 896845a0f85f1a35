package kvlease

import (
	"errors"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
)

func seqPool(t testing.TB, blocks int, opts ...Option) *Pool[[]byte] {
	t.Helper()
	return hostPool(t, blocks, 64, opts...)
}

func seqTokens(n int, base int32) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = base + int32(i)
	}
	return out
}

func checkPool(t *testing.T, p *Pool[[]byte]) {
	t.Helper()
	if err := p.Check(); err != nil {
		t.Fatal(err)
	}
}

// TestSequenceLifecycle: a prompt prefilled in one commit, then decoded
// token by token, seals exactly ChainHashes' blocks; a second request with
// the same prompt hits every block but the last token's.
func TestSequenceLifecycle(t *testing.T) {
	const bt = 16
	p := seqPool(t, 64, WithBlockTokens(bt))
	seed := BlockHash(7)
	prompt := seqTokens(50, 100)
	s, err := p.Admit(SequenceSpec{Owner: "a", Seed: seed, Prompt: prompt})
	if err != nil {
		t.Fatal(err)
	}
	if s.Hits() != 0 || s.Computed() != 0 || s.Len() != 50 || s.Lease().Len() != 4 {
		t.Fatalf("hits %d computed %d len %d blocks %d", s.Hits(), s.Computed(), s.Len(), s.Lease().Len())
	}
	if err := s.Commit(50); err != nil {
		t.Fatal(err)
	}
	if len(s.BlockHashes()) != 3 {
		t.Fatalf("sealed %d after prefill, want 3", len(s.BlockHashes()))
	}
	for i := range 30 {
		if err := s.AppendComputed(int32(9000 + i)); err != nil {
			t.Fatal(err)
		}
	}
	if s.Len() != 80 || s.Lease().Len() != 5 || s.Lease().Len() != 5 || len(s.BlockHashes()) != 5 {
		t.Fatalf("len %d blocks %d sealed %d, want 80 5 5", s.Len(), s.Lease().Len(), len(s.BlockHashes()))
	}
	want := ChainHashes(seed, s.Tokens(), bt)
	if !slices.Equal(s.BlockHashes(), want) {
		t.Fatalf("hashes %x, want %x", s.BlockHashes(), want)
	}
	if s.parent() != want[4] {
		t.Fatalf("parent %x, want %x", s.parent(), want[4])
	}
	s.Lease().Release()
	checkPool(t, p)

	// Same prompt: 3 full blocks, the last token's block is not a hit.
	s2, err := p.Admit(SequenceSpec{Owner: "b", Seed: seed, Prompt: prompt})
	if err != nil {
		t.Fatal(err)
	}
	if s2.Hits() != 3 || s2.CachedTokens() != 48 || s2.Computed() != 48 {
		t.Fatalf("hits %d cached %d computed %d, want 3 48 48", s2.Hits(), s2.CachedTokens(), s2.Computed())
	}
	s2.Lease().Release()
	// A prompt of exactly 48 tokens: its third block holds the last token.
	s3, err := p.Admit(SequenceSpec{Owner: "c", Seed: seed, Prompt: prompt[:48]})
	if err != nil {
		t.Fatal(err)
	}
	if s3.Hits() != 2 {
		t.Fatalf("48-token prompt: hits %d, want 2", s3.Hits())
	}
	if err := s3.Commit(s3.Len() - s3.Computed()); err != nil {
		t.Fatal(err)
	}
	s3.Lease().Release()
	// Another seed shares nothing.
	s4, err := p.Admit(SequenceSpec{Owner: "d", Seed: seed + 1, Prompt: prompt})
	if err != nil {
		t.Fatal(err)
	}
	if s4.Hits() != 0 {
		t.Fatalf("other seed: hits %d", s4.Hits())
	}
	s4.Lease().Release()
	checkPool(t, p)
	if st := p.Stats(); st.Leased != 0 || st.OpenLeases != 0 {
		t.Fatalf("left leased: %+v", st)
	}
}

// TestSequenceChunkedSpeculative: chunked prefill in odd chunks and
// speculative tokens rolled back seal the same blocks as one clean pass.
func TestSequenceChunkedSpeculative(t *testing.T) {
	const bt = 8
	p := seqPool(t, 64, WithBlockTokens(bt))
	prompt := seqTokens(37, 1)
	s, err := p.Admit(SequenceSpec{Owner: "a", Seed: 1, Prompt: prompt})
	if err != nil {
		t.Fatal(err)
	}
	for s.Computed() < s.Len() {
		if err := s.Commit(min(7, s.Len()-s.Computed())); err != nil {
			t.Fatal(err)
		}
	}
	accepted := slices.Clone(prompt)
	next := int32(500)
	for round := range 10 {
		draft := []int32{next, next + 1, next + 2, next + 3}
		if err := s.Append(draft...); err != nil {
			t.Fatal(err)
		}
		keep := round % 5 // 0..4 accepted
		if err := s.Commit(keep); err != nil {
			t.Fatal(err)
		}
		if err := s.Rollback(len(draft) - keep); err != nil {
			t.Fatal(err)
		}
		accepted = append(accepted, draft[:keep]...)
		next += 10
		if s.Len() != s.Computed() || !slices.Equal(s.Tokens(), accepted) {
			t.Fatalf("round %d: len %d computed %d", round, s.Len(), s.Computed())
		}
	}
	if want := ChainHashes(1, accepted, bt); !slices.Equal(s.BlockHashes(), want) {
		t.Fatalf("hashes %x, want %x", s.BlockHashes(), want)
	}
	// Uncommitted tokens never seal: append a full block's worth, commit
	// nothing, roll it back.
	sealed := len(s.BlockHashes())
	if err := s.Append(seqTokens(2*bt, 7000)...); err != nil {
		t.Fatal(err)
	}
	if len(s.BlockHashes()) != sealed {
		t.Fatalf("append sealed blocks: %d -> %d", sealed, len(s.BlockHashes()))
	}
	if err := s.Rollback(2 * bt); err != nil {
		t.Fatal(err)
	}
	if err := s.Rollback(1); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("rollback past computed: %v", err)
	}
	if err := s.Commit(1); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("commit past appended: %v", err)
	}
	if err := s.Commit(-1); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("negative commit: %v", err)
	}
	s.Lease().Release()
	checkPool(t, p)
}

func TestSequenceErrors(t *testing.T) {
	plain := seqPool(t, 4)
	if _, err := plain.Admit(SequenceSpec{Owner: "a", Prompt: seqTokens(4, 0)}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("no block size: %v", err)
	}
	p := seqPool(t, 4, WithBlockTokens(4))
	if _, err := p.Admit(SequenceSpec{Owner: "a", Prompt: nil}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("empty prompt: %v", err)
	}
	if _, err := p.Admit(SequenceSpec{Owner: "", Prompt: seqTokens(4, 0)}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("empty owner: %v", err)
	}
	if _, err := p.Admit(SequenceSpec{Owner: "a", Prompt: seqTokens(17, 0)}); !errors.Is(err, ErrExceedsCapacity) {
		t.Fatalf("prompt over capacity: %v", err)
	}
	// Growth refused: nothing appended, the request can be preempted.
	s, err := p.Admit(SequenceSpec{Owner: "a", Prompt: seqTokens(12, 0)})
	if err != nil {
		t.Fatal(err)
	}
	other, err := p.Acquire("other", 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(12); err != nil {
		t.Fatal(err) // fills block 2 exactly: no growth yet
	}
	if err := s.Append(1); !errors.Is(err, ErrExhausted) {
		t.Fatalf("append past pool: %v", err)
	}
	if s.Len() != 12 {
		t.Fatalf("refused append changed length to %d", s.Len())
	}
	other.Release()
	if err := s.Append(1, 2); err != nil {
		t.Fatal(err)
	}
	// Commit is never silently missing: appending more while tokens are
	// pending is refused, and changes nothing.
	if err := s.Append(3); !errors.Is(err, ErrInvalidArgument) || s.Len() != 14 {
		t.Fatalf("append with 2 tokens pending: %v, len %d", err, s.Len())
	}
	if err := s.AppendComputed(3); !errors.Is(err, ErrInvalidArgument) || s.Len() != 14 || s.Computed() != 12 {
		t.Fatalf("append computed with 2 tokens pending: %v, len %d computed %d", err, s.Len(), s.Computed())
	}
	if err := s.Rollback(1); err != nil {
		t.Fatal(err)
	}
	if err := s.Append(3); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("append with 1 token pending: %v", err)
	}
	// An abort from another goroutine: the scheduler's next call fails.
	done := make(chan struct{})
	go func() { s.Lease().Abort(errors.New("client gone")); close(done) }()
	<-done
	if err := s.Commit(1); err != nil {
		t.Fatalf("commit inside a block after abort: %v", err) // nothing to seal
	}
	if err := s.Append(seqTokens(8, 0)...); !errors.Is(err, ErrLeaseClosed) {
		t.Fatalf("append after abort: %v", err)
	}
	if err := s.Rollback(0); err != nil {
		t.Fatal(err)
	}
	s.Lease().Release() // idempotent after Abort
	checkPool(t, p)
	if st := p.Stats(); st.Leased != 0 {
		t.Fatalf("leased %d after abort", st.Leased)
	}
}

// TestSequenceSealAfterAbort: a commit that would seal a block of an
// aborted lease fails with ErrLeaseClosed and leaves Computed unchanged.
func TestSequenceSealAfterAbort(t *testing.T) {
	p := seqPool(t, 8, WithBlockTokens(4))
	s, err := p.Admit(SequenceSpec{Owner: "a", Prompt: seqTokens(6, 0)})
	if err != nil {
		t.Fatal(err)
	}
	s.Lease().Abort(nil)
	if err := s.Commit(6); !errors.Is(err, ErrLeaseClosed) {
		t.Fatalf("commit sealing after abort: %v", err)
	}
	if s.Computed() != 0 || len(s.BlockHashes()) != 0 {
		t.Fatalf("computed %d sealed %d after a failed commit", s.Computed(), len(s.BlockHashes()))
	}
	checkPool(t, p)
}

// TestSequenceVerified: in verified mode a sequence's seals record tokens
// and a later sequence's hits are verified.
func TestSequenceVerified(t *testing.T) {
	p := seqPool(t, 32, WithVerifiedPrefix(4))
	prompt := seqTokens(17, 3)
	s, err := p.Admit(SequenceSpec{Owner: "a", Seed: 9, Prompt: prompt})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(17); err != nil {
		t.Fatal(err)
	}
	s.Lease().Release()
	s2, err := p.Admit(SequenceSpec{Owner: "b", Seed: 9, Prompt: prompt})
	if err != nil {
		t.Fatal(err)
	}
	if s2.Hits() != 4 {
		t.Fatalf("verified hits %d, want 4", s2.Hits())
	}
	s2.Lease().Release()
	if st := p.Stats(); st.VerifyMismatches != 0 {
		t.Fatalf("mismatches %d", st.VerifyMismatches)
	}
	checkPool(t, p)
}

// TestSequenceEvents: the blocks a sequence seals are announced with
// parent and tokens, the first with no parent.
func TestSequenceEvents(t *testing.T) {
	const bt = 4
	p := seqPool(t, 32, WithBlockTokens(bt), WithKVEvents(64))
	s, err := p.Admit(SequenceSpec{Owner: "a", Seed: 5, Prompt: seqTokens(9, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(9); err != nil {
		t.Fatal(err)
	}
	if err := s.AppendComputed(seqTokens(3, 50)...); err != nil {
		t.Fatal(err)
	}
	evs, dropped := p.DrainKVEvents(nil)
	if dropped != 0 || len(evs) != 3 {
		t.Fatalf("%d events, %d dropped, want 3 stored", len(evs), dropped)
	}
	hs := s.BlockHashes()
	for k, ev := range evs {
		if ev.Kind != KVBlockStored || ev.BlockHash != hs[k] || ev.BlockSize != bt {
			t.Fatalf("event %d: %+v", k, ev)
		}
		if !slices.Equal(ev.TokenIDs, s.Tokens()[k*bt:(k+1)*bt]) {
			t.Fatalf("event %d tokens %v", k, ev.TokenIDs)
		}
		if (k == 0) == ev.HasParent || (k > 0 && ev.ParentBlockHash != hs[k-1]) {
			t.Fatalf("event %d parent %x has %v", k, ev.ParentBlockHash, ev.HasParent)
		}
	}
	s.Lease().Release()
}

// TestSequenceConcurrentAbort races request goroutines' aborts against the
// scheduler driving their sequences; every block comes back.
func TestSequenceConcurrentAbort(t *testing.T) {
	p := seqPool(t, 256, WithBlockTokens(4))
	var wg sync.WaitGroup
	for r := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := p.Admit(SequenceSpec{Owner: "r", Seed: BlockHash(r % 3), Prompt: seqTokens(10, int32(r%2))})
			if err != nil {
				t.Error(err)
				return
			}
			aborted := make(chan struct{})
			go func() { s.Lease().Abort(nil); close(aborted) }()
			if err := s.Commit(s.Len() - s.Computed()); err != nil && !errors.Is(err, ErrLeaseClosed) {
				t.Error(err)
			}
			for i := range 40 {
				if err := s.AppendComputed(int32(i)); err != nil {
					if !errors.Is(err, ErrLeaseClosed) {
						t.Error(err)
					}
					break
				}
			}
			<-aborted
			s.Lease().Release()
		}()
	}
	wg.Wait()
	checkPool(t, p)
	if st := p.Stats(); st.Leased != 0 || st.OpenLeases != 0 {
		t.Fatalf("left: %+v", st)
	}
}

// FuzzSequence drives a sequence with random appends, commits and
// rollbacks and checks it against a model: the committed tokens, and
// sealed hashes equal to ChainHashes over them.
func FuzzSequence(f *testing.F) {
	f.Add(uint64(1), []byte{0, 1, 2, 3, 4, 5})
	f.Add(uint64(2), []byte{9, 9, 9, 200, 17, 33, 1})
	f.Fuzz(func(t *testing.T, seed uint64, ops []byte) {
		if len(ops) > 200 {
			ops = ops[:200]
		}
		const bt = 4
		p := seqPool(t, 64, WithBlockTokens(bt))
		rng := rand.New(rand.NewPCG(seed, 1))
		prompt := seqTokens(1+rng.IntN(20), int32(rng.IntN(3)))
		warm, err := p.Admit(SequenceSpec{Owner: "w", Seed: 1, Prompt: prompt})
		if err != nil {
			t.Fatal(err)
		}
		_ = warm.Lease().SetRetention(Retention(seed % 8)) // mixed retention classes, evicted as the pool fills
		if err := warm.Commit(warm.Len() - warm.Computed()); err != nil {
			t.Fatal(err)
		}
		warm.Lease().Release()
		s, err := p.Admit(SequenceSpec{Owner: "s", Seed: 1, Prompt: prompt})
		if err != nil {
			t.Fatal(err)
		}
		_ = s.Lease().SetRetention(Retention(seed >> 3 % 8))
		model := slices.Clone(prompt)
		computed := s.Computed()
		for _, op := range ops {
			n := int(op >> 2)
			switch op & 3 {
			case 0, 1:
				n %= 9
				computedToo := op&3 == 1 && n%2 == 0 // AppendComputed, one token mostly
				if computedToo {
					n = min(n, 2) / 2
				}
				toks := seqTokens(n, int32(op))
				var err error
				if computedToo {
					err = s.AppendComputed(toks...)
				} else {
					err = s.Append(toks...)
				}
				switch {
				case computedToo && err == nil:
					model = append(model, toks...)
					computed += n
				case n > 0 && len(model) > computed:
					// Tokens pending: refused until committed or rolled back.
					if !errors.Is(err, ErrInvalidArgument) {
						t.Fatalf("append %d with %d pending: %v", n, len(model)-computed, err)
					}
				case err == nil:
					model = append(model, toks...)
				case !errors.Is(err, ErrExhausted) && !errors.Is(err, ErrExceedsCapacity):
					t.Fatal(err)
				}
			case 2:
				n = min(n, len(model)-computed)
				if err := s.Commit(n); err != nil {
					t.Fatal(err)
				}
				computed += n
			case 3:
				n = min(n, len(model)-computed)
				if err := s.Rollback(n); err != nil {
					t.Fatal(err)
				}
				model = model[:len(model)-n]
			}
			if !slices.Equal(s.Tokens(), model) || s.Computed() != computed || len(s.BlockHashes()) != computed/bt {
				t.Fatalf("sequence %v/%d/%d, model %v/%d", s.Tokens(), s.Computed(), len(s.BlockHashes()), model, computed)
			}
		}
		if want := ChainHashes(1, model[:computed], bt); !slices.Equal(s.BlockHashes(), want) {
			t.Fatalf("hashes %x, want %x", s.BlockHashes(), want)
		}
		s.Lease().Release()
		if err := p.Check(); err != nil {
			t.Fatal(err)
		}
	})
}

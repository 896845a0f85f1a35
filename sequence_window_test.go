package kvlease

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// TestSequenceWindow: a sliding-window sequence gives back the blocks
// that fall out of the window of the next token to compute as it commits
// (sealed ones stay cached), seals the same chain as a full-attention
// one, and a later request hits on the window alone after the prompt's
// first blocks were evicted, where a full-attention lookup misses.
func TestSequenceWindow(t *testing.T) {
	const bt, window = 4, 8
	p := seqPool(t, 8, WithBlockTokens(bt))
	prompt := seqTokens(20, 1) // 5 blocks; the 5th holds the last token
	s, err := p.Admit(SequenceSpec{Owner: "a", Seed: 3, Prompt: prompt, Window: window})
	if err != nil {
		t.Fatal(err)
	}
	if s.Base() != 0 || s.Lease().Len() != 5 || s.Hits() != 0 {
		t.Fatalf("base %d blocks %d hits %d", s.Base(), s.Lease().Len(), s.Hits())
	}
	// Computed 5: the next token attends to tokens 0..4 (block 0 on);
	// 12: to 4..11 (block 1 on); 16: block 2 on; 20: to 12..19 (block 3
	// on). (Blocks trimmed one at a time reach the LRU in order.)
	for _, st := range []struct{ commit, trimmed int }{{5, 0}, {7, 1}, {4, 2}, {4, 3}} {
		if err := s.Commit(st.commit); err != nil {
			t.Fatal(err)
		}
		if got := s.Lease().Trimmed(); got != st.trimmed {
			t.Fatalf("computed %d: trimmed %d, want %d", s.Computed(), got, st.trimmed)
		}
	}
	for i := range 10 { // decode: 30 tokens, the window's start at block 5
		if err := s.AppendComputed(int32(900 + i)); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := s.Lease().Trimmed(), (30-window)/bt; got != want || s.Lease().Len() != 8 {
		t.Fatalf("after decode: trimmed %d, want %d; blocks %d", got, want, s.Lease().Len())
	}
	if want := ChainHashes(3, s.Tokens(), bt); !slices.Equal(s.BlockHashes(), want) {
		t.Fatalf("hashes %x, want %x", s.BlockHashes(), want)
	}
	if st := p.Stats(); st.Leased != 3 || st.Cached != 5 {
		t.Fatalf("a window of 3 blocks held, the trimmed 5 cached: %+v", st)
	}
	s.Lease().Release()

	// Evict the blocks trimmed first (0 and 1: the LRU's oldest): one
	// block is free, the others cached.
	filler, err := p.Acquire("filler", 3)
	if err != nil {
		t.Fatal(err)
	}
	filler.Release()
	hashes := ChainHashes(3, prompt, bt)
	if n := p.CachedPrefixTokens(3, prompt); n != 0 || p.CachedPrefix(hashes[2:4]) != 2 {
		t.Fatalf("full-attention prefix %d, window blocks cached %d", n, p.CachedPrefix(hashes[2:4]))
	}
	// The window before block 4 (tokens 8..15: blocks 2 and 3) is cached.
	w, err := p.Admit(SequenceSpec{Owner: "b", Seed: 3, Prompt: prompt, Window: window})
	if err != nil {
		t.Fatal(err)
	}
	if w.Hits() != 4 || w.Base() != 2 || w.Lease().Len() != 3 || w.CachedTokens() != 16 || w.Computed() != 16 {
		t.Fatalf("window hits %d base %d blocks %d cached %d computed %d", w.Hits(), w.Base(), w.Lease().Len(), w.CachedTokens(), w.Computed())
	}
	for i := range 2 {
		if ref := w.Lease().Ref(i); ref.ID != mustFind(t, p, hashes[2+i]) {
			t.Fatalf("lease index %d is not block %d's hit", i, 2+i)
		}
	}
	if err := w.Commit(4); err != nil || len(w.BlockHashes()) != 5 {
		t.Fatalf("commit: %v, sealed %d", err, len(w.BlockHashes()))
	}
	if w.Lease().Trimmed() != 1 { // next token 20 attends to 12..19: block 3 on
		t.Fatalf("trimmed %d", w.Lease().Trimmed())
	}
	if want := ChainHashes(3, prompt, bt); !slices.Equal(w.BlockHashes(), want) {
		t.Fatalf("hashes %x", w.BlockHashes())
	}
	w.Lease().Release()
	if err := p.CheckQuiescent(); err != nil {
		t.Fatal(err)
	}
}

func mustFind(t *testing.T, p *Pool[[]byte], h BlockHash) BlockID {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	id, ok := p.index.find(h)
	if !ok {
		t.Fatalf("hash %x not findable", h)
	}
	return id
}

// TestWindowHitModel holds windowHit to its definition: the longest hit p
// whose window blocks [windowStart(p·B), p) are all cached, over random
// cached sets, block sizes and windows.
func TestWindowHitModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(4, 4))
	for trial := range 400 {
		bt := 1 + rng.IntN(5)
		window := 1 + rng.IntN(40)
		nb := 1 + rng.IntN(20)
		p := seqPool(t, 64, WithBlockTokens(bt))
		hashes := make([]BlockHash, nb)
		cached := make([]bool, nb)
		for k := range hashes {
			hashes[k] = BlockHash(1000*trial + k + 1)
			if rng.IntN(4) != 0 {
				cached[k] = true
				l, _ := p.Acquire("seal", 1)
				if err := l.Seal(0, hashes[k]); err != nil {
					t.Fatal(err)
				}
				l.Release()
			}
		}
		want, wantBase := 0, 0
		for hit := nb; hit > 0 && want == 0; hit-- {
			ws := 0
			if hit*bt > window {
				ws = (hit*bt - window) / bt
			}
			ok := true
			for k := ws; k < hit; k++ {
				ok = ok && cached[k]
			}
			if ok {
				want, wantBase = hit, ws
			}
		}
		p.mu.Lock()
		got, base := p.windowHit(hashes, nil, bt, window)
		p.mu.Unlock()
		if got != want || base != wantBase {
			t.Fatalf("trial %d (bt %d window %d cached %v): hit %d base %d, want %d %d", trial, bt, window, cached, got, base, want, wantBase)
		}
	}
}

// TestSequenceWindowVerified: in verified mode a window hit is verified
// block by block from the window's first block on (its parent is the
// block before, its extra keys those of its absolute place).
func TestSequenceWindowVerified(t *testing.T) {
	const bt, window = 4, 8
	for _, img := range []ExtraKey{{Start: 10, End: 14, Key: "img"}, {Start: 17, End: 21, Key: "img"}} {
		p := seqPool(t, 32, WithVerifiedPrefix(bt))
		prompt := seqTokens(25, 7)
		extra := []ExtraKey{img}
		s, err := p.Admit(SequenceSpec{Owner: "a", Seed: 1, Prompt: prompt, Extra: extra, Window: window})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Commit(s.Len()); err != nil {
			t.Fatal(err)
		}
		s.Lease().Release()
		w, err := p.Admit(SequenceSpec{Owner: "b", Seed: 1, Prompt: prompt, Extra: extra, Window: window})
		if err != nil {
			t.Fatal(err)
		}
		if w.Hits() != 6 || w.Base() != 4 {
			t.Fatalf("image %v: verified window hits %d base %d, want 6 4", img, w.Hits(), w.Base())
		}
		w.Lease().Release()
		// Another image over the same tokens: its blocks and every block
		// after differ, so at most the blocks before the image hit.
		other := img
		other.Key = "other"
		o, err := p.Admit(SequenceSpec{Owner: "c", Seed: 1, Prompt: prompt, Extra: []ExtraKey{other}, Window: window})
		if err != nil {
			t.Fatal(err)
		}
		if o.Hits() > img.Start/bt {
			t.Fatalf("image %v: another image hits %d blocks", img, o.Hits())
		}
		o.Lease().Release()
		if st := p.Stats(); st.VerifyMismatches != 0 {
			t.Fatalf("image %v: mismatches %d", img, st.VerifyMismatches)
		}
		if err := p.CheckQuiescent(); err != nil {
			t.Fatal(err)
		}
	}
}

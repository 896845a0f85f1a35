package kvlease

import (
	"errors"
	"slices"
	"testing"

	"github.com/kvlease/kvlease/internal/slots"
)

// Extra keys go into the hash of exactly the blocks they cover: text
// before an image is shared with prompts carrying another image, the
// image's blocks are not; seals record them (verified hits compare them)
// and events publish them. A lease's adapter tags its blocks' events and
// their snapshot re-announcements.
func TestSequenceExtraKeysAndAdapter(t *testing.T) {
	const bt = 16
	for _, verified := range []bool{false, true} {
		opt := WithBlockTokens(bt)
		if verified {
			opt = WithVerifiedPrefix(bt)
		}
		p := seqPool(t, 64, opt, WithKVEvents(256))
		prompt := seqTokens(64, 1)
		img := func(key string) []ExtraKey { return []ExtraKey{{Start: 20, End: 36, Key: key}} }
		a, err := p.Admit(SequenceSpec{Owner: "a", Seed: 9, Prompt: prompt, Extra: img("img:A"), Adapter: Adapter{ID: 1, Name: "sql"}})
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Commit(a.Len()); err != nil {
			t.Fatal(err)
		}
		hs := a.BlockHashes()
		want := []BlockHash{HashBlock(9, prompt[:16])}
		want = append(want, HashBlock(want[0], prompt[16:32], []string{"img:A"}...))
		want = append(want, HashBlock(want[1], prompt[32:48], []string{"img:A"}...))
		want = append(want, HashBlock(want[2], prompt[48:64]))
		if !slices.Equal(hs, want) {
			t.Fatalf("verified %v: hashes %x, want %x", verified, hs, want)
		}
		a.Lease().Release()
		evs, _ := p.DrainKVEvents(nil)
		if len(evs) != 4 {
			t.Fatalf("%d events", len(evs))
		}
		for k, ev := range evs {
			wantExtra := []string(nil)
			if k == 1 || k == 2 {
				wantExtra = []string{"img:A"}
			}
			if !slices.Equal(ev.ExtraKeys, wantExtra) || ev.LoraID != 1 || ev.LoraName != "sql" {
				t.Fatalf("event %d: extra %q lora %d %q", k, ev.ExtraKeys, ev.LoraID, ev.LoraName)
			}
		}
		_, snap := p.SnapshotKVBlocks(nil)
		for _, ev := range snap {
			if ev.LoraName != "sql" || (ev.BlockHash == want[1] || ev.BlockHash == want[2]) != slices.Equal(ev.ExtraKeys, []string{"img:A"}) {
				t.Fatalf("snapshot %+v", ev)
			}
		}
		// Another image: only the text before it is shared.
		b, err := p.Admit(SequenceSpec{Owner: "b", Seed: 9, Prompt: prompt, Extra: img("img:B")})
		if err != nil {
			t.Fatal(err)
		}
		if b.Hits() != 1 {
			t.Fatalf("verified %v: another image hit %d blocks, want 1", verified, b.Hits())
		}
		b.Lease().Release()
		// No image at all: the same.
		if n := p.CachedPrefixTokens(9, prompt); n != 1 {
			t.Fatalf("verified %v: the prompt without its image hits %d, want 1", verified, n)
		}
		// The same image: every block but the last token's.
		c, err := p.Admit(SequenceSpec{Owner: "c", Seed: 9, Prompt: prompt, Extra: img("img:A")})
		if err != nil {
			t.Fatal(err)
		}
		if c.Hits() != 3 {
			t.Fatalf("verified %v: the same image hit %d, want 3", verified, c.Hits())
		}
		// Blocks sealed without an adapter: events say the base model.
		if err := c.Commit(c.Len() - c.Computed()); err != nil {
			t.Fatal(err)
		}
		c.Lease().Release()
		if st := p.Stats(); st.VerifyMismatches != 0 {
			t.Fatalf("mismatches %d", st.VerifyMismatches)
		}
		checkPool(t, p)
	}
}

// A verified hit needs the same extra keys: a block whose hash matches
// but whose keys differ (a crafted collision) is a miss.
func TestVerifyExtraKeys(t *testing.T) {
	p := seqPool(t, 16, WithVerifiedPrefix(4))
	prompt := seqTokens(9, 1)
	s, err := p.Admit(SequenceSpec{Owner: "a", Seed: 1, Prompt: prompt, Extra: []ExtraKey{{0, 4, "x"}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(9); err != nil {
		t.Fatal(err)
	}
	h0 := s.BlockHashes()[0]
	s.Lease().Release()
	// The lookup claims block 0's hash for the same tokens with no keys.
	v := verifier{seed: 1, hashes: []BlockHash{h0}, tokens: prompt, blockTokens: 4}
	p.mu.Lock()
	id, ok := p.index.find(h0)
	hit := ok && p.verify(id, 0, &v)
	p.mu.Unlock()
	if !ok || hit {
		t.Fatalf("found %v, verified %v: keys were not compared", ok, hit)
	}
	// The lookup reports the mismatch; only an acquire counts it (a
	// query such as CachedPrefixTokens changes nothing).
	p.mu.Lock()
	n, mismatch := p.probe([]BlockHash{h0}, &v)
	p.mu.Unlock()
	if n != 0 || !mismatch {
		t.Fatalf("probe: %d hits, mismatch %v", n, mismatch)
	}
	if got := p.Stats().VerifyMismatches; got != 0 {
		t.Fatalf("a lookup alone counted %d mismatches", got)
	}
}

// CachedPrefixTokens only reads: hits or not, verified or not, the
// pool's stats and its eviction order are as they were.
func TestCachedPrefixTokensReadsOnly(t *testing.T) {
	for _, opts := range [][]Option{{WithBlockTokens(4)}, {WithVerifiedPrefix(4)}} {
		p := seqPool(t, 6, opts...)
		prompt := seqTokens(13, 1)
		for _, owner := range []string{"a", "b"} {
			s, err := p.Admit(SequenceSpec{Owner: owner, Seed: BlockHash(len(owner)), Prompt: prompt})
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Commit(s.Len() - s.Computed()); err != nil {
				t.Fatal(err)
			}
			s.Lease().Release()
		}
		before, lru := p.Stats(), lruOrder(p)
		if n := p.CachedPrefixTokens(1, prompt); n != 3 {
			t.Fatalf("cached prefix %d, want 3", n)
		}
		if n := p.CachedPrefixTokens(1, seqTokens(13, 2)); n != 0 {
			t.Fatalf("another prompt: %d", n)
		}
		if after := p.Stats(); after != before || !slices.Equal(lruOrder(p), lru) {
			t.Fatalf("a query changed the pool: %+v → %+v, LRU %v → %v", before, after, lru, lruOrder(p))
		}
	}
}

// lruOrder lists the cached slots, least recently used first.
func lruOrder(p *Pool[[]byte]) []int32 {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []int32
	for id := range p.tab.Len() {
		if p.tab.ClassOf(int32(id)) == slots.Cached {
			out = append(out, int32(id))
		}
	}
	if h := p.tab.LRUHead(); h != slots.Nil {
		out = append([]int32{h}, out...) // the head first: the next victim
	}
	return out
}

func TestAdapterErrors(t *testing.T) {
	p := seqPool(t, 8, WithBlockTokens(4))
	if _, err := p.Admit(SequenceSpec{Owner: "a", Prompt: seqTokens(4, 0), Extra: []ExtraKey{{-1, 3, "k"}}}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("negative range: %v", err)
	}
	if _, err := p.Admit(SequenceSpec{Owner: "a", Prompt: seqTokens(4, 0), Adapter: Adapter{ID: 3}}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("adapter without a name: %v", err)
	}
	if st := p.Stats(); st.Leased != 0 || st.OpenLeases != 0 {
		t.Fatalf("a refused admission holds %+v", st)
	}
	l, _ := p.Acquire("a", 1)
	if err := l.SetAdapter(Adapter{}); err != nil {
		t.Fatal(err)
	}
	l.Release()
	if err := l.SetAdapter(Adapter{ID: 1, Name: "x"}); !errors.Is(err, ErrLeaseClosed) {
		t.Fatalf("closed lease: %v", err)
	}
	checkPool(t, p)
}

// SealTokens with extra keys: a lease-level seal findable by the pool's
// hash of them and announced with them.
func TestSealTokensExtra(t *testing.T) {
	p := seqPool(t, 8, WithBlockTokens(2), WithKVEvents(8))
	l, _ := p.Acquire("a", 2)
	keys := []string{"img:1"}
	h0, err := l.SealTokens(0, 3, []int32{1, 2}, keys...)
	if err != nil {
		t.Fatal(err)
	}
	keys[0] = "changed" // the pool kept its own copy
	if h0 != HashBlock(3, []int32{1, 2}, []string{"img:1"}...) || h0 != poolHash(t, p, 3, []int32{1, 2}, []string{"img:1"}) {
		t.Fatal("SealTokens's hash is not the pool's")
	}
	l.Release()
	evs, _ := p.DrainKVEvents(nil)
	if len(evs) != 1 || !slices.Equal(evs[0].ExtraKeys, []string{"img:1"}) {
		t.Fatalf("events %+v", evs)
	}
	if p.CachedPrefix([]BlockHash{h0}) != 1 {
		t.Fatal("not findable by its hash")
	}
	checkPool(t, p)
}

package kvlease

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/cespare/xxhash/v2"
)

// HashBlock with extra keys is the documented encoding: HashBlock without keys, and
// with keys xxhash64 of the plain hash and each key length-prefixed.
func TestHashBlockExtraKeys(t *testing.T) {
	toks := seqTokens(16, 5)
	if HashBlock(3, toks, nil...) != HashBlock(3, toks) {
		t.Fatal("no extra keys: not HashBlock")
	}
	extra := []string{"image:abc", ""}
	buf := binary.LittleEndian.AppendUint64(nil, uint64(HashBlock(3, toks)))
	for _, k := range extra {
		buf = binary.LittleEndian.AppendUint32(buf, uint32(len(k)))
		buf = append(buf, k...)
	}
	if got, want := HashBlock(3, toks, extra...), BlockHash(xxhash.Sum64(buf)); got != want {
		t.Fatalf("%x, want %x", got, want)
	}
	seen := map[BlockHash][]string{}
	for _, e := range [][]string{nil, {"a"}, {"b"}, {"a", "b"}, {"b", "a"}, {"ab"}, {"a", ""}, {"", "a"}} {
		h := HashBlock(3, toks, e...)
		if prev, ok := seen[h]; ok {
			t.Fatalf("keys %q and %q hash alike", prev, e)
		}
		seen[h] = e
	}
	if n := testing.AllocsPerRun(10, func() { _ = HashBlock(3, toks, extra...) }); n != 0 {
		t.Fatalf("HashBlock with extra keys allocates %v", n)
	}
}

func TestBlockExtras(t *testing.T) {
	spans := []ExtraKey{{0, 40, "lora"}, {10, 20, "img1"}, {31, 33, "img2"}, {48, 48, "empty"}}
	for k, want := range [][]string{{"lora", "img1"}, {"lora", "img1", "img2"}, {"lora", "img2"}, nil} {
		if got := blockExtras(nil, spans, k, 16); !slices.Equal(got, want) {
			t.Errorf("block %d: %q, want %q", k, got, want)
		}
	}
}

// poolHash is the pool's hash of one block (Pool.hashBlocks of one).
func poolHash(t testing.TB, p *Pool[[]byte], parent BlockHash, tokens []int32, extra []string) BlockHash {
	t.Helper()
	var out [1]BlockHash
	var ex [][]string
	if extra != nil {
		ex = [][]string{extra}
	}
	if err := p.hashBlocks(parent, tokens, ex, out[:]); err != nil {
		t.Fatal(err)
	}
	return out[0]
}

// perBlock makes a Hasher of a one-block function.
func perBlock(f func(parent BlockHash, tokens []int32, extra []string) BlockHash) Hasher {
	return func(parent BlockHash, tokens []int32, extra [][]string, out []BlockHash) error {
		bt := len(tokens) / len(out)
		for k := range out {
			var ex []string
			if extra != nil {
				ex = extra[k]
			}
			parent = f(parent, tokens[k*bt:(k+1)*bt], ex)
			out[k] = parent
		}
		return nil
	}
}

// countingHasher is HashBlock (extra keys included) that counts its calls and the blocks
// it hashes.
type countingHasher struct{ calls, blocks atomic.Int64 }

func (h *countingHasher) hash(parent BlockHash, tokens []int32, extra [][]string, out []BlockHash) error {
	h.calls.Add(1)
	h.blocks.Add(int64(len(out)))
	defaultChain(parent, tokens, extra, out)
	return nil
}

func (h *countingHasher) reset() { h.calls.Store(0); h.blocks.Store(0) }

// TestSequenceHashesOnce: a 4,096-token prompt admitted with a prefix hit
// is hashed exactly once, in one Hasher call for its 256 full blocks, by
// the admission; prefilling it hashes nothing more (the prompt's blocks
// are sealed with the admission's hashes); each decoded block costs one
// hash.
func TestSequenceHashesOnce(t *testing.T) {
	const bt = 16
	var h countingHasher
	for _, verified := range []bool{false, true} {
		h.reset()
		opt := WithBlockTokens(bt)
		if verified {
			opt = WithVerifiedPrefix(bt)
		}
		p := seqPool(t, 1024, opt, WithHasher(h.hash))
		prompt := seqTokens(4096, 11)
		warm, err := p.Admit(SequenceSpec{Owner: "warm", Seed: 3, Prompt: prompt})
		if err != nil {
			t.Fatal(err)
		}
		if err := warm.Commit(warm.Len()); err != nil {
			t.Fatal(err)
		}
		warm.Lease().Release()
		if n, c := h.blocks.Load(), h.calls.Load(); n != 256 || c != 1 {
			t.Fatalf("verified %v: the first admission and prefill hashed %d blocks in %d calls, want 256 in 1", verified, n, c)
		}
		h.reset()
		s, err := p.Admit(SequenceSpec{Owner: "req", Seed: 3, Prompt: prompt})
		if err != nil {
			t.Fatal(err)
		}
		if s.Hits() != 255 {
			t.Fatalf("verified %v: hits %d", verified, s.Hits())
		}
		if n, c := h.blocks.Load(), h.calls.Load(); n != 256 || c != 1 {
			t.Fatalf("verified %v: admission with a prefix hit hashed %d blocks in %d calls, want 256 in 1", verified, n, c)
		}
		if err := s.Commit(s.Len() - s.Computed()); err != nil {
			t.Fatal(err)
		}
		if err := s.AppendComputed(seqTokens(bt, 9000)...); err != nil {
			t.Fatal(err)
		}
		if n := h.blocks.Load(); n != 257 {
			t.Fatalf("verified %v: after prefill and one decoded block: %d hashes, want 257", verified, n)
		}
		if want := ChainHashes(3, s.Tokens(), bt); !slices.Equal(s.BlockHashes(), want) {
			t.Fatal("hashes differ from ChainHashes")
		}
		s.Lease().Release()
		checkPool(t, p)
	}
}

func sha(parent BlockHash, tokens []int32, extra []string) BlockHash {
	d := sha256.New()
	binary.Write(d, binary.BigEndian, uint64(parent))
	binary.Write(d, binary.BigEndian, tokens)
	for _, k := range extra {
		d.Write([]byte(k))
	}
	return BlockHash(binary.BigEndian.Uint64(d.Sum(nil)))
}

// A pool's own hasher is used by every path: seals, lookups by tokens
// (verified), sequences, Pool.hashBlocks, and the KV events carry its
// hashes.
func TestWithHasher(t *testing.T) {
	mine := perBlock(sha)
	p := seqPool(t, 32, WithVerifiedPrefix(4), WithHasher(mine), WithKVEvents(64))
	toks := seqTokens(9, 1)
	l, _, err := p.AcquirePrefixTokens("a", 5, toks, 3)
	if err != nil {
		t.Fatal(err)
	}
	h0, err := l.SealTokens(0, 5, toks[:4])
	if err != nil {
		t.Fatal(err)
	}
	h1, err := l.SealTokens(1, h0, toks[4:8])
	if err != nil {
		t.Fatal(err)
	}
	if h0 != sha(5, toks[:4], nil) || h1 != sha(h0, toks[4:8], nil) || poolHash(t, p, 5, toks[:4], nil) != h0 {
		t.Fatal("seals did not use the pool's hasher")
	}
	var two [2]BlockHash
	if err := p.hashBlocks(5, toks[:8], nil, two[:]); err != nil || two != [2]BlockHash{h0, h1} {
		t.Fatalf("hashBlocks of two blocks: %x %v, want %x %x", two, err, h0, h1)
	}
	l.Release()
	if n := p.CachedPrefixTokens(5, toks); n != 2 {
		t.Fatalf("verified lookup with the pool's hasher: %d hits, want 2", n)
	}
	s, err := p.Admit(SequenceSpec{Owner: "s", Seed: 5, Prompt: toks})
	if err != nil || s.Hits() != 2 {
		t.Fatalf("sequence: %v hits %d", err, s.Hits())
	}
	s.Lease().Release()
	evs, _ := p.DrainKVEvents(nil)
	if len(evs) != 2 || evs[0].BlockHash != h0 || evs[1].BlockHash != h1 || evs[1].ParentBlockHash != h0 {
		t.Fatalf("events %+v", evs)
	}
	mem, _ := NewHostMemory(4, 64)
	if _, err := NewPool[[]byte](mem, WithHasher(nil)); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("nil hasher: %v", err)
	}
	if _, err := NewPool[[]byte](mem, WithHasher(mine), WithHasher(mine)); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("two hashers: %v", err)
	}
}

// TestHashBlocksArgs: hashBlocks refuses tokens that are not whole
// blocks and extra keys for another number of blocks.
func TestHashBlocksArgs(t *testing.T) {
	p := seqPool(t, 8, WithBlockTokens(4))
	var out [2]BlockHash
	for _, c := range []struct {
		tokens int
		extra  [][]string
		out    int
	}{{7, nil, 2}, {12, nil, 2}, {8, [][]string{nil}, 2}, {4, nil, 0}} {
		if err := p.hashBlocks(0, seqTokens(c.tokens, 0), c.extra, out[:c.out]); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%d tokens, %d extra, %d blocks: %v", c.tokens, len(c.extra), c.out, err)
		}
	}
	if err := p.hashBlocks(0, nil, nil, nil); err != nil {
		t.Errorf("nothing to hash: %v", err)
	}
	ex := [][]string{nil, {"img"}}
	if err := p.hashBlocks(9, seqTokens(8, 0), ex, out[:]); err != nil {
		t.Fatal(err)
	}
	h0 := HashBlock(9, seqTokens(4, 0))
	if out[0] != h0 || out[1] != HashBlock(h0, seqTokens(8, 0)[4:], "img") {
		t.Errorf("HashBlocks %x", out)
	}
}

// errHasher fails once armed, counting the blocks it was asked for.
type errHasher struct {
	armed atomic.Bool
}

var errHash = errors.New("hasher: encoder failed")

func (h *errHasher) hash(parent BlockHash, tokens []int32, extra [][]string, out []BlockHash) error {
	if h.armed.Load() {
		return errHash
	}
	defaultChain(parent, tokens, extra, out)
	return nil
}

// TestHasherErrors: a Hasher's error reaches the caller wrapped, and
// nothing is held or sealed because of it: an admission holds nothing, a
// commit seals nothing and keeps Computed, a seal and a lookup by tokens
// are refused, a cached-prefix count is a miss.
func TestHasherErrors(t *testing.T) {
	var h errHasher
	p := seqPool(t, 16, WithBlockTokens(4), WithHasher(h.hash), WithKVEvents(16))
	prompt := seqTokens(9, 1)
	h.armed.Store(true)
	if _, err := p.Admit(SequenceSpec{Owner: "a", Seed: 1, Prompt: prompt}); !errors.Is(err, errHash) {
		t.Fatalf("admission: %v", err)
	}
	if _, _, err := p.AcquirePrefixTokens("a", 1, prompt, 3); !errors.Is(err, errHash) {
		t.Fatalf("AcquirePrefixTokens: %v", err)
	}
	if n := p.CachedPrefixTokens(1, prompt); n != 0 {
		t.Fatalf("CachedPrefixTokens %d", n)
	}
	var out [1]BlockHash
	if err := p.hashBlocks(1, prompt[:4], nil, out[:]); !errors.Is(err, errHash) {
		t.Fatalf("HashBlocks: %v", err)
	}
	if err := p.CheckQuiescent(); err != nil {
		t.Fatal(err)
	}
	h.armed.Store(false)
	s, err := p.Admit(SequenceSpec{Owner: "a", Seed: 1, Prompt: prompt})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Commit(s.Len()); err != nil {
		t.Fatal(err)
	}
	// A generated block needs a hash: refused, nothing sealed, Computed kept.
	if err := s.Append(seqTokens(3, 50)...); err != nil {
		t.Fatal(err)
	}
	h.armed.Store(true)
	if err := s.Commit(3); !errors.Is(err, errHash) {
		t.Fatalf("commit: %v", err)
	}
	if s.Computed() != 9 || len(s.BlockHashes()) != 2 {
		t.Fatalf("after a failed commit: computed %d sealed %d", s.Computed(), len(s.BlockHashes()))
	}
	if _, err := s.Lease().SealTokens(2, s.parent(), s.Tokens()[8:12]); !errors.Is(err, errHash) {
		t.Fatalf("SealTokens: %v", err)
	}
	h.armed.Store(false)
	if err := s.Commit(3); err != nil || len(s.BlockHashes()) != 3 {
		t.Fatalf("commit once the hasher works: %v, sealed %d", err, len(s.BlockHashes()))
	}
	if want := ChainHashes(1, s.Tokens(), 4); !slices.Equal(s.BlockHashes(), want) {
		t.Fatalf("hashes %x, want %x", s.BlockHashes(), want)
	}
	s.Lease().Release()
	if err := p.CheckQuiescent(); err != nil {
		t.Fatal(err)
	}
}

// hashBlocks writes to out the pool's chain hashes of len(out)
// consecutive full blocks of tokens under parent, as its Hasher
// (WithHasher) or HashBlock computes them (a caller outside calls
// its Hasher, or ChainHashes without one). tokens must be
// len(out) blocks of the pool's block tokens (any equal split without
// WithBlockTokens) and extra nil or one entry per block; otherwise the
// error wraps ErrInvalidArgument. A hasher's error is returned wrapped.
func (p *Pool[R]) hashBlocks(parent BlockHash, tokens []int32, extra [][]string, out []BlockHash) error {
	n := len(out)
	bt := p.cfg.blockTokens
	switch {
	case n == 0:
		if len(tokens) != 0 || len(extra) != 0 {
			return fmt.Errorf("kvlease: hash %d tokens into no block: %w", len(tokens), ErrInvalidArgument)
		}
		return nil
	case bt == 0 && (len(tokens) == 0 || len(tokens)%n != 0):
		return fmt.Errorf("kvlease: hash %d tokens as %d equal blocks: %w", len(tokens), n, ErrInvalidArgument)
	case bt > 0 && len(tokens) != n*bt:
		return fmt.Errorf("kvlease: hash %d tokens as %d blocks of %d: %w", len(tokens), n, bt, ErrInvalidArgument)
	case extra != nil && len(extra) != n:
		return fmt.Errorf("kvlease: hash %d blocks with extra keys for %d: %w", n, len(extra), ErrInvalidArgument)
	}
	return p.hashChain(parent, tokens, extra, out)
}

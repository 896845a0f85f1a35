package kvlease

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/cespare/xxhash/v2"
)

// HashBlockExtra is the documented encoding: HashBlock without keys, and
// with keys xxhash64 of the plain hash and each key length-prefixed.
func TestHashBlockExtra(t *testing.T) {
	toks := seqTokens(16, 5)
	if HashBlockExtra(3, toks, nil) != HashBlock(3, toks) {
		t.Fatal("no extra keys: not HashBlock")
	}
	extra := []string{"image:abc", ""}
	buf := binary.LittleEndian.AppendUint64(nil, uint64(HashBlock(3, toks)))
	for _, k := range extra {
		buf = binary.LittleEndian.AppendUint32(buf, uint32(len(k)))
		buf = append(buf, k...)
	}
	if got, want := HashBlockExtra(3, toks, extra), BlockHash(xxhash.Sum64(buf)); got != want {
		t.Fatalf("%x, want %x", got, want)
	}
	seen := map[BlockHash][]string{}
	for _, e := range [][]string{nil, {"a"}, {"b"}, {"a", "b"}, {"b", "a"}, {"ab"}, {"a", ""}, {"", "a"}} {
		h := HashBlockExtra(3, toks, e)
		if prev, ok := seen[h]; ok {
			t.Fatalf("keys %q and %q hash alike", prev, e)
		}
		seen[h] = e
	}
	if n := testing.AllocsPerRun(10, func() { _ = HashBlockExtra(3, toks, extra) }); n != 0 {
		t.Fatalf("HashBlockExtra allocates %v", n)
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

// countingHasher is HashBlockExtra that counts its calls.
type countingHasher struct{ n atomic.Int64 }

func (h *countingHasher) hash(parent BlockHash, tokens []int32, extra []string) BlockHash {
	h.n.Add(1)
	return HashBlockExtra(parent, tokens, extra)
}

// TestSequenceHashesOnce: a 4,096-token prompt admitted with a prefix hit
// is hashed exactly once, block by block (256 full blocks), by the
// admission; prefilling it hashes nothing more (the prompt's blocks are
// sealed with the admission's hashes); each decoded block costs one hash.
func TestSequenceHashesOnce(t *testing.T) {
	const bt = 16
	var h countingHasher
	for _, verified := range []bool{false, true} {
		h.n.Store(0)
		opt := WithBlockTokens(bt)
		if verified {
			opt = WithVerifiedPrefix(bt)
		}
		p := seqPool(t, 1024, opt, WithHasher(h.hash))
		prompt := seqTokens(4096, 11)
		warm, err := p.NewSequence("warm", 3, prompt)
		if err != nil {
			t.Fatal(err)
		}
		if err := warm.Commit(warm.Len()); err != nil {
			t.Fatal(err)
		}
		warm.Release()
		if n := h.n.Load(); n != 256 {
			t.Fatalf("verified %v: the first admission and prefill hashed %d blocks, want 256", verified, n)
		}
		h.n.Store(0)
		s, err := p.NewSequence("req", 3, prompt)
		if err != nil {
			t.Fatal(err)
		}
		if s.Hits() != 255 {
			t.Fatalf("verified %v: hits %d", verified, s.Hits())
		}
		if n := h.n.Load(); n != 256 {
			t.Fatalf("verified %v: admission with a prefix hit hashed %d blocks, want 256 (once each)", verified, n)
		}
		if err := s.Commit(s.Len() - s.Computed()); err != nil {
			t.Fatal(err)
		}
		if err := s.AppendComputed(seqTokens(bt, 9000)...); err != nil {
			t.Fatal(err)
		}
		if n := h.n.Load(); n != 257 {
			t.Fatalf("verified %v: after prefill and one decoded block: %d hashes, want 257", verified, n)
		}
		if want := ChainHashes(3, s.Tokens(), bt); !slices.Equal(s.BlockHashes(), want) {
			t.Fatal("hashes differ from ChainHashes")
		}
		s.Release()
		checkPool(t, p)
	}
}

// A pool's own hasher is used by every path: seals, lookups by tokens
// (verified), sequences, Pool.HashBlock, and the KV events carry its hashes.
func TestWithHasher(t *testing.T) {
	mine := func(parent BlockHash, tokens []int32, extra []string) BlockHash {
		d := sha256.New()
		binary.Write(d, binary.BigEndian, uint64(parent))
		binary.Write(d, binary.BigEndian, tokens)
		for _, k := range extra {
			d.Write([]byte(k))
		}
		return BlockHash(binary.BigEndian.Uint64(d.Sum(nil)))
	}
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
	if h0 != mine(5, toks[:4], nil) || h1 != mine(h0, toks[4:8], nil) || p.HashBlock(5, toks[:4], nil) != h0 {
		t.Fatal("seals did not use the pool's hasher")
	}
	l.Release()
	if n := p.CachedPrefixTokens(5, toks); n != 2 {
		t.Fatalf("verified lookup with the pool's hasher: %d hits, want 2", n)
	}
	s, err := p.NewSequence("s", 5, toks)
	if err != nil || s.Hits() != 2 {
		t.Fatalf("sequence: %v hits %d", err, s.Hits())
	}
	s.Release()
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

package kvlease

import (
	"encoding/binary"
	"slices"
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

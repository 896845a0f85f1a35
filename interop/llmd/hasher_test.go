package llmd

import (
	"encoding/binary"
	"hash/fnv"
	"math/rand/v2"
	"testing"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache/kvblock"
	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
)

// The Hasher of the root package's ExampleWithHasher, written from llm-d's
// description of its block hash (FNV-64a over the canonical CBOR of
// [parent, tokens, extra]); these tests hold it to llm-d's own token
// processor, so the example's claim is checked against the real thing.

func cborHead(b []byte, major byte, v uint64) []byte {
	m := major << 5
	switch {
	case v < 24:
		return append(b, m|byte(v))
	case v <= 0xff:
		return append(b, m|24, byte(v))
	case v <= 0xffff:
		return binary.BigEndian.AppendUint16(append(b, m|25), uint16(v))
	case v <= 0xffffffff:
		return binary.BigEndian.AppendUint32(append(b, m|26), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(b, m|27), v)
}

func cborText(b []byte, s string) []byte { return append(cborHead(b, 3, uint64(len(s))), s...) }

func llmdPayload(b []byte, parent uint64, tokens []int32, model string, keys []string) []byte {
	b = cborHead(b, 4, 3)
	b = cborHead(b, 0, parent)
	if tokens == nil {
		b = append(b, 0xf6)
	} else {
		b = cborHead(b, 4, uint64(len(tokens)))
		for _, t := range tokens {
			b = cborHead(b, 0, uint64(uint32(t)))
		}
	}
	switch {
	case model != "":
		b = cborText(b, model)
	case len(keys) > 0:
		b = cborHead(b, 4, uint64(len(keys)))
		for _, k := range keys {
			b = cborText(cborHead(b, 5, 1), "Hash")
			b = cborText(b, k)
		}
	default:
		b = append(b, 0xf6)
	}
	return b
}

func fnv64a(b []byte) uint64 {
	h := fnv.New64a()
	h.Write(b)
	return h.Sum64()
}

func llmdRoot(hashSeed, model string) kvlease.BlockHash {
	return kvlease.BlockHash(fnv64a(llmdPayload(nil, fnv64a([]byte(hashSeed)), nil, model, nil)))
}

func llmdHasher(parent kvlease.BlockHash, tokens []int32, extra [][]string, out []kvlease.BlockHash) error {
	bt := len(tokens) / len(out)
	var buf [256]byte
	for k := range out {
		var keys []string
		if extra != nil {
			keys = extra[k]
		}
		parent = kvlease.BlockHash(fnv64a(llmdPayload(buf[:0], uint64(parent), tokens[k*bt:(k+1)*bt], "", keys)))
		out[k] = parent
	}
	return nil
}

// llmdKeys is llm-d's own chain of block keys for tokens under model and
// hashSeed, with per-block multimodal identifiers (nil: text).
func llmdKeys(t *testing.T, hashSeed, model string, bt int, tokens []int32, keys [][]string) []kvlease.BlockHash {
	t.Helper()
	tp, err := kvblock.NewChunkedTokenDatabase(&kvblock.TokenProcessorConfig{BlockSizeTokens: bt, HashSeed: hashSeed})
	require.NoError(t, err)
	toks := make([]uint32, len(tokens))
	for i, v := range tokens {
		toks[i] = uint32(v)
	}
	var feats []*kvblock.BlockExtraFeatures
	if keys != nil {
		feats = make([]*kvblock.BlockExtraFeatures, len(keys))
		for k, ks := range keys {
			if len(ks) == 0 {
				continue
			}
			f := &kvblock.BlockExtraFeatures{}
			for _, s := range ks {
				f.MMHashes = append(f.MMHashes, kvblock.MMHash{Hash: s})
			}
			feats[k] = f
		}
	}
	got, err := tp.TokensToKVBlockKeys(kvblock.EmptyBlockHash, toks, model, feats)
	require.NoError(t, err)
	out := make([]kvlease.BlockHash, len(got))
	for i, h := range got {
		out[i] = kvlease.BlockHash(h)
	}
	return out
}

// TestHasherMatchesLLMD: a pool with the example's Hasher, seeded with
// llm-d's chain root, seals exactly the block keys llm-d's token processor
// computes for the same prompt: text and multimodal blocks, hash seeds,
// token ids of 2³¹ and more, block sizes whose token counts take every
// CBOR length form; and the example's printed hashes are llm-d's.
func TestHasherMatchesLLMD(t *testing.T) {
	// ExampleWithHasher's prompt and output.
	ex := llmdKeys(t, "", "meta-llama/Llama-3.1-8B", 4, []int32{1, 2, 3, 4, 5, 6, 7, 8, 9}, [][]string{nil, {"img-0"}})
	require.Equal(t, []kvlease.BlockHash{0x243067a3090e6b31, 0x7af07326e6c658df}, ex)

	rng := rand.New(rand.NewPCG(5, 8))
	for trial := range 40 {
		bt := []int{1, 4, 16, 23, 24, 300}[trial%6]
		seed := []string{"", "42", "a-much-longer-hash-seed"}[trial%3]
		model := []string{"m", "meta-llama/Llama-3.1-8B"}[trial%2]
		n := 1 + rng.IntN(6)
		tokens := make([]int32, n*bt+rng.IntN(bt))
		for i := range tokens {
			switch rng.IntN(4) {
			case 0:
				tokens[i] = int32(rng.IntN(24))
			case 1:
				tokens[i] = int32(rng.IntN(70000))
			case 2:
				tokens[i] = int32(rng.Uint32()) // ids of 2³¹ and more too
			default:
				tokens[i] = int32(rng.IntN(1 << 20))
			}
		}
		var spec []kvlease.ExtraKey
		var keys [][]string
		if trial%2 == 1 {
			start := rng.IntN(len(tokens))
			end := start + 1 + rng.IntN(2*bt)
			spec = []kvlease.ExtraKey{{Start: start, End: end, Key: "sha256:img"}}
			keys = make([][]string, n)
			for k := range keys {
				if start < (k+1)*bt && end > k*bt {
					keys[k] = []string{"sha256:img"}
				}
			}
		}
		want := llmdKeys(t, seed, model, bt, tokens, keys)

		mem, err := kvlease.NewHostMemory(16, 64)
		require.NoError(t, err)
		p, err := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(bt), kvlease.WithHasher(llmdHasher))
		require.NoError(t, err)
		s, err := p.Admit(kvlease.SequenceSpec{Owner: "r", Seed: llmdRoot(seed, model), Prompt: tokens, Extra: spec})
		require.NoError(t, err)
		require.NoError(t, s.Commit(s.Len()))
		require.Equal(t, want, s.BlockHashes(), "trial %d: %d blocks of %d tokens", trial, n, bt)
		s.Lease().Release()
		require.NoError(t, p.CheckQuiescent())
	}
}

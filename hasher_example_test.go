package kvlease_test

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"

	"github.com/kvlease/kvlease"
)

// llm-d's block hash, written from its description: llm-d-kv-cache's
// token processor hashes a block as FNV-64a over the canonical CBOR
// encoding (RFC 8949) of the array [parent, tokens, extra], where parent
// is an unsigned integer, tokens an array of unsigned integers (the
// uint32 token ids) and extra null, or for a multimodal block an array of
// maps {"Hash": identifier}. Its chain root for a model is the hash of
// [FNV-64a(HashSeed), null, model name].

// cborHead appends a CBOR head: major type and argument, shortest form.
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

const cborNull = 0xf6

// llmdPayload appends the CBOR of [parent, tokens, extra]: tokens nil is
// null, model (the root's extra) a text string, keys the multimodal
// identifiers.
func llmdPayload(b []byte, parent uint64, tokens []int32, model string, keys []string) []byte {
	b = cborHead(b, 4, 3)
	b = cborHead(b, 0, parent)
	if tokens == nil {
		b = append(b, cborNull)
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
		b = append(b, cborNull)
	}
	return b
}

func fnv64a(b []byte) uint64 {
	h := fnv.New64a()
	h.Write(b)
	return h.Sum64()
}

// llmdRoot is llm-d's chain root for a model under a hash seed.
func llmdRoot(hashSeed, model string) kvlease.BlockHash {
	return kvlease.BlockHash(fnv64a(llmdPayload(nil, fnv64a([]byte(hashSeed)), nil, model, nil)))
}

// llmdHasher hashes a batch of blocks as llm-d does, with one payload
// buffer for the whole batch.
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

// A pool that must reproduce another system's block hashes plugs its
// hash in: here llm-d's, so that llm-d's KV-cache indexer, hashing the
// same prompt itself, finds the blocks the pool announces. The pool
// hands the Hasher every block it has at once (the prompt's two full
// blocks in one call) and chains from the seed it is given: the caller
// passes llm-d's chain root for the model. interop/llmd checks these
// hashes against llm-d's own token processor.
func ExampleWithHasher() {
	mem, _ := kvlease.NewHostMemory(8, 64)
	pool, _ := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(4), kvlease.WithHasher(llmdHasher))
	root := llmdRoot("", "meta-llama/Llama-3.1-8B") // llm-d's HashSeed "", the model's name
	prompt := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9}
	s, _ := pool.Admit(kvlease.SequenceSpec{Owner: "req-1", Seed: root, Prompt: prompt,
		Extra: []kvlease.ExtraKey{{Start: 4, End: 8, Key: "img-0"}}}) // an image over tokens 4..7
	_ = s.Commit(s.Len())
	for k, h := range s.BlockHashes() {
		fmt.Printf("block %d %016x\n", k, uint64(h))
	}
	s.Lease().Release()
	fmt.Println("quiescent:", pool.CheckQuiescent())
	// Output:
	// block 0 243067a3090e6b31
	// block 1 7af07326e6c658df
	// quiescent: <nil>
}

package main

import (
	"encoding/binary"
	"hash/fnv"
	"strconv"
	"strings"
)

// The simulated model: a deterministic tokenizer and a sampler that stand
// in for a real model's, so that the engine around them (what this example
// teaches) behaves as it would with one. Nothing here is kvlease.

const (
	vocab = 32000 // token ids are 0..vocab-1
	eos   = 2     // the end-of-sequence token: a sequence that samples it stops ("stop")
)

// tokenize splits text on white space; a word of the form w<id> (what
// detokenize writes) is token id, any other word hashes to one. So the
// same text always gives the same tokens, a generated text fed back is
// its tokens again, and texts sharing leading words share leading tokens.
func tokenize(text string) []uint32 {
	words := strings.Fields(text)
	out := make([]uint32, 0, len(words))
	for _, w := range words {
		if id, ok := wordID(w); ok {
			out = append(out, id)
			continue
		}
		h := fnv.New32a()
		h.Write([]byte(w))
		out = append(out, 3+h.Sum32()%(vocab-3)) // 0..2 are special
	}
	return out
}

func wordID(w string) (uint32, bool) {
	rest, ok := strings.CutPrefix(w, "w")
	if !ok || rest == "" {
		return 0, false
	}
	n, err := strconv.ParseUint(rest, 10, 32)
	if err != nil || n >= vocab || strconv.FormatUint(n, 10) != rest {
		return 0, false
	}
	return uint32(n), true
}

// detokenize is one token's text, with its leading space.
func detokenize(id uint32) string { return " w" + strconv.FormatUint(uint64(id), 10) }

// sample is the model's next token after the sequence so far: a function
// of the last token and the position only (a real model looks at all of
// them through its KV; the engine does not care how the token came).
func sample(last uint32, pos int) uint32 {
	var b [12]byte
	binary.LittleEndian.PutUint32(b[:4], last)
	binary.LittleEndian.PutUint64(b[4:], uint64(pos))
	h := fnv.New32a()
	h.Write(b[:])
	return h.Sum32() % vocab
}

// writeKV stands for the attention layers writing a token's keys and
// values into its slot: token id at its position in the block.
func writeKV(region []byte, slot int, id uint32) {
	binary.LittleEndian.PutUint32(region[4*slot:], id)
}

// kvMatches reports whether a block holds the KV of these tokens: what a
// prefix hit must serve.
func kvMatches(region []byte, tokens []uint32) bool {
	for i, id := range tokens {
		if binary.LittleEndian.Uint32(region[4*i:]) != id {
			return false
		}
	}
	return true
}

package kvlease

import "unsafe"

// Token is a token id type the hash functions accept: int32 (the
// package's own) or uint32 (most Go tokenizers, llm-d). Both are hashed as
// the same 4 little-endian bytes, so a token id hashes the same whichever
// type carries it: uint32 id 3000000000 and int32 id -1294967296 are one
// token: HashBlock over TokensInt32 of a []uint32 hashes the same bits.
type Token interface {
	~int32 | ~uint32
}

// TokensInt32 returns tokens as []int32 without copying: the same memory,
// read as int32 (ids ≥ 2³¹ read as negative numbers, the same 4 bytes).
// Pass the result wherever the package takes []int32 (SealTokens,
// AcquirePrefixTokens, Admit); KV events carry the bits unchanged
// and the events package encodes them as the unsigned ids they are. The
// two slices alias: a write through one is seen through the other.
func TokensInt32[T Token](tokens []T) []int32 {
	if len(tokens) == 0 {
		return nil
	}
	return unsafe.Slice((*int32)(unsafe.Pointer(unsafe.SliceData(tokens))), len(tokens))
}

// TokensUint32 is TokensInt32's inverse: tokens read as []uint32 without
// copying (for an engine whose tokenizer wants uint32 back, such as a
// sequence's tokens handed to a detokenizer).
func TokensUint32[T Token](tokens []T) []uint32 {
	if len(tokens) == 0 {
		return nil
	}
	return unsafe.Slice((*uint32)(unsafe.Pointer(unsafe.SliceData(tokens))), len(tokens))
}

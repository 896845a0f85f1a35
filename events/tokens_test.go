package events

import (
	"errors"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvlease/kvlease"
)

// TestTokenIDsUint32: ids of 2³¹ and more go on the wire as the unsigned
// ids they are and come back with their bits unchanged.
func TestTokenIDsUint32(t *testing.T) {
	ids := []uint32{0, 1, 1<<31 - 1, 1 << 31, 3000000000, 1<<32 - 1}
	for _, enc := range []Encoding{MapEncoding, ArrayEncoding} {
		payload := newBatchEncoder(enc, 0).encode(1, []wireEvent{{
			tag: tagBlockStored, hashes: []uint64{1}, tokens: kvlease.TokensInt32(ids), blockSize: len(ids),
		}})
		var top []any
		if err := msgpack.Unmarshal(payload, &top); err != nil {
			t.Fatal(err)
		}
		b, err := DecodeBatch(payload)
		if err != nil {
			t.Fatal(err)
		}
		got := kvlease.TokensUint32(b.Events[0].TokenIDs)
		for i := range ids {
			if got[i] != ids[i] {
				t.Fatalf("%v: token %d: %d, want %d", enc, i, got[i], ids[i])
			}
		}
		if n := rawTokens(t, top, enc); n[4] != 3000000000 {
			t.Fatalf("%v: on the wire %v", enc, n)
		}
	}
	// An id that is no 32-bit id is refused.
	bad := newBatchEncoder(MapEncoding, 0).encode(1, []wireEvent{{tag: tagBlockStored, hashes: []uint64{1}, tokens: []int32{1}, blockSize: 1}})
	i := len(bad) - 1
	for ; i > 0 && !(bad[i] == 0x01 && bad[i-1] == 0x91); i-- { // the token array [1]
	}
	if i == 0 {
		t.Fatal("token array not found")
	}
	patched := append(append(append([]byte{}, bad[:i]...), 0xcf, 0, 0, 0, 1, 0, 0, 0, 0), bad[i+1:]...)
	if _, err := DecodeBatch(patched); !errors.Is(err, ErrMalformed) {
		t.Fatalf("a 2^32 token id: %v", err)
	}
}

// rawTokens digs the token ids of the first event out of a generic decode,
// as a subscriber in another language reads them.
func rawTokens(t *testing.T, top []any, enc Encoding) []uint64 {
	t.Helper()
	ev := top[1].([]any)[0]
	var toks []any
	if enc == MapEncoding {
		toks = ev.(map[string]any)["token_ids"].([]any)
	} else {
		toks = ev.([]any)[3].([]any)
	}
	out := make([]uint64, len(toks))
	for i, v := range toks {
		switch n := v.(type) {
		case uint64:
			out[i] = n
		case int64:
			out[i] = uint64(n)
		case uint32:
			out[i] = uint64(n)
		case uint8:
			out[i] = uint64(n)
		case uint16:
			out[i] = uint64(n)
		case int8:
			out[i] = uint64(n)
		default:
			t.Fatalf("token %T", v)
		}
	}
	return out
}

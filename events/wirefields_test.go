package events

import (
	"errors"
	"slices"
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

// A lease's adapter tags its blocks' BlockStored (overriding the
// source's) and is never merged into a neighbour of another tag; extra
// keys go out per block, and blocks with them are merged into their
// chain's event like any other (vLLM sends the blocks a request filled
// in one BlockStored, extra_keys holding one entry per block, nil where
// a block has none).
func TestAdapterTagsAndExtraKeys(t *testing.T) {
	toks := func(b int32) []int32 { return []int32{b, b + 1} }
	evs := []kvlease.KVEvent{
		{Seq: 1, Kind: kvlease.KVBlockStored, BlockHash: 1, TokenIDs: toks(0), BlockSize: 2},
		{Seq: 2, Kind: kvlease.KVBlockStored, BlockHash: 2, ParentBlockHash: 1, HasParent: true, TokenIDs: toks(2), BlockSize: 2, LoraID: 1, LoraName: "sql"},
		{Seq: 3, Kind: kvlease.KVBlockStored, BlockHash: 3, ParentBlockHash: 2, HasParent: true, TokenIDs: toks(4), BlockSize: 2, LoraID: 1, LoraName: "sql"},
		{Seq: 4, Kind: kvlease.KVBlockStored, BlockHash: 4, ParentBlockHash: 3, HasParent: true, TokenIDs: toks(6), BlockSize: 2, LoraID: 1, LoraName: "sql", ExtraKeys: []string{"img:9", ""}},
		{Seq: 5, Kind: kvlease.KVBlockStored, BlockHash: 5, ParentBlockHash: 4, HasParent: true, TokenIDs: toks(8), BlockSize: 2, LoraID: 1, LoraName: "sql"},
		{Seq: 6, Kind: kvlease.KVBlockStored, BlockHash: 6, ParentBlockHash: 5, HasParent: true, TokenIDs: toks(10), BlockSize: 2, LoraID: 1, LoraName: "sql"},
		// A new chain whose first two blocks hold an image, then text.
		{Seq: 7, Kind: kvlease.KVBlockStored, BlockHash: 7, TokenIDs: toks(12), BlockSize: 2, ExtraKeys: []string{"img:1"}},
		{Seq: 8, Kind: kvlease.KVBlockStored, BlockHash: 8, ParentBlockHash: 7, HasParent: true, TokenIDs: toks(14), BlockSize: 2, ExtraKeys: []string{"img:1", "salt"}},
		{Seq: 9, Kind: kvlease.KVBlockStored, BlockHash: 9, ParentBlockHash: 8, HasParent: true, TokenIDs: toks(16), BlockSize: 2, ExtraKeys: []string{}},
		// Not its parent's child: a new event.
		{Seq: 10, Kind: kvlease.KVBlockStored, BlockHash: 10, ParentBlockHash: 1, HasParent: true, TokenIDs: toks(18), BlockSize: 2, ExtraKeys: []string{"img:2"}},
	}
	d := &drainer{p: &Publisher{}}
	src := &source{Source: Source{LoraName: "base-tag", LoraID: 7}}
	wire := d.convert(src, evs, nil, true)
	for _, enc := range []Encoding{MapEncoding, ArrayEncoding} {
		b, err := DecodeBatch(newBatchEncoder(enc, 0).encode(1, wire))
		if err != nil {
			t.Fatal(err)
		}
		type got struct {
			hashes []uint64
			lora   string
			id     int
			extra  [][]string
		}
		var out []got
		for _, e := range b.Events {
			g := got{hashes: e.BlockHashes, lora: e.LoraName, extra: e.ExtraKeys}
			if e.LoraID != nil {
				g.id = *e.LoraID
			}
			out = append(out, g)
		}
		want := []got{
			{hashes: []uint64{1}, lora: "base-tag", id: 7},
			{hashes: []uint64{2, 3, 4, 5, 6}, lora: "sql", id: 1, extra: [][]string{nil, nil, {"img:9", ""}, nil, nil}},
			{hashes: []uint64{7, 8, 9}, lora: "base-tag", id: 7, extra: [][]string{{"img:1"}, {"img:1", "salt"}, nil}},
			{hashes: []uint64{10}, lora: "base-tag", id: 7, extra: [][]string{{"img:2"}}},
		}
		if len(out) != len(want) {
			t.Fatalf("%v: %d events %+v", enc, len(out), out)
		}
		for i := range want {
			if !slices.Equal(out[i].hashes, want[i].hashes) || out[i].lora != want[i].lora || out[i].id != want[i].id ||
				!slices.EqualFunc(out[i].extra, want[i].extra, slices.Equal[[]string]) {
				t.Fatalf("%v: event %d: %+v, want %+v", enc, i, out[i], want[i])
			}
		}
	}
	// extra_keys must hold one entry per block.
	bad := wireEvent{tag: tagBlockStored, hashes: []uint64{1, 2}, tokens: []int32{1, 2}, blockSize: 1, extraKeys: [][]string{{"x"}}}
	if _, err := DecodeBatch(newBatchEncoder(MapEncoding, 0).encode(1, []wireEvent{bad})); !errors.Is(err, ErrMalformed) {
		t.Fatalf("extra_keys of the wrong length: %v", err)
	}
}

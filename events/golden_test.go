package events

import (
	"encoding/hex"
	"fmt"
	"testing"

	"github.com/kvlease/kvlease"
)

// goldenEvents is a pool's worth of events with no tenant: chains, an
// adapter, extra keys, a removal and a clear.
func goldenEvents(t *testing.T) []kvlease.KVEvent {
	t.Helper()
	mem, err := kvlease.NewHostMemory(8, 16)
	if err != nil {
		t.Fatal(err)
	}
	p, err := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(2), kvlease.WithKVEvents(64))
	if err != nil {
		t.Fatal(err)
	}
	l, err := p.Acquire("golden", 4)
	if err != nil {
		t.Fatal(err)
	}
	h0, err := l.SealTokens(0, 42, []int32{1, 2})
	if err != nil {
		t.Fatal(err)
	}
	h1, err := l.SealTokens(1, h0, []int32{3, 4}, []string{"img:1"}...)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.SealTokens(2, h1, []int32{5, 6}); err != nil {
		t.Fatal(err)
	}
	l2, err := p.Acquire("golden-lora", 2)
	if err != nil {
		t.Fatal(err)
	}
	if err := l2.SetAdapter(kvlease.Adapter{ID: 3, Name: "sql"}); err != nil {
		t.Fatal(err)
	}
	g0, err := l2.SealTokens(0, 7, []int32{70000, 8})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l2.SealTokens(1, g0, []int32{9, 10}); err != nil {
		t.Fatal(err)
	}
	l.Release()
	l2.Release()
	p.ResetCache(false)
	evs, _ := p.DrainKVEvents(nil)
	return evs
}

// Events without a tenant are byte for byte what they were before
// namespaces existed, in both encodings.
func TestGoldenBytesWithoutTenant(t *testing.T) {
	golden := map[Encoding]string{
		MapEncoding:   "93cb3ff00000000000009389a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657393cf05d566780f6edd68cf873c4eb7acb9c6b9cfeced4bb23c26e2cdb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647396010203040506aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797393c091a5696d673a31c088a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfb50d249ff14b7e89cffe7441b58ee37bf0b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394ce0001117008090aaa626c6f636b5f73697a6502a76c6f72615f696403a66d656469756da3475055a96c6f72615f6e616d65a373716c81a474797065b0416c6c426c6f636b73436c656172656400",
		ArrayEncoding: "93cb3ff00000000000009399ab426c6f636b53746f72656493cf05d566780f6edd68cf873c4eb7acb9c6b9cfeced4bb23c26e2cdc09601020304050602c0a3475055c093c091a5696d673a31c098ab426c6f636b53746f72656492cfb50d249ff14b7e89cffe7441b58ee37bf0c094ce0001117008090a0203a3475055a373716c91b0416c6c426c6f636b73436c656172656400",
	}
	evs := goldenEvents(t)
	for enc, want := range golden {
		d := &drainer{p: &Publisher{}}
		src := &source{Source: Source{Medium: "GPU"}}
		wire := d.convert(src, evs, nil, true)
		got := hex.EncodeToString(newBatchEncoder(enc, 0).encode(1, wire))
		if got != want {
			t.Errorf("%v: %s\nwant %s", enc, got, want)
		}
	}
}

// A tenant's chain goes out with its namespace as the last extra key of
// its first block (after the block's own), and nowhere else.
func TestNamespaceIsFirstBlocksLastExtraKey(t *testing.T) {
	evs := []kvlease.KVEvent{
		{Seq: 1, Kind: kvlease.KVBlockStored, BlockHash: 1, TokenIDs: []int32{1, 2}, BlockSize: 2, Namespace: "ns:a"},
		{Seq: 2, Kind: kvlease.KVBlockStored, BlockHash: 2, ParentBlockHash: 1, HasParent: true, TokenIDs: []int32{3, 4}, BlockSize: 2, Namespace: "ns:a"},
		{Seq: 3, Kind: kvlease.KVBlockStored, BlockHash: 3, TokenIDs: []int32{1, 2}, BlockSize: 2, Namespace: "ns:b", ExtraKeys: []string{"img:1"}},
		{Seq: 4, Kind: kvlease.KVBlockStored, BlockHash: 4, TokenIDs: []int32{1, 2}, BlockSize: 2},
	}
	d := &drainer{p: &Publisher{}}
	wire := d.convert(&source{}, evs, nil, true)
	for _, enc := range []Encoding{MapEncoding, ArrayEncoding} {
		b, err := DecodeBatch(newBatchEncoder(enc, 0).encode(1, wire))
		if err != nil {
			t.Fatal(err)
		}
		if len(b.Events) != 3 {
			t.Fatalf("%v: %d events", enc, len(b.Events))
		}
		want := [][][]string{{{"ns:a"}, nil}, {{"img:1", "ns:b"}}, nil}
		for i, e := range b.Events {
			if fmt.Sprint(e.ExtraKeys) != fmt.Sprint(want[i]) || (want[i] == nil) != (e.ExtraKeys == nil) {
				t.Fatalf("%v: event %d extra keys %q, want %q", enc, i, e.ExtraKeys, want[i])
			}
		}
	}
	if evs[2].ExtraKeys[0] != "img:1" || len(evs[2].ExtraKeys) != 1 {
		t.Fatalf("the pool's extra keys were written: %q", evs[2].ExtraKeys)
	}
}

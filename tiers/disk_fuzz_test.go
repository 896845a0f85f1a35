package tiers

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
)

// FuzzDiskDecode feeds arbitrary slot contents (what a file may hold
// after a crash, corruption or tampering) to the slot decoder, keyed and
// not: it never panics, and what it accepts is a slot this tier wrote
// (re-encoding the decoded slot gives back the same bytes).
func FuzzDiskDecode(f *testing.F) {
	d := &Disk{cfg: DiskConfig{BlockBytes: 64, Fingerprint: 3}, ns: namespaceID("m"), slotBytes: diskAlign}
	buf := make([]byte, d.slotBytes)
	src := make([]byte, 64)
	d.encode(buf, &SlotWrite{Src: src, Hash: 5, Parent: 4, HasParent: true, Tokens: []int32{1, 2, 3}}, nil)
	f.Add(append([]byte{}, buf...), false)
	keyed := &Disk{cfg: d.cfg, ns: d.ns, slotBytes: d.slotBytes}
	keyed.cfg.Key = []byte("0123456789abcdef")
	d.encode(buf, &SlotWrite{Src: src, Hash: 6, Chained: true}, keyed.newMAC())
	f.Add(append([]byte{}, buf...), true)
	d.encode(buf, &SlotWrite{Src: src, Hash: 7, Parent: 6, HasParent: true, Tokens: []int32{4}, Namespace: "ns:0123",
		Adapter: kvlease.Adapter{ID: 2, Name: "sql"}, ExtraKeys: []string{"img:1", ""}}, nil)
	f.Add(append([]byte{}, buf...), false)
	f.Fuzz(func(t *testing.T, data []byte, withKey bool) {
		dd := d
		if withKey {
			dd = keyed
		}
		slot := make([]byte, dd.slotBytes)
		copy(slot, data)
		m, ok := dd.decode(slot, dd.newMAC())
		if !ok {
			return
		}
		again := make([]byte, dd.slotBytes)
		dd.encode(again, &SlotWrite{Src: slot[headerSize : headerSize+dd.cfg.BlockBytes], Hash: m.Hash, Parent: m.Parent,
			HasParent: m.HasParent, Chained: m.Chained, Tokens: m.Tokens,
			Namespace: m.Namespace, Adapter: m.Adapter, ExtraKeys: m.ExtraKeys}, dd.newMAC())
		require.Equal(t, slot[:offSum+sumLen], again[:offSum+sumLen], "an accepted header is one this tier writes")
	})
}

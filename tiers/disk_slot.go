package tiers

// The disk tier's slot format: the header, the tags (namespace, adapter,
// extra keys), encoding and decoding with their checksums, and the
// records a read or write names.

import (
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"hash"
	"math"

	"github.com/cespare/xxhash/v2"

	"github.com/kvlease/kvlease"
)

// Header layout of a slot (little endian), then the block at headerSize,
// then its tags (tagsLen bytes), then the block's tokens (4 bytes each)
// when they fit in the slot:
//
//	0 magic  8 hash  16 parent  24 flags (1 parent known, 2 parent is a block)
//	32 block bytes  40 tokens recorded (4 bytes)  44 checksum kind (4 bytes)
//	48 namespace (16 bytes of its SHA-256)  64 fingerprint
//	72 tags bytes (4 bytes)  76..95 zero
//	96 checksum: xxhash64 in 8 bytes, or an HMAC-SHA256 in 32
//
// The tags are the block's tenant namespace, adapter and extra keys
// (kvlease.SealInfo's), none of them when all are empty (0 bytes), else:
//
//	u16 len, namespace; i64 lora id; u16 len, lora name;
//	u16 count, then per extra key u16 len, key
//
// The checksum covers the whole slot but itself.
const (
	offTokens = 40
	offKind   = 44
	offNS     = 48
	offFP     = 64
	offTags   = 72
	offSum    = 96
	sumLen    = 32
)

// tagsLen is how many bytes w's tags take in its slot (0: none), ok false
// when a length does not fit its field.
func tagsLen(w *SlotWrite) (n int, ok bool) {
	if w.Namespace == "" && w.Adapter == (kvlease.Adapter{}) && len(w.ExtraKeys) == 0 {
		return 0, true
	}
	ok = len(w.Namespace) <= math.MaxUint16 && len(w.Adapter.Name) <= math.MaxUint16 && len(w.ExtraKeys) <= math.MaxUint16
	n = 2 + len(w.Namespace) + 8 + 2 + len(w.Adapter.Name) + 2
	for _, k := range w.ExtraKeys {
		ok = ok && len(k) <= math.MaxUint16
		n += 2 + len(k)
	}
	return n, ok
}

// appendTags appends w's tags (tagsLen's bytes) to dst.
func appendTags(dst []byte, w *SlotWrite) []byte {
	str := func(dst []byte, s string) []byte {
		return append(binary.LittleEndian.AppendUint16(dst, uint16(len(s))), s...)
	}
	dst = str(dst, w.Namespace)
	dst = binary.LittleEndian.AppendUint64(dst, uint64(int64(w.Adapter.ID)))
	dst = str(dst, w.Adapter.Name)
	dst = binary.LittleEndian.AppendUint16(dst, uint16(len(w.ExtraKeys)))
	for _, k := range w.ExtraKeys {
		dst = str(dst, k)
	}
	return dst
}

// parseTags reads the tags b holds (all of b) into m; ok is false for
// anything appendTags does not write, or an adapter kvlease refuses.
func parseTags(b []byte, m *SlotMeta) (ok bool) {
	if len(b) == 0 {
		return true
	}
	str := func() (string, bool) {
		if len(b) < 2 {
			return "", false
		}
		n := int(binary.LittleEndian.Uint16(b))
		if len(b) < 2+n {
			return "", false
		}
		s := string(b[2 : 2+n])
		b = b[2+n:]
		return s, true
	}
	if m.Namespace, ok = str(); !ok || len(b) < 8 {
		return false
	}
	id := int64(binary.LittleEndian.Uint64(b))
	b = b[8:]
	if id != int64(int(id)) {
		return false
	}
	m.Adapter.ID = int(id)
	if m.Adapter.Name, ok = str(); !ok || len(b) < 2 {
		return false
	}
	n := int(binary.LittleEndian.Uint16(b))
	b = b[2:]
	if n > 0 {
		m.ExtraKeys = make([]string, 0, min(n, len(b)/2))
	}
	for range n {
		k, ok := str()
		if !ok {
			return false
		}
		m.ExtraKeys = append(m.ExtraKeys, k)
	}
	return len(b) == 0 && (m.Adapter.Name != "" || m.Adapter.ID == 0) &&
		(m.Namespace != "" || m.Adapter != (kvlease.Adapter{}) || len(m.ExtraKeys) > 0)
}

// namespaceID is what a slot records of its namespace.
func namespaceID(ns string) (id [16]byte) {
	sum := sha256.Sum256([]byte("kvlease/tiers disk namespace\x00" + ns))
	copy(id[:], sum[:])
	return id
}

// newMAC returns an HMAC-SHA256 under the key, or nil without one; each
// worker and the scan have their own.
func (d *Disk) newMAC() hash.Hash {
	if len(d.cfg.Key) == 0 {
		return nil
	}
	return hmac.New(sha256.New, d.cfg.Key)
}

// encode fills buf (one slot) with the header, the block and its tokens.
func (d *Disk) encode(buf []byte, w *SlotWrite, mac hash.Hash) {
	clear(buf[:headerSize])
	binary.LittleEndian.PutUint64(buf[0:], slotMagic)
	binary.LittleEndian.PutUint64(buf[8:], uint64(w.Hash))
	binary.LittleEndian.PutUint64(buf[16:], uint64(w.Parent))
	var flags uint64
	if w.HasParent {
		flags |= 1
	}
	if w.Chained {
		flags |= 2
	}
	binary.LittleEndian.PutUint64(buf[24:], flags)
	binary.LittleEndian.PutUint64(buf[32:], uint64(d.cfg.BlockBytes))
	kind := uint32(sumXXHash)
	if mac != nil {
		kind = sumHMAC
	}
	binary.LittleEndian.PutUint32(buf[offKind:], kind)
	copy(buf[offNS:], d.ns[:])
	binary.LittleEndian.PutUint64(buf[offFP:], d.cfg.Fingerprint)
	body := headerSize + d.cfg.BlockBytes
	n := copy(buf[headerSize:body], w.Src)
	clear(buf[headerSize+n:])
	if tl, _ := tagsLen(w); tl > 0 && body+tl <= len(buf) { // (Write checked it fits)
		binary.LittleEndian.PutUint32(buf[offTags:], uint32(tl))
		appendTags(buf[body:body], w)
		body += tl
	}
	if len(w.Tokens) > 0 && body+4*len(w.Tokens) <= len(buf) {
		binary.LittleEndian.PutUint32(buf[offTokens:], uint32(len(w.Tokens)))
		for i, t := range w.Tokens {
			binary.LittleEndian.PutUint32(buf[body+4*i:], uint32(t))
		}
	}
	d.sum(buf[offSum:offSum:offSum+sumLen], buf, mac)
}

// sum appends the slot's checksum (or MAC) to dst: it covers the header
// but the checksum itself, the block, the tokens and the zero padding.
func (d *Disk) sum(dst, buf []byte, mac hash.Hash) []byte {
	if mac != nil {
		mac.Reset()
		_, _ = mac.Write(buf[:offSum])
		_, _ = mac.Write(buf[offSum+sumLen:])
		return mac.Sum(dst)
	}
	var x xxhash.Digest
	x.Reset()
	_, _ = x.Write(buf[:offSum])
	_, _ = x.Write(buf[offSum+sumLen:])
	return binary.LittleEndian.AppendUint64(dst, x.Sum64())
}

// decode checks a slot read into buf; ok is false for anything but a
// whole, valid slot of this tier's namespace, fingerprint and key.
func (d *Disk) decode(buf []byte, mac hash.Hash) (m SlotMeta, ok bool) {
	body := headerSize + d.cfg.BlockBytes
	nt := uint64(binary.LittleEndian.Uint32(buf[offTokens:]))
	tl := uint64(binary.LittleEndian.Uint32(buf[offTags:]))
	kind := uint32(sumXXHash)
	if mac != nil {
		kind = sumHMAC
	}
	if binary.LittleEndian.Uint64(buf[0:]) != slotMagic ||
		binary.LittleEndian.Uint64(buf[32:]) != uint64(d.cfg.BlockBytes) ||
		uint64(body)+tl+4*nt > uint64(len(buf)) ||
		binary.LittleEndian.Uint32(buf[offKind:]) != kind ||
		[16]byte(buf[offNS:offNS+16]) != d.ns ||
		binary.LittleEndian.Uint64(buf[offFP:]) != d.cfg.Fingerprint {
		return SlotMeta{}, false
	}
	var want [sumLen]byte
	d.sum(want[:0], buf, mac)
	if subtle.ConstantTimeCompare(want[:], buf[offSum:offSum+sumLen]) != 1 {
		return SlotMeta{}, false
	}
	flags := binary.LittleEndian.Uint64(buf[24:])
	m = SlotMeta{
		Hash:      kvlease.BlockHash(binary.LittleEndian.Uint64(buf[8:])),
		Parent:    kvlease.BlockHash(binary.LittleEndian.Uint64(buf[16:])),
		HasParent: flags&1 != 0,
		Chained:   flags&2 != 0,
	}
	if !parseTags(buf[body:body+int(tl)], &m) {
		return SlotMeta{}, false
	}
	body += int(tl)
	if nt > 0 {
		m.Tokens = make([]int32, nt)
		for i := range m.Tokens {
			m.Tokens[i] = int32(binary.LittleEndian.Uint32(buf[body+4*i:]))
		}
	}
	return m, true
}

// SlotMeta is what a slot's header records about its block: its hash, its
// parent (HasParent: the parent is known; Chained: the parent is a block,
// not the namespace seed of a chain's first block), its tags (the tenant
// namespace, adapter and extra keys it was sealed with: see
// kvlease.SealInfo) and, when they fit in the slot, its tokens.
type SlotMeta struct {
	Hash      kvlease.BlockHash
	Parent    kvlease.BlockHash
	HasParent bool
	Chained   bool
	Tokens    []int32
	Namespace string
	Adapter   kvlease.Adapter
	ExtraKeys []string
}

// sealInfo is m as the seal record it mirrors: a block rebuilt from its
// slot is sealed as its header says.
func (m SlotMeta) sealInfo() kvlease.SealInfo {
	return kvlease.SealInfo{Hash: m.Hash, Parent: m.Parent, HasParent: m.HasParent, Chained: m.Chained, Tokens: m.Tokens,
		Namespace: m.Namespace, Adapter: m.Adapter, ExtraKeys: m.ExtraKeys}
}

// SlotWrite is one block written to a disk slot: the block, and what the
// slot's header records about it. Its tags (Namespace, Adapter,
// ExtraKeys) always: Write refuses a block whose tags do not fit in the
// slot after the block (every slot keeps 512 bytes for them, and what
// its last page has left). Tokens only when they fit after the tags (a
// block of whole 4 KiB pages has room for about 870).
type SlotWrite struct {
	Src       []byte
	Dst       DiskSlot
	Hash      kvlease.BlockHash
	Parent    kvlease.BlockHash
	HasParent bool
	Chained   bool
	Tokens    []int32
	Namespace string
	Adapter   kvlease.Adapter
	ExtraKeys []string
}

// SlotRead is one block read from a disk slot that must hold Hash.
type SlotRead struct {
	Src  DiskSlot
	Dst  []byte
	Hash kvlease.BlockHash
}

package audit

import (
	"encoding/binary"

	"github.com/cespare/xxhash/v2"

	"github.com/kvlease/kvlease"
)

// TierStamp fills b with the content of the prefix block whose hash is h:
// the marker of tiered KV, whose content is a function of its prefix.
func TierStamp(b []byte, h kvlease.BlockHash) {
	var x [16]byte
	binary.LittleEndian.PutUint64(x[:], uint64(h))
	for off := 0; off+8 <= len(b); off += 8 {
		binary.LittleEndian.PutUint64(x[8:], uint64(off))
		binary.LittleEndian.PutUint64(b[off:], xxhash.Sum64(x[:]))
	}
}

// junkByte fills what failed and quarantined copies leave behind.
const junkByte = 0xDB

func junk(b []byte) {
	for i := range b {
		b[i] = junkByte
	}
}

// classify compares a block with the content of h: 0 when it holds it,
// 2 for content no completed copy wrote (a failed or quarantined copy's
// junk, or a fresh block's zeros), 1 for any other content (another
// block's).
func classify(b []byte, h kvlease.BlockHash, want []byte) int {
	TierStamp(want, h)
	if string(b) == string(want) {
		return 0
	}
	for off := 0; off+8 <= len(b); off += 8 {
		if w := binary.LittleEndian.Uint64(b[off:]); w == 0 || w == 0xDBDBDBDBDBDBDBDB {
			return 2
		}
	}
	return 1
}

// check compares block b, served as holding h, and records a violation.
func (r *tiersRun[D]) check(b []byte, h kvlease.BlockHash, where string) {
	r.rep.Checked++
	switch classify(b, h, r.want) {
	case 1:
		r.violate(&r.rep.Mismatches, "%s: holds another block's content (want %016x)", where, uint64(h))
	case 2:
		r.violate(&r.rep.UnknownReads, "%s: holds content no completed copy wrote (want %016x)", where, uint64(h))
	}
}

package events

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
)

// Encoding selects how events are laid out inside a batch.
type Encoding uint8

const (
	// MapEncoding writes each event as a msgpack map with a "type" key
	// naming it and one key per field (current vLLM, llm-d ≥ v0.9).
	MapEncoding Encoding = iota
	// ArrayEncoding writes each event as a tagged array: the type name
	// first, then the fields in declaration order (msgspec array_like
	// tagged structs: older vLLM, llm-d ≤ v0.8).
	ArrayEncoding
)

func (e Encoding) String() string {
	switch e {
	case MapEncoding:
		return "map"
	case ArrayEncoding:
		return "array"
	}
	return fmt.Sprintf("Encoding(%d)", uint8(e))
}

// The vLLM event type names.
const (
	tagBlockStored      = "BlockStored"
	tagBlockRemoved     = "BlockRemoved"
	tagAllBlocksCleared = "AllBlocksCleared"
)

// wireEvent is one vLLM event before encoding. Hashes are full 64-bit
// unsigned integers on the wire.
type wireEvent struct {
	tag       string
	hashes    []uint64
	parent    uint64
	hasParent bool
	tokens    []int32
	blockSize int
	medium    string
	loraID    int
	loraName  string     // empty: lora_id and lora_name are nil
	extraKeys [][]string // per block: its extra keys or nil; nil: no extra_keys field
}

// batchEncoder encodes batches into a reused buffer. It writes msgpack
// directly, in the forms msgpack/v5's Encoder picks (the shortest for
// lengths and integers, except hashes: always the 9-byte uint64 form;
// float64 timestamps), without reflection or an io.Writer per value.
type batchEncoder struct {
	enc    Encoding
	dpRank int
	buf    []byte
}

func newBatchEncoder(enc Encoding, dpRank int) *batchEncoder {
	return &batchEncoder{enc: enc, dpRank: dpRank}
}

// encode returns a fresh payload: [ts, [events...], data_parallel_rank].
func (b *batchEncoder) encode(ts float64, evs []wireEvent) []byte {
	buf := appendArrayLen(b.buf[:0], 3)
	buf = appendFloat64(buf, ts)
	buf = appendArrayLen(buf, len(evs))
	for i := range evs {
		buf = b.event(buf, &evs[i])
	}
	buf = appendInt(buf, int64(b.dpRank))
	b.buf = buf
	return bytes.Clone(buf)
}

func (b *batchEncoder) event(buf []byte, ev *wireEvent) []byte {
	m := b.enc == MapEncoding
	key := func(buf []byte, k string) []byte {
		if m {
			return appendString(buf, k)
		}
		return buf
	}
	fields := 0
	switch ev.tag {
	case tagBlockStored:
		fields = 7 // block_hashes parent_block_hash token_ids block_size lora_id medium lora_name
		if ev.extraKeys != nil {
			fields++ // extra_keys, sent only when a block has some
		}
	case tagBlockRemoved:
		fields = 2 // block_hashes medium
	}
	if m {
		buf = appendMapLen(buf, fields+1)
		buf = appendString(buf, "type")
	} else {
		buf = appendArrayLen(buf, fields+1)
	}
	buf = appendString(buf, ev.tag)
	if fields == 0 {
		return buf
	}
	buf = key(buf, "block_hashes")
	buf = appendArrayLen(buf, len(ev.hashes))
	for _, h := range ev.hashes {
		buf = appendUint64Full(buf, h) // always the full 8-byte form
	}
	if ev.tag == tagBlockStored {
		buf = key(buf, "parent_block_hash")
		if ev.hasParent {
			buf = appendUint64Full(buf, ev.parent)
		} else {
			buf = append(buf, mpNil)
		}
		buf = key(buf, "token_ids")
		buf = appendArrayLen(buf, len(ev.tokens))
		for _, t := range ev.tokens {
			// Token ids are unsigned (vLLM's are non-negative; Go
			// tokenizers and llm-d use uint32): the 4 bytes kvlease
			// carries go on the wire as the uint32 they are.
			buf = appendInt(buf, int64(uint32(t)))
		}
		buf = key(buf, "block_size")
		buf = appendInt(buf, int64(ev.blockSize))
		buf = key(buf, "lora_id")
		if ev.loraName != "" {
			buf = appendInt(buf, int64(ev.loraID))
		} else {
			buf = append(buf, mpNil)
		}
	}
	buf = key(buf, "medium")
	if ev.medium != "" {
		buf = appendString(buf, ev.medium)
	} else {
		buf = append(buf, mpNil)
	}
	if ev.tag == tagBlockStored {
		buf = key(buf, "lora_name")
		if ev.loraName != "" {
			buf = appendString(buf, ev.loraName)
		} else {
			buf = append(buf, mpNil)
		}
		if ev.extraKeys != nil {
			buf = key(buf, "extra_keys")
			buf = appendArrayLen(buf, len(ev.extraKeys))
			for _, keys := range ev.extraKeys {
				if keys == nil {
					buf = append(buf, mpNil)
					continue
				}
				buf = appendArrayLen(buf, len(keys))
				for _, k := range keys {
					buf = appendString(buf, k)
				}
			}
		}
	}
	return buf
}

// msgpack codes.
const (
	mpNil     = 0xc0
	mpFloat64 = 0xcb
	mpUint8   = 0xcc
	mpUint16  = 0xcd
	mpUint32  = 0xce
	mpUint64  = 0xcf
	mpInt8    = 0xd0
	mpInt16   = 0xd1
	mpInt32   = 0xd2
	mpInt64   = 0xd3
	mpStr8    = 0xd9
	mpStr16   = 0xda
	mpStr32   = 0xdb
	mpArray16 = 0xdc
	mpArray32 = 0xdd
	mpMap16   = 0xde
	mpMap32   = 0xdf
)

func appendLen(buf []byte, n int, fix, fixMax, c16, c32 byte) []byte {
	switch {
	case n <= int(fixMax):
		return append(buf, fix|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(buf, c16), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(buf, c32), uint32(n))
}

func appendArrayLen(buf []byte, n int) []byte {
	return appendLen(buf, n, 0x90, 15, mpArray16, mpArray32)
}
func appendMapLen(buf []byte, n int) []byte { return appendLen(buf, n, 0x80, 15, mpMap16, mpMap32) }

func appendString(buf []byte, s string) []byte {
	switch n := len(s); {
	case n < 32:
		buf = append(buf, 0xa0|byte(n))
	case n < 256:
		buf = append(buf, mpStr8, byte(n))
	case n <= math.MaxUint16:
		buf = binary.BigEndian.AppendUint16(append(buf, mpStr16), uint16(n))
	default:
		buf = binary.BigEndian.AppendUint32(append(buf, mpStr32), uint32(n))
	}
	return append(buf, s...)
}

func appendFloat64(buf []byte, f float64) []byte {
	return binary.BigEndian.AppendUint64(append(buf, mpFloat64), math.Float64bits(f))
}

func appendUint64Full(buf []byte, v uint64) []byte {
	return binary.BigEndian.AppendUint64(append(buf, mpUint64), v)
}

// appendInt writes n in the shortest form, as msgpack/v5's EncodeInt.
func appendInt(buf []byte, n int64) []byte {
	if n >= 0 {
		u := uint64(n)
		switch {
		case u <= math.MaxInt8:
			return append(buf, byte(u))
		case u <= math.MaxUint8:
			return append(buf, mpUint8, byte(u))
		case u <= math.MaxUint16:
			return binary.BigEndian.AppendUint16(append(buf, mpUint16), uint16(u))
		case u <= math.MaxUint32:
			return binary.BigEndian.AppendUint32(append(buf, mpUint32), uint32(u))
		}
		return appendUint64Full(buf, u)
	}
	switch {
	case n >= -32:
		return append(buf, byte(n))
	case n >= math.MinInt8:
		return append(buf, mpInt8, byte(n))
	case n >= math.MinInt16:
		return binary.BigEndian.AppendUint16(append(buf, mpInt16), uint16(n))
	case n >= math.MinInt32:
		return binary.BigEndian.AppendUint32(append(buf, mpInt32), uint32(n))
	}
	return binary.BigEndian.AppendUint64(append(buf, mpInt64), uint64(n))
}

package events

import (
	"bytes"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
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
	loraName  string // empty: lora_id and lora_name are nil
}

// batchEncoder encodes batches into a reused buffer.
type batchEncoder struct {
	enc      Encoding
	dpRank   int
	buf      bytes.Buffer
	e        *msgpack.Encoder
	wroteErr error
}

func newBatchEncoder(enc Encoding, dpRank int) *batchEncoder {
	b := &batchEncoder{enc: enc, dpRank: dpRank}
	b.e = msgpack.NewEncoder(&b.buf)
	return b
}

// encode returns a fresh payload: [ts, [events...], data_parallel_rank].
func (b *batchEncoder) encode(ts float64, evs []wireEvent) []byte {
	b.buf.Reset()
	e := b.e
	b.wroteErr = nil
	b.w(e.EncodeArrayLen(3))
	b.w(e.EncodeFloat64(ts))
	b.w(e.EncodeArrayLen(len(evs)))
	for i := range evs {
		b.event(&evs[i])
	}
	b.w(e.EncodeInt(int64(b.dpRank)))
	if b.wroteErr != nil {
		// Writing to a bytes.Buffer cannot fail; an error here is a bug.
		panic(fmt.Sprintf("events: encode batch: %v", b.wroteErr))
	}
	return bytes.Clone(b.buf.Bytes())
}

func (b *batchEncoder) w(err error) {
	if err != nil && b.wroteErr == nil {
		b.wroteErr = err
	}
}

func (b *batchEncoder) event(ev *wireEvent) {
	e := b.e
	m := b.enc == MapEncoding
	key := func(k string) {
		if m {
			b.w(e.EncodeString(k))
		}
	}
	fields := 0
	switch ev.tag {
	case tagBlockStored:
		fields = 7 // block_hashes parent_block_hash token_ids block_size lora_id medium lora_name
	case tagBlockRemoved:
		fields = 2 // block_hashes medium
	}
	if m {
		b.w(e.EncodeMapLen(fields + 1))
		b.w(e.EncodeString("type"))
	} else {
		b.w(e.EncodeArrayLen(fields + 1))
	}
	b.w(e.EncodeString(ev.tag))
	if fields == 0 {
		return
	}
	key("block_hashes")
	b.w(e.EncodeArrayLen(len(ev.hashes)))
	for _, h := range ev.hashes {
		b.w(e.EncodeUint64(h)) // always the full 8-byte form
	}
	if ev.tag == tagBlockStored {
		key("parent_block_hash")
		if ev.hasParent {
			b.w(e.EncodeUint64(ev.parent))
		} else {
			b.w(e.EncodeNil())
		}
		key("token_ids")
		b.w(e.EncodeArrayLen(len(ev.tokens)))
		for _, t := range ev.tokens {
			b.w(e.EncodeInt(int64(t)))
		}
		key("block_size")
		b.w(e.EncodeInt(int64(ev.blockSize)))
		key("lora_id")
		if ev.loraName != "" {
			b.w(e.EncodeInt(int64(ev.loraID)))
		} else {
			b.w(e.EncodeNil())
		}
	}
	key("medium")
	if ev.medium != "" {
		b.w(e.EncodeString(ev.medium))
	} else {
		b.w(e.EncodeNil())
	}
	if ev.tag == tagBlockStored {
		key("lora_name")
		if ev.loraName != "" {
			b.w(e.EncodeString(ev.loraName))
		} else {
			b.w(e.EncodeNil())
		}
	}
}

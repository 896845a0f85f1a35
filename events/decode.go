package events

import (
	"errors"
	"fmt"
	"math"

	"github.com/vmihailenco/msgpack/v5"
)

// ErrMalformed is wrapped by DecodeBatch's errors for a payload that is not
// a vLLM event batch.
var ErrMalformed = errors.New("events: malformed batch")

// MaxPayload bounds the payload DecodeBatch accepts.
const MaxPayload = 64 << 20

// Event is one decoded vLLM KV event.
type Event struct {
	Type            string // "BlockStored", "BlockRemoved" or "AllBlocksCleared"
	BlockHashes     []uint64
	ParentBlockHash *uint64 // nil for the first block of a chain
	TokenIDs        []int32
	BlockSize       int
	LoraID          *int
	Medium          string
	LoraName        string
	ExtraKeys       [][]string // per block: its extra keys, or nil; nil when the event has none
}

// Batch is one decoded payload.
type Batch struct {
	TS               float64
	Events           []Event
	DataParallelRank *int
}

// DecodeBatch decodes a payload in either encoding (maps with a "type"
// key, or tagged arrays), as a subscriber would. Unknown event types and
// malformed fields are errors wrapping ErrMalformed.
func DecodeBatch(payload []byte) (Batch, error) {
	var b Batch
	if len(payload) > MaxPayload {
		return b, fmt.Errorf("events: payload of %d bytes: %w", len(payload), ErrMalformed)
	}
	if err := checkShape(payload); err != nil {
		return b, err
	}
	var top any
	if err := msgpack.Unmarshal(payload, &top); err != nil {
		return b, fmt.Errorf("events: %v: %w", err, ErrMalformed)
	}
	arr, ok := top.([]any)
	if !ok || len(arr) < 2 || len(arr) > 3 {
		return b, fmt.Errorf("events: batch is not [ts, events, rank]: %w", ErrMalformed)
	}
	switch ts := arr[0].(type) {
	case float64:
		b.TS = ts
	case float32:
		b.TS = float64(ts)
	default:
		return b, fmt.Errorf("events: ts is %T: %w", arr[0], ErrMalformed)
	}
	evs, ok := arr[1].([]any)
	if !ok {
		return b, fmt.Errorf("events: events is %T: %w", arr[1], ErrMalformed)
	}
	if len(arr) == 3 && arr[2] != nil {
		r, err := toInt(arr[2])
		if err != nil {
			return b, fmt.Errorf("events: data_parallel_rank: %w", err)
		}
		b.DataParallelRank = &r
	}
	b.Events = make([]Event, 0, len(evs))
	for i, raw := range evs {
		e, err := decodeEvent(raw)
		if err != nil {
			return b, fmt.Errorf("events: event %d: %w", i, err)
		}
		b.Events = append(b.Events, e)
	}
	return b, nil
}

var (
	storedFields  = []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys"}
	removedFields = []string{"block_hashes", "medium"}
)

func decodeEvent(raw any) (Event, error) {
	var e Event
	var fields []any // positional, tag first
	switch v := raw.(type) {
	case []any:
		fields = v
	case map[string]any:
		tag, ok := v["type"].(string)
		if !ok {
			return e, fmt.Errorf("map event without a string \"type\": %w", ErrMalformed)
		}
		fields = []any{tag}
		var names []string
		switch tag {
		case tagBlockStored:
			names = storedFields
		case tagBlockRemoved:
			names = removedFields
		}
		for _, n := range names {
			fields = append(fields, v[n])
		}
	default:
		return e, fmt.Errorf("event is %T: %w", raw, ErrMalformed)
	}
	if len(fields) == 0 {
		return e, fmt.Errorf("event without a type: %w", ErrMalformed)
	}
	tag, ok := fields[0].(string)
	if !ok {
		return e, fmt.Errorf("event type is %T: %w", fields[0], ErrMalformed)
	}
	e.Type = tag
	at := func(i int) any {
		if i < len(fields) {
			return fields[i]
		}
		return nil
	}
	var err error
	switch tag {
	case tagAllBlocksCleared:
		return e, nil
	case tagBlockStored:
		if len(fields) < 5 {
			return e, fmt.Errorf("BlockStored with %d fields: %w", len(fields), ErrMalformed)
		}
		if e.BlockHashes, err = toHashes(fields[1]); err != nil {
			return e, err
		}
		if fields[2] != nil {
			h, err := toHash(fields[2])
			if err != nil {
				return e, err
			}
			e.ParentBlockHash = &h
		}
		toks, ok := fields[3].([]any)
		if !ok {
			return e, fmt.Errorf("token_ids is %T: %w", fields[3], ErrMalformed)
		}
		e.TokenIDs = make([]int32, len(toks))
		for i, t := range toks {
			n, err := toInt(t)
			if err != nil {
				return e, err
			}
			if n < math.MinInt32 || n > math.MaxUint32 {
				return e, fmt.Errorf("token id %d is not a 32-bit id: %w", n, ErrMalformed)
			}
			e.TokenIDs[i] = int32(n) // ids ≥ 2³¹ keep their bits (kvlease.TokensUint32 reads them back)
		}
		if e.BlockSize, err = toInt(fields[4]); err != nil {
			return e, err
		}
		if raw := at(5); raw != nil {
			id, err := toInt(raw)
			if err != nil {
				return e, err
			}
			e.LoraID = &id
		}
		if e.Medium, err = toStr(at(6)); err != nil {
			return e, err
		}
		if e.LoraName, err = toStr(at(7)); err != nil {
			return e, err
		}
		if raw := at(8); raw != nil {
			if e.ExtraKeys, err = toExtraKeys(raw, len(e.BlockHashes)); err != nil {
				return e, err
			}
		}
	case tagBlockRemoved:
		if len(fields) < 2 {
			return e, fmt.Errorf("BlockRemoved with %d fields: %w", len(fields), ErrMalformed)
		}
		if e.BlockHashes, err = toHashes(fields[1]); err != nil {
			return e, err
		}
		if e.Medium, err = toStr(at(2)); err != nil {
			return e, err
		}
	default:
		return e, fmt.Errorf("unknown event type %q: %w", tag, ErrMalformed)
	}
	return e, nil
}

// toExtraKeys reads extra_keys: one entry per block, each nil or an
// array of strings.
func toExtraKeys(raw any, blocks int) ([][]string, error) {
	arr, ok := raw.([]any)
	if !ok || len(arr) != blocks {
		return nil, fmt.Errorf("extra_keys is not one entry per block: %w", ErrMalformed)
	}
	out := make([][]string, len(arr))
	for i, v := range arr {
		if v == nil {
			continue
		}
		keys, ok := v.([]any)
		if !ok {
			return nil, fmt.Errorf("extra_keys[%d] is %T: %w", i, v, ErrMalformed)
		}
		out[i] = make([]string, len(keys))
		for j, k := range keys {
			if out[i][j], ok = k.(string); !ok {
				return nil, fmt.Errorf("extra_keys[%d][%d] is %T: %w", i, j, k, ErrMalformed)
			}
		}
	}
	return out, nil
}

func toHashes(raw any) ([]uint64, error) {
	arr, ok := raw.([]any)
	if !ok {
		return nil, fmt.Errorf("block_hashes is %T: %w", raw, ErrMalformed)
	}
	out := make([]uint64, len(arr))
	for i, h := range arr {
		v, err := toHash(h)
		if err != nil {
			return nil, err
		}
		out[i] = v
	}
	return out, nil
}

func toHash(raw any) (uint64, error) {
	switch v := raw.(type) {
	case uint64:
		return v, nil
	case int64:
		return uint64(v), nil
	case uint8, uint16, uint32, int8, int16, int32:
		n, _ := toInt(v)
		return uint64(n), nil
	}
	return 0, fmt.Errorf("hash is %T: %w", raw, ErrMalformed)
}

func toInt(raw any) (int, error) {
	switch v := raw.(type) {
	case int64:
		return int(v), nil
	case uint64:
		if v > 1<<62 {
			return 0, fmt.Errorf("integer %d out of range: %w", v, ErrMalformed)
		}
		return int(v), nil
	case int8:
		return int(v), nil
	case int16:
		return int(v), nil
	case int32:
		return int(v), nil
	case uint8:
		return int(v), nil
	case uint16:
		return int(v), nil
	case uint32:
		return int(v), nil
	}
	return 0, fmt.Errorf("number is %T: %w", raw, ErrMalformed)
}

func toStr(raw any) (string, error) {
	if raw == nil {
		return "", nil
	}
	s, ok := raw.(string)
	if !ok {
		return "", fmt.Errorf("string field is %T: %w", raw, ErrMalformed)
	}
	return s, nil
}

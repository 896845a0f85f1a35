package events

import (
	"errors"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// TestDecodeRefusesOversizedDeclarations: headers that declare more
// elements or bytes than the payload holds are refused before msgpack
// allocates for them (the fuzzer's 18-byte array of 2³²−1 elements took
// the process's memory).
func TestDecodeRefusesOversizedDeclarations(t *testing.T) {
	cases := map[string][]byte{
		"array32 of 2^32-1":      {0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0},
		"map32 of 2^31":          {0xdf, 0x80, 0, 0, 0, 0xc0, 0xc0},
		"array16 past the end":   {0xdc, 0x00, 0x10, 0xc0, 0xc0},
		"fixarray past the end":  {0x93, 0xc0},
		"nested pending":         {0x92, 0x9f, 0xc0},
		"str32 of 2^32-1":        {0xdb, 0xff, 0xff, 0xff, 0xff, 'a'},
		"bin16 past the end":     {0xc5, 0x01, 0x00, 0x01},
		"ext32 past the end":     {0xc9, 0x00, 0x00, 0x00, 0x08, 0x01, 0x02},
		"truncated float64":      {0xcb, 0x01, 0x02},
		"truncated length":       {0xdd, 0x00},
		"reserved header 0xc1":   {0xc1},
		"the fuzzer's input":     []byte("\x93\x93\x17\xa0\xddnmf\x8f\xe8\x10\xa1ui\x96\xe0\xa5N`R\xca000000"),
		"empty":                  {},
		"fixext16 past the end":  {0xd8, 0x01, 0x02},
		"fixstr past the end":    {0xa5, 'a', 'b'},
		"map16 with odd content": {0xde, 0x00, 0x02, 0xc0, 0xc0, 0xc0},
	}
	for name, p := range cases {
		t.Run(name, func(t *testing.T) {
			if _, err := DecodeBatch(p); !errors.Is(err, ErrMalformed) {
				t.Fatalf("DecodeBatch(% x) = %v, want ErrMalformed", p, err)
			}
		})
	}
}

// TestCheckShapeAcceptsWhatMsgpackEncodes: every value the encoder
// library writes passes the shape check.
func TestCheckShapeAcceptsWhatMsgpackEncodes(t *testing.T) {
	values := []any{
		nil, true, 1, -1, -33, 200, 70000, int64(1) << 40, uint64(1) << 63, 1.5, float32(2.5),
		"", "abc", string(make([]byte, 300)), string(make([]byte, 70000)), make([]byte, 3), make([]byte, 300),
		[]any{}, []any{1, "a", []any{nil}}, make([]any, 20), make([]any, 70000),
		map[string]any{"type": "BlockStored", "block_hashes": []uint64{1, 2}}, make(map[string]int, 0),
		[]any{1.0, []any{map[string]any{"type": "AllBlocksCleared"}}, 0},
	}
	for i, v := range values {
		p, err := msgpack.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		if err := checkShape(p); err != nil {
			t.Errorf("value %d (%T): %v", i, v, err)
		}
	}
	big := make(map[string]int, 20)
	for i := range 20 {
		big[string(rune('a'+i))] = i
	}
	p, _ := msgpack.Marshal(big)
	if err := checkShape(p); err != nil {
		t.Errorf("map16: %v", err)
	}
}

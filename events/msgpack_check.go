package events

import (
	"encoding/binary"
	"fmt"
)

// checkShape walks a msgpack value's headers without decoding it and
// refuses one whose containers declare more elements, or whose strings,
// binaries and extensions declare more bytes, than the payload has left.
// msgpack.Unmarshal trusts those declared lengths and allocates for them
// before reading a single element, so an 18-byte payload declaring an
// array of 2³² elements would take the subscriber's memory; after this
// check every allocation is bounded by the payload's own size.
func checkShape(p []byte) error {
	pending := 1 // values still to read; each needs at least one byte
	pos := 0
	need := func(n uint64) error {
		if n > uint64(len(p)-pos) {
			return fmt.Errorf("events: msgpack value at byte %d declares %d bytes, %d left: %w", pos, n, len(p)-pos, ErrMalformed)
		}
		return nil
	}
	length := func(width int) (uint64, error) {
		if err := need(uint64(width)); err != nil {
			return 0, err
		}
		var n uint64
		switch width {
		case 1:
			n = uint64(p[pos])
		case 2:
			n = uint64(binary.BigEndian.Uint16(p[pos:]))
		case 4:
			n = uint64(binary.BigEndian.Uint32(p[pos:]))
		}
		pos += width
		return n, nil
	}
	skip := func(n uint64) error {
		if err := need(n); err != nil {
			return err
		}
		pos += int(n)
		return nil
	}
	elems := func(n uint64) error {
		// The new elements and the ones already pending each need a byte.
		if n+uint64(pending) > uint64(len(p)-pos) {
			return fmt.Errorf("events: msgpack container at byte %d declares %d elements, %d bytes left: %w", pos, n, len(p)-pos, ErrMalformed)
		}
		pending += int(n)
		return nil
	}
	for pending > 0 {
		if pos >= len(p) {
			return fmt.Errorf("events: msgpack payload ends inside a value: %w", ErrMalformed)
		}
		c := p[pos]
		pos++
		pending--
		var err error
		switch {
		case c <= 0x7f || c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3:
		case c >= 0x80 && c <= 0x8f:
			err = elems(2 * uint64(c&0x0f))
		case c >= 0x90 && c <= 0x9f:
			err = elems(uint64(c & 0x0f))
		case c >= 0xa0 && c <= 0xbf:
			err = skip(uint64(c & 0x1f))
		default:
			err = checkTyped(c, length, skip, elems)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// checkTyped handles the msgpack headers from 0xc4 to 0xdf.
func checkTyped(c byte, length func(int) (uint64, error), skip func(uint64) error, elems func(uint64) error) error {
	sized := func(width int, then func(uint64) error, extra uint64) error {
		n, err := length(width)
		if err != nil {
			return err
		}
		return then(n + extra)
	}
	switch c {
	case 0xc4, 0xd9: // bin8, str8
		return sized(1, skip, 0)
	case 0xc5, 0xda: // bin16, str16
		return sized(2, skip, 0)
	case 0xc6, 0xdb: // bin32, str32
		return sized(4, skip, 0)
	case 0xc7: // ext8: length, type, data
		return sized(1, skip, 1)
	case 0xc8:
		return sized(2, skip, 1)
	case 0xc9:
		return sized(4, skip, 1)
	case 0xca: // float32
		return skip(4)
	case 0xcb: // float64
		return skip(8)
	case 0xcc, 0xd0:
		return skip(1)
	case 0xcd, 0xd1:
		return skip(2)
	case 0xce, 0xd2:
		return skip(4)
	case 0xcf, 0xd3:
		return skip(8)
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1, 2, 4, 8, 16: type, data
		return skip(1 + 1<<(c-0xd4))
	case 0xdc:
		return sized(2, elems, 0)
	case 0xdd:
		return sized(4, elems, 0)
	case 0xde:
		return sized(2, func(n uint64) error { return elems(2 * n) }, 0)
	case 0xdf:
		return sized(4, func(n uint64) error { return elems(2 * n) }, 0)
	}
	return fmt.Errorf("events: msgpack header 0x%02x is never used: %w", c, ErrMalformed)
}

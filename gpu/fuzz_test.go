package gpu

import (
	"testing"
)

// FuzzRing drives a descriptor ring with reservations (submissions),
// completions of the oldest submission in flight (its event), and
// reservations undone at once (nothing enqueued), against a model of
// which slots are in flight. Every slot a reservation returns lies inside
// the ring and overlaps no slot in flight; a ring with nothing in flight
// takes any table that fits it; an undo leaves the ring as it was.
func FuzzRing(f *testing.F) {
	f.Add(uint8(10), []byte{4, 4, 4, 0x80, 4, 0x80, 0x80, 4, 0xC3, 2})
	f.Add(uint8(4), []byte("ACC\x80C"))
	f.Add(uint8(1), []byte{1, 1, 0x80, 1})
	f.Add(uint8(64), []byte{63, 2, 0x80, 2, 64, 0x80, 0x80, 64})
	f.Fuzz(func(t *testing.T, size uint8, ops []byte) {
		c := int(size%64) + 1
		var r descRing
		r.init(make([]byte, c*descBytes), 1<<20)
		type res struct {
			pos, n int
			end    uint64
		}
		var flight []res // in flight, oldest first
		busy := make([]bool, c)
		for _, op := range ops {
			switch {
			case op&0xC0 == 0x80: // the oldest submission's event completed
				if len(flight) == 0 {
					continue
				}
				old := flight[0]
				flight = flight[1:]
				r.release(old.end)
				for i := old.pos; i < old.pos+old.n; i++ {
					busy[i] = false
				}
			case op&0xC0 == 0xC0: // a reservation whose submission puts nothing in flight
				n := int(op&0x3F) + 1
				head, tail := r.head, r.tail.Load()
				if _, _, _, ok := r.reserve(n); ok {
					r.unreserve()
					if len(flight) > 0 && (r.head != head || r.tail.Load() != tail) {
						t.Fatalf("undo of reserve(%d): head %d tail %d, was %d %d", n, r.head, r.tail.Load(), head, tail)
					}
				}
			default:
				n := int(op&0x3F) + 1
				empty := len(flight) == 0
				slot, addr, end, ok := r.reserve(n)
				if !ok {
					if empty && n <= c {
						t.Fatalf("an empty ring of %d refused %d descriptors", c, n)
					}
					continue
				}
				pos := int((addr - r.dptr) / descBytes)
				if len(slot) != n || pos < 0 || pos+n > c || &slot[0] != &r.descs[pos] {
					t.Fatalf("reserve(%d) in a ring of %d: slot at %d of %d", n, c, pos, len(slot))
				}
				for i := pos; i < pos+n; i++ {
					if busy[i] {
						t.Fatalf("reserve(%d) handed out slot %d, still in flight (%v)", n, i, flight)
					}
					busy[i] = true
				}
				flight = append(flight, res{pos, n, end})
			}
		}
	})
}

// FuzzKeySet checks the set Start uses to find blocks written twice
// against a map.
func FuzzKeySet(f *testing.F) {
	f.Add(uint16(4), []byte{1, 2, 3, 1, 2, 9})
	f.Fuzz(func(t *testing.T, n uint16, keys []byte) {
		var s keySet
		limit := int(n % 4096) // a Start of n pairs inserts at most n keys
		s.reset(limit)
		m := map[uint64]bool{}
		for i := 0; i+1 < len(keys) && len(m) < limit; i += 2 {
			k := (uint64(keys[i])<<8 | uint64(keys[i+1]) + 1) << 8 // block addresses: 256-aligned, never 0
			if got, want := s.has(k), m[k]; got != want {
				t.Fatalf("has(%x) = %v, want %v", k, got, want)
			}
			if got, want := s.insert(k), !m[k]; got != want {
				t.Fatalf("insert(%x) = %v, want %v", k, got, want)
			}
			m[k] = true
		}
	})
}

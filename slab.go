package kvlease

import "unsafe"

// Leases are carved from slabs.
//
// A lease cycle is on the hot path of every decode step, and one heap
// allocation per lease (the handle and its block table together) would be
// most of its cost. So the pool allocates leases slabLeases at a time, per
// size class of inline block table (1, 2, 4, … 64 blocks), and hands them
// out in order under its lock: the allocation is amortised over the slab
// (about 16 KiB: 136 one-block leases, 68 of 16 blocks, 26 of 64).
// A lease is never reused: the slab is garbage once every lease carved from
// it is unreachable. The price is retention: a lease kept alive keeps its
// slab alive.
//
// With the leak check on, every lease is allocated on its own instead, so
// that its cleanup runs as soon as it alone becomes unreachable.

// slabBytes is the size a slab aims at: big enough that the allocation is
// a small share of a lease's cost, small enough that a long-lived lease
// pins little (at most one slab of its class). Every slab has at least
// minSlabLeases leases.
const (
	slabBytes     = 16 << 10
	minSlabLeases = 4
)

type (
	box1[R any] struct {
		l Lease[R]
		a [1]BlockRef
	}
	box2[R any] struct {
		l Lease[R]
		a [2]BlockRef
	}
	box4[R any] struct {
		l Lease[R]
		a [4]BlockRef
	}
	box8[R any] struct {
		l Lease[R]
		a [8]BlockRef
	}
	box16[R any] struct {
		l Lease[R]
		a [16]BlockRef
	}
	box32[R any] struct {
		l Lease[R]
		a [32]BlockRef
	}
	box64[R any] struct {
		l Lease[R]
		a [64]BlockRef
	}
)

// leaseSlabs holds the current slab of each class. Guarded by the pool's
// mutex.
type leaseSlabs[R any] struct {
	b0  slab[Lease[R]] // no inline table: more than 64 blocks
	b1  slab[box1[R]]
	b2  slab[box2[R]]
	b4  slab[box4[R]]
	b8  slab[box8[R]]
	b16 slab[box16[R]]
	b32 slab[box32[R]]
	b64 slab[box64[R]]
}

// slab is one allocation of leases, handed out in order from next.
type slab[B any] struct {
	buf  []B
	next int
}

// take returns the next unused element of the slab, starting a new slab
// when it is used up, or a lone allocation when single is set.
func take[B any](s *slab[B], single bool) *B {
	if single {
		return new(B)
	}
	if s.next == len(s.buf) {
		s.buf = make([]B, max(minSlabLeases, slabBytes/int(unsafe.Sizeof(*new(B)))))
		s.next = 0
	}
	b := &s.buf[s.next]
	s.next++
	return b
}

// carve returns a zero lease and an empty block table with room for n.
func (s *leaseSlabs[R]) carve(n int, single bool) (*Lease[R], []BlockRef) {
	switch {
	case n <= 1:
		b := take(&s.b1, single)
		return &b.l, b.a[:0]
	case n <= 2:
		b := take(&s.b2, single)
		return &b.l, b.a[:0]
	case n <= 4:
		b := take(&s.b4, single)
		return &b.l, b.a[:0]
	case n <= 8:
		b := take(&s.b8, single)
		return &b.l, b.a[:0]
	case n <= 16:
		b := take(&s.b16, single)
		return &b.l, b.a[:0]
	case n <= 32:
		b := take(&s.b32, single)
		return &b.l, b.a[:0]
	case n <= 64:
		b := take(&s.b64, single)
		return &b.l, b.a[:0]
	}
	return take(&s.b0, single), make([]BlockRef, 0, n)
}

package gpu

import (
	"go.uber.org/atomic"
	"unsafe"
)

// defaultRingDescs is the size of an engine's descriptor ring, in
// descriptors (4 MiB of mapped pinned memory, allocated at the engine's
// first launch): a scattered copy of 128 Ki pieces, or several smaller
// ones in flight.
const defaultRingDescs = 1 << 17

// descRing holds the kernel's descriptor tables of one engine: one
// allocation of device-mapped pinned memory, used as a FIFO of tables in
// stream order. A launch's table is a contiguous slot, written by the host
// and then read by the kernel through its device address: no upload, no
// allocation per launch.
//
// The rule that keeps it safe: a slot is reused only after the event of
// the submission that used it has completed. Slots are reserved in
// submission order (under the engine's submission lock) and released in
// completion order, which is the same order (one stream), so the free
// space is always the part between the newest reservation (head) and the
// end of the oldest submission still in flight (tail). A reservation that
// finds too little room fails: that submission goes to the copy engine
// (CopyStats.RingFull), it never waits for, or overwrites, a table in
// flight. A submission whose completion can never be proven (a sticky
// error) never releases its slot.
type descRing struct {
	mem   []byte       // host view of the allocation; nil until the first launch
	dptr  uint64       // its device address
	descs []kernelDesc // mem as descriptors
	// head counts descriptors ever reserved (a slot skipped at the end of
	// the ring counts as reserved); guarded by the engine's subMu. undo is
	// head before the newest reservation.
	head, undo uint64
	// tail counts descriptors released: everything before it is free.
	// Stored by the completion goroutine, loaded under subMu.
	tail atomic.Uint64
}

// init makes the ring use mem (mapped pinned memory at device address
// dptr), of at least one descriptor.
func (r *descRing) init(mem []byte, dptr uint64) {
	r.mem, r.dptr = mem, dptr
	r.descs = unsafe.Slice((*kernelDesc)(unsafe.Pointer(unsafe.SliceData(mem))), len(mem)/descBytes)
}

// reserve reserves n contiguous descriptors. It returns the slot, its
// device address and the reservation's end (what release takes once the
// submission completed), or ok false when the ring lacks the room now.
// Called under the engine's subMu.
//
// Everything in flight lies in [tail, head) (counted from the start, not
// wrapped); a reservation [start, end) with head ≤ start and end ≤ tail +
// size lies in the lap after tail, so it overlaps nothing in flight. When
// nothing is in flight (tail == head), head and tail jump to the next lap's
// start: every table that fits the ring fits then, whatever the position.
func (r *descRing) reserve(n int) (slot []kernelDesc, addr, end uint64, ok bool) {
	c := uint64(len(r.descs))
	if n <= 0 || uint64(n) > c {
		return nil, 0, 0, false
	}
	if tail := r.tail.Load(); tail == r.head && r.head%c != 0 {
		// Nothing in flight, so no release can race this store.
		r.head = (r.head + c - 1) / c * c
		r.tail.Store(r.head)
	}
	start := r.head
	pos := start % c
	if pos+uint64(n) > c { // a table never wraps: skip to the ring's start
		start += c - pos
		pos = 0
	}
	end = start + uint64(n)
	if end-r.tail.Load() > c {
		return nil, 0, 0, false
	}
	r.undo, r.head = r.head, end
	return r.descs[pos : pos+uint64(n)], r.dptr + pos*descBytes, end, true
}

// unreserve undoes the newest reservation, whose submission put nothing
// in flight. Called under subMu, right after that reserve.
func (r *descRing) unreserve() { r.head = r.undo }

// release frees every descriptor up to end, the end of the reservation
// of a submission whose event has completed. Called in completion order.
func (r *descRing) release(end uint64) { r.tail.Store(end) }

package gpu

import (
	"fmt"
	"math/bits"
	"slices"

	"github.com/kvlease/kvlease"
)

// copyJob is one Start: its ops, what it pins, its transfer and fence.
// Jobs are reused (CopyEngine.free) once settled, with their buffers, so a
// Start allocates nothing but its transfer; a quarantined job is never
// reused (the device may still read what it points to).
type copyJob struct {
	t        *kvlease.Transfer
	kind     copyKind
	pairs    int
	ops      []copyOp // merged copies, in pair order
	bytes    int      // bytes of all ops
	arenas   []*arena // distinct arenas touched, each counted pending once
	arenaBuf [4]*arena
	// written holds the blocks written, read the blocks read (device to
	// device only): a block written twice, or both read and written, is
	// refused.
	written, read keySet
	sameSpace     bool
	lastSrc       *arena
	lastDst       *arena
	srcs, dsts    resolver // the flat transports' lookups (here, not on the stack: they escape)

	kernel  bool       // plan chose the kernel
	sub     submission // what the stream receives
	ringEnd uint64     // end of the job's ring reservation; 0: none
	f       fence
	outcome error // enqueue error to report once the fence completes
}

// reset readies a job for a Start of pairs pairs of kind.
func (j *copyJob) reset(kind copyKind, pairs int) {
	j.kind, j.pairs = kind, pairs
	j.ops = j.ops[:0]
	j.bytes = 0
	j.arenas = j.arenaBuf[:0]
	j.sameSpace = kind == deviceToDevice
	j.written.reset(pairs)
	if j.sameSpace {
		j.read.reset(pairs)
	}
	j.lastSrc, j.lastDst = nil, nil
	j.kernel, j.ringEnd = false, 0
}

// add appends the copy of block src to block dst, merging it into the
// previous op when both sides are adjacent. Its errors are phrased to
// follow "pair i: ".
func (j *copyJob) add(src, dst span) error {
	n := src.a.blockBytes
	if dst.a.blockBytes != n {
		return fmt.Errorf("src block is %d bytes, dst block %d: %w", n, dst.a.blockBytes, kvlease.ErrInvalidArgument)
	}
	dk := dst.key()
	if !j.written.insert(dk) {
		return fmt.Errorf("block 0x%x is written twice: %w", dk, kvlease.ErrInvalidArgument)
	}
	if j.sameSpace {
		sk := src.key()
		if j.written.has(sk) || j.read.has(dk) {
			return fmt.Errorf("a block is both read and written: %w", kvlease.ErrInvalidArgument)
		}
		j.read.insert(sk)
	}
	if src.a != j.lastSrc {
		if err := j.touch(src.a); err != nil {
			return err
		}
		j.lastSrc = src.a
	}
	if dst.a != j.lastDst {
		if err := j.touch(dst.a); err != nil {
			return err
		}
		j.lastDst = dst.a
	}
	j.bytes += n
	if k := len(j.ops) - 1; k >= 0 {
		op := &j.ops[k]
		if op.src == src.a && op.dst == dst.a && op.srcOff+op.n == src.off && op.dstOff+op.n == dst.off {
			op.n += n // adjacent on both sides: one longer copy
			return nil
		}
	}
	j.ops = append(j.ops, copyOp{dst: dst.a, src: src.a, dstOff: dst.off, srcOff: src.off, n: n})
	return nil
}

// touch records arena a as touched by the job.
func (j *copyJob) touch(a *arena) error {
	if slices.Contains(j.arenas, a) {
		return nil
	}
	j.arenas = append(j.arenas, a)
	return nil
}

// pin counts the job as pending on every arena it touches, after checking
// (under the device lock) that each belongs to d and none closed since it
// was looked up.
func (j *copyJob) pin(d *Device) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	dir := dirNames[j.kind]
	if d.closed {
		return fmt.Errorf("gpu: %s: %s: %w", dir, d.name, ErrClosed)
	}
	for _, a := range j.arenas {
		switch {
		case a.dev != d:
			return fmt.Errorf("gpu: %s: a %s of another device (%s): %w", dir, a.kind, a.dev.name, kvlease.ErrInvalidArgument)
		case a.closed:
			return fmt.Errorf("gpu: %s: the %s at 0x%x is closed: %w", dir, a.kind, a.addr, kvlease.ErrInvalidArgument)
		}
	}
	for _, a := range j.arenas {
		a.pending++
	}
	return nil
}

// keySet is a set of block addresses (never 0) with open addressing,
// reused from Start to Start: checking a block costs a hash and a probe or
// two, where sorting the keys cost a Start O(n log n).
type keySet struct {
	slots []uint64
	shift uint8
}

func (s *keySet) reset(n int) {
	size := 16
	for size < 2*n {
		size <<= 1
	}
	if cap(s.slots) < size {
		s.slots = make([]uint64, size)
	} else {
		s.slots = s.slots[:size]
		clear(s.slots)
	}
	s.shift = uint8(64 - bits.TrailingZeros(uint(size)))
}

// slot is where k's probe starts: Fibonacci hashing of the address above
// its 256-byte alignment.
func (s *keySet) slot(k uint64) uint64 { return ((k >> 8) * 0x9E3779B97F4A7C15) >> s.shift }

// insert adds k and reports whether it was absent.
func (s *keySet) insert(k uint64) bool {
	mask := uint64(len(s.slots) - 1)
	for i := s.slot(k); ; i = (i + 1) & mask {
		switch s.slots[i] {
		case 0:
			s.slots[i] = k
			return true
		case k:
			return false
		}
	}
}

// has reports whether k is in the set.
func (s *keySet) has(k uint64) bool {
	mask := uint64(len(s.slots) - 1)
	for i := s.slot(k); ; i = (i + 1) & mask {
		switch s.slots[i] {
		case 0:
			return false
		case k:
			return true
		}
	}
}

package tiers

// The disk tier's I/O: a Read or Write becomes jobs the workers run in
// file order, in runs of adjacent slots, each resolving its transfer when
// the call's last part is done.

import (
	"fmt"
	"hash"
	"slices"
	"sync"

	"go.uber.org/atomic"

	"github.com/kvlease/kvlease"
)

// diskJob is one worker's part of a Read or Write: the parts of one call
// share its transfer, which resolves when the last part is done.
type diskJob struct {
	writes []SlotWrite
	reads  []SlotRead
	*diskCall
}

// diskCall is one Read or Write, split over up to Workers jobs.
type diskCall struct {
	t        *kvlease.Transfer
	canceled atomic.Bool
	left     atomic.Int32
	mu       sync.Mutex
	err      error // the first part's error
}

// finish records one part's outcome and resolves the transfer after the
// last part.
func (c *diskCall) finish(err error) {
	if err != nil {
		c.mu.Lock()
		if c.err == nil {
			c.err = err
		}
		c.mu.Unlock()
	}
	if c.left.Add(-1) == 0 {
		c.mu.Lock()
		err := c.err
		c.mu.Unlock()
		c.t.Resolve(err)
	}
}

// Write writes each block to its slot, split into up to Workers parts
// that workers write in parallel (each part in order), and returns its
// transfer, following kvlease.Transport's order: the transfer is created
// and attach is called with it before any byte is written; if attach
// fails nothing is written, the transfer is resolved with attach's error
// and Write returns that error. The transfer resolves when every worker
// has returned from its part's last write (with the first error, if any;
// a part stops at its first error); Cancel skips the slots not yet
// written. Errors wrap
// kvlease.ErrInvalidArgument (no blocks, a slot out of range, a block of
// the wrong size, tags that do not fit: see TagsFit) or ErrClosed.
func (d *Disk) Write(writes []SlotWrite, attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	for i := range writes {
		w := &writes[i]
		if err := d.checkSlot(w.Dst, len(w.Src)); err != nil {
			return nil, err
		}
		if !d.TagsFit(w) {
			return nil, fmt.Errorf("tiers: disk slot %d: the block's tags (namespace %q, adapter %q, %d extra keys) do not fit in its slot: %w",
				w.Dst, w.Namespace, w.Adapter.Name, len(w.ExtraKeys), kvlease.ErrInvalidArgument)
		}
	}
	return d.start(&diskJob{writes: writes}, len(writes), attach)
}

// Read reads each slot into its block, as Write does in the other
// direction. A slot that does not hold a valid block with the expected
// hash fails the read with ErrCorruptSlot (its part stops there) and
// stops serving hits: Lookup ends before it from then on.
func (d *Disk) Read(reads []SlotRead, attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	for _, r := range reads {
		if err := d.checkSlot(r.Src, len(r.Dst)); err != nil {
			return nil, err
		}
	}
	return d.start(&diskJob{reads: reads}, len(reads), attach)
}

// TagsFit reports whether w's tags (its namespace, adapter and extra
// keys) fit in a slot after the block, as Write requires.
func (d *Disk) TagsFit(w *SlotWrite) bool {
	tl, ok := tagsLen(w)
	return ok && headerSize+d.cfg.BlockBytes+tl <= d.slotBytes
}

func (d *Disk) checkSlot(s DiskSlot, n int) error {
	if s < 0 || int(s) >= d.cfg.Slots || n != d.cfg.BlockBytes {
		return fmt.Errorf("tiers: disk slot %d of %d with a block of %d bytes (want %d): %w",
			s, d.cfg.Slots, n, d.cfg.BlockBytes, kvlease.ErrInvalidArgument)
	}
	return nil
}

func (d *Disk) start(j *diskJob, n int, attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	if n == 0 || attach == nil {
		return nil, fmt.Errorf("tiers: disk job of %d blocks (attach set: %v): %w", n, attach != nil, kvlease.ErrInvalidArgument)
	}
	d.qmu.Lock()
	defer d.qmu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("tiers: disk tier: %w", ErrClosed)
	}
	call := &diskCall{}
	call.t = kvlease.NewTransfer(func() { call.canceled.Store(true) })
	if err := attach(call.t); err != nil {
		call.t.Resolve(err)
		return call.t, err
	}
	// Split the call over the workers: a long prefix is read (or written)
	// in parallel, each part in order.
	parts := min(d.cfg.Workers, n)
	call.left.Store(int32(parts))
	for p := range parts {
		lo, hi := p*n/parts, (p+1)*n/parts
		part := &diskJob{diskCall: call}
		if j.writes != nil {
			part.writes = j.writes[lo:hi]
		} else {
			part.reads = j.reads[lo:hi]
		}
		d.queue = append(d.queue, part)
	}
	if parts == 1 {
		d.qcond.Signal()
	} else {
		d.qcond.Broadcast()
	}
	return call.t, nil
}

// next returns the next queued job, waiting for one; nil once the disk is
// closed and the queue is empty.
func (d *Disk) next() *diskJob {
	d.qmu.Lock()
	defer d.qmu.Unlock()
	for len(d.queue) == 0 {
		if d.closed {
			return nil
		}
		d.qcond.Wait()
	}
	j := d.queue[0]
	d.queue[0] = nil
	d.queue = d.queue[1:]
	return j
}

// maxRunBytes bounds one merged disk I/O: a run of adjacent slots is
// written or read with one pwrite or pread of at most this many bytes
// (at least one slot).
const maxRunBytes = 1 << 20

// runSlots is the most slots one disk I/O covers.
func (d *Disk) runSlots() int { return max(1, maxRunBytes/d.slotBytes) }

// adjacent reports whether slot b follows slot a in the same file.
func (d *Disk) adjacent(a, b DiskSlot) bool { return b == a+DiskSlot(len(d.files)) }

// fileOrder puts a job's slots of a striped tier file by file, each in
// offset order (a copy: the caller's slice is left alone), so that a run
// of consecutive ids, which alternates files, becomes one run per file.
func (d *Disk) fileOrder(j *diskJob) {
	f := DiskSlot(len(d.files))
	if f == 1 {
		return
	}
	cmp := func(a, b DiskSlot) int {
		if a%f != b%f {
			return int(a%f - b%f)
		}
		return int(a/f - b/f)
	}
	if j.writes != nil {
		j.writes = slices.Clone(j.writes)
		slices.SortStableFunc(j.writes, func(a, b SlotWrite) int { return cmp(a.Dst, b.Dst) })
	}
	if j.reads != nil {
		j.reads = slices.Clone(j.reads)
		slices.SortStableFunc(j.reads, func(a, b SlotRead) int { return cmp(a.Src, b.Src) })
	}
}

// IOs returns how many disk reads and writes (pread and pwrite calls)
// the tier has issued for Read and Write: one per run of slots adjacent
// in their file (consecutive slots with one file; striped over Files, a
// worker takes its slots file by file, so consecutive ids make one run
// per file), at most 1 MiB each, rather than one per slot.
func (d *Disk) IOs() int64 { return d.ios.Load() }

// work is one disk worker.
func (d *Disk) work() {
	defer d.workers.Done()
	buf := alignedBuf(d.slotBytes * d.runSlots())
	mac := d.newMAC()
	for j := d.next(); j != nil; j = d.next() {
		j.finish(d.run(j, buf, mac))
	}
}

// run does one job; its error is the transfer's outcome. Slots adjacent
// in their file move as one run: each slot's cancel check and BeforeIO
// come first, in order, then one pwrite (or pread) covers the run.
func (d *Disk) run(j *diskJob, buf []byte, mac hash.Hash) error {
	d.fileOrder(j)
	most, sb := d.runSlots(), d.slotBytes
	for i := 0; i < len(j.writes); {
		k := 0 // slots of the run encoded into buf
		for ; i+k < len(j.writes) && k < most && (k == 0 || d.adjacent(j.writes[i+k-1].Dst, j.writes[i+k].Dst)); k++ {
			w := &j.writes[i+k]
			if j.canceled.Load() {
				return fmt.Errorf("tiers: disk write canceled before slot %d: %w", w.Dst, kvlease.ErrCanceled)
			}
			if d.cfg.BeforeIO != nil {
				if err := d.cfg.BeforeIO(true, w.Dst); err != nil {
					return err
				}
			}
			d.encode(buf[k*sb:(k+1)*sb], w, mac)
		}
		f, off := d.at(j.writes[i].Dst)
		d.ios.Add(1)
		if _, err := f.WriteAt(buf[:k*sb], off); err != nil {
			return fmt.Errorf("tiers: disk write of slots %d to %d: %w", j.writes[i].Dst, j.writes[i+k-1].Dst, err)
		}
		d.mu.Lock()
		for _, w := range j.writes[i : i+k] {
			delete(d.bad, w.Dst)
		}
		d.mu.Unlock()
		i += k
	}
	for i := 0; i < len(j.reads); {
		k := 0
		for ; i+k < len(j.reads) && k < most && (k == 0 || d.adjacent(j.reads[i+k-1].Src, j.reads[i+k].Src)); k++ {
			r := &j.reads[i+k]
			if j.canceled.Load() {
				return fmt.Errorf("tiers: disk read canceled before slot %d: %w", r.Src, kvlease.ErrCanceled)
			}
			if d.cfg.BeforeIO != nil {
				if err := d.cfg.BeforeIO(false, r.Src); err != nil {
					return err
				}
			}
		}
		f, off := d.at(j.reads[i].Src)
		d.ios.Add(1)
		if _, err := f.ReadAt(buf[:k*sb], off); err != nil {
			return fmt.Errorf("tiers: disk read of slots %d to %d: %w", j.reads[i].Src, j.reads[i+k-1].Src, err)
		}
		for q := range k {
			r, slot := &j.reads[i+q], buf[q*sb:(q+1)*sb]
			if m, ok := d.decode(slot, mac); !ok || m.Hash != r.Hash {
				d.mu.Lock()
				d.bad[r.Src] = r.Hash
				d.mu.Unlock()
				return fmt.Errorf("tiers: disk slot %d (want block %016x): %w", r.Src, uint64(r.Hash), ErrCorruptSlot)
			}
			copy(r.Dst, slot[headerSize:headerSize+d.cfg.BlockBytes])
		}
		i += k
	}
	return nil
}

// isBad reports whether slot s failed a read while it should hold h.
func (d *Disk) isBad(s DiskSlot, h kvlease.BlockHash) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	bh, ok := d.bad[s]
	return ok && bh == h
}

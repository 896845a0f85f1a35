package tiers

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/cespare/xxhash/v2"

	"github.com/kvlease/kvlease"
)

// DiskSlot names a slot of a disk tier: its number, 0..Blocks()-1. It is
// the region type of the disk tier's pool.
type DiskSlot int64

// DiskConfig describes a disk tier.
type DiskConfig struct {
	// Dir holds the slot files (tier-NNN.slots); it is created if needed.
	// Files already there with the same geometry are scanned and their
	// valid slots are findable again (see OpenDisk).
	Dir string
	// Files is how many files the slots are striped over (default 1):
	// slot s lives in file s mod Files.
	Files int
	// Slots is the number of blocks; BlockBytes the size of one (the
	// host tier's block size).
	Slots, BlockBytes int
	// Workers bounds the concurrent disk I/O (default 4): every Read and
	// Write is one job for one worker, queued when all are busy.
	Workers int
	// Direct opens the files with O_DIRECT where the system and the file
	// system allow it (it falls back to buffered I/O otherwise: see
	// Disk.Direct).
	Direct bool
	// BeforeIO, if set, runs in the worker before each slot is read or
	// written. An error fails the job there: the transfer resolves with
	// it (the worker provably stopped), and what was not written is never
	// sealed, what was not read never onboarded. Tests and audits inject
	// failures and stalls with it.
	BeforeIO func(write bool, slot DiskSlot) error
	// PoolOptions are options for the disk tier's pool (its index), such
	// as kvlease.WithKVEvents and kvlease.WithBlockTokens for KV events
	// with medium "DISK" (see Cache.EventSources).
	PoolOptions []kvlease.Option
}

// Disk is a disk tier (G3): fixed-size slots in preallocated files, each
// slot a header (magic, block hash, parent hash, size, checksum) followed
// by the block, read and written whole by a bounded pool of workers with
// pread and pwrite. A slot whose checksum or hash does not match (torn by
// a crash mid-write, corrupted at rest) is a miss, never wrong KV: a read
// of it fails, and the slot stops serving hits until it is rewritten.
//
// The disk tier's index is its kvlease pool (Pool): a slot is findable by
// its hash once sealed there, after the write into it resolved. OpenDisk
// rebuilds that index by scanning the files, so a restart keeps the tier.
// Disk implements kvlease.Memory[DiskSlot].
type Disk struct {
	cfg       DiskConfig
	files     []*os.File
	direct    bool
	slotBytes int
	pool      *kvlease.Pool[DiskSlot]
	recovered int
	scanned   map[DiskSlot]SlotMeta // what OpenDisk found in each recovered slot

	// The queue of jobs: unbounded, so that queueing never blocks the
	// caller (an eviction hook on an acquiring goroutine) behind a slow
	// disk; it holds at most one job per pool block in flight.
	qmu     sync.Mutex
	qcond   *sync.Cond
	queue   []*diskJob
	closed  bool // guarded by qmu
	workers sync.WaitGroup

	mu  sync.Mutex
	bad map[DiskSlot]kvlease.BlockHash // slots that failed a read, by the hash they should hold
}

var _ kvlease.Memory[DiskSlot] = (*Disk)(nil)

// ErrCorruptSlot is the outcome of a disk read that found a slot whose
// checksum, size or hash did not match: the slot is a miss.
var ErrCorruptSlot = errors.New("tiers: corrupt or torn disk slot")

const (
	slotMagic  = 0x3252454954564b4c // "LKVTIER2", little endian
	headerSize = 64
	diskAlign  = 4096
)

// OpenDisk opens (creating them if needed) the slot files of a disk tier
// and rebuilds its index by scanning them: every slot whose header and
// checksum are valid is findable again by its hash. Files of another size
// are recreated empty. Errors wrap kvlease.ErrInvalidArgument for a bad
// geometry, or the file system's error.
func OpenDisk(cfg DiskConfig) (*Disk, error) {
	if cfg.Files == 0 {
		cfg.Files = 1
	}
	if cfg.Workers == 0 {
		cfg.Workers = 4
	}
	if cfg.Dir == "" || cfg.Slots <= 0 || cfg.BlockBytes <= 0 || cfg.Files < 0 || cfg.Workers < 0 || cfg.Files > cfg.Slots {
		return nil, fmt.Errorf("tiers: disk tier in %q with %d slots of %d bytes over %d files, %d workers: %w",
			cfg.Dir, cfg.Slots, cfg.BlockBytes, cfg.Files, cfg.Workers, kvlease.ErrInvalidArgument)
	}
	if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
		return nil, fmt.Errorf("tiers: disk tier: %w", err)
	}
	d := &Disk{
		cfg:       cfg,
		slotBytes: (headerSize + cfg.BlockBytes + diskAlign - 1) / diskAlign * diskAlign,
		bad:       make(map[DiskSlot]kvlease.BlockHash),
		direct:    cfg.Direct,
	}
	for f := range cfg.Files {
		file, direct, err := openSlotFile(filepath.Join(cfg.Dir, fmt.Sprintf("tier-%03d.slots", f)),
			int64(d.fileSlots(f))*int64(d.slotBytes), d.direct, d.slotBytes)
		if err != nil {
			d.closeFiles()
			return nil, fmt.Errorf("tiers: disk tier: %w", err)
		}
		d.direct = d.direct && direct
		d.files = append(d.files, file)
	}
	pool, err := kvlease.NewPool[DiskSlot](d, cfg.PoolOptions...)
	if err != nil {
		d.closeFiles()
		return nil, err
	}
	d.pool = pool
	if err := d.rebuild(); err != nil {
		d.closeFiles()
		return nil, err
	}
	d.qcond = sync.NewCond(&d.qmu)
	for range cfg.Workers {
		d.workers.Add(1)
		go d.work()
	}
	return d, nil
}

// fileSlots returns how many slots file f holds.
func (d *Disk) fileSlots(f int) int {
	n := d.cfg.Slots / d.cfg.Files
	if f < d.cfg.Slots%d.cfg.Files {
		n++
	}
	return n
}

// at returns the file and offset of slot s.
func (d *Disk) at(s DiskSlot) (*os.File, int64) {
	return d.files[int(s)%len(d.files)], int64(int(s)/len(d.files)) * int64(d.slotBytes)
}

// Blocks returns the number of slots.
func (d *Disk) Blocks() int { return d.cfg.Slots }

// BlockBytes returns the size of one block.
func (d *Disk) BlockBytes() int { return d.cfg.BlockBytes }

// Region returns the slot of block id.
func (d *Disk) Region(id kvlease.BlockID) DiskSlot { return DiskSlot(id) }

// Pool returns the disk tier's pool: its index and its slot allocator.
func (d *Disk) Pool() *kvlease.Pool[DiskSlot] { return d.pool }

// Direct reports whether the files are open with O_DIRECT.
func (d *Disk) Direct() bool { return d.direct }

// Scanned returns what OpenDisk found in slot s, if it recovered it.
func (d *Disk) Scanned(s DiskSlot) (SlotMeta, bool) {
	m, ok := d.scanned[s]
	return m, ok
}

// Recovered returns how many slots OpenDisk found valid and made findable.
func (d *Disk) Recovered() int { return d.recovered }

// rebuild scans every slot and seals the valid ones in the fresh pool:
// with their tokens and place in their chain (SealChained) when the slot
// recorded them and the pool takes tokens, so that their KV events are
// whole; by hash alone otherwise.
func (d *Disk) rebuild() error {
	buf := alignedBuf(d.slotBytes)
	type entry struct {
		slot DiskSlot
		meta SlotMeta
	}
	var valid []entry
	for s := range DiskSlot(d.cfg.Slots) {
		f, off := d.at(s)
		if _, err := f.ReadAt(buf, off); err != nil {
			return fmt.Errorf("tiers: disk tier scan of slot %d: %w", s, err)
		}
		if m, ok := d.decode(buf); ok {
			valid = append(valid, entry{s, m})
		}
	}
	if len(valid) == 0 {
		return nil
	}
	// One lease over every slot of the fresh pool; seal each valid slot's
	// block with the hash its header records.
	l, err := d.pool.Acquire("tiers/scan", d.cfg.Slots)
	if err != nil {
		return err
	}
	pos := make([]int, d.cfg.Slots)
	for i := range l.Len() {
		pos[l.Ref(i).ID] = i
	}
	// Last lease position first: a block sealed by hash alone then never
	// names the unrelated block before it in this lease as its parent.
	slices.SortFunc(valid, func(a, b entry) int { return pos[b.slot] - pos[a.slot] })
	d.scanned = make(map[DiskSlot]SlotMeta, len(valid))
	for _, e := range valid {
		r := parentRec{hash: e.meta.Hash, known: e.meta.HasParent, chained: e.meta.Chained, parent: e.meta.Parent, tokens: e.meta.Tokens}
		if err := sealAs(l, pos[e.slot], r); err == nil {
			d.recovered++
			d.scanned[e.slot] = e.meta
		}
	}
	l.Release()
	d.recovered -= int(d.pool.Stats().DuplicateSeals)
	return nil
}

// Header layout of a slot (little endian), then the block at headerSize,
// then the block's tokens (4 bytes each) when they fit in the slot:
//
//	0 magic  8 hash  16 parent  24 flags (1 parent known, 2 parent is a block)
//	32 block bytes  40 checksum  48 tokens recorded  52..63 zero
//
// The checksum covers the whole slot but itself.

// encode fills buf (one slot) with the header, the block and its tokens.
func (d *Disk) encode(buf []byte, w *SlotWrite) {
	clear(buf[:headerSize])
	binary.LittleEndian.PutUint64(buf[0:], slotMagic)
	binary.LittleEndian.PutUint64(buf[8:], uint64(w.Hash))
	binary.LittleEndian.PutUint64(buf[16:], uint64(w.Parent))
	var flags uint64
	if w.HasParent {
		flags |= 1
	}
	if w.Chained {
		flags |= 2
	}
	binary.LittleEndian.PutUint64(buf[24:], flags)
	binary.LittleEndian.PutUint64(buf[32:], uint64(d.cfg.BlockBytes))
	body := headerSize + d.cfg.BlockBytes
	n := copy(buf[headerSize:body], w.Src)
	clear(buf[headerSize+n:])
	if len(w.Tokens) > 0 && body+4*len(w.Tokens) <= len(buf) {
		binary.LittleEndian.PutUint32(buf[48:], uint32(len(w.Tokens)))
		for i, t := range w.Tokens {
			binary.LittleEndian.PutUint32(buf[body+4*i:], uint32(t))
		}
	}
	binary.LittleEndian.PutUint64(buf[40:], d.checksum(buf))
}

// checksum covers the header (but the checksum itself), the block and the
// tokens recorded.
func (d *Disk) checksum(buf []byte) uint64 {
	var x xxhash.Digest
	x.Reset()
	_, _ = x.Write(buf[:40])
	_, _ = x.Write(buf[48:]) // the rest of the header, the block, the tokens and the zero padding
	return x.Sum64()
}

// decode checks a slot read into buf; ok is false for anything but a
// whole, valid slot.
func (d *Disk) decode(buf []byte) (m SlotMeta, ok bool) {
	body := headerSize + d.cfg.BlockBytes
	nt := int(binary.LittleEndian.Uint32(buf[48:]))
	if binary.LittleEndian.Uint64(buf[0:]) != slotMagic ||
		binary.LittleEndian.Uint64(buf[32:]) != uint64(d.cfg.BlockBytes) ||
		nt < 0 || body+4*nt > len(buf) ||
		binary.LittleEndian.Uint64(buf[40:]) != d.checksum(buf) {
		return SlotMeta{}, false
	}
	flags := binary.LittleEndian.Uint64(buf[24:])
	m = SlotMeta{
		Hash:      kvlease.BlockHash(binary.LittleEndian.Uint64(buf[8:])),
		Parent:    kvlease.BlockHash(binary.LittleEndian.Uint64(buf[16:])),
		HasParent: flags&1 != 0,
		Chained:   flags&2 != 0,
	}
	if nt > 0 {
		m.Tokens = make([]int32, nt)
		for i := range m.Tokens {
			m.Tokens[i] = int32(binary.LittleEndian.Uint32(buf[body+4*i:]))
		}
	}
	return m, true
}

// SlotMeta is what a slot's header records about its block: its hash, its
// parent (HasParent: the parent is known; Chained: the parent is a block,
// not the namespace seed of a chain's first block) and, when they fit in
// the slot, its tokens.
type SlotMeta struct {
	Hash      kvlease.BlockHash
	Parent    kvlease.BlockHash
	HasParent bool
	Chained   bool
	Tokens    []int32
}

// SlotWrite is one block written to a disk slot: the block, and what the
// slot's header records about it (Tokens only when they fit in the slot's
// padding after the block; a block of whole 4 KiB pages has room for
// 1008).
type SlotWrite struct {
	Src       []byte
	Dst       DiskSlot
	Hash      kvlease.BlockHash
	Parent    kvlease.BlockHash
	HasParent bool
	Chained   bool
	Tokens    []int32
}

// SlotRead is one block read from a disk slot that must hold Hash.
type SlotRead struct {
	Src  DiskSlot
	Dst  []byte
	Hash kvlease.BlockHash
}

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
// the wrong size) or ErrClosed.
func (d *Disk) Write(writes []SlotWrite, attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	for _, w := range writes {
		if err := d.checkSlot(w.Dst, len(w.Src)); err != nil {
			return nil, err
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

// work is one disk worker.
func (d *Disk) work() {
	defer d.workers.Done()
	buf := alignedBuf(d.slotBytes)
	for j := d.next(); j != nil; j = d.next() {
		j.finish(d.run(j, buf))
	}
}

// run does one job; its error is the transfer's outcome.
func (d *Disk) run(j *diskJob, buf []byte) error {
	for i := range j.writes {
		w := &j.writes[i]
		if j.canceled.Load() {
			return fmt.Errorf("tiers: disk write canceled before slot %d: %w", w.Dst, ErrCanceled)
		}
		if d.cfg.BeforeIO != nil {
			if err := d.cfg.BeforeIO(true, w.Dst); err != nil {
				return err
			}
		}
		d.encode(buf, w)
		f, off := d.at(w.Dst)
		if _, err := f.WriteAt(buf, off); err != nil {
			return fmt.Errorf("tiers: disk write of slot %d: %w", w.Dst, err)
		}
		d.mu.Lock()
		delete(d.bad, w.Dst)
		d.mu.Unlock()
	}
	for i := range j.reads {
		r := &j.reads[i]
		if j.canceled.Load() {
			return fmt.Errorf("tiers: disk read canceled before slot %d: %w", r.Src, ErrCanceled)
		}
		if d.cfg.BeforeIO != nil {
			if err := d.cfg.BeforeIO(false, r.Src); err != nil {
				return err
			}
		}
		f, off := d.at(r.Src)
		if _, err := f.ReadAt(buf, off); err != nil {
			return fmt.Errorf("tiers: disk read of slot %d: %w", r.Src, err)
		}
		if m, ok := d.decode(buf); !ok || m.Hash != r.Hash {
			d.mu.Lock()
			d.bad[r.Src] = r.Hash
			d.mu.Unlock()
			return fmt.Errorf("tiers: disk slot %d (want block %016x): %w", r.Src, uint64(r.Hash), ErrCorruptSlot)
		}
		copy(r.Dst, buf[headerSize:headerSize+d.cfg.BlockBytes])
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

// Lookup acquires the disk tier's hits for hashes: the longest prefix
// findable on disk, ending before any slot that failed a read. nil when
// nothing hits. The caller reads the slots and releases the lease.
func (d *Disk) Lookup(owner string, hashes []kvlease.BlockHash) *kvlease.Lease[DiskSlot] {
	l, err := d.pool.AcquireHits(owner, hashes)
	if err != nil || l == nil {
		return nil
	}
	for k := range l.Len() {
		if d.isBad(DiskSlot(l.Ref(k).ID), hashes[k]) {
			l.Release()
			if k == 0 {
				return nil
			}
			l, err = d.pool.AcquireHits(owner, hashes[:k])
			if err != nil {
				return nil
			}
			return l
		}
	}
	return l
}

// Close stops the workers once the queued jobs are done (their transfers
// resolve) and closes the files. Close the disk after every cache using it.
func (d *Disk) Close() error {
	d.qmu.Lock()
	if d.closed {
		d.qmu.Unlock()
		return nil
	}
	d.closed = true
	d.qcond.Broadcast()
	d.qmu.Unlock()
	d.workers.Wait()
	_ = d.pool.Close()
	return d.closeFiles()
}

func (d *Disk) closeFiles() error {
	var errs []error
	for _, f := range d.files {
		errs = append(errs, f.Close())
	}
	d.files = nil
	return errors.Join(errs...)
}

// ErrCanceled is the outcome of a disk job whose transfer was canceled
// before it finished: the slots after the cancel were not touched.
var ErrCanceled = errors.New("tiers: canceled")

// alignedBuf returns n bytes aligned for O_DIRECT.
func alignedBuf(n int) []byte {
	b := make([]byte, n+diskAlign)
	off := diskAlign - int(uintptr(unsafe.Pointer(unsafe.SliceData(b)))%diskAlign)
	if off == diskAlign {
		off = 0
	}
	return b[off : off+n : off+n]
}

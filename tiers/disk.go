package tiers

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"sync"
	"unsafe"

	"go.uber.org/atomic"

	"github.com/kvlease/kvlease"
)

// DiskSlot names a slot of a disk tier: its number, 0..Blocks()-1. It is
// the region type of the disk tier's pool.
type DiskSlot int64

// DiskConfig describes a disk tier.
type DiskConfig struct {
	// Dir holds the slot files (tier-NNN.slots); it is created 0700 if
	// needed. An existing Dir must belong to the process's user and not
	// be writable by group or others; the slot files are 0600, opened
	// without following symbolic links (on Linux relative to the
	// directory checked), and must belong to the user too.
	// Files already there with the same geometry are scanned and their
	// valid slots are findable again (see OpenDisk).
	Dir string
	// Namespace names what the slots hold: the model's identity (name,
	// revision, adapter, dtype), recorded in every slot's header. A slot
	// written under another namespace is a miss, never served: a
	// directory reused by another model serves it nothing.
	Namespace string
	// Fingerprint is the envelope's or layout's fingerprint (for example
	// handoff.Envelope.Fingerprint or layout.Layout.Fingerprint), recorded
	// in every slot's header: a slot written under another layout is a
	// miss.
	Fingerprint uint64
	// Key, when set (at least 16 bytes), turns each slot's checksum into
	// an HMAC-SHA256 under it, so whoever can write the files but does
	// not hold the key cannot forge a slot: a tampered slot is a miss.
	// Without a key the checksum (xxhash64) catches torn and corrupted
	// slots only. Read the key from a file or a secret store, never a
	// command line.
	Key []byte
	// Files is how many files the slots are striped over (default 1):
	// slot s lives in file s mod Files.
	Files int
	// Slots is the number of blocks (at most 2³¹-1); BlockBytes the size
	// of one (the host tier's block size, at most 1 GiB).
	Slots, BlockBytes int
	// Workers bounds the concurrent disk I/O (default 4, at most 1024): every Read and
	// Write is one job for one worker, queued when all are busy.
	Workers int
	// Direct opens the files with O_DIRECT where the system and the file
	// system allow it (it falls back to buffered I/O otherwise: see
	// Disk.Direct).
	Direct bool
	// BeforeIO, if set, runs in the worker before each slot is read or
	// written (a worker takes its slots file by file, each file's in
	// offset order). An error fails the job there: the transfer resolves with
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
// slot a header (magic, block hash, parent hash, size, namespace,
// fingerprint, checksum or MAC) followed by the block, read and written
// whole by a bounded pool of workers with pread and pwrite: a run of
// slots adjacent in their file (a lease's contiguous ids, with one file)
// moves with one call of at most 1 MiB (IOs counts them). A slot whose
// checksum, hash, namespace or fingerprint does not match (torn by a crash
// mid-write, corrupted or forged at rest, written by another model or
// layout) is a miss, never wrong KV: a read of it fails, and the slot
// stops serving hits until it is rewritten.
//
// The disk tier's index is its kvlease pool (Pool): a slot is findable by
// its hash once sealed there, after the write into it resolved. OpenDisk
// rebuilds that index by scanning the files, so a restart keeps the tier.
// Disk implements kvlease.Memory[DiskSlot].
type Disk struct {
	cfg       DiskConfig
	ns        [16]byte // SHA-256 of the namespace, truncated
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

	ios atomic.Int64 // preads and pwrites of Read and Write (IOs)
}

var _ kvlease.Memory[DiskSlot] = (*Disk)(nil)

// ErrCorruptSlot is the outcome of a disk read that found a slot whose
// checksum (or MAC), size, hash, namespace or fingerprint did not match:
// the slot is a miss.
var ErrCorruptSlot = errors.New("tiers: corrupt, torn or foreign disk slot")

// ErrSlotFormat is wrapped by OpenDisk's error for slot files written in
// another version of the slot format (an older build's): their slots
// lack what this one records (a block's tenant namespace, adapter and
// extra keys), so they are refused, never served. Remove the files (or
// give the tier another Dir) to start the tier empty.
var ErrSlotFormat = fmt.Errorf("tiers: disk slots of another format version: %w", kvlease.ErrInvalidArgument)

const (
	// slotMagic starts every slot this format writes: "LKVTIER" and the
	// format's version. Version 4 added the tags (tenant namespace,
	// adapter, extra keys) after the block.
	slotMagic     = 0x3452454954564b4c // "LKVTIER4", little endian
	slotMagicMask = 0x00ffffffffffffff // the "LKVTIER" of any version
	slotVersion   = 4
	headerSize    = 128
	// tagReserve is room every slot keeps after its block for the
	// block's tags, so a tenant's block fits whatever the block size.
	tagReserve = 512
	// maxDiskBlockBytes and maxDiskWorkers bound DiskConfig.BlockBytes
	// and Workers.
	maxDiskBlockBytes = 1 << 30
	maxDiskWorkers    = 1024
	diskAlign         = 4096
	minKeyLen         = 16
)

// Checksum kinds recorded in a slot's header.
const (
	sumXXHash = 1 // xxhash64, unkeyed
	sumHMAC   = 2 // HMAC-SHA256 under DiskConfig.Key
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
	// (Every size bounded before it sizes anything: a slot count a BlockID
	// holds, a block the slot arithmetic cannot overflow, a worker pool
	// that does not start a goroutine per imagined disk.)
	if cfg.Dir == "" || cfg.Slots <= 0 || cfg.Slots > math.MaxInt32 || cfg.BlockBytes <= 0 || cfg.BlockBytes > maxDiskBlockBytes ||
		cfg.Files < 0 || cfg.Workers < 0 || cfg.Workers > maxDiskWorkers || cfg.Files > cfg.Slots {
		return nil, fmt.Errorf("tiers: disk tier in %q with %d slots of %d bytes over %d files, %d workers: %w",
			cfg.Dir, cfg.Slots, cfg.BlockBytes, cfg.Files, cfg.Workers, kvlease.ErrInvalidArgument)
	}
	if len(cfg.Key) > 0 && len(cfg.Key) < minKeyLen {
		return nil, fmt.Errorf("tiers: disk tier key of %d bytes (want at least %d): %w", len(cfg.Key), minKeyLen, kvlease.ErrInvalidArgument)
	}
	cfg.Key = slices.Clone(cfg.Key)
	dir, err := privateDir(cfg.Dir)
	if err != nil {
		return nil, err
	}
	defer dir.Close()
	d := &Disk{
		cfg:       cfg,
		ns:        namespaceID(cfg.Namespace),
		slotBytes: (headerSize + cfg.BlockBytes + tagReserve + diskAlign - 1) / diskAlign * diskAlign,
		bad:       make(map[DiskSlot]kvlease.BlockHash),
		direct:    cfg.Direct,
	}
	for f := range cfg.Files {
		file, direct, err := openSlotFile(dir, fmt.Sprintf("tier-%03d.slots", f),
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
// with their tokens and place in their chain (kvlease.Lease.SealAs) when the slot
// recorded them and the pool takes tokens, so that their KV events are
// whole; by hash alone otherwise.
func (d *Disk) rebuild() error {
	buf := alignedBuf(d.slotBytes)
	mac := d.newMAC()
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
		if m, ok := d.decode(buf, mac); ok {
			valid = append(valid, entry{s, m})
		} else if magic := binary.LittleEndian.Uint64(buf[0:]); magic != slotMagic && magic&slotMagicMask == slotMagic&slotMagicMask {
			return fmt.Errorf("tiers: disk tier in %q: slot %d is in slot format version %q, this build reads version %d only: remove the slot files or use another Dir: %w",
				d.cfg.Dir, s, rune(magic>>56), slotVersion, ErrSlotFormat)
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
		if err := sealAs(l, pos[e.slot], e.meta.sealInfo()); err == nil {
			d.recovered++
			d.scanned[e.slot] = e.meta
		}
	}
	l.Release()
	d.recovered -= int(d.pool.Stats().DuplicateSeals)
	return nil
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

// alignedBuf returns n bytes aligned for O_DIRECT.
func alignedBuf(n int) []byte {
	b := make([]byte, n+diskAlign)
	off := diskAlign - int(uintptr(unsafe.Pointer(unsafe.SliceData(b)))%diskAlign)
	if off == diskAlign {
		off = 0
	}
	return b[off : off+n : off+n]
}

package tiers

import (
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"math"
	"os"
	"slices"
	"sync"
	"unsafe"

	"github.com/cespare/xxhash/v2"
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

// Header layout of a slot (little endian), then the block at headerSize,
// then its tags (tagsLen bytes), then the block's tokens (4 bytes each)
// when they fit in the slot:
//
//	0 magic  8 hash  16 parent  24 flags (1 parent known, 2 parent is a block)
//	32 block bytes  40 tokens recorded (4 bytes)  44 checksum kind (4 bytes)
//	48 namespace (16 bytes of its SHA-256)  64 fingerprint
//	72 tags bytes (4 bytes)  76..95 zero
//	96 checksum: xxhash64 in 8 bytes, or an HMAC-SHA256 in 32
//
// The tags are the block's tenant namespace, adapter and extra keys
// (kvlease.SealInfo's), none of them when all are empty (0 bytes), else:
//
//	u16 len, namespace; i64 lora id; u16 len, lora name;
//	u16 count, then per extra key u16 len, key
//
// The checksum covers the whole slot but itself.
const (
	offTokens = 40
	offKind   = 44
	offNS     = 48
	offFP     = 64
	offTags   = 72
	offSum    = 96
	sumLen    = 32
)

// tagsLen is how many bytes w's tags take in its slot (0: none), ok false
// when a length does not fit its field.
func tagsLen(w *SlotWrite) (n int, ok bool) {
	if w.Namespace == "" && w.Adapter == (kvlease.Adapter{}) && len(w.ExtraKeys) == 0 {
		return 0, true
	}
	ok = len(w.Namespace) <= math.MaxUint16 && len(w.Adapter.Name) <= math.MaxUint16 && len(w.ExtraKeys) <= math.MaxUint16
	n = 2 + len(w.Namespace) + 8 + 2 + len(w.Adapter.Name) + 2
	for _, k := range w.ExtraKeys {
		ok = ok && len(k) <= math.MaxUint16
		n += 2 + len(k)
	}
	return n, ok
}

// appendTags appends w's tags (tagsLen's bytes) to dst.
func appendTags(dst []byte, w *SlotWrite) []byte {
	str := func(dst []byte, s string) []byte {
		return append(binary.LittleEndian.AppendUint16(dst, uint16(len(s))), s...)
	}
	dst = str(dst, w.Namespace)
	dst = binary.LittleEndian.AppendUint64(dst, uint64(int64(w.Adapter.ID)))
	dst = str(dst, w.Adapter.Name)
	dst = binary.LittleEndian.AppendUint16(dst, uint16(len(w.ExtraKeys)))
	for _, k := range w.ExtraKeys {
		dst = str(dst, k)
	}
	return dst
}

// parseTags reads the tags b holds (all of b) into m; ok is false for
// anything appendTags does not write, or an adapter kvlease refuses.
func parseTags(b []byte, m *SlotMeta) (ok bool) {
	if len(b) == 0 {
		return true
	}
	str := func() (string, bool) {
		if len(b) < 2 {
			return "", false
		}
		n := int(binary.LittleEndian.Uint16(b))
		if len(b) < 2+n {
			return "", false
		}
		s := string(b[2 : 2+n])
		b = b[2+n:]
		return s, true
	}
	if m.Namespace, ok = str(); !ok || len(b) < 8 {
		return false
	}
	id := int64(binary.LittleEndian.Uint64(b))
	b = b[8:]
	if id != int64(int(id)) {
		return false
	}
	m.Adapter.ID = int(id)
	if m.Adapter.Name, ok = str(); !ok || len(b) < 2 {
		return false
	}
	n := int(binary.LittleEndian.Uint16(b))
	b = b[2:]
	if n > 0 {
		m.ExtraKeys = make([]string, 0, min(n, len(b)/2))
	}
	for range n {
		k, ok := str()
		if !ok {
			return false
		}
		m.ExtraKeys = append(m.ExtraKeys, k)
	}
	return len(b) == 0 && (m.Adapter.Name != "" || m.Adapter.ID == 0) &&
		(m.Namespace != "" || m.Adapter != (kvlease.Adapter{}) || len(m.ExtraKeys) > 0)
}

// namespaceID is what a slot records of its namespace.
func namespaceID(ns string) (id [16]byte) {
	sum := sha256.Sum256([]byte("kvlease/tiers disk namespace\x00" + ns))
	copy(id[:], sum[:])
	return id
}

// newMAC returns an HMAC-SHA256 under the key, or nil without one; each
// worker and the scan have their own.
func (d *Disk) newMAC() hash.Hash {
	if len(d.cfg.Key) == 0 {
		return nil
	}
	return hmac.New(sha256.New, d.cfg.Key)
}

// encode fills buf (one slot) with the header, the block and its tokens.
func (d *Disk) encode(buf []byte, w *SlotWrite, mac hash.Hash) {
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
	kind := uint32(sumXXHash)
	if mac != nil {
		kind = sumHMAC
	}
	binary.LittleEndian.PutUint32(buf[offKind:], kind)
	copy(buf[offNS:], d.ns[:])
	binary.LittleEndian.PutUint64(buf[offFP:], d.cfg.Fingerprint)
	body := headerSize + d.cfg.BlockBytes
	n := copy(buf[headerSize:body], w.Src)
	clear(buf[headerSize+n:])
	if tl, _ := tagsLen(w); tl > 0 && body+tl <= len(buf) { // (Write checked it fits)
		binary.LittleEndian.PutUint32(buf[offTags:], uint32(tl))
		appendTags(buf[body:body], w)
		body += tl
	}
	if len(w.Tokens) > 0 && body+4*len(w.Tokens) <= len(buf) {
		binary.LittleEndian.PutUint32(buf[offTokens:], uint32(len(w.Tokens)))
		for i, t := range w.Tokens {
			binary.LittleEndian.PutUint32(buf[body+4*i:], uint32(t))
		}
	}
	d.sum(buf[offSum:offSum:offSum+sumLen], buf, mac)
}

// sum appends the slot's checksum (or MAC) to dst: it covers the header
// but the checksum itself, the block, the tokens and the zero padding.
func (d *Disk) sum(dst, buf []byte, mac hash.Hash) []byte {
	if mac != nil {
		mac.Reset()
		_, _ = mac.Write(buf[:offSum])
		_, _ = mac.Write(buf[offSum+sumLen:])
		return mac.Sum(dst)
	}
	var x xxhash.Digest
	x.Reset()
	_, _ = x.Write(buf[:offSum])
	_, _ = x.Write(buf[offSum+sumLen:])
	return binary.LittleEndian.AppendUint64(dst, x.Sum64())
}

// decode checks a slot read into buf; ok is false for anything but a
// whole, valid slot of this tier's namespace, fingerprint and key.
func (d *Disk) decode(buf []byte, mac hash.Hash) (m SlotMeta, ok bool) {
	body := headerSize + d.cfg.BlockBytes
	nt := uint64(binary.LittleEndian.Uint32(buf[offTokens:]))
	tl := uint64(binary.LittleEndian.Uint32(buf[offTags:]))
	kind := uint32(sumXXHash)
	if mac != nil {
		kind = sumHMAC
	}
	if binary.LittleEndian.Uint64(buf[0:]) != slotMagic ||
		binary.LittleEndian.Uint64(buf[32:]) != uint64(d.cfg.BlockBytes) ||
		uint64(body)+tl+4*nt > uint64(len(buf)) ||
		binary.LittleEndian.Uint32(buf[offKind:]) != kind ||
		[16]byte(buf[offNS:offNS+16]) != d.ns ||
		binary.LittleEndian.Uint64(buf[offFP:]) != d.cfg.Fingerprint {
		return SlotMeta{}, false
	}
	var want [sumLen]byte
	d.sum(want[:0], buf, mac)
	if subtle.ConstantTimeCompare(want[:], buf[offSum:offSum+sumLen]) != 1 {
		return SlotMeta{}, false
	}
	flags := binary.LittleEndian.Uint64(buf[24:])
	m = SlotMeta{
		Hash:      kvlease.BlockHash(binary.LittleEndian.Uint64(buf[8:])),
		Parent:    kvlease.BlockHash(binary.LittleEndian.Uint64(buf[16:])),
		HasParent: flags&1 != 0,
		Chained:   flags&2 != 0,
	}
	if !parseTags(buf[body:body+int(tl)], &m) {
		return SlotMeta{}, false
	}
	body += int(tl)
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
// not the namespace seed of a chain's first block), its tags (the tenant
// namespace, adapter and extra keys it was sealed with: see
// kvlease.SealInfo) and, when they fit in the slot, its tokens.
type SlotMeta struct {
	Hash      kvlease.BlockHash
	Parent    kvlease.BlockHash
	HasParent bool
	Chained   bool
	Tokens    []int32
	Namespace string
	Adapter   kvlease.Adapter
	ExtraKeys []string
}

// sealInfo is m as the seal record it mirrors: a block rebuilt from its
// slot is sealed as its header says.
func (m SlotMeta) sealInfo() kvlease.SealInfo {
	return kvlease.SealInfo{Hash: m.Hash, Parent: m.Parent, HasParent: m.HasParent, Chained: m.Chained, Tokens: m.Tokens,
		Namespace: m.Namespace, Adapter: m.Adapter, ExtraKeys: m.ExtraKeys}
}

// SlotWrite is one block written to a disk slot: the block, and what the
// slot's header records about it. Its tags (Namespace, Adapter,
// ExtraKeys) always: Write refuses a block whose tags do not fit in the
// slot after the block (every slot keeps 512 bytes for them, and what
// its last page has left). Tokens only when they fit after the tags (a
// block of whole 4 KiB pages has room for about 870).
type SlotWrite struct {
	Src       []byte
	Dst       DiskSlot
	Hash      kvlease.BlockHash
	Parent    kvlease.BlockHash
	HasParent bool
	Chained   bool
	Tokens    []int32
	Namespace string
	Adapter   kvlease.Adapter
	ExtraKeys []string
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

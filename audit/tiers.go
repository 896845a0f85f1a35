package audit

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
	"go.uber.org/atomic"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/gpu"
	"github.com/kvlease/kvlease/tiers"
)

// TiersConfig describes a run of the tiers audit (RunTiers): a tiered
// cache (package tiers) over a device pool, a host pool and a disk tier,
// driven by requests with shared prefixes, with faults injected into every
// copy between the tiers. Start from DefaultTiersConfig.
type TiersConfig struct {
	// Seed draws the workload and the faults. Copies run on their own
	// goroutines, so a run is not replayable step by step; what it checks
	// holds whatever the interleaving.
	Seed uint64
	// Requests is the number of requests to run.
	Requests int
	// DeviceBlocks, HostBlocks and DiskSlots size the tiers (DiskSlots 0:
	// no disk tier); BlockBytes is the size of one block (at least 64).
	DeviceBlocks, HostBlocks, DiskSlots int
	BlockBytes                          int
	// Docs documents of DocBlocks blocks are the shared prefixes; a
	// request asks for a leading part of one of them plus up to two
	// blocks of its own. MaxLive requests are in flight at once.
	Docs, DocBlocks int
	MaxLive         int
	// Policy is the cache's offload policy (zero: write-back).
	Policy tiers.Policy
	// Faults are the probabilities of the injected faults.
	Faults TiersFaults
	// SweepEvery is how many requests pass between sweeps: every tier's
	// findable blocks of every document are read back and checked, and
	// every pool is checked (Pool.Check).
	SweepEvery int
	// Dir holds the disk tier's files; empty means a temporary directory
	// removed at the end.
	Dir string
	// GPU, when set, runs the audit on that device (gpu.Open, or the CPU
	// fallback gpu.OpenHost): the device tier in a DeviceArena, the host
	// tier in a PinnedArena, every copy between them through the device's
	// real copy engines, one forced onto the kernel and one onto the copy
	// engine, used alternately; device blocks are written and checked
	// through synchronous copies. The copies are real, so the faults that
	// fake a copy (CopyFail, Stall, Quarantine) do not apply; Cancel,
	// Abort, DiskFail and Corrupt do. BlockBytes must be a multiple of
	// gpu.Alignment. RunTiers does not close the device.
	GPU *gpu.Device

	lieOnFail bool // tests: a failed copy reports success (the audit must catch it)
	// tests: the share of device hits whose block is overwritten with junk
	// behind the cache's back before the audit reads it (it must catch it)
	corruptHits float64
}

// TiersFaults are the faults of a tiers audit, as probabilities.
type TiersFaults struct {
	// CopyFail: a device↔host copy writes part of its blocks and junk
	// into the rest, then resolves with an error.
	CopyFail float64
	// Stall: a copy, or one disk slot's I/O, waits until the driver lets
	// it go (many requests later, or at the drain).
	Stall float64
	// Quarantine: a device↔host copy writes junk, is quarantined (ended
	// without proof), and resolves only when the driver delivers late
	// evidence (half of them having finished the copy, half not).
	Quarantine float64
	// DiskFail: one disk slot's read or write fails before it touches the
	// file (the job stops there and resolves with the error).
	DiskFail float64
	// Corrupt: per request, a few bytes of a disk slot file are
	// overwritten at rest, behind the tier's back.
	Corrupt float64
	// Abort: per step on a live request, it is aborted, whether or not
	// its onboarding copies have resolved.
	Abort float64
	// Cancel: a device↔host copy is canceled right after it started (a
	// copy the device already holds finishes anyway; one it has not begun
	// may be skipped, and must then never be served).
	Cancel float64
}

// DefaultTiersConfig returns a small, fault-heavy configuration that runs
// in about a second: a device pool a quarter of the documents' working
// set, a host pool that holds the rest, a disk tier below.
func DefaultTiersConfig() TiersConfig {
	return TiersConfig{
		Seed:         1,
		Requests:     2000,
		DeviceBlocks: 48, HostBlocks: 96, DiskSlots: 256,
		BlockBytes: 512,
		Docs:       24, DocBlocks: 8,
		MaxLive: 4,
		Policy:  tiers.WriteBack,
		Faults: TiersFaults{
			CopyFail: 0.04, Stall: 0.08, Quarantine: 0.03,
			DiskFail: 0.04, Corrupt: 0.01, Abort: 0.05, Cancel: 0.03,
		},
		SweepEvery: 50,
	}
}

func (c *TiersConfig) validate() error {
	f := c.Faults
	probs := []float64{f.CopyFail, f.Stall, f.Quarantine, f.DiskFail, f.Corrupt, f.Abort, f.Cancel}
	for _, p := range probs {
		if p < 0 || p > 1 {
			return fmt.Errorf("audit: tiers fault probability %v outside [0, 1]: %w", p, kvlease.ErrInvalidArgument)
		}
	}
	switch {
	case c.Requests <= 0, c.DeviceBlocks <= 0, c.HostBlocks <= 0, c.DiskSlots < 0,
		c.BlockBytes < 64, c.BlockBytes%8 != 0, c.Docs <= 0, c.DocBlocks <= 0, c.MaxLive <= 0, c.SweepEvery < 0:
		return fmt.Errorf("audit: tiers config %+v: sizes must be positive (block bytes a multiple of 8, at least 64): %w", *c, kvlease.ErrInvalidArgument)
	case c.MaxLive*(c.DocBlocks+2) > c.DeviceBlocks:
		return fmt.Errorf("audit: %d live requests of up to %d blocks do not fit %d device blocks: %w",
			c.MaxLive, c.DocBlocks+2, c.DeviceBlocks, kvlease.ErrInvalidArgument)
	case f.CopyFail+f.Stall+f.Quarantine > 1 || f.Stall+f.DiskFail > 1:
		return fmt.Errorf("audit: copy fault probabilities sum over 1: %w", kvlease.ErrInvalidArgument)
	}
	return nil
}

// TiersReport is the outcome of RunTiers.
type TiersReport struct {
	Seed     uint64
	Requests int // requests admitted
	Refused  int // requests the device pool refused (exhausted): nothing held
	Aborted  int // requests aborted, most with copies in flight
	Elapsed  time.Duration

	// Queried blocks and the hits of each tier, as the driver saw them in
	// every Onboard; Checked is how many onboarded or hit blocks had their
	// content checked (every valid block of every request, and the sweeps).
	Queried uint64
	Hits    [3]uint64
	Checked uint64

	// Faults injected.
	CopyFails, Stalls, Quarantines, DiskFails, Corruptions, Cancels int

	// On a GPU (TiersConfig.GPU): the device's name and how many copies
	// each path carried (submissions: kernel launches, and batched or
	// looped copy-engine submissions).
	Device                       string
	KernelSubmits, EngineSubmits int64

	// Stats is the cache's own counters at the end.
	Stats tiers.Stats

	// Mismatches: a block served as valid (a hit, or an onboarded block
	// within Onboard.Valid) held another block's content. UnknownReads: it
	// held content no completed copy wrote (junk of a failed or
	// quarantined copy, or nothing yet). Other: accounting, settling,
	// Pool.Check, counters that disagree with the driver's.
	Mismatches, UnknownReads, Other int
	Violations                      []string // the first few, described

	// Events is how many KV events the tiers published (every tier's pool
	// has them on); EventDrops how many their rings dropped (the view
	// resynchronised from a snapshot then). Every stored event is checked
	// (a block of the workload, its tokens, its parent when it names one)
	// and, at rest, each tier's replayed events must match what its pool
	// serves; failures count in Other.
	Events, EventDrops int
}

// Total returns the number of violations.
func (r *TiersReport) Total() int { return r.Mismatches + r.UnknownReads + r.Other }

// OK reports whether the run found no violation.
func (r *TiersReport) OK() bool { return r.Total() == 0 }

// Write prints the report; its last line starts with OK or FAIL.
func (r *TiersReport) Write(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "kvaudit tiers: seed %d, %d requests (%d refused, %d aborted) in %v\n",
		r.Seed, r.Requests, r.Refused, r.Aborted, r.Elapsed.Round(time.Millisecond))
	fmt.Fprintf(&b, "blocks queried %d, hits device %d host %d disk %d, content checked %d\n",
		r.Queried, r.Hits[0], r.Hits[1], r.Hits[2], r.Checked)
	fmt.Fprintf(&b, "faults: copy failures %d, stalls %d, quarantines %d, disk failures %d, corruptions %d, cancels %d\n",
		r.CopyFails, r.Stalls, r.Quarantines, r.DiskFails, r.Corruptions, r.Cancels)
	if r.Device != "" {
		fmt.Fprintf(&b, "device %s: copies by the kernel %d, by the copy engine %d (submissions)\n", r.Device, r.KernelSubmits, r.EngineSubmits)
	}
	for t := tiers.TierDevice; t <= tiers.TierDisk; t++ {
		s := r.Stats.Tiers[t]
		fmt.Fprintf(&b, "tier %s: hits %d offloaded %d onboarded %d copy failures %d dropped %d\n",
			t, s.Hits, s.Offloaded, s.Onboarded, s.CopyFailures, s.Dropped)
	}
	fmt.Fprintf(&b, "KV events %d (dropped %d), checked against each tier's index\n", r.Events, r.EventDrops)
	fmt.Fprintf(&b, "marker mismatches %d\nunknown reads %d\nother violations %d\n", r.Mismatches, r.UnknownReads, r.Other)
	for _, v := range r.Violations {
		fmt.Fprintf(&b, "  %s\n", v)
	}
	if r.OK() {
		b.WriteString("OK\n")
	} else {
		fmt.Fprintf(&b, "FAIL: %d violations\n", r.Total())
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// TierStamp fills b with the content of the prefix block whose hash is h:
// the marker of tiered KV, whose content is a function of its prefix.
func TierStamp(b []byte, h kvlease.BlockHash) {
	var x [16]byte
	binary.LittleEndian.PutUint64(x[:], uint64(h))
	for off := 0; off+8 <= len(b); off += 8 {
		binary.LittleEndian.PutUint64(x[8:], uint64(off))
		binary.LittleEndian.PutUint64(b[off:], xxhash.Sum64(x[:]))
	}
}

// junkByte fills what failed and quarantined copies leave behind.
const junkByte = 0xDB

func junk(b []byte) {
	for i := range b {
		b[i] = junkByte
	}
}

// classify compares a block with the content of h: 0 when it holds it,
// 2 for content no completed copy wrote (a failed or quarantined copy's
// junk, or a fresh block's zeros), 1 for any other content (another
// block's).
func classify(b []byte, h kvlease.BlockHash, want []byte) int {
	TierStamp(want, h)
	if string(b) == string(want) {
		return 0
	}
	for off := 0; off+8 <= len(b); off += 8 {
		if w := binary.LittleEndian.Uint64(b[off:]); w == 0 || w == 0xDBDBDBDBDBDBDBDB {
			return 2
		}
	}
	return 1
}

var (
	errInjectedCopy = errors.New("audit: injected copy failure")
	errInjectedDisk = errors.New("audit: injected disk failure")
	errInjectedQuar = errors.New("audit: injected quarantine (device lost)")
	errLateFailed   = errors.New("audit: late evidence: the quarantined copy never finished")
	errStallCancel  = errors.New("audit: stalled copy canceled")
)

// tiersRun is one run's state. D is the device pool's region: []byte in
// memory, gpu.DevicePtr on a device.
type tiersRun[D any] struct {
	cfg  TiersConfig
	rep  *TiersReport
	rmu  sync.Mutex // guards rep's counters and violations written off the driver's goroutine
	rngM sync.Mutex
	rng  *rand.Rand

	dev   *kvlease.Pool[D]
	host  *kvlease.Pool[[]byte]
	disk  *tiers.Disk
	cache *tiers.Cache[D]
	dir   string
	// load returns a device block's content (the region itself in memory,
	// a copy read back from the device on a GPU); store writes content
	// into a device block. Both run on the driver's goroutine only.
	load  func(D) ([]byte, error)
	store func(D, []byte) error

	hmu      sync.Mutex
	held     []func() // stalled and quarantined copies, waiting for the driver
	draining atomic.Bool

	docs  [][]kvlease.BlockHash
	want  []byte // classify's scratch
	stamp []byte // a block's content, written by complete

	// What every block of the workload is, for checking KV events: its
	// parent (the seed for a chain's first block) and tokens.
	blocks map[kvlease.BlockHash]blockInfo
	// views replays each tier's KV events: the blocks it says are
	// findable (device, host, disk).
	views [3]map[kvlease.BlockHash]bool
}

type blockInfo struct {
	parent kvlease.BlockHash
	first  bool
	tokens []int32
}

// tierBlockTokens is the tiers audit's block size in tokens.
const tierBlockTokens = 4

// addChain records a chain's blocks; hashes[k] is the block of tokens
// toks[4k:4k+4] under hashes[k-1] (seed for k == 0).
func (r *tiersRun[D]) addChain(seed kvlease.BlockHash, toks []int32, hashes []kvlease.BlockHash) {
	for k, h := range hashes {
		info := blockInfo{parent: seed, first: k == 0, tokens: toks[tierBlockTokens*k : tierBlockTokens*(k+1)]}
		if k > 0 {
			info.parent = hashes[k-1]
		}
		r.blocks[h] = info
	}
}

// drainEvents applies each tier's KV events to its view and checks each:
// a block of the workload, stored with its tokens and, when it names a
// parent, the right one. A ring that overflowed resynchronises the view
// from the pool's snapshot (counted, not a violation).
func (r *tiersRun[D]) drainEvents() {
	for t, src := range r.cache.EventSources() {
		evs, dropped := src.Pool.DrainKVEvents(nil)
		view := r.views[t]
		if dropped > 0 {
			r.rep.EventDrops += int(dropped)
			_, snap := src.Pool.SnapshotKVBlocks(nil)
			clear(view)
			for _, e := range snap {
				view[e.BlockHash] = true
			}
			continue
		}
		for _, e := range evs {
			r.rep.Events++
			switch e.Kind {
			case kvlease.KVAllBlocksCleared:
				clear(view)
			case kvlease.KVBlockRemoved:
				delete(view, e.BlockHash)
			case kvlease.KVBlockStored:
				view[e.BlockHash] = true
				info, ok := r.blocks[e.BlockHash]
				switch {
				case !ok:
					r.violate(&r.rep.Other, "%s stored an unknown block %016x", src.Medium, uint64(e.BlockHash))
				case e.HasParent && (info.first || e.ParentBlockHash != info.parent):
					r.violate(&r.rep.Other, "%s stored %016x under parent %016x, not its own", src.Medium, uint64(e.BlockHash), uint64(e.ParentBlockHash))
				case e.TokenIDs == nil:
					r.violate(&r.rep.Other, "%s stored %016x without its tokens", src.Medium, uint64(e.BlockHash))
				case !slices.Equal(e.TokenIDs, info.tokens) || e.HasParent == info.first:
					r.violate(&r.rep.Other, "%s stored %016x with tokens %v (parent named: %v), want %v", src.Medium, uint64(e.BlockHash), e.TokenIDs, e.HasParent, info.tokens)
				}
			}
		}
	}
}

// checkViews compares each tier's replayed events with what its pool can
// actually serve (at rest: nothing changes meanwhile).
func (r *tiersRun[D]) checkViews() {
	for t, src := range r.cache.EventSources() {
		_, snap := src.Pool.SnapshotKVBlocks(nil)
		if len(snap) != len(r.views[t]) {
			r.violate(&r.rep.Other, "%s events say %d blocks are findable, the pool has %d", src.Medium, len(r.views[t]), len(snap))
			continue
		}
		for _, e := range snap {
			if h := e.BlockHash; !r.views[t][h] {
				r.violate(&r.rep.Other, "%s pool serves %016x, its events never stored it", src.Medium, uint64(h))
				break
			}
		}
	}
}

func (r *tiersRun[D]) chance(p float64) bool {
	if p <= 0 || r.draining.Load() {
		return false
	}
	r.rngM.Lock()
	defer r.rngM.Unlock()
	return r.rng.Float64() < p
}

func (r *tiersRun[D]) intN(n int) int {
	r.rngM.Lock()
	defer r.rngM.Unlock()
	return r.rng.IntN(n)
}

func (r *tiersRun[D]) violate(kind *int, format string, args ...any) {
	r.rmu.Lock()
	defer r.rmu.Unlock()
	*kind++
	if len(r.rep.Violations) < 20 {
		r.rep.Violations = append(r.rep.Violations, fmt.Sprintf(format, args...))
	}
}

func (r *tiersRun[D]) count(n *int) {
	r.rmu.Lock()
	*n++
	r.rmu.Unlock()
}

func (r *tiersRun[D]) hold(fn func()) {
	r.hmu.Lock()
	r.held = append(r.held, fn)
	r.hmu.Unlock()
}

// letGo releases one held copy at random; false when none is held.
func (r *tiersRun[D]) letGo() bool {
	r.hmu.Lock()
	if len(r.held) == 0 {
		r.hmu.Unlock()
		return false
	}
	i := r.intN(len(r.held))
	fn := r.held[i]
	r.held[i] = r.held[len(r.held)-1]
	r.held = r.held[:len(r.held)-1]
	r.hmu.Unlock()
	fn()
	return true
}

// await waits for ch, letting held copies go one by one while it is not
// closed (copies may be held while it waits: an onboard from disk starts
// its second copy only when the first is done). A wait that sees no copy
// held for 20 seconds is stuck: a copy that neither resolves nor is held,
// a violation.
func (r *tiersRun[D]) await(ch <-chan struct{}, what string) bool {
	idleSince := time.Now()
	for {
		select {
		case <-ch:
			return true
		default:
		}
		if r.letGo() {
			idleSince = time.Now()
			continue
		}
		if time.Since(idleSince) > 20*time.Second {
			r.violate(&r.rep.Other, "%s: stuck with no copy held", what)
			return false
		}
		select {
		case <-ch:
			return true
		case <-time.After(200 * time.Microsecond):
		}
	}
}

// copier is the audit's device↔host transport: a plain copy on a
// goroutine of its own, or one of the injected faults.
type copier struct{ r *tiersRun[[]byte] }

func (c copier) Start(pairs []kvlease.CopyPair[[]byte, []byte], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	if len(pairs) == 0 || attach == nil {
		return nil, fmt.Errorf("audit: copy of %d pairs: %w", len(pairs), kvlease.ErrInvalidArgument)
	}
	r := c.r
	f := r.cfg.Faults
	var canceled atomic.Bool
	t := kvlease.NewTransfer(func() { canceled.Store(true) })
	if err := attach(t); err != nil {
		t.Resolve(err)
		return t, err
	}
	copyAll := func() bool {
		for _, p := range pairs {
			if canceled.Load() {
				return false
			}
			copy(p.Dst, p.Src)
		}
		return true
	}
	switch {
	case r.chance(f.CopyFail):
		r.count(&r.rep.CopyFails)
		go func() {
			half := len(pairs) / 2
			for i, p := range pairs {
				if i < half {
					copy(p.Dst, p.Src)
				} else {
					junk(p.Dst)
				}
			}
			if r.cfg.lieOnFail {
				t.Resolve(nil)
				return
			}
			t.Resolve(errInjectedCopy)
		}()
	case r.chance(f.Stall):
		r.count(&r.rep.Stalls)
		r.hold(func() {
			if copyAll() {
				t.Resolve(nil)
			} else {
				t.Resolve(errStallCancel)
			}
		})
	case r.chance(f.Quarantine):
		r.count(&r.rep.Quarantines)
		for _, p := range pairs {
			junk(p.Dst)
		}
		t.Quarantine(errInjectedQuar)
		finish := r.chance(0.5)
		r.hold(func() {
			if finish && copyAll() {
				t.Resolve(nil)
			} else {
				t.Resolve(errLateFailed)
			}
		})
	default:
		go func() {
			if copyAll() {
				t.Resolve(nil)
			} else {
				t.Resolve(errStallCancel)
			}
		}()
	}
	return t, nil
}

// beforeIO is the disk tier's fault hook.
func (r *tiersRun[D]) beforeIO(write bool, slot tiers.DiskSlot) error {
	f := r.cfg.Faults
	switch {
	case r.chance(f.DiskFail):
		r.count(&r.rep.DiskFails)
		return fmt.Errorf("slot %d (write %v): %w", slot, write, errInjectedDisk)
	case r.chance(f.Stall):
		r.count(&r.rep.Stalls)
		ch := make(chan struct{})
		r.hold(func() { close(ch) })
		<-ch
	}
	return nil
}

// corrupt overwrites a few bytes of a slot file at rest.
func (r *tiersRun[D]) corrupt() error {
	entries, err := os.ReadDir(r.dir)
	if err != nil {
		return err
	}
	var files []string
	for _, e := range entries {
		if strings.HasSuffix(e.Name(), ".slots") {
			files = append(files, filepath.Join(r.dir, e.Name()))
		}
	}
	if len(files) == 0 {
		return nil
	}
	f, err := os.OpenFile(files[r.intN(len(files))], os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if fi.Size() < 16 {
		return nil
	}
	b := make([]byte, 8)
	for i := range b {
		b[i] = byte(r.intN(256))
	}
	if _, err := f.WriteAt(b, int64(r.intN(int(fi.Size()-8)))); err != nil {
		return err
	}
	r.count(&r.rep.Corruptions)
	return nil
}

// check compares block b, served as holding h, and records a violation.
func (r *tiersRun[D]) check(b []byte, h kvlease.BlockHash, where string) {
	r.rep.Checked++
	switch classify(b, h, r.want) {
	case 1:
		r.violate(&r.rep.Mismatches, "%s: holds another block's content (want %016x)", where, uint64(h))
	case 2:
		r.violate(&r.rep.UnknownReads, "%s: holds content no completed copy wrote (want %016x)", where, uint64(h))
	}
}

type tiersReq[D any] struct {
	id     int
	o      *tiers.Onboard[D]
	hashes []kvlease.BlockHash
}

// arrive admits one request: a leading part of a document and up to two
// blocks of its own.
func (r *tiersRun[D]) arrive(id int) *tiersReq[D] {
	doc := r.docs[r.intN(len(r.docs))]
	p := r.cfg.DocBlocks
	if r.chance(0.3) {
		p = 1 + r.intN(r.cfg.DocBlocks)
	}
	hashes := append([]kvlease.BlockHash(nil), doc[:p]...)
	for k := range r.intN(3) {
		toks := []int32{int32(id), int32(k), -1, -2}
		h := kvlease.HashBlock(hashes[len(hashes)-1], toks)
		r.blocks[h] = blockInfo{parent: hashes[len(hashes)-1], tokens: toks}
		hashes = append(hashes, h)
	}
	o, err := r.cache.Acquire(fmt.Sprintf("r%d", id), hashes, len(hashes))
	if err != nil {
		if !errors.Is(err, kvlease.ErrExhausted) {
			r.violate(&r.rep.Other, "request %d: acquire: %v", id, err)
		}
		r.rep.Refused++
		// The blocks come back as copies land and offers are copied: let
		// the copies, the cache's offload worker and the disk's workers
		// run, as an engine waiting for memory would.
		time.Sleep(50 * time.Microsecond)
		return nil
	}
	r.rep.Requests++
	r.rep.Queried += uint64(len(hashes))
	for t := tiers.TierDevice; t <= tiers.TierDisk; t++ {
		r.rep.Hits[t] += uint64(o.Hits(t))
	}
	// Device hits are usable at once.
	for k := range o.Hits(tiers.TierDevice) {
		if r.chance(r.cfg.corruptHits) {
			if p, err := r.dev.Region(o.Lease.Ref(k)); err == nil {
				junk(r.stamp)
				_ = r.store(p, r.stamp)
			}
		}
		b, err := r.loadRef(o.Lease.Ref(k))
		if err != nil {
			r.violate(&r.rep.Other, "request %d: device hit %d: %v", id, k, err)
			continue
		}
		r.check(b, hashes[k], fmt.Sprintf("request %d device hit %d", id, k))
	}
	return &tiersReq[D]{id: id, o: o, hashes: hashes}
}

// complete finishes a request whose onboard is ready: check the valid
// prefix, compute and seal the rest, check the whole lease, release.
// loadRef returns the content of the device block ref names.
func (r *tiersRun[D]) loadRef(ref kvlease.BlockRef) ([]byte, error) {
	p, err := r.dev.Region(ref)
	if err != nil {
		return nil, err
	}
	return r.load(p)
}

func (r *tiersRun[D]) complete(q *tiersReq[D]) {
	valid, err := q.o.Wait(context.Background())
	l := q.o.Lease
	if valid > q.o.Prefix() || (err == nil && valid != q.o.Prefix()) {
		r.violate(&r.rep.Other, "request %d: valid %d of a prefix of %d (error %v)", q.id, valid, q.o.Prefix(), err)
	}
	for k := range valid {
		b, err := r.loadRef(l.Ref(k))
		if err != nil {
			r.violate(&r.rep.Other, "request %d: region %d: %v", q.id, k, err)
			continue
		}
		r.check(b, q.hashes[k], fmt.Sprintf("request %d onboarded block %d", q.id, k))
	}
	for k := valid; k < len(q.hashes); k++ {
		p, err := l.Region(k)
		if err == nil {
			TierStamp(r.stamp, q.hashes[k])
			err = r.store(p, r.stamp)
		}
		if err != nil {
			r.violate(&r.rep.Other, "request %d: region %d: %v", q.id, k, err)
			continue
		}
		parent := kvlease.BlockHash(0)
		if k > 0 {
			parent = q.hashes[k-1]
		}
		if k == 0 {
			parent = kvlease.BlockHash(r.cfg.Seed)
		}
		h, err := r.cache.SealTokens(l, k, parent, r.blocks[q.hashes[k]].tokens)
		if err != nil {
			r.violate(&r.rep.Other, "request %d: seal %d: %v", q.id, k, err)
		} else if h != q.hashes[k] {
			r.violate(&r.rep.Other, "request %d: block %d sealed as %016x, want %016x", q.id, k, uint64(h), uint64(q.hashes[k]))
		}
	}
	// Nothing wrote into the lease behind its back meanwhile.
	for k := range q.hashes {
		if b, err := r.loadRef(l.Ref(k)); err == nil {
			r.check(b, q.hashes[k], fmt.Sprintf("request %d block %d at release", q.id, k))
		}
	}
	l.Release()
}

// sweep reads back every tier's findable blocks of every document and
// checks them, and checks every pool.
func (r *tiersRun[D]) sweep() {
	for d, doc := range r.docs {
		if l, err := r.dev.AcquireHits("audit/sweep", doc); err != nil {
			r.violate(&r.rep.Other, "sweep device doc %d: %v", d, err)
		} else if l != nil {
			for k := range l.Len() {
				if b, err := r.loadRef(l.Ref(k)); err == nil {
					r.check(b, doc[k], fmt.Sprintf("device tier doc %d block %d", d, k))
				}
			}
			l.Release()
		}
		if l, err := r.host.AcquireHits("audit/sweep", doc); err != nil {
			r.violate(&r.rep.Other, "sweep host doc %d: %v", d, err)
		} else if l != nil {
			for k := range l.Len() {
				if b, err := r.host.Region(l.Ref(k)); err == nil {
					r.check(b, doc[k], fmt.Sprintf("host tier doc %d block %d", d, k))
				}
			}
			l.Release()
		}
		if r.disk == nil {
			continue
		}
		dl := r.disk.Lookup("audit/sweep", doc)
		if dl == nil {
			continue
		}
		bufs := make([]byte, dl.Len()*r.cfg.BlockBytes)
		reads := make([]tiers.SlotRead, dl.Len())
		for k := range reads {
			reads[k] = tiers.SlotRead{Src: r.disk.Region(dl.Ref(k).ID), Dst: bufs[k*r.cfg.BlockBytes : (k+1)*r.cfg.BlockBytes], Hash: doc[k]}
		}
		t, err := r.disk.Read(reads, func(t *kvlease.Transfer) error { return dl.AttachRange(t, 0, dl.Len(), kvlease.Read) })
		if err != nil {
			r.violate(&r.rep.Other, "sweep disk doc %d: %v", d, err)
			dl.Release()
			continue
		}
		if r.await(t.Done(), "sweep disk read") && t.Err() == nil {
			// A failed read (corrupt slot, injected failure) is a miss.
			for k := range reads {
				r.check(reads[k].Dst, doc[k], fmt.Sprintf("disk tier doc %d block %d", d, k))
			}
		}
		dl.Release()
	}
	r.checkPools()
	r.drainEvents()
}

func (r *tiersRun[D]) checkPools() {
	pools := []struct {
		name string
		err  error
		s    kvlease.Stats
	}{{"device", r.dev.Check(), r.dev.Stats()}, {"host", r.host.Check(), r.host.Stats()}}
	if r.disk != nil {
		pools = append(pools, struct {
			name string
			err  error
			s    kvlease.Stats
		}{"disk", r.disk.Pool().Check(), r.disk.Pool().Stats()})
	}
	for _, p := range pools {
		if p.err != nil {
			r.violate(&r.rep.Other, "%s pool: %v", p.name, p.err)
		}
		s := p.s
		if s.Free+s.Cached+s.Leased+s.Draining+s.Quarantined != s.Capacity {
			r.violate(&r.rep.Other, "%s pool: counts %+v do not sum to capacity", p.name, s)
		}
	}
}

// RunTiers runs the tiers audit: requests onboard their prefixes across
// the tiers while copies fail, stall, are canceled and are quarantined,
// disk slots fail and are corrupted at rest, and requests are aborted
// mid-copy. It checks the content of every block served as valid (every
// device hit, every onboarded block within Onboard.Valid, and in sweeps
// every findable block of every tier), the content of every lease at
// release (no late write landed in it), the pools' accounting, that the
// cache's hit counters agree with what the Onboards said, and, after the
// drain (every held copy let go, late evidence delivered), that every
// pool settles with nothing leased, draining or quarantined. With
// cfg.GPU set it runs on that device (see TiersConfig.GPU). The error is
// for a configuration it refuses, or a disk tier or device memory it
// cannot get; violations are in the report.
func RunTiers(cfg TiersConfig) (*TiersReport, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if cfg.GPU != nil {
		return runTiersGPU(cfg)
	}
	r := newTiersRun[[]byte](cfg)
	r.load = func(b []byte) ([]byte, error) { return b, nil }
	r.store = func(b, src []byte) error { copy(b, src); return nil }
	dm, err := kvlease.NewHostMemory(cfg.DeviceBlocks, cfg.BlockBytes)
	if err != nil {
		return nil, err
	}
	hm, err := kvlease.NewHostMemory(cfg.HostBlocks, cfg.BlockBytes)
	if err != nil {
		return nil, err
	}
	if r.dev, err = kvlease.NewPool[[]byte](dm, tierPoolOptions()...); err != nil {
		return nil, err
	}
	if r.host, err = kvlease.NewPool[[]byte](hm, tierPoolOptions()...); err != nil {
		return nil, err
	}
	return r.run(copier{r}, copier{r})
}

// tierPoolOptions: every tier publishes KV events (the ring holds far
// more than a sweep's worth), so the run checks them too.
func tierPoolOptions() []kvlease.Option {
	return []kvlease.Option{kvlease.WithBlockTokens(tierBlockTokens), kvlease.WithKVEvents(1 << 16)}
}

func newTiersRun[D any](cfg TiersConfig) *tiersRun[D] {
	return &tiersRun[D]{cfg: cfg, rep: &TiersReport{Seed: cfg.Seed}, rng: rand.New(rand.NewPCG(cfg.Seed, 0x7469657273)),
		want: make([]byte, cfg.BlockBytes), stamp: make([]byte, cfg.BlockBytes)}
}

// faultyTransport is the cache's device↔host transport as the audit
// hands it over: it alternates between two transports (when both are
// set) and cancels a share of the copies right after they start.
type faultyTransport[S, D any] struct {
	next [2]kvlease.Transport[S, D]
	n    *atomic.Uint64
	// after runs on every transfer started.
	after func(*kvlease.Transfer)
}

func (f faultyTransport[S, D]) Start(pairs []kvlease.CopyPair[S, D], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	next := f.next[0]
	if f.next[1] != nil && f.n.Add(1)%2 == 0 {
		next = f.next[1]
	}
	t, err := next.Start(pairs, attach)
	if err == nil && t != nil {
		f.after(t)
	}
	return t, err
}

// cancelSome is the Cancel fault: a copy canceled as soon as it started.
func (r *tiersRun[D]) cancelSome(t *kvlease.Transfer) {
	if r.chance(r.cfg.Faults.Cancel) {
		r.count(&r.rep.Cancels)
		t.Cancel()
	}
}

// run drives the requests over r's pools (set by the caller) with the
// given device↔host transports, then drains and checks; it closes the
// pools.
func (r *tiersRun[D]) run(offload kvlease.Transport[D, []byte], onload kvlease.Transport[[]byte, D]) (*TiersReport, error) {
	cfg, rep := r.cfg, r.rep
	start := time.Now()
	var err error
	if cfg.DiskSlots > 0 {
		r.dir = cfg.Dir
		if r.dir == "" {
			if r.dir, err = os.MkdirTemp("", "kvaudit-tiers-"); err != nil {
				return nil, err
			}
			defer os.RemoveAll(r.dir)
		}
		r.disk, err = tiers.OpenDisk(tiers.DiskConfig{Dir: r.dir, Files: 2, Slots: cfg.DiskSlots,
			BlockBytes: cfg.BlockBytes, Workers: 2, BeforeIO: r.beforeIO, PoolOptions: tierPoolOptions()})
		if err != nil {
			return nil, err
		}
	}
	var n1, n2 atomic.Uint64
	if r.cache, err = tiers.New(tiers.Config[D]{Device: r.dev, Host: r.host, Disk: r.disk,
		Offload: faultyTransport[D, []byte]{next: [2]kvlease.Transport[D, []byte]{offload}, n: &n1, after: r.cancelSome},
		Onload:  faultyTransport[[]byte, D]{next: [2]kvlease.Transport[[]byte, D]{onload}, n: &n2, after: r.cancelSome},
		Policy:  cfg.Policy}); err != nil {
		return nil, err
	}
	r.blocks = make(map[kvlease.BlockHash]blockInfo)
	for t := range r.views {
		r.views[t] = make(map[kvlease.BlockHash]bool)
	}
	r.docs = make([][]kvlease.BlockHash, cfg.Docs)
	for d := range r.docs {
		toks := make([]int32, cfg.DocBlocks*tierBlockTokens)
		for i := range toks {
			toks[i] = int32(d*1_000_003 + i)
		}
		r.docs[d] = kvlease.ChainHashes(kvlease.BlockHash(cfg.Seed), toks, tierBlockTokens)
		r.addChain(kvlease.BlockHash(cfg.Seed), toks, r.docs[d])
	}

	var live []*tiersReq[D]
	arrivals := 0
	for arrivals < cfg.Requests || len(live) > 0 {
		if arrivals < cfg.Requests && (len(live) == 0 || (len(live) < cfg.MaxLive && r.chance(0.5))) {
			arrivals++
			if q := r.arrive(arrivals); q != nil {
				live = append(live, q)
			}
			if r.disk != nil && r.chance(cfg.Faults.Corrupt) {
				if err := r.corrupt(); err != nil {
					r.violate(&r.rep.Other, "corrupt: %v", err)
				}
			}
			if cfg.SweepEvery > 0 && arrivals%cfg.SweepEvery == 0 {
				r.sweep()
			}
			continue
		}
		if r.chance(0.3) && r.letGo() {
			continue
		}
		i := r.intN(len(live))
		q := live[i]
		if arrivals < cfg.Requests && r.chance(cfg.Faults.Abort) {
			q.o.Lease.Abort(errors.New("audit: client went away"))
			rep.Aborted++
		} else {
			select {
			case <-q.o.Ready():
			default:
				if arrivals < cfg.Requests && r.chance(0.5) {
					continue // another request's turn
				}
				if !r.await(q.o.Ready(), fmt.Sprintf("request %d onboard", q.id)) {
					q.o.Lease.Abort(errors.New("audit: stuck"))
					live = append(live[:i], live[i+1:]...)
					continue
				}
			}
			r.complete(q)
		}
		live = append(live[:i], live[i+1:]...)
	}

	// Drain: no new faults; every held copy goes, late evidence for every
	// quarantine; then everything must settle.
	r.draining.Store(true)
	for r.letGo() {
	}
	r.sweep()
	for r.letGo() {
	}
	if err := r.cache.Close(); err != nil {
		r.violate(&r.rep.Other, "cache close: %v", err)
	}
	settled := func(s kvlease.Stats) bool {
		return s.Leased == 0 && s.Draining == 0 && s.Quarantined == 0
	}
	deadline := time.Now().Add(20 * time.Second)
	for !(settled(r.dev.Stats()) && settled(r.host.Stats()) && (r.disk == nil || settled(r.disk.Pool().Stats()))) {
		if r.letGo() {
			continue
		}
		if time.Now().After(deadline) {
			r.violate(&r.rep.Other, "not settled after the drain: device %+v host %+v", r.dev.Stats(), r.host.Stats())
			break
		}
		time.Sleep(100 * time.Microsecond)
	}
	r.checkPools()
	r.drainEvents()
	r.checkViews()
	rep.Stats = r.cache.Stats()
	for t := range rep.Hits {
		if rep.Stats.Tiers[t].Hits != rep.Hits[t] {
			r.violate(&r.rep.Other, "tier %v counted %d hits, the onboards said %d", tiers.Tier(t), rep.Stats.Tiers[t].Hits, rep.Hits[t])
		}
		if rep.Stats.Tiers[t].Onboarded > rep.Stats.Tiers[t].Hits {
			r.violate(&r.rep.Other, "tier %v onboarded %d blocks of %d hits", tiers.Tier(t), rep.Stats.Tiers[t].Onboarded, rep.Stats.Tiers[t].Hits)
		}
	}
	if rep.Stats.Queried != rep.Queried {
		r.violate(&r.rep.Other, "cache counted %d blocks queried, the driver %d", rep.Stats.Queried, rep.Queried)
	}
	if r.disk != nil {
		if err := r.disk.Close(); err != nil {
			r.violate(&r.rep.Other, "disk close: %v", err)
		}
	}
	_ = r.dev.Close()
	_ = r.host.Close()
	rep.Elapsed = time.Since(start)
	return rep, nil
}

// runTiersGPU is RunTiers on cfg.GPU: device and pinned arenas, two
// engines (kernel, copy engine) used alternately, blocks read and written
// through synchronous copies. Whatever it allocated is freed at the end;
// an arena or engine that refuses to close (a copy still in flight) is a
// violation.
func runTiersGPU(cfg TiersConfig) (*TiersReport, error) {
	d := cfg.GPU
	var closers []func() error
	closeAll := func() error {
		var errs []error
		for i := len(closers) - 1; i >= 0; i-- {
			errs = append(errs, closers[i]())
		}
		closers = nil
		return errors.Join(errs...)
	}
	devMem, err := d.AllocDevice(cfg.DeviceBlocks, cfg.BlockBytes)
	if err != nil {
		return nil, err
	}
	closers = append(closers, devMem.Close)
	hostMem, err := d.AllocPinned(cfg.HostBlocks, cfg.BlockBytes)
	if err != nil {
		_ = closeAll()
		return nil, err
	}
	closers = append(closers, hostMem.Close)
	kern, err := d.NewCopyEngine(gpu.WithPath(gpu.PathKernel))
	if err != nil {
		_ = closeAll()
		return nil, err
	}
	closers = append(closers, kern.Close)
	ce, err := d.NewCopyEngine(gpu.WithPath(gpu.PathCopyEngine))
	if err != nil {
		_ = closeAll()
		return nil, err
	}
	closers = append(closers, ce.Close)

	r := newTiersRun[gpu.DevicePtr](cfg)
	buf := make([]byte, cfg.BlockBytes)
	r.load = func(p gpu.DevicePtr) ([]byte, error) { return buf, d.CopyToHost(buf, p) }
	r.store = func(p gpu.DevicePtr, b []byte) error { return d.CopyFromHost(p, b) }
	if r.dev, err = kvlease.NewPool[gpu.DevicePtr](devMem, tierPoolOptions()...); err != nil {
		_ = closeAll()
		return nil, err
	}
	if r.host, err = kvlease.NewPool[[]byte](hostMem, tierPoolOptions()...); err != nil {
		_ = closeAll()
		return nil, err
	}
	var n1, n2 atomic.Uint64
	offload := faultyTransport[gpu.DevicePtr, []byte]{next: [2]kvlease.Transport[gpu.DevicePtr, []byte]{kern.DeviceToHost(), ce.DeviceToHost()},
		n: &n1, after: func(*kvlease.Transfer) {}}
	onload := faultyTransport[[]byte, gpu.DevicePtr]{next: [2]kvlease.Transport[[]byte, gpu.DevicePtr]{kern.HostToDevice(), ce.HostToDevice()},
		n: &n2, after: func(*kvlease.Transfer) {}}
	st0 := d.CopyStats()
	rep, err := r.run(offload, onload)
	if err != nil {
		_ = closeAll()
		return nil, err
	}
	st := d.CopyStats()
	rep.Device = d.Name()
	rep.KernelSubmits = st.KernelLaunches - st0.KernelLaunches
	rep.EngineSubmits = st.BatchedSubmits + st.LoopedSubmits - st0.BatchedSubmits - st0.LoopedSubmits
	if rep.Requests >= 100 && (rep.KernelSubmits == 0 || rep.EngineSubmits == 0) {
		r.violate(&rep.Other, "a path never carried a copy: kernel %d, copy engine %d submissions (%v)", rep.KernelSubmits, rep.EngineSubmits, st)
	}
	if err := closeAll(); err != nil {
		r.violate(&rep.Other, "freeing the device memory and engines after the drain: %v", err)
	}
	return rep, nil
}

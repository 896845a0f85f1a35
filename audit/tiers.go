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
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/kvlease/kvlease"
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

	lieOnFail bool // tests: a failed copy reports success (the audit must catch it)
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
			DiskFail: 0.04, Corrupt: 0.01, Abort: 0.05,
		},
		SweepEvery: 50,
	}
}

func (c *TiersConfig) validate() error {
	f := c.Faults
	probs := []float64{f.CopyFail, f.Stall, f.Quarantine, f.DiskFail, f.Corrupt, f.Abort}
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
	CopyFails, Stalls, Quarantines, DiskFails, Corruptions int

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
	fmt.Fprintf(&b, "faults: copy failures %d, stalls %d, quarantines %d, disk failures %d, corruptions %d\n",
		r.CopyFails, r.Stalls, r.Quarantines, r.DiskFails, r.Corruptions)
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

// tiersRun is one run's state.
type tiersRun struct {
	cfg  TiersConfig
	rep  *TiersReport
	rmu  sync.Mutex // guards rep's counters and violations written off the driver's goroutine
	rngM sync.Mutex
	rng  *rand.Rand

	dev, host *kvlease.Pool[[]byte]
	disk      *tiers.Disk
	cache     *tiers.Cache[[]byte]
	dir       string

	hmu      sync.Mutex
	held     []func() // stalled and quarantined copies, waiting for the driver
	draining atomic.Bool

	docs [][]kvlease.BlockHash
	want []byte

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
func (r *tiersRun) addChain(seed kvlease.BlockHash, toks []int32, hashes []kvlease.BlockHash) {
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
func (r *tiersRun) drainEvents() {
	for t, src := range r.cache.EventSources() {
		evs, dropped := src.Pool.DrainKVEvents(nil)
		view := r.views[t]
		if dropped > 0 {
			r.rep.EventDrops += int(dropped)
			_, hashes := src.Pool.(interface {
				SnapshotKVCache() (uint64, []kvlease.BlockHash)
			}).SnapshotKVCache()
			clear(view)
			for _, h := range hashes {
				view[h] = true
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
func (r *tiersRun) checkViews() {
	for t, src := range r.cache.EventSources() {
		_, hashes := src.Pool.(interface {
			SnapshotKVCache() (uint64, []kvlease.BlockHash)
		}).SnapshotKVCache()
		if len(hashes) != len(r.views[t]) {
			r.violate(&r.rep.Other, "%s events say %d blocks are findable, the pool has %d", src.Medium, len(r.views[t]), len(hashes))
			continue
		}
		for _, h := range hashes {
			if !r.views[t][h] {
				r.violate(&r.rep.Other, "%s pool serves %016x, its events never stored it", src.Medium, uint64(h))
				break
			}
		}
	}
}

func (r *tiersRun) chance(p float64) bool {
	if p <= 0 || r.draining.Load() {
		return false
	}
	r.rngM.Lock()
	defer r.rngM.Unlock()
	return r.rng.Float64() < p
}

func (r *tiersRun) intN(n int) int {
	r.rngM.Lock()
	defer r.rngM.Unlock()
	return r.rng.IntN(n)
}

func (r *tiersRun) violate(kind *int, format string, args ...any) {
	r.rmu.Lock()
	defer r.rmu.Unlock()
	*kind++
	if len(r.rep.Violations) < 20 {
		r.rep.Violations = append(r.rep.Violations, fmt.Sprintf(format, args...))
	}
}

func (r *tiersRun) count(n *int) {
	r.rmu.Lock()
	*n++
	r.rmu.Unlock()
}

func (r *tiersRun) hold(fn func()) {
	r.hmu.Lock()
	r.held = append(r.held, fn)
	r.hmu.Unlock()
}

// letGo releases one held copy at random; false when none is held.
func (r *tiersRun) letGo() bool {
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
func (r *tiersRun) await(ch <-chan struct{}, what string) bool {
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
type copier struct{ r *tiersRun }

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
func (r *tiersRun) beforeIO(write bool, slot tiers.DiskSlot) error {
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
func (r *tiersRun) corrupt() error {
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
func (r *tiersRun) check(b []byte, h kvlease.BlockHash, where string) {
	r.rep.Checked++
	switch classify(b, h, r.want) {
	case 1:
		r.violate(&r.rep.Mismatches, "%s: holds another block's content (want %016x)", where, uint64(h))
	case 2:
		r.violate(&r.rep.UnknownReads, "%s: holds content no completed copy wrote (want %016x)", where, uint64(h))
	}
}

type tiersReq struct {
	id     int
	o      *tiers.Onboard[[]byte]
	hashes []kvlease.BlockHash
}

// arrive admits one request: a leading part of a document and up to two
// blocks of its own.
func (r *tiersRun) arrive(id int) *tiersReq {
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
		b, err := r.dev.Region(o.Lease.Ref(k))
		if err != nil {
			r.violate(&r.rep.Other, "request %d: device hit %d: %v", id, k, err)
			continue
		}
		r.check(b, hashes[k], fmt.Sprintf("request %d device hit %d", id, k))
	}
	return &tiersReq{id: id, o: o, hashes: hashes}
}

// complete finishes a request whose onboard is ready: check the valid
// prefix, compute and seal the rest, check the whole lease, release.
func (r *tiersRun) complete(q *tiersReq) {
	valid, err := q.o.Wait(context.Background())
	l := q.o.Lease
	if valid > q.o.Prefix() || (err == nil && valid != q.o.Prefix()) {
		r.violate(&r.rep.Other, "request %d: valid %d of a prefix of %d (error %v)", q.id, valid, q.o.Prefix(), err)
	}
	for k := range valid {
		b, err := r.dev.Region(l.Ref(k))
		if err != nil {
			r.violate(&r.rep.Other, "request %d: region %d: %v", q.id, k, err)
			continue
		}
		r.check(b, q.hashes[k], fmt.Sprintf("request %d onboarded block %d", q.id, k))
	}
	for k := valid; k < len(q.hashes); k++ {
		b, err := l.Region(k)
		if err != nil {
			r.violate(&r.rep.Other, "request %d: region %d: %v", q.id, k, err)
			continue
		}
		TierStamp(b, q.hashes[k])
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
		if b, err := r.dev.Region(l.Ref(k)); err == nil {
			r.check(b, q.hashes[k], fmt.Sprintf("request %d block %d at release", q.id, k))
		}
	}
	l.Release()
}

// sweep reads back every tier's findable blocks of every document and
// checks them, and checks every pool.
func (r *tiersRun) sweep() {
	for d, doc := range r.docs {
		for _, tier := range []struct {
			name string
			p    *kvlease.Pool[[]byte]
		}{{"device", r.dev}, {"host", r.host}} {
			l, err := tier.p.AcquireHits("audit/sweep", doc)
			if err != nil {
				r.violate(&r.rep.Other, "sweep %s doc %d: %v", tier.name, d, err)
				continue
			}
			if l == nil {
				continue
			}
			for k := range l.Len() {
				if b, err := tier.p.Region(l.Ref(k)); err == nil {
					r.check(b, doc[k], fmt.Sprintf("%s tier doc %d block %d", tier.name, d, k))
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

func (r *tiersRun) checkPools() {
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
// the tiers while copies fail, stall and are quarantined, disk slots fail
// and are corrupted at rest, and requests are aborted mid-copy. It checks
// the content of every block served as valid (every device hit, every
// onboarded block within Onboard.Valid, and in sweeps every findable
// block of every tier), the content of every lease at release (no late
// write landed in it), the pools' accounting, that the cache's hit
// counters agree with what the Onboards said, and, after the drain (every
// held copy let go, late evidence delivered), that every pool settles
// with nothing leased, draining or quarantined. The error is for a
// configuration it refuses or a disk tier it cannot open; violations are
// in the report.
func RunTiers(cfg TiersConfig) (*TiersReport, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	rep := &TiersReport{Seed: cfg.Seed}
	r := &tiersRun{cfg: cfg, rep: rep, rng: rand.New(rand.NewPCG(cfg.Seed, 0x7469657273)), want: make([]byte, cfg.BlockBytes)}
	start := time.Now()
	dm, err := kvlease.NewHostMemory(cfg.DeviceBlocks, cfg.BlockBytes)
	if err != nil {
		return nil, err
	}
	hm, err := kvlease.NewHostMemory(cfg.HostBlocks, cfg.BlockBytes)
	if err != nil {
		return nil, err
	}
	// Every tier publishes KV events (the ring holds far more than a
	// sweep's worth), so the run checks them too.
	opts := func() []kvlease.Option {
		return []kvlease.Option{kvlease.WithBlockTokens(tierBlockTokens), kvlease.WithKVEvents(1 << 16)}
	}
	if r.dev, err = kvlease.NewPool[[]byte](dm, opts()...); err != nil {
		return nil, err
	}
	if r.host, err = kvlease.NewPool[[]byte](hm, opts()...); err != nil {
		return nil, err
	}
	if cfg.DiskSlots > 0 {
		r.dir = cfg.Dir
		if r.dir == "" {
			if r.dir, err = os.MkdirTemp("", "kvaudit-tiers-"); err != nil {
				return nil, err
			}
			defer os.RemoveAll(r.dir)
		}
		r.disk, err = tiers.OpenDisk(tiers.DiskConfig{Dir: r.dir, Files: 2, Slots: cfg.DiskSlots,
			BlockBytes: cfg.BlockBytes, Workers: 2, BeforeIO: r.beforeIO, PoolOptions: opts()})
		if err != nil {
			return nil, err
		}
	}
	r.cache, err = tiers.New(tiers.Config[[]byte]{Device: r.dev, Host: r.host, Disk: r.disk,
		Offload: copier{r}, Onload: copier{r}, Policy: cfg.Policy})
	if err != nil {
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

	var live []*tiersReq
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
	settled := func(p *kvlease.Pool[[]byte]) bool {
		s := p.Stats()
		return s.Leased == 0 && s.Draining == 0 && s.Quarantined == 0
	}
	deadline := time.Now().Add(20 * time.Second)
	for !(settled(r.dev) && settled(r.host) && (r.disk == nil || func() bool {
		s := r.disk.Pool().Stats()
		return s.Leased == 0 && s.Draining == 0 && s.Quarantined == 0
	}())) {
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

package audit

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/tiers"

	"go.uber.org/atomic"
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

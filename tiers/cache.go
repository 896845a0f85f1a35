package tiers

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"go.uber.org/atomic"
)

// Policy says when device blocks are copied to the host tier.
type Policy uint8

const (
	// WriteBack copies a device block to the host tier when the device
	// pool evicts it (through the pool's eviction hook): no copy for
	// blocks that are never evicted, nothing lost that is.
	WriteBack Policy = iota + 1
	// WriteThrough copies a device block to the host tier when it is
	// sealed through Cache.Seal: every sealed block costs a copy, and an
	// evicted block is already below.
	WriteThrough
)

func (p Policy) String() string {
	switch p {
	case WriteBack:
		return "write-back"
	case WriteThrough:
		return "write-through"
	}
	return "policy(?)"
}

// Config describes a tiered cache: a device pool (G1), a pinned host pool
// (G2) and optionally a disk tier (G3), with the transports that copy
// between device and host. Device and Host are required, must keep seal
// records (kvlease.WithSealRecords, or WithKVEvents or
// WithVerifiedPrefix, which keep them too) and must have the same block
// size (and Disk too); the cache installs eviction hooks on them (Device
// with WriteBack, Host when there is a Disk), so do not install your own.
type Config[D any] struct {
	Device  *kvlease.Pool[D]
	Host    *kvlease.Pool[[]byte]
	Disk    *Disk // nil: two tiers
	Offload kvlease.Transport[D, []byte]
	Onload  kvlease.Transport[[]byte, D]
	Policy  Policy // zero means WriteBack
	// DeviceReserve and HostReserve are the free-block watermarks of
	// write-back: after each Acquire (and each offload into the host), the
	// cache offers the least recently used cached blocks of a pool whose
	// free blocks (plus those already on their way down) are below its
	// reserve (kvlease.Pool.OfferCached), so that acquires find free
	// blocks instead of evicting, which loses what it evicts. Zero means
	// an eighth of the pool; negative means none (eviction alone offers).
	DeviceReserve, HostReserve int
}

// Cache is a tiered KV cache over a device pool, a pinned host pool and an
// optional disk tier. It does not own the pools: it copies blocks between
// them, each copy a kvlease.Transfer that gates both sides (a Read on the
// source, a Write on the destination), and it seals a lower tier's block
// only once the copy into it has resolved, so no tier ever serves a block
// whose content is not known.
//
// Offload: with WriteBack the device pool offers its eviction victims
// (see kvlease.Pool.SetEvictHook), with WriteThrough Seal copies each
// sealed block; the host pool's victims go to the disk tier the same way.
// Onboard: Acquire finds the longest prefix across tiers, device hits
// first, then host, then disk, in chain order, and copies the lower tiers'
// blocks into the device lease it returns (see Onboard).
//
// All methods are safe for concurrent use.
type Cache[D any] struct {
	dev     *kvlease.Pool[D]
	host    *kvlease.Pool[[]byte]
	disk    *Disk
	offload kvlease.Transport[D, []byte]
	onload  kvlease.Transport[[]byte, D]
	policy  Policy

	mu sync.Mutex
	// diskParent is how each disk slot's block was sealed, by disk slot.
	// The device and host pools keep their own records (Pool.SealInfo,
	// read with recOf); the disk is not a kvlease pool the cache can ask
	// (its pool's record would be lost at a restart, the slot header is
	// not): this table mirrors what the headers say, rebuilt from them by
	// OpenDisk's scan.
	diskParent []kvlease.SealInfo
	closed     bool
	isClosed   atomic.Bool    // closed, for the lock-free check of Acquire
	wg         sync.WaitGroup // copy watchers and the offload worker
	stop       chan struct{}  // closed by Close: watchers of stuck copies give up

	// The offload worker runs what the eviction hooks hand it, so that an
	// evicting acquire only queues its offer: it never waits for the next
	// tier's allocator, let alone the copy.
	workMu     sync.Mutex
	workCond   *sync.Cond
	work       []func()
	workDone   bool // set by Close once no hook can queue any more
	workParked bool // the worker waits on workCond: a queued offer must wake it

	stats counters

	devReserve, hostReserve   int
	devInflight, hostInflight atomic.Int64 // offered blocks not yet free
}

// ErrClosed is returned by a Cache's methods after Close.
var ErrClosed = errors.New("tiers: cache closed")

// New builds a tiered cache over cfg's pools and installs its eviction
// hooks. Errors wrap kvlease.ErrInvalidArgument for a missing pool or
// transport, a device or host pool that keeps no seal records
// (kvlease.WithSealRecords) or mismatched block sizes.
func New[D any](cfg Config[D]) (*Cache[D], error) {
	switch {
	case cfg.Device == nil || cfg.Host == nil:
		return nil, fmt.Errorf("tiers: a device pool and a host pool are required: %w", kvlease.ErrInvalidArgument)
	case cfg.Offload == nil || cfg.Onload == nil:
		return nil, fmt.Errorf("tiers: offload and onload transports are required: %w", kvlease.ErrInvalidArgument)
	case !cfg.Device.Stats().SealRecords || !cfg.Host.Stats().SealRecords:
		return nil, fmt.Errorf("tiers: the device and host pools must keep seal records (kvlease.WithSealRecords), so that a block's copies are sealed as it was: %w",
			kvlease.ErrInvalidArgument)
	case cfg.Device.Memory().BlockBytes() != cfg.Host.Memory().BlockBytes():
		return nil, fmt.Errorf("tiers: device blocks of %d bytes, host blocks of %d: %w",
			cfg.Device.Memory().BlockBytes(), cfg.Host.Memory().BlockBytes(), kvlease.ErrInvalidArgument)
	case cfg.Disk != nil && cfg.Disk.BlockBytes() != cfg.Host.Memory().BlockBytes():
		return nil, fmt.Errorf("tiers: disk blocks of %d bytes, host blocks of %d: %w",
			cfg.Disk.BlockBytes(), cfg.Host.Memory().BlockBytes(), kvlease.ErrInvalidArgument)
	}
	if cfg.Policy == 0 {
		cfg.Policy = WriteBack
	}
	if cfg.Policy != WriteBack && cfg.Policy != WriteThrough {
		return nil, fmt.Errorf("tiers: unknown policy %d: %w", cfg.Policy, kvlease.ErrInvalidArgument)
	}
	c := &Cache[D]{
		dev: cfg.Device, host: cfg.Host, disk: cfg.Disk,
		offload: cfg.Offload, onload: cfg.Onload, policy: cfg.Policy,
		stop: make(chan struct{}),
	}
	if c.disk != nil {
		// What the disk's scan found: its rebuilt slots' parents and
		// tokens, for the seals on the way up.
		c.diskParent = make([]kvlease.SealInfo, c.disk.Blocks())
		for slot, m := range c.disk.scanned {
			c.diskParent[slot] = m.sealInfo()
		}
	}
	c.workCond = sync.NewCond(&c.workMu)
	c.wg.Add(1)
	go c.worker()
	c.devReserve = reserveOf(cfg.DeviceReserve, cfg.Device.Memory().Blocks())
	c.hostReserve = reserveOf(cfg.HostReserve, cfg.Host.Memory().Blocks())
	if c.policy == WriteBack {
		c.dev.SetEvictHook(c.deviceEvicted)
	} else {
		c.devReserve = 0
	}
	if c.disk == nil {
		c.hostReserve = 0
	}
	if c.disk != nil {
		c.host.SetEvictHook(c.hostEvicted)
	}
	return c, nil
}

func reserveOf(r, capacity int) int {
	switch {
	case r < 0:
		return 0
	case r == 0:
		return max(capacity/8, 1)
	}
	return min(r, capacity)
}

// keepReserve offers cached blocks of p to its hook while its free blocks
// and those on their way down are fewer than reserve.
func keepReserve[R any](p *kvlease.Pool[R], reserve int, inflight *atomic.Int64) {
	if reserve == 0 {
		return
	}
	if want := reserve - p.Stats().Free - int(inflight.Load()); want > 0 {
		p.OfferCached(want)
	}
}

// Policy returns the cache's offload policy.
func (c *Cache[D]) Policy() Policy { return c.policy }

// Close removes the cache's eviction hooks, stops waiting for copies that
// never resolve (quarantined ones keep their blocks quarantined) and waits
// for the watchers of the others. It does not close the pools or the disk.
func (c *Cache[D]) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.isClosed.Store(true)
	close(c.stop)
	c.mu.Unlock()
	c.dev.SetEvictHook(nil)
	c.host.SetEvictHook(nil)
	c.workMu.Lock()
	c.workDone = true
	c.workCond.Broadcast()
	c.workMu.Unlock()
	c.wg.Wait()
	return nil
}

// later queues fn for the offload worker. After Close it runs fn at once
// (a hook that raced Close): fn only releases what it was handed then.
func (c *Cache[D]) later(fn func()) {
	c.workMu.Lock()
	if c.workDone {
		c.workMu.Unlock()
		fn()
		return
	}
	c.work = append(c.work, fn)
	if c.workParked {
		c.workCond.Signal()
	}
	c.workMu.Unlock()
}

// While offers keep coming, the worker looks for more every workPoll for
// up to workPolls times before it parks: waking a parked goroutine costs
// the evicting acquire a system call (most of what the hook adds to it),
// a worker that is awake costs it nothing. An idle cache parks after
// about a millisecond.
const (
	workPoll  = 20 * time.Microsecond
	workPolls = 50
)

// worker runs the queued offloads in order until Close, then what is
// left.
func (c *Cache[D]) worker() {
	defer c.wg.Done()
	var batch []func()
	idle := 0
	for {
		c.workMu.Lock()
		if len(c.work) == 0 && !c.workDone {
			if idle < workPolls {
				c.workMu.Unlock()
				idle++
				time.Sleep(workPoll)
				continue
			}
			c.workParked = true
			for len(c.work) == 0 && !c.workDone {
				c.workCond.Wait()
			}
			c.workParked = false
		}
		if len(c.work) == 0 {
			c.workMu.Unlock()
			return
		}
		idle = 0
		batch, c.work = c.work, batch[:0]
		c.workMu.Unlock()
		for i, fn := range batch {
			fn()
			batch[i] = nil
		}
	}
}

// watch runs fn once t resolves, on a goroutine of its own; if the cache
// closes first (t quarantined and never resolved), fn runs with ok false.
// It reports false when the cache is closed and fn will not run.
func (c *Cache[D]) watch(t *kvlease.Transfer, fn func(ok bool)) bool {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return false
	}
	c.wg.Add(1)
	c.mu.Unlock()
	go func() {
		defer c.wg.Done()
		select {
		case <-t.Done():
			fn(true)
		case <-c.stop:
			select {
			case <-t.Done():
				fn(true)
			default:
				fn(false)
			}
		}
	}()
	return true
}

// recOf returns how block ref of p was sealed (its pool's seal record,
// Pool.SealInfo) if it is sealed as h, else a record that knows only h.
// Its tokens are its own copy: the caller seals a lower tier's block with
// them after ref may have moved on. A record that knows no parent still
// keeps the block's tags (tenant namespace, adapter, extra keys).
func recOf[R any](p *kvlease.Pool[R], ref kvlease.BlockRef, h kvlease.BlockHash) kvlease.SealInfo {
	if r, ok := p.SealInfo(ref, nil); ok && r.Hash == h {
		return hashOnly(r)
	}
	return kvlease.SealInfo{Hash: h}
}

// hashOnly is r, less what a record that knows no parent cannot say.
func hashOnly(r kvlease.SealInfo) kvlease.SealInfo {
	if !r.HasParent {
		r.Parent, r.Chained, r.Tokens = 0, false, nil
	}
	return r
}

// diskRec returns what diskParent records for slot id if it was recorded
// for hash h, else a record that knows only h. Called with c.mu held.
func (c *Cache[D]) diskRec(id kvlease.BlockID, h kvlease.BlockHash) kvlease.SealInfo {
	if r := c.diskParent[id]; r.Hash == h {
		return hashOnly(r)
	}
	return kvlease.SealInfo{Hash: h}
}

// sealAs seals block i of l as r says (kvlease.Lease.SealAs): its KV
// event and its pool's record name r's parent and carry r's tokens,
// whatever the block's place in l. If the pool refuses the tokens (no
// WithBlockTokens, or another hasher), it seals with the parent alone,
// an event without tokens. A record that knows no parent is a plain Seal:
// callers seal a lease's blocks last to first, so that one never names
// the lease's previous block, which in a lower tier is unrelated, as the
// parent.
func sealAs[R any](l *kvlease.Lease[R], i int, r kvlease.SealInfo) error {
	err := l.SealAs(i, r)
	if err != nil && r.Tokens != nil {
		r.Tokens = nil
		err = l.SealAs(i, r)
	}
	return err
}

package tiers

import (
	"context"
	"fmt"
	"go.uber.org/atomic"

	"github.com/kvlease/kvlease"
)

// Onboard is the result of Cache.Acquire: a device lease whose first
// blocks are the prefix found across the tiers, and the copies bringing
// the lower tiers' blocks in.
//
// Blocks 0..Hits(TierDevice)-1 are device hits, usable at once. The next
// Hits(TierHost) blocks are being copied from the host tier, the next
// Hits(TierDisk) from the disk tier (through a host staging block, which
// also brings them back into the host tier). Until those copies resolve,
// the onboarded blocks are gated by Write transfers: nobody can Seal them
// or hit them, and their content must not be read. The rest of the lease
// is fresh: the caller may compute into it at once.
//
// Ready is closed once every copy has resolved; Valid then says how many
// leading blocks hold the prefix's content (all the hits, unless a copy
// failed: the blocks after a failure hold nothing and must be computed).
// Onboard.Sequence is the request as a kvlease.Sequence when Cache.Admit
// made it (nil after Cache.Acquire): Wait records the onboarded blocks in
// it.
// The cache seals the onboarded valid blocks on the device when they
// arrive, so later lookups hit them there. A copy that is quarantined
// never resolves: Ready stays open, and the caller gives up through
// Wait's context (then Abort the lease: its blocks stay quarantined until
// late evidence).
type Onboard[D any] struct {
	Lease    *kvlease.Lease[D]
	Sequence *kvlease.Sequence[D] // Cache.Admit's; nil after Cache.Acquire

	hits  [numTiers]int
	valid atomic.Int64
	ready chan struct{}
	err   error // set before ready closes
}

// readyNow is the Ready channel of every Onboard with nothing to onboard.
var readyNow = func() chan struct{} { ch := make(chan struct{}); close(ch); return ch }()

// Hits returns how many blocks of the prefix tier t supplied.
func (o *Onboard[D]) Hits(t Tier) int { return o.hits[t] }

// Prefix returns the length of the prefix found across all tiers.
func (o *Onboard[D]) Prefix() int { return o.hits[TierDevice] + o.hits[TierHost] + o.hits[TierDisk] }

// Ready returns a channel closed once every onboarding copy has resolved.
func (o *Onboard[D]) Ready() <-chan struct{} { return o.ready }

// Valid returns how many leading blocks of the lease hold the prefix's
// content now: the device hits until Ready, then every block whose copy
// succeeded (up to the first failure).
func (o *Onboard[D]) Valid() int { return int(o.valid.Load()) }

// Wait waits until Ready or ctx ends and returns Valid. The error is
// ctx's, or the first copy failure (Valid then is shorter than Prefix).
//
// With a Sequence (Cache.Admit), Wait also records the blocks that
// arrived (Sequence.Onboarded: they count as hits and as computed, so
// the engine computes from Sequence.Computed on): call it from the
// goroutine that drives the sequence, before computing anything. Ready
// alone records nothing.
func (o *Onboard[D]) Wait(ctx context.Context) (int, error) {
	select {
	case <-o.ready:
	case <-ctx.Done():
		return o.Valid(), ctx.Err()
	}
	valid := o.Valid()
	if s := o.Sequence; s != nil && valid > s.Hits() {
		if err := s.Onboarded(valid - s.Hits()); err != nil && o.err == nil {
			return valid, fmt.Errorf("tiers: onboard for %q: %w", s.Lease().Owner(), err)
		}
	}
	return valid, o.err
}

// Acquire looks hashes up across the tiers and returns a device lease of
// n blocks (all or nothing, like kvlease.Pool.AcquirePrefix): the device's
// cached prefix, then the host tier's hits for the following hashes, then
// the disk tier's, in chain order, then fresh blocks. Hits below the device
// are onboarded asynchronously (see Onboard). Only the first n hashes are
// looked up. Errors are the device pool's AcquirePrefix errors, or
// ErrClosed.
//
// Every hit is sealed and shared, so pass only the hashes of blocks the
// request will not write (vLLM's last-token rule, as AcquirePrefix says):
// never the hash of the block holding the prompt's last token, whose KV
// the engine computes to sample the first output token. For a prompt of
// t tokens in blocks of b, that is the first (t-1)/b hashes. Admit applies
// the rule for you.
func (c *Cache[D]) Acquire(owner string, hashes []kvlease.BlockHash, n int) (*Onboard[D], error) {
	return c.acquire(nil, owner, hashes, n)
}

// AcquireFor is Acquire for tenant t, a tenant of the device pool
// (kvlease.Pool.Tenant): the device lease is t's (its fresh blocks
// charged to t under its quota, kvlease.Tenant.AcquirePrefix), and a
// block of the host or disk tier is onboarded only if it was stored under
// t's namespace (kvlease.Tenant.Namespace): the prefix found below the
// device ends at the first block stored under another (by another
// tenant, or by no tenant), whatever its hash. Acquire, for no tenant,
// onboards only blocks stored under none. A nil t is Acquire. Errors as
// Acquire's, and kvlease.ErrQuota.
func (c *Cache[D]) AcquireFor(t *kvlease.Tenant[D], owner string, hashes []kvlease.BlockHash, n int) (*Onboard[D], error) {
	return c.acquire(t, owner, hashes, n)
}

func (c *Cache[D]) acquire(tn *kvlease.Tenant[D], owner string, hashes []kvlease.BlockHash, n int) (*Onboard[D], error) {
	if c.isClosed.Load() {
		return nil, fmt.Errorf("tiers: acquire for %q: %w", owner, ErrClosed)
	}
	if len(hashes) > n {
		hashes = hashes[:max(n, 0)]
	}
	var (
		l   *kvlease.Lease[D]
		d   int
		err error
		ns  string
	)
	if tn != nil {
		ns = tn.Namespace()
		l, d, err = tn.AcquirePrefix(owner, hashes, n)
	} else {
		l, d, err = c.dev.AcquirePrefix(owner, hashes, n)
	}
	if err != nil {
		return nil, err
	}
	o := &Onboard[D]{Lease: l, ready: readyNow}
	o.hits[TierDevice] = d
	o.valid.Store(int64(d))
	c.stats.queried.Add(uint64(len(hashes)))
	c.stats.tiers[TierDevice].hits.Add(uint64(d))
	rest := hashes[d:]

	// Pin the host hits and the disk hits (and host staging blocks for
	// the latter) before anything else can evict them, each prefix cut
	// at the first block of another namespace. What the lower tiers know
	// of each hit (parent, tokens, tags) goes with it, for the seals on
	// the way up: the copies' KV events then match the originals'.
	hl, recs := pinHits(owner, rest, ns, c.host.AcquireHits, func(l *kvlease.Lease[[]byte], hs []kvlease.BlockHash) []kvlease.SealInfo {
		recs := make([]kvlease.SealInfo, len(hs))
		for k := range hs {
			recs[k] = recOf(c.host, l.Ref(k), hs[k])
		}
		return recs
	})
	h := len(recs)
	var dl *kvlease.Lease[DiskSlot]
	var stage *kvlease.Lease[[]byte]
	m := 0
	if c.disk != nil && h < len(rest) {
		var drecs []kvlease.SealInfo
		dl, drecs = pinHits(owner, rest[h:], ns, func(owner string, hs []kvlease.BlockHash) (*kvlease.Lease[DiskSlot], error) {
			return c.disk.Lookup(owner, hs), nil
		}, func(l *kvlease.Lease[DiskSlot], hs []kvlease.BlockHash) []kvlease.SealInfo {
			ids := l.AppendBlockIDs(make([]kvlease.BlockID, 0, len(hs)), 0)
			recs := make([]kvlease.SealInfo, len(hs))
			c.mu.Lock()
			for k := range hs {
				recs[k] = c.diskRec(ids[k], hs[k])
			}
			c.mu.Unlock()
			return recs
		})
		if dl != nil {
			if stage, err = c.host.Acquire(ownerStage, dl.Len()); err != nil {
				dl.Release()
				dl, stage = nil, nil
			} else {
				m = dl.Len()
				recs = append(recs, drecs...)
			}
		}
	}
	o.hits[TierHost], o.hits[TierDisk] = h, m
	for k := range recs {
		if !recs[k].HasParent && d+k > 0 {
			// Unknown to the tier (a rebuilt disk): the chain says
			// the parent; a chain's first block keeps none.
			recs[k].Parent, recs[k].HasParent, recs[k].Chained = hashes[d+k-1], true, true
		}
	}
	keepReserve(c.dev, c.devReserve, &c.devInflight)
	c.stats.tiers[TierHost].hits.Add(uint64(h))
	c.stats.tiers[TierDisk].hits.Add(uint64(m))
	if h+m == 0 {
		return o, nil // nothing to onboard: ready at once
	}
	o.ready = make(chan struct{})

	// One gate of our own over every onboarded block, a Write: nobody
	// seals or hits them until the copies are attached and resolved. The
	// gate touches no memory itself, so a cancel (the caller aborted) may
	// resolve it at once; the copies' own attachments still hold. The
	// disk read gates only the cache's own leases (the disk lease,
	// released at once, and the staging blocks), never the caller's, so
	// the caller's abort reaches it through the gate's cancel alone.
	var canceled atomic.Bool
	var diskRead atomic.Pointer[kvlease.Transfer]
	var gate *kvlease.Transfer
	gate = kvlease.NewTransfer(func() {
		canceled.Store(true)
		if t := diskRead.Load(); t != nil {
			t.Cancel()
		}
		gate.Resolve(kvlease.ErrCanceled)
	})
	if err := l.AttachRange(gate, d, d+h+m, kvlease.Write); err != nil {
		gate.Resolve(err) // cannot happen: l is new and its blocks fresh
	}

	var ht *kvlease.Transfer
	if h > 0 {
		ht = c.copyIn(hl, l, 0, d, h)
		hl.Release()
	}
	var dt *kvlease.Transfer
	if m > 0 {
		dt = c.readDisk(dl, stage, rest[h:h+m])
		dl.Release()
		if dt != nil {
			diskRead.Store(dt)
			if canceled.Load() { // the gate's cancel came before the store
				dt.Cancel()
			}
		}
	}
	done := func(t *kvlease.Transfer) bool {
		if t == nil {
			return false
		}
		select {
		case <-t.Done():
			return t.Err() == nil
		case <-c.stop:
			return false
		}
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		gate.Resolve(ErrClosed)
		if stage != nil {
			stage.Release()
		}
		o.err = fmt.Errorf("tiers: onboard of %d blocks for %q: %w", h+m, owner, ErrClosed)
		close(o.ready)
		return o, nil
	}
	c.wg.Add(1)
	c.mu.Unlock()
	go func() {
		defer c.wg.Done()
		valid := d
		var firstErr error
		fail := func(t *kvlease.Transfer, tier Tier, blocks int, what string) {
			c.stats.tiers[tier].failures.Add(uint64(blocks))
			if firstErr == nil {
				var cause error = ErrClosed
				if t != nil && t.Err() != nil {
					cause = t.Err()
				}
				firstErr = fmt.Errorf("tiers: onboard %d blocks from %s: %w", blocks, what, cause)
			}
		}
		hostOK := h == 0 || done(ht)
		if h > 0 {
			if hostOK {
				valid += h
				c.stats.tiers[TierHost].onboarded.Add(uint64(h))
			} else {
				fail(ht, TierHost, h, "host")
			}
		}
		if m > 0 {
			diskOK := done(dt)
			if diskOK {
				// The staging blocks hold the disk's content: they join
				// the host tier (sealed as the disk's record says: the
				// host pool's record), then go on to the device.
				for k := m - 1; k >= 0; k-- {
					if sealAs(stage, k, recs[h+k]) != nil {
						diskOK = false
						break
					}
				}
			} else {
				fail(dt, TierDisk, m, "disk")
			}
			if diskOK {
				var t2 *kvlease.Transfer
				if !canceled.Load() {
					t2 = c.copyIn(stage, l, 0, d+h, m)
				}
				stage.Release()
				if done(t2) {
					c.stats.tiers[TierDisk].onboarded.Add(uint64(m))
					if hostOK {
						valid += m
					}
				} else {
					fail(t2, TierDisk, m, "disk (via host)")
				}
			} else {
				stage.Release()
			}
		}
		gate.Resolve(nil)
		// In chain order: a plain Seal (no tokens known) then names the
		// block before, its parent, as a device lease's blocks do.
		for k := d; k < valid; k++ {
			if sealAs(l, k, recs[k-d]) != nil {
				break // closed by the caller, or sealed by it already
			}
			c.sealed(l, k, recs[k-d].Hash)
		}
		o.valid.Store(int64(valid))
		o.err = firstErr
		close(o.ready)
	}()
	return o, nil
}

// pinHits pins the leading hits of hashes in a lower tier (lookup: its
// AcquireHits) and reads their records (recs), the prefix cut at the
// first block not stored under namespace ns: it gives the lease back and
// pins the shorter prefix again (checked again, in case the tier changed
// in between; once more cut, it gives up). A nil lease: no hits.
func pinHits[R any](owner string, hashes []kvlease.BlockHash, ns string,
	lookup func(string, []kvlease.BlockHash) (*kvlease.Lease[R], error),
	recs func(*kvlease.Lease[R], []kvlease.BlockHash) []kvlease.SealInfo) (*kvlease.Lease[R], []kvlease.SealInfo) {
	for try := 0; try < 2; try++ {
		l, _ := lookup(owner, hashes)
		if l == nil {
			return nil, nil
		}
		rs := recs(l, hashes[:l.Len()])
		k := 0
		for k < len(rs) && rs[k].Namespace == ns {
			k++
		}
		if k == len(rs) {
			return l, rs
		}
		l.Release()
		if k == 0 {
			return nil, nil
		}
		hashes = hashes[:k]
	}
	return nil, nil
}

// Admit is Acquire for a request as a kvlease.Sequence, the way an engine
// admits requests (kvlease.Pool.Admit) when its prefix may be found below
// the device: the device pool checks spec and hashes the prompt once (its
// Hasher, extra keys, adapter), the lookup runs across the tiers with the
// hashes vLLM's last-token rule allows (never the block holding the
// prompt's last token; see Acquire), and the Onboard it returns carries
// the request's Sequence over the device lease. The device hits count as
// computed at once (Sequence.Hits, CachedTokens); the host and disk hits
// once Wait has seen their copies land. The engine then computes from
// Sequence.Computed and commits as for any sequence; the sequence seals
// its blocks on the device itself, and write-back offloads them when the
// device evicts them. A spec.Tenant registered with the device pool
// (kvlease.Pool.Tenant) admits the request as AcquireFor that tenant:
// charged to it, and onboarding only blocks stored under its namespace.
//
// A WriteThrough cache, which copies blocks as Cache.Seal seals them, and
// a sliding-window spec are refused (kvlease.ErrInvalidArgument). Other
// errors are kvlease.Pool.Admit's and Acquire's; nothing is held after
// one.
func (c *Cache[D]) Admit(spec kvlease.SequenceSpec) (*Onboard[D], error) {
	if c.policy == WriteThrough {
		return nil, fmt.Errorf("tiers: admit %q: a sequence seals its own blocks, which write-through would not copy: %w",
			spec.Owner, kvlease.ErrInvalidArgument)
	}
	var o *Onboard[D]
	tn, _ := c.dev.LookupTenant(spec.Tenant)
	seq, err := c.dev.AdmitWith(spec, func(hashes []kvlease.BlockHash, n int) (*kvlease.Lease[D], int, error) {
		var err error
		if o, err = c.acquire(tn, spec.Owner, hashes, n); err != nil {
			return nil, 0, err
		}
		return o.Lease, o.Hits(TierDevice), nil
	})
	if err != nil {
		return nil, err
	}
	o.Sequence = seq
	return o, nil
}

// copyIn starts the onload of blocks src[from:from+n] into dst[at:at+n]
// (a Read on the source, a Write on the destination) and returns its
// transfer, or nil if it could not start.
func (c *Cache[D]) copyIn(src *kvlease.Lease[[]byte], dst *kvlease.Lease[D], from, at, n int) *kvlease.Transfer {
	pairs := make([]kvlease.CopyPair[[]byte, D], n)
	// One lock per lease for the regions, not one per block. The
	// destination blocks are fresh and gated by Writes; take them as read
	// regions (the same memory), as the source's, so that a block sealed
	// by now is not refused.
	srcRegions, err1 := src.AppendReadRegions(make([][]byte, 0, n), from, from+n)
	dstRegions, err2 := dst.AppendReadRegions(make([]D, 0, n), at, at+n)
	if err1 != nil || err2 != nil {
		return nil
	}
	for k := range n {
		pairs[k] = kvlease.CopyPair[[]byte, D]{Src: srcRegions[k], Dst: dstRegions[k]}
	}
	t, err := c.onload.Start(pairs, func(t *kvlease.Transfer) error {
		if err := src.AttachRange(t, from, from+n, kvlease.Read); err != nil {
			return err
		}
		return dst.AttachRange(t, at, at+n, kvlease.Write)
	})
	if err != nil {
		if t != nil && t.State() == kvlease.TransferResolved {
			return t // resolved with the error: done() reports it
		}
		return nil
	}
	return t
}

// readDisk starts reading the disk lease's slots into the staging lease
// and returns the transfer, or nil if it could not start.
func (c *Cache[D]) readDisk(dl *kvlease.Lease[DiskSlot], stage *kvlease.Lease[[]byte], hashes []kvlease.BlockHash) *kvlease.Transfer {
	reads := make([]SlotRead, len(hashes))
	dsts, err := stage.AppendRegions(make([][]byte, 0, len(hashes)), 0, len(hashes))
	if err != nil {
		return nil
	}
	slots := dl.AppendBlockIDs(make([]kvlease.BlockID, 0, len(hashes)), 0)
	for k := range hashes {
		reads[k] = SlotRead{Src: DiskSlot(slots[k]), Dst: dsts[k], Hash: hashes[k]}
	}
	t, err := c.disk.Read(reads, func(t *kvlease.Transfer) error {
		if err := dl.AttachRange(t, 0, len(hashes), kvlease.Read); err != nil {
			return err
		}
		return stage.AttachRange(t, 0, len(hashes), kvlease.Write)
	})
	if err != nil && (t == nil || t.State() != kvlease.TransferResolved) {
		return nil
	}
	return t
}

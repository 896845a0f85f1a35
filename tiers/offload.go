package tiers

import (
	"github.com/kvlease/kvlease"
)

// Owners of the leases the cache itself holds in the lower tiers.
const (
	ownerOffload = "tiers/offload"
	ownerStage   = "tiers/stage"
)

// Seal seals block i of a device lease with hash h under parent (the
// previous block's hash, or the namespace seed for the first block), as
// kvlease.Lease.Seal does, and records the parent for the disk tier's slot
// headers. With WriteThrough it also starts copying the block to the host
// tier (unless the host has it already): a Read on block i of l until the
// copy resolves, so l may be released at once. Errors are Seal's.
func (c *Cache[D]) Seal(l *kvlease.Lease[D], i int, parent, h kvlease.BlockHash) error {
	if err := l.Seal(i, h); err != nil {
		return err
	}
	ref := l.Ref(i)
	c.mu.Lock()
	setParent(c.devParent, ref, parent, true)
	c.mu.Unlock()
	if c.policy == WriteThrough {
		c.toHost(l, i, []kvlease.BlockHash{h}, false)
	}
	return nil
}

// deviceEvicted is the device pool's eviction hook (WriteBack): copy the
// offered blocks to the host tier, then let them go.
func (c *Cache[D]) deviceEvicted(l *kvlease.Lease[D], hashes []kvlease.BlockHash) {
	c.devInflight.Add(int64(len(hashes)))
	c.toHost(l, 0, hashes, true)
}

// toHost copies blocks from..from+len(hashes)-1 of device lease src into
// fresh host blocks and seals them there once the copy resolves; blocks the
// host has already are skipped. release closes src once the copy is
// attached (the offered lease of an eviction). It never blocks on the copy.
func (c *Cache[D]) toHost(src *kvlease.Lease[D], from int, hashes []kvlease.BlockHash, release bool) {
	st := &c.stats.tiers[TierHost]
	watched := false
	if release {
		defer func() {
			src.Release()
			if !watched {
				c.devInflight.Add(-int64(len(hashes)))
			}
		}()
	}
	// Copy only the run of blocks the host does not have; a block the host
	// has is dropped (its copy there is as good).
	var pos []int
	var hs []kvlease.BlockHash
	for k, h := range hashes {
		if c.host.CachedPrefix([]kvlease.BlockHash{h}) > 0 {
			st.dropped.Add(1)
			continue
		}
		pos = append(pos, from+k)
		hs = append(hs, h)
	}
	if len(pos) == 0 {
		return
	}
	dst, err := c.host.Acquire(ownerOffload, len(pos))
	if err != nil {
		st.dropped.Add(uint64(len(pos)))
		return
	}
	pairs := make([]kvlease.CopyPair[D, []byte], len(pos))
	parents := make([]parentRec, len(pos))
	c.mu.Lock()
	for j, p := range pos {
		ref := src.Ref(p)
		parents[j].parent, parents[j].known = getParent(c.devParent, ref)
	}
	c.mu.Unlock()
	// One lock per lease for the regions, not one per block.
	srcRegions, err1 := src.AppendReadRegions(make([]D, 0, src.Len()), 0)
	dstRegions, err2 := dst.AppendRegions(make([][]byte, 0, len(pos)), 0)
	if err1 != nil || err2 != nil {
		dst.Release()
		st.dropped.Add(uint64(len(pos)))
		return
	}
	for j, p := range pos {
		pairs[j] = kvlease.CopyPair[D, []byte]{Src: srcRegions[p], Dst: dstRegions[j]}
	}
	whole := release && len(pos) == src.Len() // the offered lease, every block copied
	t, err := c.offload.Start(pairs, func(t *kvlease.Transfer) error {
		if whole {
			// Every block is sealed: Attach gates them all as Reads.
			if err := src.Attach(t); err != nil {
				return err
			}
		} else {
			for _, p := range pos {
				if err := src.AttachRange(t, p, p+1, kvlease.Read); err != nil {
					return err
				}
			}
		}
		return dst.AttachRange(t, 0, len(pos), kvlease.Write)
	})
	if err != nil {
		st.failures.Add(uint64(len(pos)))
		dst.Release()
		return
	}
	c.mu.Lock()
	for j := range pos {
		setParent(c.hostParent, dst.Ref(j), parents[j].parent, parents[j].known)
	}
	c.mu.Unlock()
	watched = c.watch(t, func(done bool) {
		defer func() {
			dst.Release()
			if release {
				c.devInflight.Add(-int64(len(hashes)))
			}
			keepReserve(c.host, c.hostReserve, &c.hostInflight)
		}()
		if !done || t.Err() != nil {
			st.failures.Add(uint64(len(pos)))
			return
		}
		for j, h := range hs {
			if dst.Seal(j, h) != nil {
				return
			}
		}
		st.offloaded.Add(uint64(len(pos)))
	})
	if !watched {
		dst.Release()
	}
}

// hostEvicted is the host pool's eviction hook when there is a disk tier:
// write the offered blocks to fresh disk slots, sealed there once the
// writes resolve.
func (c *Cache[D]) hostEvicted(l *kvlease.Lease[[]byte], hashes []kvlease.BlockHash) {
	c.hostInflight.Add(int64(len(hashes)))
	watched := false
	defer func() {
		l.Release()
		if !watched {
			c.hostInflight.Add(-int64(len(hashes)))
		}
	}()
	st := &c.stats.tiers[TierDisk]
	d := c.disk
	var pos []int
	var hs []kvlease.BlockHash
	for k, h := range hashes {
		if d.pool.CachedPrefix([]kvlease.BlockHash{h}) > 0 {
			st.dropped.Add(1)
			continue
		}
		pos = append(pos, k)
		hs = append(hs, h)
	}
	if len(pos) == 0 {
		return
	}
	dst, err := d.pool.Acquire(ownerOffload, len(pos))
	if err != nil {
		st.dropped.Add(uint64(len(pos)))
		return
	}
	writes := make([]SlotWrite, len(pos))
	c.mu.Lock()
	for j, p := range pos {
		ref := l.Ref(p)
		parent, known := getParent(c.hostParent, ref)
		writes[j] = SlotWrite{Dst: d.Region(dst.Ref(j).ID), Hash: hs[j], Parent: parent, HasParent: known}
	}
	c.mu.Unlock()
	for j, p := range pos {
		src, err := c.host.Region(l.Ref(p))
		if err != nil {
			dst.Release()
			st.dropped.Add(uint64(len(pos)))
			return
		}
		writes[j].Src = src
	}
	t, err := d.Write(writes, func(t *kvlease.Transfer) error {
		for _, p := range pos {
			if err := l.AttachRange(t, p, p+1, kvlease.Read); err != nil {
				return err
			}
		}
		return dst.AttachRange(t, 0, len(pos), kvlease.Write)
	})
	if err != nil {
		st.failures.Add(uint64(len(pos)))
		dst.Release()
		return
	}
	watched = c.watch(t, func(done bool) {
		defer func() {
			dst.Release()
			c.hostInflight.Add(-int64(len(hashes)))
		}()
		if !done || t.Err() != nil {
			st.failures.Add(uint64(len(pos)))
			return
		}
		for j, h := range hs {
			if dst.Seal(j, h) != nil {
				return
			}
		}
		st.offloaded.Add(uint64(len(pos)))
	})
	if !watched {
		dst.Release()
	}
}

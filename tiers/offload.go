package tiers

import (
	"cmp"
	"slices"

	"github.com/kvlease/kvlease"
)

// Owners of the leases the cache itself holds in the lower tiers.
const (
	ownerOffload = "tiers/offload"
	ownerStage   = "tiers/stage"
)

// Seal seals block i of a device lease with hash h under parent (the
// previous block's hash, or the namespace seed for the first block), as
// kvlease.Lease.Seal does, with parent recorded in the device pool's seal
// record (kvlease.Lease.SealAs; the block's KV event names it unless i is
// 0, a chain's first block) for the lower tiers' copies and slot headers.
// With WriteThrough it also starts copying the block to the host tier
// (unless the host has it already): a Read on block i of l until the copy
// resolves, so l may be released at once. Errors are
// Seal's. Prefer SealTokens when KV events are published: events without
// tokens are not (routers key blocks by their tokens).
func (c *Cache[D]) Seal(l *kvlease.Lease[D], i int, parent, h kvlease.BlockHash) error {
	if err := l.SealAs(i, kvlease.SealInfo{Hash: h, Parent: parent, HasParent: true, Chained: i > 0}); err != nil {
		return err
	}
	c.sealed(l, i, h)
	return nil
}

// SealTokens seals block i of a device lease with the hash of its tokens
// under parent, as kvlease.Lease.SealTokens does (the device pool needs
// WithBlockTokens), and returns that hash. The device pool's seal record
// keeps the tokens, so the block's copies in the lower tiers are sealed
// with them too: every tier's KV events then carry the block's tokens and its parent, each
// with the tier's medium (EventSources). Otherwise as Seal.
func (c *Cache[D]) SealTokens(l *kvlease.Lease[D], i int, parent kvlease.BlockHash, tokens []int32) (kvlease.BlockHash, error) {
	h, err := l.SealTokens(i, parent, tokens)
	if err != nil {
		return h, err
	}
	c.sealed(l, i, h)
	return h, nil
}

// sealed is called once block i of device lease l is sealed as h (its
// record is the device pool's): with WriteThrough it starts the block's
// copy to the host.
func (c *Cache[D]) sealed(l *kvlease.Lease[D], i int, h kvlease.BlockHash) {
	if c.policy == WriteThrough {
		c.toHost(l, i, []kvlease.BlockHash{h}, false)
	}
}

// deviceEvicted is the device pool's eviction hook (WriteBack): queue the
// offered blocks for the offload worker, which copies them to the host
// tier, then lets them go.
func (c *Cache[D]) deviceEvicted(l *kvlease.Lease[D], hashes []kvlease.BlockHash) {
	c.devInflight.Add(int64(len(hashes)))
	c.later(func() { c.toHost(l, 0, hashes, true) })
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
	srcIDs := src.AppendBlockIDs(make([]kvlease.BlockID, 0, src.Len()), 0)
	// The host blocks come as runs of ascending ids (the pool's contiguous
	// allocation); taking the device blocks in ascending id order too makes
	// runs on both sides, each one copy for a transport that merges them
	// (NewMemCopy, the gpu copy engine). Which host block holds which hash
	// is free: each is sealed on its own.
	sortByID(pos, hs, srcIDs)
	dst, err := c.host.Acquire(ownerOffload, len(pos))
	if err != nil {
		st.dropped.Add(uint64(len(pos)))
		return
	}
	pairs := make([]kvlease.CopyPair[D, []byte], len(pos))
	parents := make([]kvlease.SealInfo, len(pos))
	for j, p := range pos {
		parents[j] = recOf(c.dev, src.Ref(p), hs[j])
	}
	// One lock per lease for the regions, not one per block.
	n := src.Len()
	srcRegions, err1 := src.AppendReadRegions(make([]D, 0, n), 0, n)
	dstRegions, err2 := dst.AppendRegions(make([][]byte, 0, len(pos)), 0, len(pos))
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
	watched = c.watch(t, func(done bool) {
		defer func() {
			if release {
				c.devInflight.Add(-int64(len(hashes)))
			}
			// Refill the host's reserve before dst closes: whoever waits
			// for every tier to be quiet then sees the offers too.
			keepReserve(c.host, c.hostReserve, &c.hostInflight)
			dst.Release()
		}()
		if !done || t.Err() != nil {
			st.failures.Add(uint64(len(pos)))
			return
		}
		for j := len(parents) - 1; j >= 0; j-- {
			if sealAs(dst, j, parents[j]) != nil {
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
// queue the offered blocks for the offload worker, which writes them to
// fresh disk slots, sealed there once the writes resolve.
func (c *Cache[D]) hostEvicted(l *kvlease.Lease[[]byte], hashes []kvlease.BlockHash) {
	c.hostInflight.Add(int64(len(hashes)))
	c.later(func() { c.toDisk(l, hashes) })
}

// toDisk writes the offered host blocks of l to fresh disk slots and
// closes l; it never blocks on the writes.
func (c *Cache[D]) toDisk(l *kvlease.Lease[[]byte], hashes []kvlease.BlockHash) {
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
	dstIDs := dst.AppendBlockIDs(make([]kvlease.BlockID, 0, len(pos)), 0)
	n := l.Len()
	srcRegions, err := l.AppendReadRegions(make([][]byte, 0, n), 0, n)
	if err != nil {
		dst.Release()
		st.dropped.Add(uint64(len(pos)))
		return
	}
	recs := make([]kvlease.SealInfo, len(pos))
	for j, p := range pos {
		recs[j] = recOf(c.host, l.Ref(p), hs[j])
	}
	for j := range pos {
		writes[j] = SlotWrite{Src: srcRegions[pos[j]], Dst: d.Region(dstIDs[j]), Hash: hs[j], Parent: recs[j].Parent,
			HasParent: recs[j].HasParent, Chained: recs[j].Chained, Tokens: recs[j].Tokens,
			Namespace: recs[j].Namespace, Adapter: recs[j].Adapter, ExtraKeys: recs[j].ExtraKeys}
		if !d.TagsFit(&writes[j]) {
			// Its tags do not fit a slot: the block is not kept below
			// the host rather than kept without its namespace.
			dst.Release()
			st.dropped.Add(uint64(len(pos)))
			return
		}
	}
	c.mu.Lock()
	for j := range pos {
		c.diskParent[dstIDs[j]] = recs[j]
	}
	c.mu.Unlock()
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
		for j := len(recs) - 1; j >= 0; j-- {
			if sealAs(dst, j, recs[j]) != nil {
				return
			}
		}
		st.offloaded.Add(uint64(len(pos)))
	})
	if !watched {
		dst.Release()
	}
}

// sortByID orders the positions pos (with their hashes hs) by the block
// ids ids[pos[i]], ascending: a no-op in the common case (the pool offers
// its victims ascending).
func sortByID(pos []int, hs []kvlease.BlockHash, ids []kvlease.BlockID) {
	if slices.IsSortedFunc(pos, func(a, b int) int { return cmp.Compare(ids[a], ids[b]) }) {
		return
	}
	type entry struct {
		pos int
		h   kvlease.BlockHash
	}
	es := make([]entry, len(pos))
	for i := range pos {
		es[i] = entry{pos[i], hs[i]}
	}
	slices.SortFunc(es, func(a, b entry) int { return cmp.Compare(ids[a.pos], ids[b.pos]) })
	for i, e := range es {
		pos[i], hs[i] = e.pos, e.h
	}
}

package tiers

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
)

// tokChain returns the tokens and hashes of a chain of n blocks of four
// tokens under seed.
func tokChain(seed, n int) ([]int32, []kvlease.BlockHash) {
	toks := make([]int32, n*4)
	for i := range toks {
		toks[i] = int32(seed*100000 + i)
	}
	return toks, kvlease.ChainHashes(kvlease.BlockHash(seed), toks, 4)
}

// Every tier's pool reports its blocks with the tier's medium; the lower
// tiers' stored events carry the parent and tokens of the device's
// original, and no event anywhere names a wrong parent.
func TestEventsCarryMediumParentsAndTokens(t *testing.T) {
	opts := func() []kvlease.Option {
		return []kvlease.Option{kvlease.WithBlockTokens(4), kvlease.WithKVEvents(1 << 12)}
	}
	dm, _ := kvlease.NewHostMemory(8, testBlockBytes)
	hm, _ := kvlease.NewHostMemory(8, testBlockBytes)
	dev, err := kvlease.NewPool[[]byte](dm, opts()...)
	require.NoError(t, err)
	host, err := kvlease.NewPool[[]byte](hm, opts()...)
	require.NoError(t, err)
	disk, err := OpenDisk(DiskConfig{Dir: t.TempDir(), Slots: 64, BlockBytes: testBlockBytes, Workers: 2, PoolOptions: opts()})
	require.NoError(t, err)
	c, err := New(Config[[]byte]{Device: dev, Host: host, Disk: disk, Offload: MemCopy{}, Onload: MemCopy{}, DeviceReserve: 4, HostReserve: 4})
	require.NoError(t, err)
	r := &rig{c: c, dev: dev, host: host, disk: disk}
	t.Cleanup(func() {
		require.NoError(t, c.Close())
		require.NoError(t, disk.Close())
	})

	srcs := c.EventSources()
	require.Len(t, srcs, 3)
	for i, want := range []struct {
		pool   any
		medium string
	}{{dev, "GPU"}, {host, "CPU"}, {disk.Pool(), "DISK"}} {
		require.Same(t, want.pool, srcs[i].Pool)
		require.Equal(t, want.medium, srcs[i].Medium)
	}

	parentOf := map[kvlease.BlockHash]kvlease.BlockHash{} // a chain's first block: its seed
	tokensOf := map[kvlease.BlockHash][]int32{}
	first := map[kvlease.BlockHash]bool{}
	run := func(seed, n int) {
		toks, hs := tokChain(seed, n)
		for k, h := range hs {
			tokensOf[h] = toks[4*k : 4*k+4]
			if k == 0 {
				parentOf[h], first[h] = kvlease.BlockHash(seed), true
			} else {
				parentOf[h] = hs[k-1]
			}
		}
		o, err := c.Acquire("req", hs, n)
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		valid, err := o.Wait(ctx)
		cancel()
		require.NoError(t, err)
		require.Equal(t, o.Prefix(), valid)
		for k := valid; k < n; k++ {
			parent := kvlease.BlockHash(seed)
			if k > 0 {
				parent = hs[k-1]
			}
			h, err := c.SealTokens(o.Lease, k, parent, toks[4*k:4*k+4])
			require.NoError(t, err)
			require.Equal(t, hs[k], h)
		}
		o.Lease.Release()
		r.settle(t)
	}
	for i := range 10 {
		run(1+i%5, 3) // five chains of three blocks through 8 device and 8 host blocks
	}

	stored := map[string]int{}
	withTokens := map[string]int{}
	removed := 0
	for _, s := range srcs {
		evs, dropped := s.Pool.DrainKVEvents(nil)
		require.Zero(t, dropped)
		for _, e := range evs {
			switch e.Kind {
			case kvlease.KVBlockRemoved:
				if s.Medium == "GPU" {
					removed++
				}
				continue
			case kvlease.KVBlockStored:
			default:
				continue
			}
			stored[s.Medium]++
			want, ok := parentOf[e.BlockHash]
			require.True(t, ok, "%s stored an unknown block %x", s.Medium, e.BlockHash)
			if e.HasParent {
				require.False(t, first[e.BlockHash], "%s: a chain's first block names a parent", s.Medium)
				require.Equal(t, want, e.ParentBlockHash, "%s: wrong parent", s.Medium)
			}
			if e.TokenIDs != nil {
				withTokens[s.Medium]++
				require.Equal(t, tokensOf[e.BlockHash], e.TokenIDs, s.Medium)
				require.Equal(t, !first[e.BlockHash], e.HasParent, "%s: a block with tokens names its parent unless it starts its chain", s.Medium)
				require.Equal(t, 4, e.BlockSize)
			}
		}
	}
	t.Logf("stored %v (with tokens %v), device removals %d, stats %+v", stored, withTokens, removed, c.Stats())
	require.Positive(t, removed, "evictions from the device are reported")
	for _, m := range []string{"GPU", "CPU", "DISK"} {
		require.Positive(t, stored[m], m)
		require.Equal(t, stored[m], withTokens[m], "every %s stored event carries its tokens", m)
	}
}

// A disk tier rebuilt by its scan re-announces its blocks with the parent
// and tokens their slots recorded (when the tokens fit), so a restarted
// tier's KV events are whole; tokens that do not fit are left out.
func TestDiskRestartKeepsTokens(t *testing.T) {
	dir := t.TempDir()
	opts := []kvlease.Option{kvlease.WithBlockTokens(4), kvlease.WithKVEvents(64)}
	cfg := DiskConfig{Dir: dir, Slots: 4, BlockBytes: testBlockBytes, Workers: 2, PoolOptions: opts}
	d, err := OpenDisk(cfg)
	require.NoError(t, err)
	toks, hs := tokChain(3, 2)
	long := make([]int32, 2000) // more than a slot's padding holds
	dl, err := d.Pool().Acquire("w", 4)
	require.NoError(t, err)
	b := make([]byte, testBlockBytes)
	stamp(b, hs[0])
	writes := []SlotWrite{
		{Src: b, Dst: d.Region(dl.Ref(0).ID), Hash: hs[0], Parent: 3, HasParent: true, Tokens: toks[:4]},
		{Src: b, Dst: d.Region(dl.Ref(1).ID), Hash: hs[1], Parent: hs[0], HasParent: true, Chained: true, Tokens: toks[4:8]},
		{Src: b, Dst: d.Region(dl.Ref(2).ID), Hash: 77, Parent: 5, HasParent: true, Chained: true, Tokens: long},
		{Src: b, Dst: d.Region(dl.Ref(3).ID), Hash: 88},
	}
	tr, err := d.Write(writes, func(t *kvlease.Transfer) error { return dl.Attach(t) })
	require.NoError(t, err)
	<-tr.Done()
	require.NoError(t, tr.Err())
	dl.Release()
	require.NoError(t, d.Close())

	d, err = OpenDisk(cfg)
	require.NoError(t, err)
	defer d.Close()
	require.Equal(t, 4, d.Recovered())
	m, ok := d.Scanned(writes[1].Dst)
	require.True(t, ok)
	require.Equal(t, SlotMeta{Hash: hs[1], Parent: hs[0], HasParent: true, Chained: true, Tokens: toks[4:8]}, m)
	m, ok = d.Scanned(writes[2].Dst)
	require.True(t, ok)
	require.Nil(t, m.Tokens, "tokens that do not fit are not recorded")

	evs, _ := d.Pool().DrainKVEvents(nil)
	byHash := map[kvlease.BlockHash]kvlease.KVEvent{}
	for _, e := range evs {
		require.Equal(t, kvlease.KVBlockStored, e.Kind)
		byHash[e.BlockHash] = e
	}
	require.Len(t, byHash, 4)
	require.Equal(t, toks[:4], byHash[hs[0]].TokenIDs)
	require.False(t, byHash[hs[0]].HasParent, "a chain's first block names no parent")
	require.Equal(t, toks[4:8], byHash[hs[1]].TokenIDs)
	require.True(t, byHash[hs[1]].HasParent)
	require.Equal(t, hs[0], byHash[hs[1]].ParentBlockHash)
	require.Nil(t, byHash[77].TokenIDs)
	require.True(t, byHash[77].HasParent, "a block without tokens still names the parent its header records")
	require.Equal(t, kvlease.BlockHash(5), byHash[77].ParentBlockHash)
	require.False(t, byHash[88].HasParent, "a block sealed by hash alone names no unrelated parent")
}

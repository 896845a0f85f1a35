package tiers

import (
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
)

var tenantKey = []byte("the tiers test's tenant key, 32b")

// tenantRig is a three-tier cache whose device pool knows tenants acme
// and globex, every tier publishing KV events.
type tenantRig struct {
	*rig
	acme, globex *kvlease.Tenant[[]byte]
}

func newTenantRig(t *testing.T, dir string) *tenantRig {
	t.Helper()
	opts := func() []kvlease.Option {
		return []kvlease.Option{kvlease.WithBlockTokens(4), kvlease.WithKVEvents(1 << 12)}
	}
	dm, _ := kvlease.NewHostMemory(8, testBlockBytes)
	hm, _ := kvlease.NewHostMemory(8, testBlockBytes)
	dev, err := kvlease.NewPool[[]byte](dm, append(opts(), kvlease.WithTenantKey(tenantKey))...)
	require.NoError(t, err)
	host, err := kvlease.NewPool[[]byte](hm, opts()...)
	require.NoError(t, err)
	disk, err := OpenDisk(DiskConfig{Dir: dir, Slots: 64, BlockBytes: testBlockBytes, Workers: 2, PoolOptions: opts()})
	require.NoError(t, err)
	c, err := New(Config[[]byte]{Device: dev, Host: host, Disk: disk, Offload: MemCopy{}, Onload: MemCopy{}, DeviceReserve: 4, HostReserve: 4})
	require.NoError(t, err)
	r := &tenantRig{rig: &rig{c: c, dev: dev, host: host, disk: disk}}
	r.acme, err = dev.Tenant("acme")
	require.NoError(t, err)
	r.globex, err = dev.Tenant("globex")
	require.NoError(t, err)
	return r
}

func (r *tenantRig) close(t *testing.T) {
	t.Helper()
	r.settle(t)
	require.NoError(t, r.c.Close())
	require.NoError(t, r.disk.Close())
}

func wait(t *testing.T, o *Onboard[[]byte]) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	valid, err := o.Wait(ctx)
	require.NoError(t, err)
	return valid
}

// A tenant's blocks keep their namespace, adapter and extra keys on the
// way down to the host and the disk (records and KV events); after a
// restart of the disk tier (and of the device and host pools), they
// onboard for their tenant only: another tenant, or no tenant, asking
// for the very same hashes gets none of them.
func TestTenantNamespaceThroughTiers(t *testing.T) {
	dir := t.TempDir()
	r := newTenantRig(t, dir)
	acme := r.acme
	seed, err := r.dev.TenantSeed("acme", 0)
	require.NoError(t, err)
	toks, _ := tokChain(7, 3)
	extra := [][]string{nil, nil, {"img:1"}}
	o, err := r.c.AcquireFor(acme, "acme-req", nil, 3)
	require.NoError(t, err)
	require.NoError(t, o.Lease.SetAdapter(kvlease.Adapter{ID: 1, Name: "sql"}))
	hs := make([]kvlease.BlockHash, 3)
	parent := seed
	for k := range 3 {
		hs[k], err = o.Lease.SealTokens(k, parent, toks[4*k:4*k+4], extra[k]...)
		require.NoError(t, err)
		parent = hs[k]
	}
	o.Lease.Release()
	// Flood the device and the host with plain chains until acme's
	// blocks reach the disk.
	for i := 0; r.disk.Pool().CachedPrefix(hs) < 3; i++ {
		require.Less(t, i, 40, "acme's blocks never reached the disk")
		_, fh := tokChain(100+i, 2)
		fo, err := r.c.Acquire("filler", fh, 2)
		require.NoError(t, err)
		wait(t, fo)
		for k := range 2 {
			p := kvlease.BlockHash(100 + i)
			if k > 0 {
				p = fh[k-1]
			}
			require.NoError(t, r.c.Seal(fo.Lease, k, p, fh[k]))
		}
		fo.Lease.Release()
		r.settle(t)
	}
	// Every tier published acme's blocks with their tags.
	want := map[kvlease.BlockHash][]string{hs[0]: nil, hs[1]: nil, hs[2]: {"img:1"}}
	for _, s := range r.c.EventSources() {
		evs, _ := s.Pool.DrainKVEvents(nil)
		seen := 0
		for _, e := range evs {
			keys, ok := want[e.BlockHash]
			if e.Kind != kvlease.KVBlockStored || !ok {
				continue
			}
			seen++
			require.Equal(t, acme.Namespace(), e.Namespace, "%s: namespace of %x", s.Medium, e.BlockHash)
			require.Equal(t, "sql", e.LoraName, s.Medium)
			require.Equal(t, keys, e.ExtraKeys, s.Medium)
		}
		require.GreaterOrEqual(t, seen, 3, "%s published acme's blocks", s.Medium)
	}
	r.close(t)

	// Restart everything but the disk's files.
	r = newTenantRig(t, dir)
	defer r.close(t)
	require.Equal(t, acme.Namespace(), r.acme.Namespace(), "a namespace is the same in every pool with the key")
	require.Equal(t, 3, r.disk.Pool().CachedPrefix(hs))
	for _, who := range []*kvlease.Tenant[[]byte]{r.globex, nil} {
		o, err := r.c.AcquireFor(who, "other", hs, 3)
		require.NoError(t, err)
		require.Zero(t, o.Prefix(), "tenant %v onboarded acme's blocks", who)
		o.Lease.Release()
	}
	o, err = r.c.Acquire("anonymous", hs, 3)
	require.NoError(t, err)
	require.Zero(t, o.Prefix())
	o.Lease.Release()

	o, err = r.c.AcquireFor(r.acme, "acme-again", hs, 3)
	require.NoError(t, err)
	require.Equal(t, 3, o.Hits(TierDisk))
	require.Equal(t, 3, wait(t, o))
	for k := range 3 {
		info, ok := r.dev.SealInfo(o.Lease.Ref(k), nil)
		require.True(t, ok)
		require.Equal(t, acme.Namespace(), info.Namespace)
		require.Equal(t, kvlease.Adapter{ID: 1, Name: "sql"}, info.Adapter)
		require.Equal(t, extra[k], info.ExtraKeys)
		require.Equal(t, toks[4*k:4*k+4], info.Tokens)
	}
	require.Equal(t, 3, r.acme.Stats().Held, "the onboarded blocks are acme's")
	o.Lease.Release()
}

// Admit with a registered tenant is AcquireFor it; an unregistered name
// registers nothing.
func TestAdmitForTenant(t *testing.T) {
	r := newTenantRig(t, t.TempDir())
	defer r.close(t)
	seed, _ := r.dev.TenantSeed("acme", 0)
	toks, _ := tokChain(3, 2)
	o, err := r.c.Admit(kvlease.SequenceSpec{Owner: "a", Prompt: toks, Seed: seed, Tenant: "acme"})
	require.NoError(t, err)
	require.Equal(t, 2, r.acme.Stats().Held)
	o.Sequence.Lease().Release()
	o, err = r.c.Admit(kvlease.SequenceSpec{Owner: "b", Prompt: toks, Seed: seed, Tenant: "nobody"})
	require.NoError(t, err)
	o.Sequence.Lease().Release()
	_, ok := r.dev.LookupTenant("nobody")
	require.False(t, ok)
}

// A tier whose files hold slots of an older format refuses to open with
// an error that says so, rather than serve or silently drop them.
func TestOpenDiskRefusesOldSlotFormat(t *testing.T) {
	dir := t.TempDir()
	cfg := DiskConfig{Dir: dir, Slots: 4, BlockBytes: testBlockBytes}
	d, err := OpenDisk(cfg)
	require.NoError(t, err)
	require.NoError(t, d.Close())
	f, err := os.OpenFile(filepath.Join(dir, "tier-000.slots"), os.O_RDWR, 0)
	require.NoError(t, err)
	old := binary.LittleEndian.AppendUint64(nil, slotMagic&slotMagicMask|uint64('3')<<56)
	require.Equal(t, "LKVTIER3", string(old))
	_, err = f.WriteAt(old, int64(d.slotBytes))
	require.NoError(t, err)
	require.NoError(t, f.Close())
	_, err = OpenDisk(cfg)
	require.ErrorIs(t, err, ErrSlotFormat)
	require.ErrorIs(t, err, kvlease.ErrInvalidArgument)
	require.Contains(t, err.Error(), "remove the slot files")
}

// Tags that cannot fit a slot are refused by Write, never cut.
func TestDiskWriteRefusesTagsThatDoNotFit(t *testing.T) {
	d, err := OpenDisk(DiskConfig{Dir: t.TempDir(), Slots: 4, BlockBytes: testBlockBytes})
	require.NoError(t, err)
	defer d.Close()
	big := slices.Repeat([]string{string(make([]byte, 1000))}, 8)
	w := SlotWrite{Src: make([]byte, testBlockBytes), Dst: 0, Hash: 1, ExtraKeys: big}
	require.False(t, d.TagsFit(&w))
	_, err = d.Write([]SlotWrite{w}, func(*kvlease.Transfer) error { return nil })
	require.True(t, errors.Is(err, kvlease.ErrInvalidArgument), "%v", err)
}

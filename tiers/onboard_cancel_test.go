package tiers

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
)

// TestOnboardAbortCancelsDiskRead: a caller that aborts its onboarding
// lease while the disk read is under way cancels that read too (issue
// 30, item 1: the read gates only the cache's own leases, so aborting
// the caller's lease used to leave it running to its end, holding the
// staging blocks and the disk slots however long the disk took). The
// read stops at its next slot, and every tier's blocks come back.
func TestOnboardAbortCancelsDiskRead(t *testing.T) {
	reading, gate := make(chan struct{}), make(chan struct{})
	var reads atomic.Int32
	d, err := OpenDisk(DiskConfig{Dir: t.TempDir(), Slots: 8, BlockBytes: testBlockBytes, Workers: 1,
		BeforeIO: func(write bool, _ DiskSlot) error {
			if !write && reads.Add(1) == 1 {
				close(reading)
				<-gate // the disk takes its time over the first slot
			}
			return nil
		}})
	require.NoError(t, err)
	hashes := chain(7, 3)
	dl, err := d.Pool().Acquire("w", len(hashes))
	require.NoError(t, err)
	var writes []SlotWrite
	for k, h := range hashes {
		b := make([]byte, testBlockBytes)
		stamp(b, h)
		writes = append(writes, SlotWrite{Src: b, Dst: d.Region(dl.Ref(k).ID), Hash: h})
	}
	tr, err := d.Write(writes, func(t *kvlease.Transfer) error { return dl.Attach(t) })
	require.NoError(t, err)
	<-tr.Done()
	require.NoError(t, tr.Err())
	for k, h := range hashes {
		require.NoError(t, dl.Seal(k, h))
	}
	dl.Release()

	dm, err := kvlease.NewHostMemory(8, testBlockBytes)
	require.NoError(t, err)
	hm, err := kvlease.NewHostMemory(8, testBlockBytes)
	require.NoError(t, err)
	dev, err := kvlease.NewPool[[]byte](dm, kvlease.WithSealRecords())
	require.NoError(t, err)
	host, err := kvlease.NewPool[[]byte](hm, kvlease.WithSealRecords())
	require.NoError(t, err)
	c, err := New(Config[[]byte]{Device: dev, Host: host, Disk: d, Offload: MemCopy{}, Onload: MemCopy{}, DeviceReserve: -1, HostReserve: -1})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, c.Close())
		require.NoError(t, dev.Check())
		require.NoError(t, host.Check())
		require.NoError(t, d.Pool().Check())
		require.NoError(t, d.Close())
	})

	o, err := c.Acquire("req", hashes, len(hashes))
	require.NoError(t, err)
	require.Equal(t, len(hashes), o.Hits(TierDisk))
	select {
	case <-reading:
	case <-time.After(10 * time.Second):
		t.Fatal("the disk read never started")
	}
	o.Lease.Abort(errors.New("client went away"))
	close(gate)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	valid, err := o.Wait(ctx)
	require.ErrorIs(t, err, kvlease.ErrCanceled, "the onboard's outcome")
	require.Zero(t, valid)
	require.EqualValues(t, 1, reads.Load(), "slots read after the abort: the disk read was not cancelled")
	for name, p := range map[string]*kvlease.Pool[[]byte]{"device": dev, "host": host} {
		s := p.Stats()
		require.Zero(t, s.Leased+s.Draining+s.Quarantined, "%s pool %+v", name, s)
	}
	s := d.Pool().Stats()
	require.Zero(t, s.Leased+s.Draining+s.Quarantined, "disk pool %+v", s)
}

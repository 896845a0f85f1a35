package kvlease_test

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
)

func TestTransferGroupStates(t *testing.T) {
	r0, r1, r2 := kvlease.NewTransfer(nil), kvlease.NewTransfer(nil), kvlease.NewTransfer(nil)
	g, err := kvlease.NewTransferGroup(r0, r1, r2)
	require.NoError(t, err)
	require.Equal(t, 3, g.Ranks())
	require.Same(t, r1, g.Rank(1))
	require.Equal(t, kvlease.TransferPending, g.State())
	done := g.Done()

	require.True(t, r0.Resolve(nil))
	require.Equal(t, kvlease.TransferPending, g.State(), "one rank resolved is not the whole")

	reason := errors.New("rank 1 peer vanished")
	r1.Quarantine(reason)
	require.Equal(t, kvlease.TransferQuarantined, g.State())
	require.Equal(t, []int{1}, g.Quarantined(nil))
	require.ErrorIs(t, g.Err(), reason)

	require.True(t, r1.Resolve(nil), "late evidence")
	require.Equal(t, kvlease.TransferPending, g.State(), "lifted: rank 2 is still pending")
	require.Empty(t, g.Quarantined(nil))
	require.False(t, coreIsClosed(done))

	outcome := errors.New("rank 2 copy failed but stopped")
	require.True(t, r2.Resolve(outcome))
	<-done
	require.Equal(t, kvlease.TransferResolved, g.State())
	require.ErrorIs(t, g.Err(), outcome)
	require.Contains(t, g.Err().Error(), "rank 2")
	require.True(t, coreIsClosed(g.Done()))
}

func TestTransferGroupInvalid(t *testing.T) {
	r := kvlease.NewTransfer(nil)
	for _, ranks := range [][]*kvlease.Transfer{nil, {r, nil}, {r, r}} {
		_, err := kvlease.NewTransferGroup(ranks...)
		require.ErrorIs(t, err, kvlease.ErrInvalidArgument)
	}
	// A group of resolved ranks is resolved, Done closed at once.
	require.True(t, r.Resolve(nil))
	g, err := kvlease.NewTransferGroup(r)
	require.NoError(t, err)
	require.True(t, coreIsClosed(g.Done()))
	require.NoError(t, g.Err())
}

func TestTransferGroupCancel(t *testing.T) {
	var runs [2]int
	r0 := kvlease.NewTransfer(func() { runs[0]++ })
	var r1 *kvlease.Transfer
	r1 = kvlease.NewTransfer(func() { runs[1]++; r1.Resolve(errors.New("cancelled, fenced")) })
	g, err := kvlease.NewTransferGroup(r0, r1)
	require.NoError(t, err)
	g.Cancel()
	g.Cancel()
	require.Equal(t, [2]int{1, 1}, runs)
	require.Equal(t, kvlease.TransferPending, g.State())
	r0.Resolve(nil)
	require.Equal(t, kvlease.TransferResolved, g.State())
}

// A lease gated by the group settles only when every rank resolved and
// is quarantined while any rank is.
func TestTransferGroupGatesLease(t *testing.T) {
	p := corePool(t, 8)
	l := coreAcquire(t, p, "tp", 4)
	ranks := []*kvlease.Transfer{kvlease.NewTransfer(nil), kvlease.NewTransfer(nil)}
	g, err := kvlease.NewTransferGroup(ranks...)
	require.NoError(t, err)
	require.NoError(t, kvlease.AttachGroupRange(l, g, 0, 2, kvlease.Read))
	require.ErrorIs(t, kvlease.AttachGroupRange(l, g, 0, 9, kvlease.Read), kvlease.ErrInvalidArgument)
	l.Release()
	coreWant(t, p, coreCounts{Free: 6, Draining: 2})

	ranks[1].Quarantine(nil)
	require.Equal(t, kvlease.LeaseQuarantined, l.State())
	coreWant(t, p, coreCounts{Free: 6, Quarantined: 2})
	ranks[0].Resolve(nil)
	require.Equal(t, kvlease.LeaseQuarantined, l.State(), "rank 1 is still quarantined")
	ranks[1].Resolve(nil)
	<-l.Settled()
	coreAllFree(t, p)

	l2 := coreAcquire(t, p, "tp", 2)
	g2, _ := kvlease.NewTransferGroup(kvlease.NewTransfer(nil), kvlease.NewTransfer(nil))
	require.NoError(t, kvlease.AttachGroup(l2, g2))
	l2.Abort(nil)
	require.Equal(t, kvlease.LeaseDraining, l2.State())
	g2.Rank(0).Resolve(nil)
	require.Equal(t, kvlease.LeaseDraining, l2.State())
	g2.Rank(1).Resolve(nil)
	require.Equal(t, kvlease.LeaseSettled, l2.State())
	require.ErrorIs(t, kvlease.AttachGroup(l2, g2), kvlease.ErrLeaseClosed)
	coreAllFree(t, p)
}

// Ranks resolve and quarantine concurrently with readers of the group.
// Run with -race -count=20.
func TestTransferGroupConcurrent(t *testing.T) {
	p := corePool(t, 64)
	for round := range 50 {
		const nr = 8
		ranks := make([]*kvlease.Transfer, nr)
		for i := range ranks {
			ranks[i] = kvlease.NewTransfer(nil)
		}
		g, err := kvlease.NewTransferGroup(ranks...)
		require.NoError(t, err)
		l := coreAcquire(t, p, fmt.Sprint("tp", round), 4)
		require.NoError(t, kvlease.AttachGroup(l, g))
		done := g.Done()
		var wg sync.WaitGroup
		for i, r := range ranks {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if (i+round)%3 == 0 {
					r.Quarantine(nil)
					_ = g.State()
				}
				r.Resolve(nil)
			}()
		}
		wg.Add(1)
		go func() { defer wg.Done(); l.Release(); _ = g.State(); _ = g.Err() }()
		wg.Wait()
		<-done
		require.Equal(t, kvlease.TransferResolved, g.State())
		<-l.Settled()
		coreAllFree(t, p)
	}
}

// Two tensor-parallel ranks each send their shard; the logical transfer
// resolves when both have.
func ExampleTransferGroup() {
	rank0, rank1 := kvlease.NewTransfer(nil), kvlease.NewTransfer(nil)
	g, _ := kvlease.NewTransferGroup(rank0, rank1)

	rank0.Resolve(nil)
	fmt.Println("rank 0 done:", g.State())
	rank1.Quarantine(errors.New("rank 1: peer vanished"))
	fmt.Println("rank 1 lost:", g.State(), g.Quarantined(nil))
	rank1.Resolve(nil) // late evidence
	<-g.Done()
	fmt.Println("all ranks:", g.State())
	// Output:
	// rank 0 done: pending
	// rank 1 lost: quarantined [1]
	// all ranks: resolved
}

package kvlease

import (
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestTransferGroupStates(t *testing.T) {
	r0, r1, r2 := NewTransfer(nil), NewTransfer(nil), NewTransfer(nil)
	g, err := NewTransferGroup(r0, r1, r2)
	require.NoError(t, err)
	require.Equal(t, 3, g.Ranks())
	require.Same(t, r1, g.Rank(1))
	require.Equal(t, TransferPending, g.State())
	done := g.Done()

	require.True(t, r0.Resolve(nil))
	require.Equal(t, TransferPending, g.State(), "one rank resolved is not the whole")

	reason := errors.New("rank 1 peer vanished")
	r1.Quarantine(reason)
	require.Equal(t, TransferQuarantined, g.State())
	require.Equal(t, []int{1}, g.Quarantined(nil))
	require.ErrorIs(t, g.Err(), reason)

	require.True(t, r1.Resolve(nil), "late evidence")
	require.Equal(t, TransferPending, g.State(), "lifted: rank 2 is still pending")
	require.Empty(t, g.Quarantined(nil))
	require.False(t, coreIsClosed(done))

	outcome := errors.New("rank 2 copy failed but stopped")
	require.True(t, r2.Resolve(outcome))
	<-done
	require.Equal(t, TransferResolved, g.State())
	require.ErrorIs(t, g.Err(), outcome)
	require.Contains(t, g.Err().Error(), "rank 2")
	require.True(t, coreIsClosed(g.Done()))
}

func TestTransferGroupInvalid(t *testing.T) {
	r := NewTransfer(nil)
	for _, ranks := range [][]*Transfer{nil, {r, nil}, {r, r}} {
		_, err := NewTransferGroup(ranks...)
		require.ErrorIs(t, err, ErrInvalidArgument)
	}
	// A group of resolved ranks is resolved, Done closed at once.
	require.True(t, r.Resolve(nil))
	g, err := NewTransferGroup(r)
	require.NoError(t, err)
	require.True(t, coreIsClosed(g.Done()))
	require.NoError(t, g.Err())
}

func TestTransferGroupCancel(t *testing.T) {
	var runs [2]int
	r0 := NewTransfer(func() { runs[0]++ })
	var r1 *Transfer
	r1 = NewTransfer(func() { runs[1]++; r1.Resolve(errors.New("cancelled, fenced")) })
	g, err := NewTransferGroup(r0, r1)
	require.NoError(t, err)
	g.Cancel()
	g.Cancel()
	require.Equal(t, [2]int{1, 1}, runs)
	require.Equal(t, TransferPending, g.State())
	r0.Resolve(nil)
	require.Equal(t, TransferResolved, g.State())
}

// A lease gated by the group settles only when every rank resolved and
// is quarantined while any rank is.
func TestTransferGroupGatesLease(t *testing.T) {
	p := corePool(t, 8)
	l := coreAcquire(t, p, "tp", 4)
	ranks := []*Transfer{NewTransfer(nil), NewTransfer(nil)}
	g, err := NewTransferGroup(ranks...)
	require.NoError(t, err)
	require.NoError(t, AttachGroupRange(l, g, 0, 2, Read))
	require.ErrorIs(t, AttachGroupRange(l, g, 0, 9, Read), ErrInvalidArgument)
	l.Release()
	coreWant(t, p, coreCounts{Free: 6, Draining: 2})

	ranks[1].Quarantine(nil)
	require.Equal(t, LeaseQuarantined, l.State())
	coreWant(t, p, coreCounts{Free: 6, Quarantined: 2})
	ranks[0].Resolve(nil)
	require.Equal(t, LeaseQuarantined, l.State(), "rank 1 is still quarantined")
	ranks[1].Resolve(nil)
	<-l.Settled()
	coreAllFree(t, p)

	l2 := coreAcquire(t, p, "tp", 2)
	g2, _ := NewTransferGroup(NewTransfer(nil), NewTransfer(nil))
	require.NoError(t, AttachGroup(l2, g2))
	l2.Abort(nil)
	require.Equal(t, LeaseDraining, l2.State())
	g2.Rank(0).Resolve(nil)
	require.Equal(t, LeaseDraining, l2.State())
	g2.Rank(1).Resolve(nil)
	require.Equal(t, LeaseSettled, l2.State())
	require.ErrorIs(t, AttachGroup(l2, g2), ErrLeaseClosed)
	coreAllFree(t, p)
}

// Ranks resolve and quarantine concurrently with readers of the group.
// Run with -race -count=20.
func TestTransferGroupConcurrent(t *testing.T) {
	p := corePool(t, 64)
	for round := range 50 {
		const nr = 8
		ranks := make([]*Transfer, nr)
		for i := range ranks {
			ranks[i] = NewTransfer(nil)
		}
		g, err := NewTransferGroup(ranks...)
		require.NoError(t, err)
		l := coreAcquire(t, p, fmt.Sprint("tp", round), 4)
		require.NoError(t, AttachGroup(l, g))
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
		require.Equal(t, TransferResolved, g.State())
		<-l.Settled()
		coreAllFree(t, p)
	}
}

// Two tensor-parallel ranks each send their shard; the logical transfer
// resolves when both have.
func ExampleTransferGroup() {
	rank0, rank1 := NewTransfer(nil), NewTransfer(nil)
	g, _ := NewTransferGroup(rank0, rank1)

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

package kvlease

import (
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// Drains swap the ring under the pool's lock and copy outside it: with
// sealers and several drainers racing, every event is drained exactly
// once, in sequence order within each drain, none is dropped while the
// ring has room, and every stored event's tokens are the block's own.
func TestKVEventDrainsRaceSeals(t *testing.T) {
	const bt, sealers, rounds = 4, 2, 300
	p := newTestPool(t, 64, WithBlockTokens(bt), WithKVEvents(1<<14))
	var wg sync.WaitGroup
	for w := range sealers {
		wg.Go(func() {
			for r := range rounds {
				l, err := p.Acquire("s", 2)
				if err != nil {
					continue // the other sealer holds blocks: fine
				}
				seed := 1 + w*rounds + r
				toks := prompt(seed, 2*bt)
				parent := BlockHash(seed)
				for i := range 2 {
					parent, err = l.SealTokens(i, parent, toks[bt*i:bt*(i+1)])
					require.NoError(t, err)
				}
				l.Release()
			}
		})
	}
	var mu sync.Mutex
	var all []KVEvent
	stop := make(chan struct{})
	var drainers sync.WaitGroup
	drain := func() {
		ev, dropped := p.DrainKVEvents(nil)
		require.Zero(t, dropped)
		for i := 1; i < len(ev); i++ {
			require.Equal(t, ev[i-1].Seq+1, ev[i].Seq, "a drain is one consecutive run")
		}
		mu.Lock()
		all = append(all, ev...)
		mu.Unlock()
	}
	for range 2 {
		drainers.Go(func() {
			for {
				select {
				case <-stop:
					return
				case <-p.KVEventsReady():
					drain()
				}
			}
		})
	}
	wg.Wait()
	close(stop)
	drainers.Wait()
	drain()
	slices.SortFunc(all, func(a, b KVEvent) int { return int(a.Seq) - int(b.Seq) })
	stored := 0
	for i, e := range all {
		require.EqualValues(t, i+1, e.Seq, "every event once")
		if e.Kind == KVBlockStored {
			stored++
			require.Len(t, e.TokenIDs, bt)
			require.Equal(t, cap(e.TokenIDs), len(e.TokenIDs))
			if e.HasParent { // the second block of a prompt: its tokens are its own
				require.Equal(t, HashBlock(e.ParentBlockHash, e.TokenIDs), e.BlockHash)
			}
		}
	}
	require.Positive(t, stored)
	require.NoError(t, p.Check())
}

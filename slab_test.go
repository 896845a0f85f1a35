package kvlease

import (
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// Leases carved from one slab must be as independent as separately
// allocated ones: their block tables never alias, across every size class
// and across slab boundaries, and growth past the inline table moves to the
// heap without disturbing neighbours. Checked builds allocate leases singly
// under the leak check, so this test turns it off to exercise the slabs.
func TestSlabLeasesAreIndependent(t *testing.T) {
	sizes := []int{1, 2, 3, 4, 7, 8, 16, 17, 32, 64, 65, 100}
	total := 0
	for _, n := range sizes {
		total += n * 60
	}
	p := newTestPool(t, total+64, WithLeakCheck(false))
	var all []*Lease[[]byte]
	for _, n := range sizes {
		for range 60 { // cross a slab boundary in every class
			l, err := p.Acquire(fmt.Sprintf("n%d", n), n)
			require.NoError(t, err)
			for i := range n {
				r, err := l.Region(i)
				require.NoError(t, err)
				privateContent(r, l.ID(), i)
			}
			all = append(all, l)
		}
	}
	refs := make([][]BlockRef, len(all))
	for j, l := range all {
		for i := range l.Len() {
			refs[j] = append(refs[j], l.Ref(i))
		}
	}
	// Grow every other lease past its inline table, release the rest.
	for j, l := range all {
		if j%2 == 0 {
			require.NoError(t, l.Extend(1))
		} else {
			l.Release()
		}
	}
	seen := map[BlockID]uint64{}
	for j, l := range all {
		for i, want := range refs[j] {
			require.Equal(t, want, l.Ref(i), "lease %d block %d: its table was overwritten", l.ID(), i)
		}
		if j%2 == 1 {
			continue
		}
		require.Equal(t, len(refs[j])+1, l.Len())
		for i := range len(refs[j]) {
			r, err := l.Region(i)
			require.NoError(t, err)
			want := make([]byte, len(r))
			privateContent(want, l.ID(), i)
			require.Equal(t, want, r)
		}
		for i := range l.Len() {
			id := l.Ref(i).ID
			if other, dup := seen[id]; dup {
				t.Fatalf("block %d in leases %d and %d", id, other, l.ID())
			}
			seen[id] = l.ID()
		}
		l.Release()
	}
	require.Equal(t, p.Memory().Blocks(), p.Stats().Free)
}

// TestSlabConcurrentCarving carves leases from many goroutines; run under
// -race it checks that slabs are only touched under the pool's lock.
func TestSlabConcurrentCarving(t *testing.T) {
	p := newTestPool(t, 512, WithLeakCheck(false))
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 500 {
				n := 1 + (g*7+i)%20
				l, err := p.Acquire("c", n)
				if err != nil {
					continue
				}
				r, _ := l.Region(n - 1)
				privateContent(r, l.ID(), n-1)
				want := make([]byte, len(r))
				privateContent(want, l.ID(), n-1)
				if string(r) != string(want) {
					t.Errorf("lease %d saw foreign content", l.ID())
				}
				l.Release()
			}
		}()
	}
	wg.Wait()
	require.Equal(t, p.Memory().Blocks(), p.Stats().Free)
}

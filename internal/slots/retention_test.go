package slots

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// Eviction takes the lowest retention class first and, within a class,
// the least recently unreferenced slot; hits of mixed classes come off
// their own lists; moving a cached slot to another class moves it to
// that class's most recent end.
func TestRetentionClasses(t *testing.T) {
	var tab Table
	tab.Init(8)
	refs := make([]Ref, 8)
	for i := range refs {
		refs[i], _ = tab.Take()
		tab.Seal(refs[i].ID)
		tab.SetIndexed(refs[i].ID, true)
	}
	// Classes by slot: 0,1 → 6; 2,3 → 4 (default); 4,5 → 1; 6,7 → 6.
	for _, id := range []int32{0, 1, 6, 7} {
		tab.SetRetention(id, 6)
	}
	tab.SetRetention(4, 1)
	tab.SetRetention(5, 1)
	drop(&tab, refs) // tail first: 7, 6, ..., 0 become cached in that order
	checkTable(t, &tab)
	if tab.LRULen() != 8 || tab.CachedIn(6) != 4 || tab.CachedIn(1) != 2 || tab.CachedIn(DefaultRetention) != 2 {
		t.Fatalf("cached %d: class 6 %d, 1 %d, default %d", tab.LRULen(), tab.CachedIn(6), tab.CachedIn(1), tab.CachedIn(DefaultRetention))
	}
	// A hit on 3, 4, 5 (mixed classes) and its release.
	hits := make([]Ref, 3)
	k := tab.Revive(hits, []int32{3, 4, 5})
	for ; k < 3; k++ {
		id := []int32{3, 4, 5}[k]
		tab.Ref(id)
		hits[k] = Ref{ID: id, Gen: tab.Gen(id)}
	}
	checkTable(t, &tab)
	drop(&tab, hits) // 5, 4, 3 become the most recent of their classes
	checkTable(t, &tab)
	tab.SetRetention(0, 1) // slot 0 joins class 1 as its most recent
	checkTable(t, &tab)
	var order []int32
	for range 8 {
		if tab.LRUHead() == Nil {
			t.Fatal("LRU empty early")
		}
		r, evicted := tab.Take()
		if !evicted {
			t.Fatal("took a free slot")
		}
		order = append(order, r.ID)
		checkTable(t, &tab)
	}
	// Class 1: 5 then 4 (released in that order), then 0; class 4: 2,
	// then 3 (re-released); class 6: 7, 6, 1 (dropped tail first).
	if want := []int32{5, 4, 0, 2, 3, 7, 6, 1}; !slices.Equal(order, want) {
		t.Fatalf("evicted %v, want %v", order, want)
	}
	if tab.LRUHead() != Nil || tab.lruMask != 0 {
		t.Fatalf("LRU not empty: head %d mask %08b", tab.LRUHead(), tab.lruMask)
	}
}

// Random leases over a small table with blocks of random retention
// classes: every operation, fast path or general (checked builds take
// both), leaves the table consistent, and an eviction always takes the
// lowest class's least recent slot.
func TestRetentionRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 24))
	var tab Table
	tab.Init(16)
	var leases [][]Ref
	for step := range 4000 {
		switch op := rng.IntN(6); {
		case op == 0 && tab.Available() > 0:
			n := 1 + rng.IntN(min(4, tab.Available()))
			var l []Ref
			for range n {
				want := tab.LRUHead()
				r, evicted := tab.Take()
				if evicted && r.ID != want {
					t.Fatalf("step %d: evicted %d, the lowest class's head is %d", step, r.ID, want)
				}
				l = append(l, r)
			}
			leases = append(leases, l)
		case op == 1 && len(leases) > 0:
			l := leases[rng.IntN(len(leases))]
			id := l[rng.IntN(len(l))].ID
			if !tab.Sealed(id) {
				tab.Seal(id)
				tab.SetRetention(id, uint8(rng.IntN(NumRetention)))
				tab.SetIndexed(id, true)
			}
		case op == 2 && len(leases) > 0:
			i := rng.IntN(len(leases))
			drop(&tab, leases[i])
			leases = slices.Delete(leases, i, i+1)
		case op == 3:
			// Hits: up to 3 cached slots, in LRU order across classes.
			var ids []int32
			for r := range NumRetention {
				for id := tab.lru[r].head; id != Nil && len(ids) < 3; id = tab.links[id].next {
					ids = append(ids, id)
				}
			}
			rng.Shuffle(len(ids), func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
			dst := make([]Ref, len(ids))
			for k := 0; k < len(ids); {
				k += tab.Revive(dst[k:], ids[k:])
				if k < len(ids) {
					tab.Ref(ids[k])
					dst[k] = Ref{ID: ids[k], Gen: tab.Gen(ids[k])}
					k++
				}
			}
			if len(dst) > 0 {
				leases = append(leases, dst)
			}
		case op == 4:
			id := int32(rng.IntN(16))
			if tab.Sealed(id) {
				tab.SetRetention(id, uint8(rng.IntN(NumRetention)))
			}
		}
		checkTable(t, &tab)
	}
}

// SetRetentionWhere moves the cached slots it matches in their recency
// order (oldest first), so a chain released tail first still leaves from
// its end, whatever its slots' ids; slots it does not match stay where
// they are, and an uncached matching slot takes the class for later.
func TestSetRetentionWhere(t *testing.T) {
	var tab Table
	tab.Init(6)
	refs := make([]Ref, 6)
	for i := range refs {
		refs[i], _ = tab.Take()
		tab.Seal(refs[i].ID)
		tab.SetIndexed(refs[i].ID, true)
	}
	drop(&tab, refs[:5]) // 4, 3, 2, 1, 0 cached in that order; 5 stays held
	match := func(id int32) bool { return id == 1 || id == 3 || id == 4 || id == 5 }
	tab.SetRetentionWhere(1, match)
	checkTable(t, &tab)
	if tab.CachedIn(1) != 3 || tab.CachedIn(DefaultRetention) != 2 || tab.ret[5] != 1 {
		t.Fatalf("class 1 %d, default %d, slot 5's class %d", tab.CachedIn(1), tab.CachedIn(DefaultRetention), tab.ret[5])
	}
	var order []int32
	for tab.LRUHead() != Nil {
		r, _ := tab.Take()
		order = append(order, r.ID)
		checkTable(t, &tab)
	}
	if want := []int32{4, 3, 1, 2, 0}; !slices.Equal(order, want) {
		t.Fatalf("evicted %v, want %v", order, want)
	}
}

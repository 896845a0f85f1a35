package slots

import (
	"math"
	"testing"
)

// filled returns a table of n slots with k of them handed out into dst.
func filled(n, k int) (*Table, []Ref) {
	tab := new(Table)
	tab.Init(n)
	dst := make([]Ref, k)
	tab.Fill(dst)
	return tab, dst
}

// drop is Drop and DropRest, as the pool calls them.
func drop(tab *Table, blocks []Ref) {
	if i := tab.Drop(blocks); i > 0 {
		tab.DropRest(blocks[:i])
	}
}

// A slot's generation skips 0 when it wraps, whether it is taken off the
// free stack or evicted: 0 is never handed out.
func TestGenerationWrapSkipsZero(t *testing.T) {
	var tab Table
	tab.Init(1)
	tab.s[0].gen = math.MaxUint32
	dst := make([]Ref, 1)
	if !tab.Fill(dst) || dst[0].Gen != 1 {
		t.Fatalf("fill after wrap: %v", dst[0])
	}
	tab.Seal(0)
	tab.SetIndexed(0, true)
	drop(&tab, dst)
	if tab.ClassOf(0) != Cached {
		t.Fatalf("sealed indexed block released: %v, want cached", tab.ClassOf(0))
	}
	tab.s[0].gen = math.MaxUint32
	r, evicted := tab.Take()
	if !evicted || r.Gen != 1 || tab.Sealed(0) || tab.Indexed(0) {
		t.Fatalf("eviction after wrap: %v evicted=%v sealed=%v indexed=%v", r, evicted, tab.Sealed(0), tab.Indexed(0))
	}
	checkTable(t, &tab)
}

// Evicting takes the least recently unreferenced block, and a chain
// enters the LRU tail first, so it is evicted from its end.
func TestTakeEvictsLeastRecent(t *testing.T) {
	tab, dst := filled(3, 3)
	for _, r := range dst {
		tab.Seal(r.ID)
		tab.SetIndexed(r.ID, true)
	}
	drop(tab, dst) // tail first onto the LRU
	for _, want := range []int32{dst[2].ID, dst[1].ID, dst[0].ID} {
		r, evicted := tab.Take()
		if !evicted || r.ID != want {
			t.Fatalf("took %v (evicted %v), want slot %d", r, evicted, want)
		}
	}
	checkTable(t, tab)
}

// Repin moves write pins only when a pin appears or disappears, and a
// quarantined pin on a leased slot counts it as quarantined and leased.
func TestRepinQuarantine(t *testing.T) {
	tab, dst := filled(2, 1)
	id := dst[0].ID
	tab.Repin(id, PinNone, PinPending, true)
	tab.Repin(id, PinPending, PinQuarantined, true)
	if tab.ClassOf(id) != Quarantined || tab.QuarantinedLeased() != 1 || !tab.Writing(id) {
		t.Fatalf("class %v, quarantined leased %d, writing %v", tab.ClassOf(id), tab.QuarantinedLeased(), tab.Writing(id))
	}
	drop(tab, dst)
	if tab.ClassOf(id) != Quarantined || tab.QuarantinedLeased() != 0 {
		t.Fatalf("after drop: class %v, quarantined leased %d", tab.ClassOf(id), tab.QuarantinedLeased())
	}
	tab.Repin(id, PinQuarantined, PinNone, true)
	if tab.ClassOf(id) != Free || tab.Writing(id) {
		t.Fatalf("after late resolve: class %v, writing %v", tab.ClassOf(id), tab.Writing(id))
	}
	checkTable(t, tab)
}

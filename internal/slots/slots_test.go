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

// ids returns the slot ids of refs.
func idsOf(refs []Ref) []int32 {
	out := make([]int32, len(refs))
	for i, r := range refs {
		out[i] = r.ID
	}
	return out
}

// A fill hands out ascending runs: a fresh table from slot 0 up, and
// blocks given back (tail first, by Drop or by Resolve) come back to the
// next fill as the same ascending run, in the fast and general paths
// alike (the table is checked after each step).
func TestFillKeepsRuns(t *testing.T) {
	bad := func(format string, args ...any) { t.Fatalf(format, args...) }
	want := func(got []Ref, start int32) {
		t.Helper()
		for i, r := range got {
			if r.ID != start+int32(i) {
				t.Fatalf("ids %v, want an ascending run from %d", idsOf(got), start)
			}
		}
	}
	tab, a := filled(32, 4)
	want(a, 0)
	b := make([]Ref, 6)
	tab.Fill(b)
	want(b, 4)
	drop(tab, b) // 4..9 go back as a run
	tab.Check(bad)
	c := make([]Ref, 3)
	tab.Fill(c)
	want(c, 4)
	c2 := make([]Ref, 5) // the rest of the run, then fresh slots after it
	tab.Fill(c2)
	if got := idsOf(c2); got[0] != 7 || got[1] != 8 || got[2] != 9 || got[3] != 10 || got[4] != 11 {
		t.Fatalf("ids %v, want 7 8 9 10 11", got)
	}
	// Given back through a pending pin: Resolve frees tail first too.
	tab.PinPending(c2, false)
	drop(tab, c2)
	tab.Resolve(c2, false, false)
	tab.Check(bad)
	d := make([]Ref, 5)
	tab.Fill(d)
	want(d, 7)
	// The general path (what checked builds sometimes take) agrees.
	drop(tab, d)
	e := make([]Ref, 5)
	tab.fillGeneral(e)
	want(e, 7)
	tab.Check(bad)
}

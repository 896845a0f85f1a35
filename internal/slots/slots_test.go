package slots

import (
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
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

func checkTable(t *testing.T, tab *Table) {
	t.Helper()
	var errs []string
	tab.Check(func(format string, args ...any) { errs = append(errs, fmt.Sprintf(format, args...)) })
	if len(errs) > 0 {
		t.Fatalf("table inconsistent: %v", errs)
	}
}

// Check finds a corrupted table (it is the tool every other test relies
// on, so it must be able to fail).
func TestCheckFindsCorruption(t *testing.T) {
	corrupt := []struct {
		name string
		f    func(tab *Table)
	}{
		{"wrong class", func(tab *Table) { tab.s[1].class = Leased }},
		{"count drift", func(tab *Table) { tab.counts[Free]--; tab.counts[Cached]++ }},
		{"negative refs", func(tab *Table) { tab.s[0].refs = -1 }},
		{"free but held", func(tab *Table) { tab.s[2].pins = 1 }},
		{"free stack short", func(tab *Table) { tab.free = tab.free[:len(tab.free)-1] }},
		{"quarantined leased miscounted", func(tab *Table) { tab.quarLeased++ }},
		{"LRU tail", func(tab *Table) { tab.lru[DefaultRetention].tail = 3 }},
		{"LRU mask", func(tab *Table) { tab.lruMask = 1 }},
	}
	for _, c := range corrupt {
		var tab Table
		tab.Init(4)
		tab.Take()
		c.f(&tab)
		found := false
		tab.Check(func(string, ...any) { found = true })
		if !found {
			t.Errorf("%s: Check found nothing", c.name)
		}
	}
	var tab Table
	tab.Init(4)
	checkTable(t, &tab)
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

// The fast paths equal the general ones: two tables driven through the
// same random sequence of leases, seals, pins, prefix hits, releases,
// resolutions and quarantines, one with every fast loop and one with
// every general loop, stay identical field for field. (Checked builds
// of the root package mix the two at random as well, under its fuzzers.)
func TestFastPathsEqualGeneral(t *testing.T) {
	for seed := range uint64(40) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { fastEqualsGeneral(t, seed) })
	}
}

type tLease struct {
	blocks []Ref
	open   bool
	pins   []tPin
}

type tPin struct {
	lo, hi       int
	write, whole bool
	quarantined  bool
}

func fastEqualsGeneral(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 7))
	const n = 24
	var fast, gen Table
	fast.Init(n)
	gen.Init(n)
	var leases []*tLease
	both := func(f func(tab *Table)) { f(&fast); f(&gen) }
	pick := func(open bool) *tLease {
		var c []*tLease
		for _, l := range leases {
			if l.open == open && len(l.blocks) > 0 {
				c = append(c, l)
			}
		}
		if len(c) == 0 {
			return nil
		}
		return c[rng.IntN(len(c))]
	}
	for step := range 400 {
		what := ""
		switch op := rng.IntN(8); op {
		case 0: // acquire fresh blocks
			k := 1 + rng.IntN(5)
			if fast.Available() < k {
				continue
			}
			a, b := make([]Ref, k), make([]Ref, k)
			if fast.FreeLen() >= k {
				fast.fillFast(a)
				gen.fillGeneral(b)
				what = "fill"
			} else {
				for i := range a {
					a[i], _ = fast.takeFast()
					b[i], _ = gen.takeGeneral()
				}
				what = "take"
			}
			if !slices.Equal(a, b) {
				t.Fatalf("step %d: fill handed out %v, general %v", step, a, b)
			}
			leases = append(leases, &tLease{blocks: a, open: true})
		case 1: // seal and index a block nothing writes
			l := pick(true)
			if l == nil {
				continue
			}
			id := l.blocks[rng.IntN(len(l.blocks))].ID
			if fast.Writing(id) || fast.Sealed(id) {
				continue
			}
			both(func(tab *Table) { tab.Seal(id); tab.SetIndexed(id, true) })
			what = "seal"
		case 2: // attach a pending transfer to an open lease
			l := pick(true)
			if l == nil {
				continue
			}
			lo := rng.IntN(len(l.blocks))
			hi := lo + rng.IntN(len(l.blocks)-lo+1)
			p := tPin{lo: lo, hi: hi, whole: rng.IntN(3) == 0}
			if p.whole {
				p.lo, p.hi = 0, len(l.blocks)
				for _, r := range l.blocks {
					fast.Repin(r.ID, PinNone, PinPending, !fast.Sealed(r.ID))
					gen.Repin(r.ID, PinNone, PinPending, !gen.Sealed(r.ID))
				}
			} else {
				p.write = rng.IntN(2) == 0
				if p.write && slices.ContainsFunc(l.blocks[lo:hi], func(r Ref) bool { return fast.Sealed(r.ID) }) {
					continue
				}
				var w int32
				if p.write {
					w = 1
				}
				pinPending(fast.s, l.blocks[lo:hi], w)
				gen.pinGeneral(l.blocks[lo:hi], p.write)
			}
			l.pins = append(l.pins, p)
			what = "pin"
		case 3: // release
			l := pick(true)
			if l == nil {
				continue
			}
			if i := fast.dropFast(l.blocks); i > 0 {
				fast.dropSlow(l.blocks[:i])
			}
			gen.dropGeneral(l.blocks)
			l.open = false
			what = "drop"
		case 4, 5: // resolve (or quarantine) a pin
			var c []*tLease
			for _, l := range leases {
				if len(l.pins) > 0 {
					c = append(c, l)
				}
			}
			if len(c) == 0 {
				continue
			}
			l := c[rng.IntN(len(c))]
			i := rng.IntN(len(l.pins))
			p := l.pins[i]
			blocks := l.blocks[p.lo:p.hi]
			switch {
			case op == 5 && !p.quarantined:
				for j := len(blocks) - 1; j >= 0; j-- {
					id := blocks[j].ID
					w := p.write || (p.whole && !fast.Sealed(id))
					both(func(tab *Table) { tab.Repin(id, PinPending, PinQuarantined, w) })
				}
				l.pins[i].quarantined = true
				what = "quarantine"
			case p.quarantined:
				for j := len(blocks) - 1; j >= 0; j-- {
					id := blocks[j].ID
					w := p.write || (p.whole && !fast.Sealed(id))
					both(func(tab *Table) { tab.Repin(id, PinQuarantined, PinNone, w) })
				}
				l.pins = slices.Delete(l.pins, i, i+1)
				what = "late resolve"
			default:
				var w int32
				if p.write {
					w = 1
				}
				k0 := len(fast.free)
				j, k := unpinFast(fast.s, blocks, fast.free[:cap(fast.free)], k0, w, p.whole)
				fast.free = fast.free[:k]
				fast.counts[Draining] -= k - k0
				fast.counts[Free] += k - k0
				fast.resolveGeneral(blocks[:j], p.write, p.whole)
				gen.resolveGeneral(blocks, p.write, p.whole)
				l.pins = slices.Delete(l.pins, i, i+1)
				what = "resolve"
			}
		case 6: // prefix hits: the LRU's blocks from the head, then any sealed held ones
			var ids []int32
			for id := fast.LRUHead(); id != Nil && len(ids) < 4; id = fast.links[id].next {
				ids = append(ids, id)
			}
			rng.Shuffle(len(ids), func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
			if l := pick(true); l != nil {
				for _, r := range l.blocks {
					if fast.Sealed(r.ID) && !fast.Writing(r.ID) && !slices.Contains(ids, r.ID) {
						ids = append(ids, r.ID)
					}
				}
			}
			if len(ids) == 0 {
				continue
			}
			a, b := make([]Ref, len(ids)), make([]Ref, len(ids))
			ka, kb := fast.reviveFast(a, ids), gen.reviveGeneral(b, ids)
			if ka == kb {
				na, nb := refHeld(fast.s, a[ka:], ids[ka:]), gen.refHeldGeneral(b[kb:], ids[kb:])
				ka, kb = ka+na, kb+nb
			}
			if ka != kb {
				t.Fatalf("step %d: revived %d, general %d", step, ka, kb)
			}
			for k := ka; k < len(ids); k++ {
				fast.Ref(ids[k])
				gen.Ref(ids[k])
				a[k] = Ref{ID: ids[k], Gen: fast.Gen(ids[k])}
				b[k] = a[k]
			}
			if !slices.Equal(a, b) {
				t.Fatalf("step %d: revived %v, general %v", step, a, b)
			}
			leases = append(leases, &tLease{blocks: a, open: true})
			what = "revive"
		case 7: // unindex a block (a reset of the cache)
			l := pick(true)
			if l == nil || fast.LRULen() == 0 {
				continue
			}
			id := fast.LRUHead()
			both(func(tab *Table) { tab.SetIndexed(id, false) })
			what = "unindex"
		}
		if !reflect.DeepEqual(fast, gen) {
			t.Fatalf("step %d (%s): fast and general tables differ:\nfast    %+v\ngeneral %+v", step, what, fast, gen)
		}
		checkTable(t, &fast)
	}
}

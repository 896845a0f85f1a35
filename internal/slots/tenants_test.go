package slots

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// takeN takes n slots for tenant tn, as the pool does: FillTenant (or
// Fill) when the free stack holds them all, else one by one.
func takeN(tab *Table, tn uint16, n int) []Ref {
	dst := make([]Ref, n)
	ok := false
	if tn == 0 {
		ok = tab.Fill(dst)
	} else {
		ok = tab.FillTenant(dst, tn)
	}
	if !ok {
		for i := range dst {
			dst[i], _ = tab.TakeFor(tn)
		}
	}
	return dst
}

// dropFor is DropTenant (or Drop) and DropRest, as the pool calls them.
func dropFor(tab *Table, tn uint16, blocks []Ref) {
	var i int
	if tn == 0 {
		i = tab.Drop(blocks)
	} else {
		i = tab.DropTenant(blocks, tn)
	}
	if i > 0 {
		tab.DropRest(blocks[:i])
	}
}

// cache takes n slots for tenant tn, seals and indexes them and drops
// them: n cached slots of tn, cached tail first.
func cache(t *testing.T, tab *Table, tn uint16, n int) []Ref {
	t.Helper()
	refs := takeN(tab, tn, n)
	for _, r := range refs {
		tab.Seal(r.ID)
		tab.SetIndexed(r.ID, true)
	}
	dropFor(tab, tn, refs)
	checkTable(t, tab)
	return refs
}

func ids(refs []Ref) []int32 {
	out := make([]int32, len(refs))
	for i, r := range refs {
		out[i] = r.ID
	}
	return out
}

// A tenant at its cap takes its own least recently cached slot, even with
// free slots left; others keep theirs. Its fresh slots are charged to it
// until they are free; a cached slot evicted for another moves its charge.
func TestTenantCapEvictsOwn(t *testing.T) {
	var tab Table
	tab.Init(16)
	a, _ := tab.AddTenant()
	b, _ := tab.AddTenant()
	tab.SetQuota(a, 4, 0)
	bs := cache(t, &tab, b, 4)
	as := cache(t, &tab, a, 4) // a at its cap: 4 held, 4 cached
	if h, c, _ := tab.TenantCounts(a); h != 4 || c != 4 || tab.Room(a) != 4 {
		t.Fatalf("a holds %d, %d cached, room %d", h, c, tab.Room(a))
	}
	// Cached tail first: a's last slot is its least recently cached.
	l := takeN(&tab, a, 2)
	if want := []int32{as[3].ID, as[2].ID}; !slices.Equal(ids(l), want) {
		t.Fatalf("a at its cap took %v, want its own oldest %v (8 slots free)", ids(l), want)
	}
	checkTable(t, &tab)
	if h, c, _ := tab.TenantCounts(a); h != 4 || c != 2 || tab.Room(a) != 2 {
		t.Fatalf("a holds %d, %d cached, room %d", h, c, tab.Room(a))
	}
	if h, c, _ := tab.TenantCounts(b); h != 4 || c != 4 {
		t.Fatalf("b holds %d, %d cached", h, c)
	}
	if _, own := tab.TenantEvictions(a); own != 2 {
		t.Fatalf("a evicted %d of its own", own)
	}
	// No tenant, no free slot: the pool's order, b's oldest first; the
	// charge leaves b.
	rest := takeN(&tab, 0, 8) // the free ones
	v, evicted := tab.TakeFor(0)
	if !evicted || v.ID != bs[3].ID || tab.TenantOf(v.ID) != 0 {
		t.Fatalf("took %v (evicted %v, tenant %d), want b's oldest %d", v, evicted, tab.TenantOf(v.ID), bs[3].ID)
	}
	if h, c, _ := tab.TenantCounts(b); h != 3 || c != 3 {
		t.Fatalf("b holds %d, %d cached after an eviction", h, c)
	}
	if others, _ := tab.TenantEvictions(b); others != 1 {
		t.Fatalf("b evicted by others %d", others)
	}
	checkTable(t, &tab)
	// Freed: uncharged.
	dropFor(&tab, a, l)
	dropFor(&tab, 0, append(rest, v))
	if h, _, _ := tab.TenantCounts(a); h != 2 {
		t.Fatalf("a holds %d after its leased slots are free", h)
	}
	checkTable(t, &tab)
}

// A reservation keeps a tenant's newest cached slots from every other
// fill; an eviction that meets them sets them aside; its own fills may
// take them; a set-aside slot that leaves the reservation is evicted
// next; a hit on a reserved slot hands its place to the newest other.
func TestTenantReservation(t *testing.T) {
	var tab Table
	tab.Init(8)
	b, _ := tab.AddTenant()
	tab.SetQuota(b, 0, 2)
	bs := cache(t, &tab, b, 3) // cached tail first: bs[2], bs[1], bs[0]; reserved: bs[1], bs[0]
	if !tab.Reserved(bs[0].ID) || !tab.Reserved(bs[1].ID) || tab.Reserved(bs[2].ID) {
		t.Fatal("the reservation is not b's newest two")
	}
	if tab.Available() != 5+1 || tab.AvailableFor(b) != 8 || tab.Evictable() != 1 {
		t.Fatalf("available %d, for b %d, evictable %d", tab.Available(), tab.AvailableFor(b), tab.Evictable())
	}
	free := takeN(&tab, 0, 5)
	// No tenant: b's unreserved slot, then nothing it may take.
	if v, _ := tab.TakeFor(0); v.ID != bs[2].ID {
		t.Fatalf("took %v, want b's unreserved %d", v, bs[2].ID)
	}
	checkTable(t, &tab)
	if tab.Available() != 0 {
		t.Fatalf("available %d with only b's reservation cached", tab.Available())
	}
	// Another tenant's fill looks past b's reserved slots: with one free
	// slot it takes that, and the reserved ones are set aside.
	dropFor(&tab, 0, free[:1])
	a, _ := tab.AddTenant()
	if tab.AvailableFor(a) != 1 {
		t.Fatalf("available for a %d", tab.AvailableFor(a))
	}
	got := takeN(&tab, a, 1)
	checkTable(t, &tab)
	dropFor(&tab, a, got) // unsealed: free again
	// b caches a third slot: its oldest reserved (bs[1]) leaves the
	// reservation and is the next eviction.
	nb := cache(t, &tab, b, 1)
	if tab.Reserved(bs[1].ID) || !tab.Reserved(nb[0].ID) {
		t.Fatal("b's newest did not take the oldest's place in the reservation")
	}
	takeN(&tab, 0, 0)
	if v, evicted := tab.TakeFor(0); !evicted || v.ID != bs[1].ID {
		t.Fatalf("took %v (evicted %v), want %d, which left the reservation", v, evicted, bs[1].ID)
	}
	checkTable(t, &tab)
	// b's own fill takes its own reserved slot (nothing else is left).
	if v, evicted := tab.TakeFor(b); !evicted || tab.TenantOf(v.ID) != b || v.ID != bs[0].ID {
		t.Fatalf("b took %v (evicted %v), want its own oldest %d", v, evicted, bs[0].ID)
	}
	checkTable(t, &tab)
	// A hit on a reserved slot: the newest unreserved one takes its place.
	tab2 := new(Table)
	tab2.Init(8)
	c, _ := tab2.AddTenant()
	tab2.SetQuota(c, 0, 1)
	cs := cache(t, tab2, c, 3) // reserved: cs[0]
	if lost, own := tab2.HitsCost(0, []int32{cs[0].ID}); lost != 1 || own != 0 {
		t.Fatalf("a hit on the reserved slot costs %d, own %d: want 1 (cs[1] is reserved instead)", lost, own)
	}
	if lost, own := tab2.HitsCost(c, []int32{cs[0].ID, cs[1].ID}); lost != 2 || own != 2 {
		t.Fatalf("c's hits cost %d, own %d", lost, own)
	}
	tab2.Ref(cs[0].ID)
	checkTable(t, tab2)
	if !tab2.Reserved(cs[1].ID) {
		t.Fatal("the newest unreserved slot did not join the reservation")
	}
	// Lowering and raising the reservation.
	tab2.SetQuota(c, 0, 0)
	checkTable(t, tab2)
	tab2.SetQuota(c, 0, 2)
	checkTable(t, tab2)
	if !tab2.Reserved(cs[1].ID) || !tab2.Reserved(cs[2].ID) {
		t.Fatal("raising the reservation did not take the cached slots")
	}
}

// Random operations on a table with tenants: after each, Check holds; no
// fill took a slot another tenant reserves; a tenant at its cap took its
// own least recently cached slot, one under it the free stack's top when
// there was one; a fill never took a tenant over its cap; HitsCost
// predicts what hits cost.
func TestTenantRandom(t *testing.T) {
	for seed := range uint64(40) {
		tenantRandom(t, seed)
	}
}

type tLease2 struct {
	tn     uint16
	blocks []Ref
}

func tenantRandom(t *testing.T, seed uint64) {
	r := rand.New(rand.NewPCG(seed, 7))
	const n = 24
	var tab Table
	tab.Init(n)
	nt := uint16(1 + r.IntN(3))
	for range nt {
		tab.AddTenant()
	}
	var leases []*tLease2
	reserved := func() int {
		s := 0
		for tn := uint16(1); tn <= nt; tn++ {
			_, rs := tab.Quota(tn)
			s += rs
		}
		return s
	}
	for step := range 400 {
		what := ""
		switch op := r.IntN(9); op {
		case 0, 1, 2: // acquire
			tn := uint16(r.IntN(int(nt) + 1))
			k := 1 + r.IntN(5)
			if tab.AvailableFor(tn) < k || (tn != 0 && tab.Room(tn) < k) {
				continue
			}
			// What each take may take, checked block by block.
			heldBefore := 0
			if tn != 0 {
				heldBefore, _, _ = tab.TenantCounts(tn)
			}
			dst := make([]Ref, k)
			if tn != 0 && tab.FillTenant(dst, tn) || tn == 0 && tab.Fill(dst) {
				leases = append(leases, &tLease2{tn, dst})
				what = "fill"
				break
			}
			for i := range dst {
				atCap := tn != 0 && tab.atCap(tn)
				var own int32 = Nil
				if atCap {
					own = tab.tenants[tn].list.head
				}
				top := Nil
				if len(tab.free) > 0 {
					top = tab.free[len(tab.free)-1]
				}
				var others []int32 // slots reserved by another tenant
				for id := range int32(n) {
					if tab.Reserved(id) && tab.TenantOf(id) != tn {
						others = append(others, id)
					}
				}
				dst[i], _ = tab.TakeFor(tn)
				id := dst[i].ID
				switch {
				case atCap && id != own:
					t.Fatalf("seed %d step %d: tenant %d at its cap took %d, want its oldest cached %d", seed, step, tn, id, own)
				case !atCap && top != Nil && id != top:
					t.Fatalf("seed %d step %d: tenant %d took %d with %d free on top", seed, step, tn, id, top)
				case slices.Contains(others, id):
					t.Fatalf("seed %d step %d: tenant %d took %d, reserved by tenant %d", seed, step, tn, id, tab.ten[id])
				}
				if tab.TenantOf(id) != tn {
					t.Fatalf("seed %d step %d: slot %d charged to %d, not %d", seed, step, id, tab.TenantOf(id), tn)
				}
			}
			if tn != 0 {
				// A fill never takes a tenant over its cap (a cap lowered
				// under what it holds: it stays where it was).
				if cp, _ := tab.Quota(tn); cp > 0 {
					if h, _, _ := tab.TenantCounts(tn); h > max(cp, heldBefore) {
						t.Fatalf("seed %d step %d: tenant %d holds %d, over its cap %d (held %d before)", seed, step, tn, h, cp, heldBefore)
					}
				}
			}
			leases = append(leases, &tLease2{tn, dst})
			what = "take"
		case 3: // seal some blocks of a lease
			if len(leases) == 0 {
				continue
			}
			l := leases[r.IntN(len(leases))]
			for _, b := range l.blocks {
				if r.IntN(2) == 0 && tab.Refs(b.ID) == 1 && !tab.Sealed(b.ID) {
					tab.Seal(b.ID)
					tab.SetIndexed(b.ID, true)
				}
			}
			what = "seal"
		case 4, 5: // release
			if len(leases) == 0 {
				continue
			}
			i := r.IntN(len(leases))
			l := leases[i]
			leases = slices.Delete(leases, i, i+1)
			dropFor(&tab, l.tn, l.blocks)
			what = "release"
		case 6: // hit cached slots
			var hit []int32
			for id := range int32(n) {
				if tab.ClassOf(id) == Cached && r.IntN(3) == 0 {
					hit = append(hit, id)
				}
			}
			if len(hit) == 0 {
				continue
			}
			tn := uint16(r.IntN(int(nt) + 1))
			before := tab.AvailableFor(tn)
			lost, _ := tab.HitsCost(tn, hit)
			dst := make([]Ref, len(hit))
			k := tab.Revive(dst, hit)
			for ; k < len(hit); k++ {
				tab.Ref(hit[k])
				dst[k] = Ref{ID: hit[k], Gen: tab.Gen(hit[k])}
			}
			if got := before - tab.AvailableFor(tn); got != lost {
				t.Fatalf("seed %d step %d: hits cost %d, HitsCost said %d", seed, step, got, lost)
			}
			leases = append(leases, &tLease2{tn, dst})
			what = "hit"
		case 7: // quota
			tn := uint16(1 + r.IntN(int(nt)))
			_, old := tab.Quota(tn)
			cp, rs := r.IntN(12), r.IntN(8)
			if cp > 0 && rs > cp || reserved()-old+rs > n {
				continue
			}
			tab.SetQuota(tn, cp, rs)
			what = "quota"
		case 8: // offer, reset or reclass a cached slot
			switch r.IntN(3) {
			case 0:
				if tab.Evictable() == 0 {
					continue
				}
				o := tab.Offer()
				if tab.TenantOf(o.ID) != 0 {
					t.Fatalf("seed %d step %d: an offered slot is still charged", seed, step)
				}
				leases = append(leases, &tLease2{0, []Ref{o}})
				what = "offer"
			case 1:
				if id := tab.LRUHead(); id != Nil {
					tab.SetIndexed(id, false)
					what = "reset"
				}
			case 2:
				if id := int32(r.IntN(n)); tab.Sealed(id) {
					tab.SetRetention(id, uint8(r.IntN(NumRetention)))
					what = "retention"
				}
			}
		}
		if what == "" {
			continue
		}
		var errs []string
		tab.Check(func(f string, a ...any) { errs = append(errs, fmt.Sprintf(f, a...)) })
		if len(errs) > 0 {
			t.Fatalf("seed %d step %d after %s: %v", seed, step, what, errs)
		}
	}
}

// Check finds corrupted tenant bookkeeping.
func TestCheckFindsTenantCorruption(t *testing.T) {
	corrupt := []struct {
		name string
		f    func(tab *Table)
	}{
		{"held drift", func(tab *Table) { tab.tenants[1].held++ }},
		{"cached drift", func(tab *Table) { tab.tenants[1].cached-- }},
		{"reserved count", func(tab *Table) { tab.reservedAll++ }},
		{"reserved flag", func(tab *Table) { tab.s[tab.tenants[1].list.head].flags |= flagReserved }},
		{"parked on a list", func(tab *Table) { tab.s[tab.tenants[1].list.tail].flags |= flagParked }},
		{"free but charged", func(tab *Table) { tab.s[tab.free[0]].flags = flagTracked; tab.ten[tab.free[0]] = 1 }},
		{"charged to no tenant", func(tab *Table) { tab.ten[tab.tenants[1].list.head] = 0 }},
		{"tenant list tail", func(tab *Table) { tab.tenants[1].list.tail = Nil }},
	}
	for _, c := range corrupt {
		tab := new(Table)
		tab.Init(8)
		tn, _ := tab.AddTenant()
		tab.SetQuota(tn, 0, 2)
		cache(t, tab, tn, 4)
		c.f(tab)
		found := false
		tab.Check(func(string, ...any) { found = true })
		if !found {
			t.Errorf("%s: Check found nothing", c.name)
		}
	}
}

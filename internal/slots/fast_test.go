package slots

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
)

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
		switch op := rng.IntN(9); op {
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
			if i, _ := fast.dropFast(l.blocks, headLeased, headDraining); i > 0 {
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
		case 8: // release with a pending read not pinned yet (pinned as it drops)
			l := pick(true)
			if l == nil {
				continue
			}
			rest := fast.dropPinnedFast(l.blocks)
			pinPending(fast.s, l.blocks[:rest], 0)
			if i, _ := fast.dropFast(l.blocks[:rest], headLeased, headDraining); i > 0 {
				fast.dropSlow(l.blocks[:i])
			}
			gen.pinGeneral(l.blocks, false)
			gen.dropGeneral(l.blocks)
			l.open = false
			l.pins = append(l.pins, tPin{lo: 0, hi: len(l.blocks)})
			what = "drop pinned"
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

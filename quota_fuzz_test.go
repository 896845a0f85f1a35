package kvlease

import (
	"errors"
	"fmt"
	"slices"
	"testing"
)

// FuzzQuota decodes its input into operations on a pool with three
// registered tenants (acquire and acquire-prefix as a tenant or as none,
// seal, release, extend, attach a read transfer, resolve or quarantine
// it, set a tenant's quota, reset the cache) and runs them against the
// pool and qzModel, a small model of quota.go's rules written apart from
// the implementation: a block is charged to the tenant whose lease took
// it fresh until it is free; a tenant's reserved blocks are its newest
// min(Reserve, cached) cached blocks; an acquire needs room under its
// cap (cap − held + its cached blocks not hit) and blocks available to it
// (free, plus cached ones no other tenant reserves) after its hits.
//
// After each step: the pool's five counts sum to capacity and equal the
// model's; every tenant's held, cached and reserved counts and the other
// line equal the model's; Pool.Check holds. Every acquire's outcome is
// the model's (admitted, ErrQuota, or another ErrExhausted), a refusal
// holds nothing, and its fresh blocks were taken as the rules say: free
// blocks first unless its tenant is at its cap, never a block another
// tenant reserved, its own least recently cached first at its cap, and
// never more than its cap.
//
//	go test -run FuzzQuota .
//	go test -run XXX -fuzz FuzzQuota -fuzztime 20000x .
func FuzzQuota(f *testing.F) {
	for _, s := range qzSeeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) { qzRun(t, data) })
}

// Hand-written sequences (op, a, b triples: see qzRun); testdata holds
// more.
var qzSeeds = [][]byte{
	// t1 cap 4: acquires 4, seals them, releases; acquires 2 at its cap
	// (its own oldest two are evicted, with 8 blocks free).
	{5, 0, 4, 0, 1, 3, 2, 0, 0, 2, 0, 1, 2, 0, 2, 2, 0, 3, 3, 0, 0, 0, 1, 1},
	// t2 reserve 3 caches 4, none caches 4, t1 floods 8 (parking t2's
	// reserved blocks), everything released, t2 hits its prefix, t1 hits
	// t2's reserved blocks.
	{5, 1, 24, 0, 6, 3, 2, 0, 0, 2, 0, 1, 2, 0, 2, 2, 0, 3, 3, 0, 0,
		0, 0, 3, 2, 0, 0, 2, 0, 1, 2, 0, 2, 2, 0, 3, 3, 0, 0,
		0, 1, 3, 0, 1, 3, 3, 0, 0, 3, 0, 0, 1, 6, 15, 1, 5, 7, 3, 0, 0, 3, 0, 0},
	// t3 cap 3: acquires 2, extends by 1, then by 1 again (refused);
	// its quota lowered to cap 1 with 3 held, then raised.
	{5, 2, 3, 0, 3, 1, 4, 0, 0, 4, 0, 0, 5, 2, 1, 4, 0, 0, 5, 2, 7, 4, 0, 0, 3, 0, 0},
	// Transfers: t1 acquires 3 with a read attached, seals, releases
	// (draining), the transfer is quarantined then resolved late.
	{0, 1, 2, 6, 0, 0, 2, 0, 0, 2, 0, 1, 3, 0, 0, 7, 0, 0, 8, 0, 0},
}

const (
	qzBlocks  = 12
	qzTenants = 3
)

type qzLease struct {
	l      *Lease[[]byte]
	tn     uint16
	chain  BlockHash
	blocks []BlockRef
	open   bool
	tr     *Transfer // attached read transfer, nil if none
	trN    int       // it gates blocks [0, trN)
	pinned bool      // tr's pins are on the blocks (the lease closed first)
	trq    bool      // tr is quarantined
}

type qzSlot struct {
	refs, pins, quar int
	sealed, indexed  bool
	hash             BlockHash
	charge           uint16
	at               int // when it was last cached
}

type qzModel struct {
	t       *testing.T
	p       *Pool[[]byte]
	ts      []*Tenant[[]byte] // [0] nil: no tenant
	q       []Quota
	slots   [qzBlocks]qzSlot
	index   map[BlockHash]int
	leases  []*qzLease
	clock   int
	queries []uint64
	hits    []uint64
	step    int
	log     []string
}

func (m *qzModel) fatalf(format string, args ...any) {
	m.t.Helper()
	m.t.Fatalf("step %d: %s\nlog:\n%s", m.step, fmt.Sprintf(format, args...), joinLines(m.log))
}

func joinLines(l []string) string {
	out := ""
	for _, s := range l {
		out += "  " + s + "\n"
	}
	return out
}

func (m *qzModel) held(id int) bool {
	s := &m.slots[id]
	return s.refs > 0 || s.pins > 0 || s.quar > 0
}

func (m *qzModel) cached(id int) bool { return !m.held(id) && m.slots[id].indexed }
func (m *qzModel) free(id int) bool   { return !m.held(id) && !m.slots[id].indexed }

// cachedOf lists tenant tn's cached blocks, least recently cached first.
func (m *qzModel) cachedOf(tn uint16) []int {
	var out []int
	for id := range m.slots {
		if m.cached(id) && m.slots[id].charge == tn {
			out = append(out, id)
		}
	}
	slices.SortFunc(out, func(a, b int) int { return m.slots[a].at - m.slots[b].at })
	return out
}

// reservedOf is tenant tn's reservation: its newest min(Reserve, cached).
func (m *qzModel) reservedOf(tn uint16, skip []int) []int {
	var c []int
	for _, id := range m.cachedOf(tn) {
		if !slices.Contains(skip, id) {
			c = append(c, id)
		}
	}
	return c[len(c)-min(m.q[tn].Reserve, len(c)):]
}

func (m *qzModel) heldBy(tn uint16) int {
	n := 0
	for id := range m.slots {
		if !m.free(id) && m.slots[id].charge == tn {
			n++
		}
	}
	return n
}

// availableFor is what a fill for tn may take once hit leaves the cache:
// free blocks and cached ones no other tenant reserves.
func (m *qzModel) availableFor(tn uint16, hit []int) int {
	n := 0
	for id := range m.slots {
		if m.free(id) || (m.cached(id) && !slices.Contains(hit, id)) {
			n++
		}
	}
	for u := uint16(1); u <= qzTenants; u++ {
		if u != tn {
			n -= len(m.reservedOf(u, hit))
		}
	}
	return n
}

// room is what tn's cap leaves for fresh blocks once hit leaves the cache.
func (m *qzModel) room(tn uint16, hit []int) int {
	if tn == 0 || m.q[tn].Cap == 0 {
		return 1 << 30
	}
	own := 0
	for _, id := range m.cachedOf(tn) {
		if !slices.Contains(hit, id) {
			own++
		}
	}
	return m.q[tn].Cap - m.heldBy(tn) + own
}

// probe is the model's prefix match.
func (m *qzModel) probe(hs []BlockHash) []int {
	var hit []int
	for _, h := range hs {
		id, ok := m.index[h]
		if !ok || slices.Contains(hit, id) {
			break
		}
		hit = append(hit, id)
	}
	return hit
}

// unheld settles block id after a hold was dropped: cached (stamped) or
// free (uncharged, its content forfeit).
func (m *qzModel) unheld(id int) {
	if m.held(id) {
		return
	}
	s := &m.slots[id]
	if s.indexed {
		m.clock++
		s.at = m.clock
		return
	}
	s.sealed, s.charge = false, 0
}

func (m *qzModel) acquire(tn uint16, chain BlockHash, n, nh int) {
	owner := fmt.Sprintf("l%d", len(m.leases))
	var hs []BlockHash
	for k := range nh {
		hs = append(hs, chain+BlockHash(k))
	}
	hit := m.probe(hs)
	fresh := n - len(hit)
	var want error
	switch {
	case fresh > m.room(tn, hit):
		want = ErrQuota
	case fresh > m.availableFor(tn, hit):
		want = ErrExhausted
	}
	// What the rules allow the fresh blocks to be.
	var reservedOthers []int
	for u := uint16(1); u <= qzTenants; u++ {
		if u != tn {
			reservedOthers = append(reservedOthers, m.reservedOf(u, hit)...)
		}
	}
	atCap := tn != 0 && m.q[tn].Cap > 0 && m.heldBy(tn) >= m.q[tn].Cap
	own := m.cachedOf(tn)
	heldBefore := m.heldBy(tn)
	freeBefore := 0
	for id := range m.slots {
		if m.free(id) {
			freeBefore++
		}
	}
	before := m.p.Stats()
	var l *Lease[[]byte]
	var got int
	var err error
	switch {
	case tn == 0 && nh == 0:
		l, err = m.p.Acquire(owner, n)
	case tn == 0:
		l, got, err = m.p.AcquirePrefix(owner, hs, n)
	case nh == 0:
		l, err = m.ts[tn].Acquire(owner, n)
	default:
		l, got, err = m.ts[tn].AcquirePrefix(owner, hs, n)
	}
	m.log = append(m.log, fmt.Sprintf("acquire tenant %d n %d hashes %d (model: %d hits, want %v): %v", tn, n, nh, len(hit), want, err))
	if want != nil {
		if !errors.Is(err, want) || (want == ErrExhausted && errors.Is(err, ErrQuota)) {
			m.fatalf("acquire: %v, want %v", err, want)
		}
		if after := m.p.Stats(); after.Free != before.Free || after.Cached != before.Cached || after.Leased != before.Leased {
			m.fatalf("a refused acquire changed the pool: %+v → %+v", before, after)
		}
		return
	}
	if err != nil {
		m.fatalf("acquire: %v, want it admitted", err)
	}
	if nh > 0 && got != len(hit) {
		m.fatalf("%d hits, model %d", got, len(hit))
	}
	ql := &qzLease{l: l, tn: tn, chain: chain, open: true}
	for i := range n {
		r := l.Ref(i)
		ql.blocks = append(ql.blocks, r)
		id := int(r.ID)
		s := &m.slots[id]
		if i < len(hit) {
			if id != hit[i] {
				m.fatalf("hit %d is block %d, model %d", i, id, hit[i])
			}
			s.refs++
			continue
		}
		switch {
		case m.held(id):
			m.fatalf("fresh block %d is held", id)
		case slices.Contains(reservedOthers, id):
			m.fatalf("tenant %d took block %d, reserved by tenant %d", tn, id, s.charge)
		case atCap && (s.charge != tn || !m.cached(id)):
			m.fatalf("tenant %d at its cap took block %d (charged to %d, cached %v): want its own", tn, id, s.charge, m.cached(id))
		}
		if m.cached(id) {
			delete(m.index, s.hash)
		}
		*s = qzSlot{refs: 1, charge: tn}
	}
	if tn != 0 {
		if cp := m.q[tn].Cap; cp > 0 && m.heldBy(tn) > max(cp, heldBefore) {
			m.fatalf("tenant %d holds %d, over its cap %d (held %d before)", tn, m.heldBy(tn), cp, heldBefore)
		}
	}
	// Own evictions at the cap: the least recently cached first.
	var ownTaken []int
	for _, r := range ql.blocks[len(hit):] {
		if slices.Contains(own, int(r.ID)) {
			ownTaken = append(ownTaken, int(r.ID))
		}
	}
	if atCap {
		var left []int
		for _, id := range own {
			if !slices.Contains(hit, id) {
				left = append(left, id)
			}
		}
		slices.SortFunc(ownTaken, func(a, b int) int { return slices.Index(left, a) - slices.Index(left, b) })
		if !slices.Equal(ownTaken, left[:len(ownTaken)]) {
			m.fatalf("tenant %d at its cap evicted %v, want its least recently cached %v", tn, ownTaken, left[:len(ownTaken)])
		}
	}
	// Free blocks first, for a fill its cap leaves room for.
	if tn == 0 || m.q[tn].Cap == 0 || heldBefore+fresh <= m.q[tn].Cap {
		if wantEv, gotEv := max(0, fresh-freeBefore), int(m.p.Stats().Evictions-before.Evictions); gotEv != wantEv {
			m.fatalf("%d evictions for %d fresh blocks with %d free: want %d", gotEv, fresh, freeBefore, wantEv)
		}
	}
	if nh > 0 && tn != 0 {
		m.queries[tn] += uint64(nh)
		m.hits[tn] += uint64(len(hit))
	}
	m.leases = append(m.leases, ql)
}

func (m *qzModel) seal(ql *qzLease, i int) {
	r := ql.blocks[i]
	s := &m.slots[r.ID]
	h := ql.chain + BlockHash(i)
	err := ql.l.Seal(i, h)
	m.log = append(m.log, fmt.Sprintf("seal block %d of %v: %v", i, ql.blocks, err))
	if s.sealed {
		if err != nil && s.hash == h {
			m.fatalf("re-seal with the same hash: %v", err)
		}
		return
	}
	if err != nil {
		m.fatalf("seal: %v", err)
	}
	s.sealed, s.hash = true, h
	if _, dup := m.index[h]; !dup {
		m.index[h] = int(r.ID)
		s.indexed = true
	}
}

func (m *qzModel) release(ql *qzLease) {
	ql.l.Release()
	m.log = append(m.log, fmt.Sprintf("release %v (tenant %d)", ql.blocks, ql.tn))
	ql.open = false
	if ql.tr != nil && ql.tr.State() != TransferResolved {
		ql.pinned = true
		for _, r := range ql.blocks[:ql.trN] {
			if ql.trq {
				m.slots[r.ID].quar++
			} else {
				m.slots[r.ID].pins++
			}
		}
	}
	for i := len(ql.blocks) - 1; i >= 0; i-- {
		id := int(ql.blocks[i].ID)
		m.slots[id].refs--
		m.unheld(id)
	}
}

func (m *qzModel) extend(ql *qzLease, k int) {
	var want error
	switch {
	case len(ql.blocks)+k > qzBlocks:
		want = ErrExceedsCapacity
	case k > m.room(ql.tn, nil):
		want = ErrQuota
	case k > m.availableFor(ql.tn, nil):
		want = ErrExhausted
	}
	before := len(ql.blocks)
	err := ql.l.Extend(k)
	m.log = append(m.log, fmt.Sprintf("extend tenant %d by %d (want %v): %v", ql.tn, k, want, err))
	if want != nil {
		if !errors.Is(err, want) || (want == ErrExhausted && errors.Is(err, ErrQuota)) {
			m.fatalf("extend: %v, want %v", err, want)
		}
		return
	}
	if err != nil {
		m.fatalf("extend: %v", err)
	}
	for i := before; i < before+k; i++ {
		r := ql.l.Ref(i)
		ql.blocks = append(ql.blocks, r)
		s := &m.slots[r.ID]
		if m.held(int(r.ID)) {
			m.fatalf("extended with a held block %d", r.ID)
		}
		if m.cached(int(r.ID)) {
			delete(m.index, s.hash)
		}
		*s = qzSlot{refs: 1, charge: ql.tn}
	}
}

// end resolves (or quarantines) ql's transfer.
func (m *qzModel) end(ql *qzLease, quarantine bool) {
	m.log = append(m.log, fmt.Sprintf("end transfer of %v quarantine=%v", ql.blocks, quarantine))
	if quarantine {
		if ql.trq {
			return
		}
		ql.tr.Quarantine(nil)
		ql.trq = true
		if ql.pinned {
			for _, r := range ql.blocks[:ql.trN] {
				m.slots[r.ID].pins--
				m.slots[r.ID].quar++
			}
		}
		return
	}
	ql.tr.Resolve(nil)
	if ql.pinned {
		for i := ql.trN - 1; i >= 0; i-- {
			id := int(ql.blocks[i].ID)
			if ql.trq {
				m.slots[id].quar--
			} else {
				m.slots[id].pins--
			}
			m.unheld(id)
		}
	}
	ql.tr, ql.pinned, ql.trq = nil, false, false
}

func (m *qzModel) verify() {
	m.t.Helper()
	st := m.p.Stats()
	if st.Free+st.Cached+st.Leased+st.Draining+st.Quarantined != st.Capacity {
		m.fatalf("counts %+v do not sum to capacity", st)
	}
	var free, cached int
	for id := range m.slots {
		switch {
		case m.free(id):
			free++
		case m.cached(id):
			cached++
		}
	}
	if st.Free != free || st.Cached != cached {
		m.fatalf("free %d cached %d, model %d %d", st.Free, st.Cached, free, cached)
	}
	lines := m.p.TenantStats(nil)
	otherHeld, otherCached := qzBlocks-free, cached
	for tn := uint16(1); tn <= qzTenants; tn++ {
		s := lines[tn-1]
		h, c := m.heldBy(tn), len(m.cachedOf(tn))
		r := min(m.q[tn].Reserve, c)
		if s.Held != h || s.Cached != c || s.Reserved != r || s.Quota != m.q[tn] ||
			s.PrefixQueries != m.queries[tn] || s.PrefixHits != m.hits[tn] {
			m.fatalf("tenant %d: %+v, model held %d cached %d reserved %d quota %+v queries %d hits %d",
				tn, s, h, c, r, m.q[tn], m.queries[tn], m.hits[tn])
		}
		otherHeld -= h
		otherCached -= c
	}
	if o := lines[qzTenants]; o.Tenant != "" || o.Held != otherHeld || o.Cached != otherCached {
		m.fatalf("other line %+v, model held %d cached %d", o, otherHeld, otherCached)
	}
	if err := m.p.Check(); err != nil {
		m.fatalf("Check: %v", err)
	}
}

// qzRun decodes data as (op, a, b) triples: op%10 is 0 acquire, 1
// acquire prefix (tenant a%4, 0 for none; chain by a>>2; 1+b%4 blocks,
// some hashed), 2 seal, 3 release, 4 extend, 5 quota (tenant 1+a%3, cap
// b%8, reserve (b>>3)%5), 6 attach a read, 7 and 8 end a transfer
// (quarantined or resolved), 9 reset the cache; a picks the lease.
func qzRun(t *testing.T, data []byte) {
	in := &fzIn{b: data}
	m := &qzModel{t: t, p: hostPool(t, qzBlocks, 16, WithLeakCheck(false)), index: map[BlockHash]int{},
		ts: make([]*Tenant[[]byte], qzTenants+1), q: make([]Quota, qzTenants+1),
		queries: make([]uint64, qzTenants+1), hits: make([]uint64, qzTenants+1)}
	for tn := 1; tn <= qzTenants; tn++ {
		var err error
		if m.ts[tn], err = m.p.Tenant(fmt.Sprintf("t%d", tn)); err != nil {
			t.Fatal(err)
		}
	}
	open := func(b int) *qzLease {
		var o []*qzLease
		for _, l := range m.leases {
			if l.open {
				o = append(o, l)
			}
		}
		if len(o) == 0 {
			return nil
		}
		return o[b%len(o)]
	}
	for ; in.more() && m.step < 200; m.step++ {
		op, a, b := in.u8(), in.u8(), in.u8()
		switch op % 10 {
		case 0, 1: // acquire (prefix when b's high bits say so)
			tn := uint16(a % (qzTenants + 1))
			n := 1 + b%4
			nh := 0
			if op%10 == 1 {
				nh = min(n, (b>>2)%4+1)
			}
			m.acquire(tn, BlockHash(1000*(1+(a>>2)%3)), n, nh)
		case 2: // seal a block of an open lease
			if ql := open(a); ql != nil {
				m.seal(ql, b%len(ql.blocks))
			}
		case 3: // release
			if ql := open(a); ql != nil {
				m.release(ql)
			}
		case 4: // extend
			if ql := open(a); ql != nil {
				m.extend(ql, 1+b%3)
			}
		case 5: // quota
			tn := uint16(1 + a%qzTenants)
			q := Quota{Cap: b % 8, Reserve: (b >> 3) % 5}
			if q.Cap > 0 && q.Reserve > q.Cap {
				q.Reserve = q.Cap
			}
			res := q.Reserve
			for u := uint16(1); u <= qzTenants; u++ {
				if u != tn {
					res += m.q[u].Reserve
				}
			}
			err := m.ts[tn].SetQuota(q)
			m.log = append(m.log, fmt.Sprintf("quota %d %+v: %v", tn, q, err))
			if (res > qzBlocks) != (err != nil) {
				m.fatalf("SetQuota %+v with %d reserved in all: %v", q, res, err)
			}
			if err == nil {
				m.q[tn] = q
			}
		case 6: // attach a read transfer to an open lease
			if ql := open(a); ql != nil && ql.tr == nil {
				ql.tr, ql.trN = NewTransfer(nil), len(ql.blocks)
				if err := ql.l.AttachRange(ql.tr, 0, len(ql.blocks), Read); err != nil {
					m.fatalf("attach: %v", err)
				}
				m.log = append(m.log, fmt.Sprintf("attach %v", ql.blocks))
			}
		case 7, 8: // end a transfer
			var withTr []*qzLease
			for _, l := range m.leases {
				if l.tr != nil {
					withTr = append(withTr, l)
				}
			}
			if len(withTr) > 0 {
				ql := withTr[a%len(withTr)]
				m.end(ql, op%10 == 7 && b%2 == 0)
			}
		case 9: // reset the cache
			n := m.p.ResetCache(false)
			dropped := 0
			for id := range m.slots {
				if m.cached(id) {
					s := &m.slots[id]
					delete(m.index, s.hash)
					*s = qzSlot{}
					dropped++
				}
			}
			m.log = append(m.log, fmt.Sprintf("reset: %d", n))
			if n != dropped {
				m.fatalf("reset dropped %d, model %d", n, dropped)
			}
		}
		m.verify()
	}
	// Clean up: everything released and resolved, the pool whole.
	for _, ql := range m.leases {
		if ql.open {
			m.release(ql)
		}
		if ql.tr != nil {
			m.end(ql, false)
		}
	}
	m.verify()
	if st := m.p.Stats(); st.Leased+st.Draining+st.Quarantined != 0 {
		m.fatalf("after cleanup %+v", st)
	}
}

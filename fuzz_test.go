package kvlease

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
)

// FuzzLifecycle decodes its input into a sequence of operations (acquire,
// acquire prefix, acquire-wait, extend, attach range read/write, attach
// whole, seal, release, abort, resolve, quarantine, late resolve, cancel,
// close, trim) and runs them against a pool and against fzModel, a small
// single-goroutine model of DESIGN.md's rules written independently of the
// implementation: it derives every block's state from the leases and
// transfers that hold it. After each step the pool's five counts, every
// lease's and transfer's state, every ref's staleness, the prefix probe and
// Pool.Check must agree with the model.
//
// The model takes the ids of fresh blocks from the pool (which free block
// is handed out is the pool's business) and checks that each was free, or,
// when nothing was free, the least recently unreferenced cached block, and
// that it got a generation never handed out before.
//
//	go test -run FuzzLifecycle .                          # the seed corpus
//	go test -run XXX -fuzz FuzzLifecycle -fuzztime 60s .  # fuzzing
func FuzzLifecycle(f *testing.F) {
	for _, seed := range fzSeeds {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		fzRun(t, data)
	})
}

// A few hand-written sequences; testdata/fuzz/FuzzLifecycle holds more.
var fzSeeds = [][]byte{
	{3, 0, 2, 5, 0, 0, 1, 3, 1, 8, 0, 10, 0, 0},
	{7, 1, 3, 7, 0, 0, 5, 5, 0, 0, 0, 2, 1, 11, 0, 0, 9, 0, 10, 0, 0},
	{5, 2, 0x21, 2, 1, 3, 6, 0, 0, 7, 0, 0, 4, 8, 0, 2, 0x31, 2, 1, 3},
	// acquire 4, read-attach [0,2), seal block 0, trim to 2, quarantine,
	// late resolve, trim past the end, extend, release.
	{7, 0, 0, 4, 5, 0, 0, 0, 1, 3, 0, 0, 8, 0, 1, 1, 16, 0, 3, 12, 0, 0, 0, 11, 0, 1, 16, 0, 6, 4, 0, 2, 9, 0},
	// acquire 3, attach whole, trim to 1, attach whole again, extend,
	// trim to 3, abort (cancels both), resolve.
	{6, 0, 0, 3, 7, 0, 0, 1, 16, 0, 2, 7, 0, 1, 1, 4, 0, 1, 16, 0, 4, 10, 0, 11, 0, 1, 11, 1, 1},
}

// fzIn reads the fuzz input; past its end every byte reads as 0.
type fzIn struct {
	b []byte
	i int
}

func (in *fzIn) more() bool { return in.i < len(in.b) }

func (in *fzIn) u8() int {
	if in.i >= len(in.b) {
		return 0
	}
	v := in.b[in.i]
	in.i++
	return int(v)
}

type fzAtt struct {
	tr       int
	from, to int
	whole    bool
	write    bool // for ranges; a whole attachment writes the unsealed blocks
}

type fzLease struct {
	l       *Lease[[]byte]
	id      uint64
	blocks  []BlockRef
	trimmed int // blocks before this index were given back by TrimTo
	closed  bool
	atts    []fzAtt
}

type fzTransfer struct {
	t        *Transfer
	state    TransferState
	err      error
	hook     int  // 0: nil hook; 1: counts; 2: counts and resolves synchronously
	hookUsed bool // the hook ran or can no longer run
	want     int  // hook runs the model expects
	runs     int  // hook runs observed
}

type fzSlot struct {
	gen     uint32 // generation of the current or last hand-out (0: never)
	refs    int    // open-lease positions holding it
	sealed  bool
	hash    BlockHash
	indexed bool // the prefix index maps hash to it
	group   int  // when it last became unreferenced (cached recency)
}

var (
	errFzCancelled = errors.New("fuzz: cancelled, fenced")
	errFzOutcome   = errors.New("fuzz: copy failed but stopped")
	errFzReason    = errors.New("fuzz: peer vanished")
)

type fzModel struct {
	t       *testing.T
	p       *Pool[[]byte]
	cap     int
	closed  bool
	slots   []fzSlot
	index   map[BlockHash]int
	used    map[[2]uint64]bool // (slot, gen) pairs ever handed out
	groups  int
	leases  []*fzLease
	trs     []*fzTransfer
	step    int
	log     []string
	obsMu   sync.Mutex
	settled map[uint64]int
}

func (m *fzModel) fatalf(format string, args ...any) {
	m.t.Helper()
	tail := m.log
	if len(tail) > 20 {
		tail = tail[len(tail)-20:]
	}
	m.t.Fatalf("step %d: %s\nlast operations:\n  %s", m.step, fmt.Sprintf(format, args...), strings.Join(tail, "\n  "))
}

func (m *fzModel) logf(format string, args ...any) {
	m.log = append(m.log, fmt.Sprintf(format, args...))
}

// cover returns, per slot, how many pending and quarantined attachments
// gate it, and whether any of them writes it.
func (m *fzModel) cover() (pend, quar []int, write []bool) {
	pend, quar, write = make([]int, m.cap), make([]int, m.cap), make([]bool, m.cap)
	for _, ls := range m.leases {
		for _, a := range ls.atts {
			st := m.trs[a.tr].state
			if st == TransferResolved {
				continue
			}
			from, to := a.from, a.to
			if a.whole {
				to = len(ls.blocks) // from the first block held when it attached
			}
			for _, r := range ls.blocks[from:to] {
				if st == TransferPending {
					pend[r.ID]++
				} else {
					quar[r.ID]++
				}
				if a.write || (a.whole && !m.slots[r.ID].sealed) {
					write[r.ID] = true
				}
			}
		}
	}
	return
}

func (m *fzModel) heldSet() []bool {
	pend, quar, _ := m.cover()
	h := make([]bool, m.cap)
	for i := range h {
		h[i] = m.slots[i].refs > 0 || pend[i] > 0 || quar[i] > 0
	}
	return h
}

// classes returns each slot's state: the first of Quarantined, Leased,
// Draining, Cached, Free that applies.
func (m *fzModel) classes() []string {
	pend, quar, _ := m.cover()
	cl := make([]string, m.cap)
	for i, s := range m.slots {
		switch {
		case quar[i] > 0:
			cl[i] = "quarantined"
		case s.refs > 0:
			cl[i] = "leased"
		case pend[i] > 0:
			cl[i] = "draining"
		case s.indexed:
			cl[i] = "cached"
		default:
			cl[i] = "free"
		}
	}
	return cl
}

func (m *fzModel) counts() coreCounts {
	var c coreCounts
	for _, k := range m.classes() {
		switch k {
		case "free":
			c.Free++
		case "cached":
			c.Cached++
		case "leased":
			c.Leased++
		case "draining":
			c.Draining++
		case "quarantined":
			c.Quarantined++
		}
	}
	return c
}

// unheld records that the slots held in before and not now became
// unreferenced at one moment: indexed ones are cached, the rest free.
func (m *fzModel) unheld(before []bool) {
	now := m.heldSet()
	m.groups++
	for i := range now {
		if before[i] && !now[i] {
			s := &m.slots[i]
			if s.indexed {
				s.group = m.groups
			} else {
				s.sealed, s.hash = false, 0
			}
		}
	}
}

func (m *fzModel) available() (free, cached int) {
	held := m.heldSet()
	for i, s := range m.slots {
		if !held[i] {
			if s.indexed {
				cached++
			} else {
				free++
			}
		}
	}
	return
}

// probe is the prefix match: the longest run of hashes that map to a block
// whose content is known (no pending or quarantined write), each block
// once.
func (m *fzModel) probe(hs []BlockHash) []int {
	_, _, write := m.cover()
	var hit []int
	for _, h := range hs {
		id, ok := m.index[h]
		if !ok || write[id] || slices.Contains(hit, id) {
			break
		}
		hit = append(hit, id)
	}
	return hit
}

// takeFreshAll checks and records that the pool handed out refs fresh in
// one fill. Their places are the pool's choice (it lays them out as
// ascending runs), so the set is checked in the order a fill takes
// blocks: the free ones first, then the cached ones least recently
// unreferenced first.
func (m *fzModel) takeFreshAll(refs []BlockRef) {
	order := slices.Clone(refs)
	key := func(r BlockRef) int {
		if r.ID < 0 || int(r.ID) >= m.cap || !m.slots[r.ID].indexed {
			return -1 // free (or out of range: takeFresh says so)
		}
		return m.slots[r.ID].group
	}
	slices.SortStableFunc(order, func(a, b BlockRef) int { return key(a) - key(b) })
	for _, r := range order {
		m.takeFresh(r)
	}
}

// takeFresh checks and records that the pool handed out ref fresh.
func (m *fzModel) takeFresh(ref BlockRef) {
	if ref.ID < 0 || int(ref.ID) >= m.cap {
		m.fatalf("fresh block %v outside the pool", ref)
	}
	held := m.heldSet()
	s := &m.slots[ref.ID]
	if held[ref.ID] {
		m.fatalf("fresh block %v is still held (refs=%d)", ref, s.refs)
	}
	free, _ := m.available()
	if free > 0 {
		if s.indexed {
			m.fatalf("fresh block %v evicted from the cache while %d blocks are free", ref, free)
		}
	} else {
		if !s.indexed {
			m.fatalf("fresh block %v is neither free nor cached", ref)
		}
		for i, o := range m.slots {
			if !held[i] && o.indexed && o.group < s.group {
				m.fatalf("evicted block %v (unreferenced at %d) before block %d (unreferenced at %d)", ref, s.group, i, o.group)
			}
		}
		delete(m.index, s.hash)
		s.indexed = false
	}
	key := [2]uint64{uint64(ref.ID), uint64(ref.Gen)}
	if ref.Gen == 0 || m.used[key] {
		m.fatalf("fresh block %v: generation 0 or handed out before", ref)
	}
	m.used[key] = true
	s.gen, s.sealed, s.hash, s.refs = ref.Gen, false, 0, 1
}

func (m *fzModel) leaseState(ls *fzLease) LeaseState {
	pend, quar := 0, 0
	for _, a := range ls.atts {
		switch m.trs[a.tr].state {
		case TransferPending:
			pend++
		case TransferQuarantined:
			quar++
		}
	}
	switch {
	case quar > 0:
		return LeaseQuarantined
	case !ls.closed:
		return LeaseActive
	case pend > 0:
		return LeaseDraining
	}
	return LeaseSettled
}

// wantErr checks err against the errors that apply (nil: none apply).
func (m *fzModel) wantErr(what string, err error, apply ...error) {
	m.t.Helper()
	if len(apply) == 0 {
		if err != nil {
			m.fatalf("%s: unexpected error %v", what, err)
		}
		return
	}
	if err == nil {
		m.fatalf("%s: no error, want one of %v", what, apply)
	}
	for _, a := range apply {
		if a == errExhaustedOnly && errors.Is(err, ErrExhausted) && !errors.Is(err, ErrQuarantineBound) {
			return
		}
		if errors.Is(err, a) {
			return
		}
	}
	m.fatalf("%s: error %v, want one of %v", what, err, apply)
}

func fzApplicable(conds ...any) []error {
	var out []error
	for i := 0; i < len(conds); i += 2 {
		if conds[i].(bool) {
			out = append(out, conds[i+1].(error))
		}
	}
	return out
}

// opened records a lease the pool handed out with its first hits blocks
// shared from hit.
func (m *fzModel) opened(l *Lease[[]byte], n int, hit []int) {
	if l.Len() != n {
		m.fatalf("lease has %d blocks, want %d", l.Len(), n)
	}
	ls := &fzLease{l: l, id: l.ID()}
	for k := 0; k < n; k++ {
		ref := l.Ref(k)
		if k < len(hit) {
			s := &m.slots[hit[k]]
			if ref != (BlockRef{ID: BlockID(hit[k]), Gen: s.gen}) {
				m.fatalf("prefix hit %d: ref %v, want %d@%d", k, ref, hit[k], s.gen)
			}
			s.refs++
		}
		ls.blocks = append(ls.blocks, ref)
	}
	m.takeFreshAll(ls.blocks[len(hit):])
	m.leases = append(m.leases, ls)
}

func (m *fzModel) acquireErrs(owner string, n int) []error {
	if owner == "" || n <= 0 {
		return []error{ErrInvalidArgument} // argument errors come first
	}
	return fzApplicable(m.closed, ErrPoolClosed, n > m.cap, ErrExceedsCapacity)
}

func (m *fzModel) acquire(owner string, n int, hs []BlockHash) {
	errs := m.acquireErrs(owner, n)
	var hit []int
	if len(errs) == 0 {
		hit = m.probe(hs[:min(len(hs), n)])
		free, cached := m.available()
		cachedHits := 0
		held := m.heldSet()
		for _, id := range hit {
			if !held[id] {
				cachedHits++
			}
		}
		if n-len(hit) > free+cached-cachedHits {
			errs = []error{m.exhausted(n-len(hit), hit)}
		}
	}
	var l *Lease[[]byte]
	var hits int
	var err error
	if hs == nil {
		l, err = m.p.Acquire(owner, n)
	} else {
		l, hits, err = m.p.AcquirePrefix(owner, hs, n)
	}
	m.logf("acquire(%q, %d, %v) → hits %d err %v", owner, n, hs, hits, err)
	m.wantErr("acquire", err, errs...)
	if err != nil {
		if l != nil || hits != 0 {
			m.fatalf("failed acquire returned a lease or hits")
		}
		return
	}
	if hits != len(hit) {
		m.fatalf("AcquirePrefix(%v, %d): %d hits, model %d (%v)", hs, n, hits, len(hit), hit)
	}
	m.opened(l, n, hit)
}

// exhausted returns the error of a request for fresh blocks refused for
// want of them: ErrQuarantineBound when more than could ever be free
// while the quarantine lasts (capacity minus quarantined slots minus the
// unquarantined slots in held, which the requester holds already), else
// plain ErrExhausted.
func (m *fzModel) exhausted(fresh int, held []int) error {
	_, quar, _ := m.cover()
	usable := m.cap
	for _, q := range quar {
		if q > 0 {
			usable--
		}
	}
	for _, id := range held {
		if quar[id] == 0 {
			usable--
		}
	}
	if fresh > usable {
		return ErrQuarantineBound
	}
	return errExhaustedOnly
}

// errExhaustedOnly stands for ErrExhausted that is not ErrQuarantineBound.
var errExhaustedOnly = errors.New("ErrExhausted, not ErrQuarantineBound")

func (m *fzModel) acquireWait(owner string, n int, cancelled bool) {
	errs := m.acquireErrs(owner, n)
	free, cached := m.available()
	fits := len(errs) == 0 && n <= free+cached
	if len(errs) == 0 && !fits && !cancelled {
		cancelled = true // a wait would block this goroutine forever
	}
	ctx := context.Background()
	if cancelled {
		c, cancel := context.WithCancel(ctx)
		cancel()
		ctx = c
	}
	l, err := m.p.AcquireWait(ctx, owner, n)
	m.logf("acquireWait(%q, %d, cancelled=%v) → err %v", owner, n, cancelled, err)
	switch {
	case len(errs) > 0:
		m.wantErr("AcquireWait", err, errs...)
	case cancelled && err != nil:
		m.wantErr("AcquireWait with a cancelled context", err, context.Canceled)
	case !fits:
		m.fatalf("AcquireWait got %d blocks with only %d free or evictable", n, free+cached)
	default:
		m.wantErr("AcquireWait", err)
	}
	if err == nil {
		m.opened(l, n, nil)
	}
}

func (m *fzModel) extend(ls *fzLease, n int) {
	errs := fzApplicable(n <= 0, ErrInvalidArgument)
	if n > 0 {
		free, cached := m.available()
		errs = fzApplicable(ls.closed, ErrLeaseClosed, m.closed, ErrPoolClosed,
			len(ls.blocks)-ls.trimmed+n > m.cap, ErrExceedsCapacity)
		if len(errs) == 0 && n > free+cached {
			var own []int
			for _, r := range ls.blocks[ls.trimmed:] {
				own = append(own, int(r.ID))
			}
			errs = []error{m.exhausted(n, own)}
		}
	}
	err := ls.l.Extend(n)
	m.logf("lease %d: extend(%d) → %v", ls.id, n, err)
	m.wantErr("Extend", err, errs...)
	if err != nil {
		return
	}
	if ls.l.Len() != len(ls.blocks)+n {
		m.fatalf("Extend(%d): Len %d, was %d", n, ls.l.Len(), len(ls.blocks))
	}
	var fresh []BlockRef
	for k := len(ls.blocks); k < ls.l.Len(); k++ {
		fresh = append(fresh, ls.l.Ref(k))
	}
	m.takeFreshAll(fresh) // (before they join ls.blocks: the model's held set)
	ls.blocks = append(ls.blocks, fresh...)
}

func (m *fzModel) attach(ls *fzLease, ti, from, to int, acc Access, whole bool) {
	tr := m.trs[ti]
	var err error
	var errs []error
	if whole {
		errs = fzApplicable(ls.closed, ErrLeaseClosed)
		from = ls.trimmed
		err = ls.l.Attach(tr.t)
		m.logf("lease %d: attach(t%d) → %v", ls.id, ti, err)
	} else {
		badRange := from < ls.trimmed || to > len(ls.blocks) || from > to
		writeSealed := false
		if !badRange && acc == Write {
			for _, r := range ls.blocks[from:to] {
				writeSealed = writeSealed || m.slots[r.ID].sealed
			}
		}
		errs = fzApplicable(ls.closed, ErrLeaseClosed, badRange, ErrInvalidArgument,
			acc != Read && acc != Write, ErrInvalidArgument,
			writeSealed, ErrInvalidArgument)
		err = ls.l.AttachRange(tr.t, from, to, acc)
		m.logf("lease %d: attachRange(t%d, %d, %d, %v) → %v", ls.id, ti, from, to, acc, err)
	}
	m.wantErr("attach", err, errs...)
	if err != nil || tr.state == TransferResolved || (!whole && from == to) {
		return // gates nothing
	}
	ls.atts = append(ls.atts, fzAtt{tr: ti, from: from, to: to, whole: whole, write: acc == Write})
}

func (m *fzModel) seal(ls *fzLease, i int, h BlockHash) {
	var errs []error
	if ls.closed {
		errs = append(errs, ErrLeaseClosed)
	}
	noop := false
	if i < ls.trimmed || i >= len(ls.blocks) {
		errs = append(errs, ErrInvalidArgument)
	} else if !ls.closed {
		s := &m.slots[ls.blocks[i].ID]
		_, _, write := m.cover()
		switch {
		case s.sealed && s.hash != h:
			errs = append(errs, ErrInvalidArgument)
		case s.sealed:
			noop = true
		case write[ls.blocks[i].ID]:
			errs = append(errs, ErrInvalidArgument)
		}
	}
	err := ls.l.Seal(i, h)
	m.logf("lease %d: seal(%d, %d) → %v", ls.id, i, h, err)
	m.wantErr("Seal", err, errs...)
	if err != nil || noop {
		return
	}
	id := int(ls.blocks[i].ID)
	s := &m.slots[id]
	s.sealed, s.hash = true, h
	if _, taken := m.index[h]; !taken {
		m.index[h] = id
		s.indexed = true
	}
}

func (m *fzModel) close(ls *fzLease, abort bool) {
	if abort {
		ls.l.Abort(nil)
	} else {
		ls.l.Release()
	}
	m.logf("lease %d: close(abort=%v)", ls.id, abort)
	if ls.closed {
		return // idempotent, and Abort after Release cancels nothing
	}
	ls.closed = true
	// Tail first: each block becomes unreferenced at its own moment.
	for i := len(ls.blocks) - 1; i >= ls.trimmed; i-- {
		before := m.heldSet()
		m.slots[ls.blocks[i].ID].refs--
		m.unheld(before)
	}
	if abort {
		var cancel []int
		for _, a := range ls.atts {
			if m.trs[a.tr].state != TransferResolved && !slices.Contains(cancel, a.tr) {
				cancel = append(cancel, a.tr)
			}
		}
		for _, ti := range cancel {
			m.cancelModel(ti)
		}
	}
}

// trim gives back the blocks before index i of an open lease, tail first,
// as a release does.
func (m *fzModel) trim(ls *fzLease, i int) {
	errs := fzApplicable(ls.closed, ErrLeaseClosed)
	if !ls.closed && (i < 0 || i > len(ls.blocks)) {
		errs = append(errs, ErrInvalidArgument)
	}
	err := ls.l.TrimTo(i)
	m.logf("lease %d: trimTo(%d) → %v", ls.id, i, err)
	m.wantErr("TrimTo", err, errs...)
	if err != nil || i <= ls.trimmed {
		return
	}
	for k := i - 1; k >= ls.trimmed; k-- {
		before := m.heldSet()
		m.slots[ls.blocks[k].ID].refs--
		m.unheld(before)
	}
	ls.trimmed = i
}

// cancelModel is what Cancel does to the model: the hook runs at most
// once, never after Resolve, and hook 2 resolves synchronously.
func (m *fzModel) cancelModel(ti int) {
	tr := m.trs[ti]
	if tr.state == TransferResolved || tr.hookUsed {
		return
	}
	tr.hookUsed = true
	if tr.hook == 0 {
		return
	}
	tr.want++
	if tr.hook == 2 {
		m.resolveModel(ti, errFzCancelled)
	}
}

func (m *fzModel) resolveModel(ti int, outcome error) bool {
	tr := m.trs[ti]
	if tr.state == TransferResolved {
		return false
	}
	before := m.heldSet()
	tr.state, tr.err, tr.hookUsed = TransferResolved, outcome, true
	m.unheld(before)
	return true
}

func (m *fzModel) resolve(ti int, outcome error) {
	want := m.resolveModel(ti, outcome)
	got := m.trs[ti].t.Resolve(outcome)
	m.logf("t%d: resolve(%v) → %v", ti, outcome, got)
	if got != want {
		m.fatalf("Resolve returned %v, want %v", got, want)
	}
}

func (m *fzModel) quarantine(ti int, reason error) {
	tr := m.trs[ti]
	tr.t.Quarantine(reason)
	m.logf("t%d: quarantine(%v)", ti, reason)
	if tr.state == TransferPending {
		tr.state, tr.err = TransferQuarantined, reason
		if reason == nil {
			tr.err = ErrQuarantined
		}
	}
}

func (m *fzModel) newTransfer(hook int) int {
	ti := len(m.trs)
	tr := &fzTransfer{hook: hook}
	switch hook {
	case 0:
		tr.t = NewTransfer(nil)
	case 1:
		tr.t = NewTransfer(func() { tr.runs++ })
	default:
		tr.t = NewTransfer(func() {
			tr.runs++
			tr.t.Resolve(errFzCancelled)
		})
	}
	m.trs = append(m.trs, tr)
	m.logf("t%d = new transfer (hook %d)", ti, hook)
	return ti
}

// verify compares everything observable with the model.
func (m *fzModel) verify() {
	m.t.Helper()
	st := m.p.Stats()
	if got, want := coreCountsOf(st), m.counts(); got != want {
		m.fatalf("counts %+v, model %+v (classes %v)", got, want, m.classes())
	}
	if _, quar, _ := m.cover(); true {
		ql, q := 0, 0
		for i, n := range quar {
			if n > 0 {
				q++
				if m.slots[i].refs > 0 {
					ql++
				}
			}
		}
		if st.QuarantinedLeased != ql || st.Usable != m.cap-q {
			m.fatalf("QuarantinedLeased %d Usable %d, model %d %d", st.QuarantinedLeased, st.Usable, ql, m.cap-q)
		}
	}
	if err := m.p.Check(); err != nil {
		m.fatalf("Check: %v", err)
	}
	open := 0
	classes := m.classes()
	m.obsMu.Lock()
	settled := maps2(m.settled)
	m.obsMu.Unlock()
	for _, ls := range m.leases {
		if !ls.closed {
			open++
		}
		want := m.leaseState(ls)
		if got := ls.l.State(); got != want {
			m.fatalf("lease %d: state %v, model %v", ls.id, got, want)
		}
		isSettled := coreIsClosed(ls.l.Settled())
		if isSettled != (want == LeaseSettled) {
			m.fatalf("lease %d: Settled closed=%v in state %v", ls.id, isSettled, want)
		}
		if n := settled[ls.id]; (n == 1) != (want == LeaseSettled) || n > 1 {
			m.fatalf("lease %d: %d EventSettled in state %v", ls.id, n, want)
		}
		if ls.l.Len() != len(ls.blocks) {
			m.fatalf("lease %d: Len %d, model %d", ls.id, ls.l.Len(), len(ls.blocks))
		}
		if got := ls.l.Trimmed(); got != ls.trimmed {
			m.fatalf("lease %d: Trimmed %d, model %d", ls.id, got, ls.trimmed)
		}
		ids := ls.l.AppendBlockIDs(nil, ls.trimmed)
		for i, r := range ls.blocks {
			if ls.l.Ref(i) != r || (i >= ls.trimmed && ids[i-ls.trimmed] != r.ID) {
				m.fatalf("lease %d: Ref(%d) = %v, model %v", ls.id, i, ls.l.Ref(i), r)
			}
			_, err := m.p.Region(r)
			live := m.slots[r.ID].gen == r.Gen && classes[r.ID] != "free"
			if live && err != nil {
				m.fatalf("Region(%v) of a %s block: %v", r, classes[r.ID], err)
			}
			if !live && !errors.Is(err, ErrStaleRef) {
				m.fatalf("Region(%v) (slot at gen %d, %s): %v, want ErrStaleRef", r, m.slots[r.ID].gen, classes[r.ID], err)
			}
		}
		if ls.trimmed < len(ls.blocks) {
			_, err := ls.l.ReadRegion(ls.trimmed)
			if ls.closed != errors.Is(err, ErrLeaseClosed) || (!ls.closed && err != nil) {
				m.fatalf("lease %d (closed=%v): ReadRegion(%d): %v", ls.id, ls.closed, ls.trimmed, err)
			}
		}
		if ls.trimmed > 0 && !ls.closed {
			if _, err := ls.l.ReadRegion(ls.trimmed - 1); !errors.Is(err, ErrInvalidArgument) {
				m.fatalf("lease %d: ReadRegion(%d) of a trimmed block: %v, want ErrInvalidArgument", ls.id, ls.trimmed-1, err)
			}
		}
		if ls.l.Closed() != ls.closed {
			m.fatalf("lease %d: Closed() = %v, model %v", ls.id, ls.l.Closed(), ls.closed)
		}
		for i := ls.trimmed; i < len(ls.blocks); i++ {
			r := ls.blocks[i]
			_, err := ls.l.Region(i)
			s := &m.slots[r.ID]
			switch {
			case ls.closed:
				if !errors.Is(err, ErrLeaseClosed) {
					m.fatalf("lease %d (closed): Region(%d): %v", ls.id, i, err)
				}
			case s.sealed || s.refs > 1:
				if !errors.Is(err, ErrReadOnly) {
					m.fatalf("lease %d: Region(%d) of a block sealed=%v refs=%d: %v, want ErrReadOnly", ls.id, i, s.sealed, s.refs, err)
				}
			case err != nil:
				m.fatalf("lease %d: Region(%d) of a private unsealed block: %v", ls.id, i, err)
			}
		}
	}
	if st.OpenLeases != open {
		m.fatalf("OpenLeases %d, model %d", st.OpenLeases, open)
	}
	for ti, tr := range m.trs {
		if got := tr.t.State(); got != tr.state {
			m.fatalf("t%d: state %v, model %v", ti, got, tr.state)
		}
		if err := tr.t.Err(); (err == nil) != (tr.err == nil) || (err != nil && !errors.Is(err, tr.err)) {
			m.fatalf("t%d: Err %v, model %v", ti, err, tr.err)
		}
		if coreIsClosed(tr.t.Done()) != (tr.state == TransferResolved) {
			m.fatalf("t%d: Done closed in state %v", ti, tr.state)
		}
		if tr.runs != tr.want {
			m.fatalf("t%d: cancel hook ran %d times, model %d", ti, tr.runs, tr.want)
		}
	}
}

func maps2(m map[uint64]int) map[uint64]int {
	out := make(map[uint64]int, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

const (
	fzMaxOps       = 300
	fzMaxLeases    = 24
	fzMaxTransfers = 12
)

func fzRun(t *testing.T, data []byte) *fzModel {
	in := &fzIn{b: data}
	capacity := 1 + in.u8()%8
	m := &fzModel{t: t, cap: capacity, slots: make([]fzSlot, capacity),
		index: map[BlockHash]int{}, used: map[[2]uint64]bool{}, settled: map[uint64]int{}}
	obs := ObserverFunc(func(e Event) {
		if e.Kind == EventSettled {
			m.obsMu.Lock()
			m.settled[e.Lease]++
			m.obsMu.Unlock()
		}
		_ = m.p.Stats() // observers may call back into the library
	})
	mem, err := NewHostMemory(capacity, 16)
	if err != nil {
		t.Fatal(err)
	}
	m.p, err = NewPool[[]byte](mem, WithObserver(obs))
	if err != nil {
		t.Fatal(err)
	}
	m.verify()

	pickLease := func() *fzLease {
		b := in.u8()
		if len(m.leases) == 0 {
			return nil
		}
		return m.leases[b%len(m.leases)]
	}
	pickTransfer := func() int {
		b := in.u8()
		if b%(len(m.trs)+1) == len(m.trs) && len(m.trs) < fzMaxTransfers {
			return m.newTransfer(in.u8() % 3)
		}
		if len(m.trs) == 0 {
			return m.newTransfer(b % 3)
		}
		return b % len(m.trs)
	}
	pickN := func() int { return in.u8() % (capacity + 2) } // 0..cap+1
	owner := func() string {
		if in.u8()%16 == 15 {
			return ""
		}
		return fmt.Sprintf("o%d", len(m.leases))
	}
	hashes := func() []BlockHash {
		b := in.u8()
		hs := make([]BlockHash, b%5)
		for k := range hs {
			hs[k] = BlockHash(1 + in.u8()%6)
		}
		return hs
	}

	for m.step = 1; m.step <= fzMaxOps && in.more(); m.step++ {
		op := in.u8() % 17
		switch op {
		case 0, 1:
			if len(m.leases) < fzMaxLeases {
				o := owner()
				m.acquire(o, pickN(), nil)
			}
		case 2:
			if len(m.leases) < fzMaxLeases {
				o, hs := owner(), hashes()
				if hs == nil {
					hs = []BlockHash{}
				}
				m.acquire(o, pickN(), hs)
			}
		case 3:
			if len(m.leases) < fzMaxLeases {
				o, n := owner(), pickN()
				m.acquireWait(o, n, in.u8()%2 == 0)
			}
		case 4:
			if ls := pickLease(); ls != nil {
				m.extend(ls, in.u8()%4)
			}
		case 5, 6:
			if ls := pickLease(); ls != nil {
				ti := pickTransfer()
				n := len(ls.blocks)
				from := in.u8()%(n+3) - 1
				to := in.u8()%(n+3) - 1
				if from == to {
					to++ // no empty ranges: whether they count as attached is not specified
				}
				acc := Access(1 + in.u8()%2)
				if b := in.u8(); b%16 == 15 {
					acc = Access(b % 4 * 3) // 0, 3, 6, 9: bad accesses
				}
				m.attach(ls, ti, from, to, acc, false)
			}
		case 7:
			if ls := pickLease(); ls != nil {
				m.attach(ls, pickTransfer(), 0, 0, 0, true)
			}
		case 8:
			if ls := pickLease(); ls != nil {
				i := in.u8()%(len(ls.blocks)+2) - 1
				m.seal(ls, i, BlockHash(1+in.u8()%6))
			}
		case 9:
			if ls := pickLease(); ls != nil {
				m.close(ls, false)
			}
		case 10:
			if ls := pickLease(); ls != nil {
				m.close(ls, true)
			}
		case 11:
			if len(m.trs) > 0 {
				ti := pickTransfer()
				var outcome error
				if in.u8()%4 == 0 {
					outcome = errFzOutcome
				}
				m.resolve(ti, outcome)
			}
		case 12:
			if len(m.trs) > 0 {
				ti := pickTransfer()
				var reason error
				if in.u8()%2 == 0 {
					reason = errFzReason
				}
				m.quarantine(ti, reason)
			}
		case 13:
			if len(m.trs) > 0 {
				ti := pickTransfer()
				m.cancelModel(ti)
				m.trs[ti].t.Cancel()
				m.logf("t%d: cancel", ti)
			}
		case 14:
			hs := hashes()
			got, want := m.p.CachedPrefix(hs), len(m.probe(hs))
			m.logf("cachedPrefix(%v) → %d", hs, got)
			if got != want {
				m.fatalf("CachedPrefix(%v) = %d, model %d", hs, got, want)
			}
		case 15:
			if in.u8()%8 == 0 {
				if err := m.p.Close(); err != nil {
					m.fatalf("Close: %v", err)
				}
				m.closed = true
				m.logf("pool close")
			}
		case 16:
			if ls := pickLease(); ls != nil {
				m.trim(ls, in.u8()%(len(ls.blocks)+3)-1)
			}
		}
		m.verify()
	}

	// Cleanup: evidence for everything, every lease closed. Nothing may
	// be lost.
	m.step = -1
	for ti := range m.trs {
		m.resolve(ti, nil)
	}
	for _, ls := range m.leases {
		m.close(ls, false)
	}
	m.verify()
	st := m.p.Stats()
	if st.Free+st.Cached != capacity || st.OpenLeases != 0 {
		m.fatalf("after cleanup: %+v", coreCountsOf(st))
	}
	return m
}

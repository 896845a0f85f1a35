package kvlease_test

import (
	"fmt"
	"hash/fnv"
	"slices"
	"strings"
)

// The sequential model of the pool's contract that linearize_test.go
// checks concurrent histories against. It speaks the contract's words,
// not the implementation's: every block has holds (open leases, pending
// and quarantined transfer pins, write pins), content (sealed under a
// hash, findable or private) and, while cached, a recency; its one state
// is the first that applies of quarantined, leased, draining, cached,
// free (rule 7). Blocks are anonymous: which free slot a fill takes is
// not observable, so the model takes the lowest.
//
// The model is a value: step copies it (clone) and never changes the
// state it was given, as porcupine requires.

// mBlock is one block's holds and content.
type mBlock struct {
	refs, pins, quar, wpins int // open leases; pending, quarantined and write (pending or quarantined) pins
	hash                    uint64
	sealed, indexed         bool
	stamp                   int // recency while cached: the LRU evicts the smallest
}

func (b *mBlock) class() string {
	switch {
	case b.quar > 0:
		return "quarantined"
	case b.refs > 0:
		return "leased"
	case b.pins > 0:
		return "draining"
	case b.indexed:
		return "cached"
	}
	return "free"
}

// mAtt is one attachment of a transfer to a range of a lease.
type mAtt struct {
	lease, from, to int
	write           bool
	deferred        bool // a pending read on an open lease: pinned when the lease closes
}

// mTransfer is a transfer: pending, quarantined or resolved, and what it
// gates.
type mTransfer struct {
	state string // "pending", "quarantined", "resolved"
	atts  []mAtt
}

// mLease is a lease: its blocks (indexes into mState.blocks) and whether
// it is open.
type mLease struct {
	blocks []int
	open   bool
}

// mWaiter is an AcquireWait: queued, granted (its lease exists), failed
// by the quarantine bound, or cancelled before it touched the pool.
type mWaiter struct {
	lease, n int
	status   string // "queued", "granted", "bound", "early"
}

type mState struct {
	blocks    []mBlock
	leases    map[int]*mLease
	transfers map[int]*mTransfer
	waiters   map[int]*mWaiter
	queue     []int // waiter ids in arrival order
	clock     int   // recency stamps
}

func newMState(capacity int) *mState {
	return &mState{blocks: make([]mBlock, capacity), leases: map[int]*mLease{}, transfers: map[int]*mTransfer{}, waiters: map[int]*mWaiter{}}
}

func (s *mState) clone() *mState {
	c := &mState{blocks: slices.Clone(s.blocks), leases: make(map[int]*mLease, len(s.leases)),
		transfers: make(map[int]*mTransfer, len(s.transfers)), waiters: make(map[int]*mWaiter, len(s.waiters)),
		queue: slices.Clone(s.queue), clock: s.clock}
	for k, l := range s.leases {
		c.leases[k] = &mLease{blocks: slices.Clone(l.blocks), open: l.open}
	}
	for k, t := range s.transfers {
		c.transfers[k] = &mTransfer{state: t.state, atts: slices.Clone(t.atts)}
	}
	for k, w := range s.waiters {
		c.waiters[k] = &mWaiter{lease: w.lease, n: w.n, status: w.status}
	}
	return c
}

// String is the state's canonical form (Equal and Hash compare it).
func (s *mState) String() string {
	var b strings.Builder
	for i, bl := range s.blocks {
		fmt.Fprintf(&b, "b%d:%d/%d/%d/%d/%x/%v/%v/%d ", i, bl.refs, bl.pins, bl.quar, bl.wpins, bl.hash, bl.sealed, bl.indexed, bl.stamp)
	}
	for _, k := range slices.Sorted(mapKeys(s.leases)) {
		fmt.Fprintf(&b, "l%d:%v%v ", k, s.leases[k].blocks, s.leases[k].open)
	}
	for _, k := range slices.Sorted(mapKeys(s.transfers)) {
		fmt.Fprintf(&b, "t%d:%s%v ", k, s.transfers[k].state, s.transfers[k].atts)
	}
	for _, k := range slices.Sorted(mapKeys(s.waiters)) {
		fmt.Fprintf(&b, "w%d:%s ", k, s.waiters[k].status)
	}
	fmt.Fprintf(&b, "q%v c%d", s.queue, s.clock)
	return b.String()
}

func mapKeys[V any](m map[int]V) func(func(int) bool) {
	return func(yield func(int) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

func (s *mState) hashOf() uint64 {
	h := fnv.New64a()
	h.Write([]byte(s.String()))
	return h.Sum64()
}

// count returns the blocks in each state: free, cached, leased,
// draining, quarantined.
func (s *mState) count() [5]int {
	var c [5]int
	for i := range s.blocks {
		switch s.blocks[i].class() {
		case "free":
			c[0]++
		case "cached":
			c[1]++
		case "leased":
			c[2]++
		case "draining":
			c[3]++
		case "quarantined":
			c[4]++
		}
	}
	return c
}

func (s *mState) available() int {
	c := s.count()
	return c[0] + c[1]
}

func (s *mState) usable() int { return len(s.blocks) - s.count()[4] }

// settle updates block i after its holds changed: a block that becomes
// cached takes the next recency stamp; one that becomes free forfeits
// its content.
func (s *mState) settle(i int, was string) {
	b := &s.blocks[i]
	now := b.class()
	if now == was {
		return
	}
	switch now {
	case "cached":
		s.clock++
		b.stamp = s.clock
	case "free":
		b.sealed, b.hash, b.stamp = false, 0, 0
	}
	if was == "cached" && now != "cached" {
		b.stamp = 0
	}
}

// hold adds deltas to block i's holds.
func (s *mState) hold(i, refs, pins, quar, wpins int) {
	was := s.blocks[i].class()
	b := &s.blocks[i]
	b.refs += refs
	b.pins += pins
	b.quar += quar
	b.wpins += wpins
	s.settle(i, was)
}

// fill takes n fresh blocks: free ones first, then the least recently
// used cached ones, evicted (their content forfeit). The caller checked
// available() ≥ n.
func (s *mState) fill(n int) []int {
	var out []int
	for i := range s.blocks {
		if len(out) < n && s.blocks[i].class() == "free" {
			out = append(out, i)
		}
	}
	for len(out) < n {
		victim := -1
		for i := range s.blocks {
			if b := &s.blocks[i]; b.class() == "cached" && (victim < 0 || b.stamp < s.blocks[victim].stamp) {
				victim = i
			}
		}
		s.blocks[victim] = mBlock{}
		out = append(out, victim)
	}
	for _, i := range out {
		s.blocks[i] = mBlock{refs: 1}
	}
	return out
}

// findable returns the block that serves hash h as a prefix hit, or -1:
// indexed, and its content known (no write pins).
func (s *mState) findable(h uint64) int {
	for i := range s.blocks {
		if b := &s.blocks[i]; b.indexed && b.hash == h && b.wpins == 0 {
			return i
		}
	}
	return -1
}

// serve is what follows every operation that may return blocks or grow
// the quarantine: queued waiters that could never be served while the
// quarantine lasts fail; then the queue's head is served while it fits.
func (s *mState) serve() {
	kept := s.queue[:0:0]
	for _, w := range s.queue {
		if s.waiters[w].n > s.usable() {
			s.waiters[w].status = "bound"
			continue
		}
		kept = append(kept, w)
	}
	s.queue = kept
	for len(s.queue) > 0 {
		w := s.waiters[s.queue[0]]
		if s.available() < w.n {
			break
		}
		s.leases[w.lease] = &mLease{blocks: s.fill(w.n), open: true}
		w.status = "granted"
		s.queue = s.queue[1:]
	}
}

// The operations, as porcupine sees them: an input and an output each.
type lin struct {
	op      string // acquire, prefix, wait-enter, wait-exit, extend, seal, release, abort, attach, resolve, quarantine, stats
	lease   int
	n       int
	hashes  []uint64 // prefix
	i       int      // seal: block; attach: from
	to      int      // attach
	hash    uint64   // seal
	write   bool     // attach
	xfer    int      // attach, resolve, quarantine
	waiter  int      // wait-enter, wait-exit
	failure bool     // resolve with an error
}

type linOut struct {
	err   string // "", "exhausted", "bound", "closed", "invalid", "exceeds", "canceled"
	hits  int
	ok    bool   // resolve: won
	stats [5]int // stats: free, cached, leased, draining, quarantined
}

func (o linOut) String() string {
	switch {
	case o.err != "":
		return o.err
	case o.stats != [5]int{}:
		return fmt.Sprintf("stats %v", o.stats)
	}
	return fmt.Sprintf("ok hits=%d won=%v", o.hits, o.ok)
}

func (in lin) String() string {
	switch in.op {
	case "acquire":
		return fmt.Sprintf("l%d=acquire(%d)", in.lease, in.n)
	case "prefix":
		return fmt.Sprintf("l%d=prefix(%d of %d)", in.lease, len(in.hashes), in.n)
	case "wait-enter", "wait-exit":
		return fmt.Sprintf("l%d=%s#%d(%d)", in.lease, in.op, in.waiter, in.n)
	case "extend":
		return fmt.Sprintf("l%d.extend(%d)", in.lease, in.n)
	case "seal":
		return fmt.Sprintf("l%d.seal(%d, %x)", in.lease, in.i, in.hash)
	case "attach":
		return fmt.Sprintf("l%d.attach(t%d, %d..%d, write=%v)", in.lease, in.xfer, in.i, in.to, in.write)
	case "resolve", "quarantine", "cancel":
		return fmt.Sprintf("t%d.%s(failure=%v)", in.xfer, in.op, in.failure)
	case "stats":
		return "stats"
	}
	return fmt.Sprintf("l%d.%s", in.lease, in.op)
}

// boundOr returns "bound" when n fresh blocks could never be free while
// the quarantine lasts (held of the requester's own usable blocks
// counted), else alt.
func (s *mState) boundOr(n, held int, alt string) string {
	if n > s.usable()-held {
		return "bound"
	}
	return alt
}

// step applies in to s (a clone) and returns the states it may lead to
// with output out: none if out is impossible. Only wait-enter has two
// (the call may see its context cancelled before it touches the pool).
func step(s0 *mState, in lin, out linOut) []*mState {
	s := s0.clone()
	want := linOut{}
	switch in.op {
	case "acquire":
		switch {
		case len(s.queue) > 0:
			want.err = s.boundOr(in.n, 0, "exhausted")
		case s.available() < in.n:
			want.err = s.boundOr(in.n, 0, "exhausted")
		default:
			s.leases[in.lease] = &mLease{blocks: s.fill(in.n), open: true}
		}
	case "prefix":
		if len(s.queue) > 0 {
			want.err = "exhausted"
			break
		}
		var hits []int
		cachedHits, held := 0, 0
		for _, h := range in.hashes[:min(len(in.hashes), in.n)] {
			i := s.findable(h)
			if i < 0 {
				break
			}
			hits = append(hits, i)
			if s.blocks[i].class() == "cached" {
				cachedHits++
			}
			if s.blocks[i].quar == 0 {
				held++
			}
		}
		fresh := in.n - len(hits)
		if fresh > s.available()-cachedHits {
			want.err = s.boundOr(fresh, held, "exhausted")
			break
		}
		for _, i := range hits {
			s.hold(i, 1, 0, 0, 0)
		}
		s.leases[in.lease] = &mLease{blocks: append(hits, s.fill(fresh)...), open: true}
		want.hits = len(hits)
	case "wait-enter":
		early := s0.clone()
		early.waiters[in.waiter] = &mWaiter{lease: in.lease, n: in.n, status: "early"}
		w := &mWaiter{lease: in.lease, n: in.n, status: "queued"}
		s.waiters[in.waiter] = w
		switch {
		case len(s.queue) == 0 && s.available() >= in.n:
			s.leases[in.lease] = &mLease{blocks: s.fill(in.n), open: true}
			w.status = "granted"
		case in.n > s.usable():
			w.status = "bound"
		default:
			s.queue = append(s.queue, in.waiter)
		}
		return []*mState{s, early}
	case "wait-exit":
		w := s.waiters[in.waiter]
		if w == nil {
			return nil // the exit before its enter
		}
		switch w.status {
		case "granted":
		case "bound":
			want.err = "bound"
		default: // queued or early: cancelled
			want.err = "canceled"
			s.queue = slices.DeleteFunc(s.queue, func(x int) bool { return x == in.waiter })
		}
		delete(s.waiters, in.waiter)
	case "extend":
		l := s.leases[in.lease]
		switch {
		case l == nil || !l.open:
			want.err = "closed"
		case in.n > len(s.blocks)-len(l.blocks):
			want.err = "exceeds"
		case s.available() < in.n:
			held := 0
			for _, i := range l.blocks {
				if s.blocks[i].quar == 0 {
					held++
				}
			}
			want.err = s.boundOr(in.n, held, "exhausted")
		default:
			l.blocks = append(l.blocks, s.fill(in.n)...)
		}
	case "seal":
		l := s.leases[in.lease]
		switch {
		case l == nil || !l.open:
			want.err = "closed"
		case in.i >= len(l.blocks):
			want.err = "invalid"
		default:
			b := &s.blocks[l.blocks[in.i]]
			switch {
			case b.sealed && b.hash != in.hash:
				want.err = "invalid"
			case b.sealed:
			case b.wpins > 0:
				want.err = "invalid"
			default:
				b.sealed, b.hash = true, in.hash
				if s.findableIndexed(in.hash) < 0 {
					b.indexed = true
				}
			}
		}
	case "release", "abort":
		l := s.leases[in.lease]
		if l == nil || !l.open {
			break
		}
		l.open = false
		for _, t := range s.transfers {
			for k := range t.atts {
				if a := &t.atts[k]; a.lease == in.lease && a.deferred {
					a.deferred = false
					for _, i := range l.blocks[a.from:a.to] {
						s.hold(i, 0, 1, 0, 0)
					}
				}
			}
		}
		for k := len(l.blocks) - 1; k >= 0; k-- { // tail first
			s.hold(l.blocks[k], -1, 0, 0, 0)
		}
	case "attach":
		l, t := s.leases[in.lease], s.transfer(in.xfer)
		switch {
		case l == nil || !l.open:
			want.err = "closed"
		case in.to > len(l.blocks):
			want.err = "invalid"
		case in.write && slices.ContainsFunc(l.blocks[in.i:in.to], func(i int) bool { return s.blocks[i].sealed }):
			want.err = "invalid"
		case t.state == "resolved" || in.i == in.to:
		default:
			a := mAtt{lease: in.lease, from: in.i, to: in.to, write: in.write}
			w := 0
			if in.write {
				w = 1
			}
			switch {
			case t.state == "pending" && !in.write:
				a.deferred = true
			case t.state == "pending":
				for _, i := range l.blocks[in.i:in.to] {
					s.hold(i, 0, 1, 0, 1)
				}
			default:
				for _, i := range l.blocks[in.i:in.to] {
					s.hold(i, 0, 0, 1, w)
				}
			}
			t.atts = append(t.atts, a)
		}
	case "resolve":
		t := s.transfer(in.xfer)
		if t.state == "resolved" {
			break
		}
		want.ok = true
		for _, a := range t.atts {
			w := 0
			if a.write {
				w = -1
			}
			blocks := s.leases[a.lease].blocks[a.from:a.to]
			for k := len(blocks) - 1; k >= 0; k-- {
				switch {
				case a.deferred:
				case t.state == "pending":
					s.hold(blocks[k], 0, -1, 0, w)
				default:
					s.hold(blocks[k], 0, 0, -1, w)
				}
			}
		}
		t.state, t.atts = "resolved", nil
	case "quarantine":
		t := s.transfer(in.xfer)
		if t.state != "pending" {
			break
		}
		t.state = "quarantined"
		for k := range t.atts {
			a := &t.atts[k]
			blocks := s.leases[a.lease].blocks[a.from:a.to]
			for j := len(blocks) - 1; j >= 0; j-- {
				if a.deferred {
					s.hold(blocks[j], 0, 0, 1, 0)
				} else {
					s.hold(blocks[j], 0, -1, 1, 0)
				}
			}
			a.deferred = false
		}
	case "cancel":
		// A request to the transport: no state (its hook is checked apart).
	case "stats":
		want.stats = s.count()
	default:
		panic("unknown operation " + in.op)
	}
	if out != want {
		return nil
	}
	s.serve()
	return []*mState{s}
}

// transfer returns transfer x: a transfer exists from NewTransfer on,
// pending, before anything attaches it.
func (s *mState) transfer(x int) *mTransfer {
	t := s.transfers[x]
	if t == nil {
		t = &mTransfer{state: "pending"}
		s.transfers[x] = t
	}
	return t
}

// findableIndexed returns the block the prefix index maps h to, or -1.
func (s *mState) findableIndexed(h uint64) int {
	for i := range s.blocks {
		if s.blocks[i].indexed && s.blocks[i].hash == h {
			return i
		}
	}
	return -1
}

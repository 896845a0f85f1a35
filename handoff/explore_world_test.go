package handoff

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/internal/explore"
)

// The explorer's world: a Source and a Destination, real halves over
// real pools, joined by the explorer's control link (explore_net_test.go)
// and data planes (explore_plane_test.go), with the deadline timers
// armed through the halves' hooks (hooks.go). Nothing runs on its own:
// each step is one choice (a delivery, a loss, a plane's return, a
// deadline, an engine's call), applied on a goroutine of its own, after
// which synctest.Wait returns once every goroutine of the bubble is
// durably blocked. The world is then quiescent: the explorer reads its
// state, checks the properties (explore_check_test.go) and lists the
// next choices.

// xcfg is a configuration of the world: the handoffs and what the
// explorer may choose.
type xcfg struct {
	name                 string
	handoffs             []xho
	srcBlocks, dstBlocks int

	drop, dup  int  // most messages a run may lose, duplicate
	reorder    bool // any waiting message may be delivered (or lost, duplicated), not only the oldest
	crash      bool // the control connection may die
	slowAttach bool // a plane attaches as a step of its own

	// What a plane op may do besides completing (push, write, return).
	fail, stall, stallSync, freeze bool

	// The engines' calls the explorer may make.
	srcAbort   bool // Outgoing.Abort
	leaseAbort bool // the source engine aborts its lease itself
	cancel     bool // the source engine cancels the transfer
	dstAbort   bool // Incoming.Abort
	dstReject  bool // Incoming.Reject while Accepted

	keepDelivered bool // the destination engine holds a delivered lease until it releases it (a choice)

	mutant  mutant
	writers bool // tell the frames' writers apart (xlink.writers)

	// How the tests explore it: exhaustively to depth (0: the whole
	// space) in CI, to long with -explore.long; walks random walks.
	depth, long, walks int
}

// xho is one handoff of a configuration.
type xho struct {
	id     uint64
	blocks int
	hashes int  // full blocks whose chained hashes it proposes (they are sealed on arrival)
	shared bool // its hashes are the first handoff's (a common prefix)
	warm   int  // blocks of its chain the destination's cache holds before the run
	early  bool // the source may release its lease at any step after Propose (else once the handoff is final)
	stream int  // 0: the blocks are written before the run; 1: the prefill writes them as choices, a streaming plane; 2: the same over a plane that cannot stream
}

// The halves' durations: distinct, so a timer's kind is its duration.
const (
	xDeadline     = 5 * time.Second
	xStartTimeout = 7 * time.Second
	xNever        = 1000 * time.Hour
)

// xh is the engines' view of one handoff.
type xh struct {
	cfg       xho
	hashes    []kvlease.BlockHash
	lease     *kvlease.Lease[[]byte] // the source lease
	prog      *Progress
	prefilled int

	out *Outgoing[[]byte]
	in  *Incoming[[]byte]

	proposed, released, aborted, leaseAborted, canceled  bool
	dstAborted, dstRejected                              bool
	delivered                                            *kvlease.Lease[[]byte] // the engine's, until it releases it
	dstReleased                                          bool
	finals, deliveries, finished, forgotten, quarantines int
	dropped                                              bool // a message of this handoff was lost
}

// xtimer is a deadline timer a half armed.
type xtimer struct {
	tm    *time.Timer // a stand-in that never fires; the half stops it
	d     time.Duration
	f     func()
	name  string // "deadline src 1", "start-timeout dst 1"; "" until its owner is known
	fired bool
	off   bool // stopped by the half, or fired
}

type xworld struct {
	cfg              *xcfg
	srcPool, dstPool *kvlease.Pool[[]byte]
	src              *Source[[]byte]
	dst              *Destination[[]byte]
	link             *xlink
	served           chan struct{}
	hs               []*xh
	step             int
	drops, dups      int
	raced            int // steps whose frames were written by racing goroutines (canonicalised)

	mu         sync.Mutex // guards what the halves' goroutines record below
	ops        []*xop
	links      map[string][][]byte // pushed data, by plane token
	timers     []*xtimer
	violations []error
	protoErrs  int
	origin     map[kvlease.BlockRef]xorigin // who wrote each sealed destination block
	tearing    bool
}

// xorigin is the content a destination block must hold: block index of
// handoff id's source lease (id 0x80+h for a warm block of handoff h).
type xorigin struct {
	id    uint64
	index int
}

const xBlockBytes = 16

func xEnvelope(blocks int) Envelope {
	return Envelope{BlockTokens: 4, BlockBytes: xBlockBytes, PoolBlocks: blocks,
		MaxContextTokens: 4 * blocks, MaxPrefillTokens: 4, MaxRunningRequests: 1}
}

// marker is the content of block index of handoff id's source lease.
func marker(o xorigin) []byte {
	b := make([]byte, xBlockBytes)
	for k := range b {
		b[k] = byte(0xA0 ^ int(o.id)*31 ^ o.index*7 ^ k*13)
	}
	return b
}

// chain returns the hashes of a handoff's blocks (the first handoff's
// when shared).
func (c xho) chain() []kvlease.BlockHash {
	if c.hashes == 0 {
		return nil
	}
	seed := kvlease.BlockHash(c.id)
	if c.shared {
		seed = 1
	}
	tokens := make([]int32, 4*c.hashes)
	for i := range tokens {
		tokens[i] = int32(i)
	}
	return kvlease.ChainHashes(seed, tokens, 4)
}

// violation records a broken property found on a half's goroutine.
func (w *xworld) violation(err error) {
	w.mu.Lock()
	w.violations = append(w.violations, err)
	w.mu.Unlock()
}

func (w *xworld) byID(id uint64) *xh {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.byIDLocked(id)
}

func (w *xworld) byIDLocked(id uint64) *xh {
	for _, h := range w.hs {
		if h.cfg.id == id {
			return h
		}
	}
	return nil
}

// runner returns the explorer's Runner for cfg: each run in a synctest
// bubble of its own.
func (cfg *xcfg) runner(t *testing.T) explore.Runner {
	return func(body func(explore.Instance)) {
		synctest.Test(t, func(t *testing.T) {
			w := newXWorld(t, cfg)
			body(w)
		})
	}
}

func newXWorld(t *testing.T, cfg *xcfg) *xworld {
	w := &xworld{cfg: cfg, links: map[string][][]byte{}, origin: map[kvlease.BlockRef]xorigin{}, served: make(chan struct{})}
	var err error
	pool := func(n int, opts ...kvlease.Option) *kvlease.Pool[[]byte] {
		mem, err := kvlease.NewHostMemory(n, xBlockBytes)
		if err != nil {
			t.Fatal(err)
		}
		p, err := kvlease.NewPool[[]byte](mem, opts...)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	w.srcPool = pool(cfg.srcBlocks)
	w.dstPool = pool(cfg.dstBlocks, kvlease.WithSealRecords())
	env := xEnvelope(max(cfg.srcBlocks, cfg.dstBlocks))
	h := &hooks{after: w.afterFunc, mutant: cfg.mutant}
	hc := HalfConfig{Envelope: env, Insecure: true, Logf: func(string, ...any) {}, Deadline: xDeadline,
		OnQuarantine: func(id uint64, _ error) {
			w.mu.Lock()
			if h := w.byIDLocked(id); h != nil {
				h.quarantines++
			}
			w.mu.Unlock()
		},
		OnError: func(error) { w.mu.Lock(); w.protoErrs++; w.mu.Unlock() },
	}
	w.dst, err = NewDestination(w.dstPool, RecvPlane[[]byte](xrecv{w}), DestinationConfig[[]byte]{
		HalfConfig: hc, StartTimeout: xStartTimeout, MaxHandoffs: -1, MaxSessionBlocks: -1,
		OnAccept:    w.onIncoming,
		OnFinal:     w.onFinal,
		OnDelivered: w.onDelivered,
	})
	if err != nil {
		t.Fatal(err)
	}
	w.dst.hooks = h
	// The warm cache: blocks the destination sealed before the run.
	for _, c := range cfg.handoffs {
		if c.warm == 0 {
			continue
		}
		hashes := c.chain()
		l, err := w.dstPool.Acquire("warm", c.warm)
		if err != nil {
			t.Fatal(err)
		}
		for i := range c.warm {
			r, _ := l.Region(i)
			o := xorigin{0x80 + c.id, i}
			copy(r, marker(o))
			if err := l.Seal(i, hashes[i]); err != nil {
				t.Fatal(err)
			}
			w.origin[l.Ref(i)] = o
		}
		l.Release()
	}
	var sp SendPlane[[]byte] = xsend{w}
	for _, c := range cfg.handoffs {
		if c.stream == 1 {
			sp = xstreamSend{xsend{w}}
		}
	}
	w.link = newXLink()
	w.link.writers = cfg.writers
	sc, dc := w.link.ends()
	go func() { _ = w.dst.Serve(dc); close(w.served) }()
	if w.src, err = NewSource(sc, sp, hc); err != nil {
		t.Fatal(err)
	}
	w.src.hooks = h
	synctest.Wait()
	w.link.mu.Lock()
	w.link.auto = false
	w.link.mu.Unlock()
	for _, c := range cfg.handoffs {
		h := &xh{cfg: c, hashes: c.chain()}
		if h.lease, err = w.srcPool.Acquire(fmt.Sprintf("r%d", c.id), c.blocks); err != nil {
			t.Fatal(err)
		}
		if c.stream == 0 {
			for i := range c.blocks {
				r, _ := h.lease.Region(i)
				copy(r, marker(xorigin{c.id, i}))
			}
		} else if h.prog, err = NewProgress(c.blocks, 1); err != nil {
			t.Fatal(err)
		}
		w.hs = append(w.hs, h)
	}
	return w
}

// afterFunc is the halves' clock: the timer it returns never fires on
// its own; the explorer fires its f as a choice.
func (w *xworld) afterFunc(d time.Duration, f func()) *time.Timer {
	x := &xtimer{tm: time.AfterFunc(xNever, func() {}), d: d, f: f}
	w.mu.Lock()
	w.timers = append(w.timers, x)
	w.mu.Unlock()
	return x.tm
}

func (w *xworld) onIncoming(in *Incoming[[]byte]) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if h := w.byIDLocked(in.ID()); h != nil && h.in == nil {
		h.in = in
	} else if h == nil || h.in != in {
		w.violations = append(w.violations, fmt.Errorf("a second Incoming for handoff %d", in.ID()))
	}
}

func (w *xworld) onFinal(in *Incoming[[]byte]) {
	w.mu.Lock()
	h := w.byIDLocked(in.ID())
	if h != nil && h.in == nil {
		h.in = in
	}
	if h != nil && h.in == in {
		h.finals++
	}
	w.mu.Unlock()
}

// onDelivered checks what the destination serves: every block of the
// delivered lease holds what its origin wrote (the hits what sealed
// them, the rest this handoff's source blocks). The engine then holds
// the lease (keepDelivered) or releases it.
func (w *xworld) onDelivered(in *Incoming[[]byte]) {
	l := in.Lease()
	for i := range in.Blocks() {
		want := xorigin{in.ID(), i}
		if i < in.Hits() {
			w.mu.Lock()
			o, ok := w.origin[l.Ref(i)]
			w.mu.Unlock()
			if !ok {
				w.violation(fmt.Errorf("handoff %d delivered with a hit (block %d, %v) nobody sealed", in.ID(), i, l.Ref(i)))
				continue
			}
			want = o
		}
		r, err := l.ReadRegion(i)
		if err != nil {
			w.violation(fmt.Errorf("handoff %d delivered: block %d: %v", in.ID(), i, err))
			continue
		}
		if !slices.Equal(r, marker(want)) {
			w.violation(fmt.Errorf("handoff %d delivered block %d (%v) holding bytes not from handoff %d's block %d: % x", in.ID(), i, l.Ref(i), want.id, want.index, r))
		}
	}
	w.mu.Lock()
	h := w.byIDLocked(in.ID())
	h.deliveries++
	keep := w.cfg.keepDelivered && !w.tearing
	if keep {
		h.delivered = l
	}
	w.mu.Unlock()
	if !keep {
		l.Release()
	}
}

// choice is one enabled step: its name and what it does.
type choice struct {
	name     string
	do       func()
	sync     bool // runs on the explorer's goroutine (it cannot block)
	optional bool // an engine's call or a fault: it may never happen
}

// Settled reports whether only the engines' calls and faults are left:
// every message delivered, every plane returned or stuck, every deadline
// fired.
func (w *xworld) Settled() bool {
	for _, c := range w.choices() {
		if !c.optional {
			return false
		}
	}
	return true
}

func (w *xworld) Choices() []string {
	cs := w.choices()
	names := make([]string, len(cs))
	for i, c := range cs {
		names[i] = c.name
	}
	return names
}

// choices lists what may happen now, in a canonical order: the engines'
// calls, the connection, the messages, the planes, the deadlines.
func (w *xworld) choices() []choice {
	cfg := w.cfg
	var cs []choice
	add := func(name string, do func()) { cs = append(cs, choice{name: name, do: do}) }
	opt := func(name string, do func()) { cs = append(cs, choice{name: name, do: do, optional: true}) }
	for _, h := range w.hs {
		id := h.cfg.id
		if !h.proposed {
			opt(fmt.Sprintf("propose %d", id), func() { w.propose(h) })
		}
		if h.prog != nil && h.prefilled < h.cfg.blocks {
			add(fmt.Sprintf("prefill %d", id), func() { w.prefill(h) })
		}
		final := h.out != nil && h.out.State().Final()
		if h.proposed && !h.lease.Closed() && (h.cfg.early || final || h.out == nil) {
			opt(fmt.Sprintf("src release %d", id), func() { h.released = true; h.lease.Release() })
		}
		if cfg.srcAbort && h.out != nil && !h.aborted && !final {
			opt(fmt.Sprintf("src abort %d", id), func() { h.aborted = true; _ = h.out.Abort("engine", nil) })
		}
		if cfg.leaseAbort && h.proposed && !h.leaseAborted && !h.lease.Closed() {
			opt(fmt.Sprintf("src lease-abort %d", id), func() { h.leaseAborted = true; h.lease.Abort(errors.New("engine")) })
		}
		if cfg.cancel && h.out != nil && !h.canceled {
			if t := h.out.Transfer(); t != nil && t.State() != kvlease.TransferResolved {
				opt(fmt.Sprintf("src cancel %d", id), func() { h.canceled = true; t.Cancel() })
			}
		}
		w.mu.Lock()
		in := h.in
		w.mu.Unlock()
		if in != nil {
			st := in.State()
			if cfg.dstAbort && !h.dstAborted && !st.Final() {
				opt(fmt.Sprintf("dst abort %d", id), func() { h.dstAborted = true; _ = in.Abort("engine", nil) })
			}
			if cfg.dstReject && !h.dstRejected && st == Accepted {
				opt(fmt.Sprintf("dst reject %d", id), func() { h.dstRejected = true; _ = in.Reject("engine", nil) })
			}
		}
		w.mu.Lock()
		held := h.delivered != nil && !h.dstReleased
		w.mu.Unlock()
		if held {
			opt(fmt.Sprintf("dst release %d", id), func() { h.dstReleased = true; h.delivered.Release() })
		}
	}
	if cfg.crash && !w.link.isClosed() {
		opt("crash", w.link.close)
	}
	for dir := range 2 {
		for k, m := range w.link.pending(dir) {
			if k > 0 && !cfg.reorder {
				break
			}
			at := dirNames[dir]
			if k > 0 {
				at = fmt.Sprintf("%s#%d", at, k+1)
			}
			var h *xh
			if m.m != nil {
				h = w.byID(m.m.Handoff())
			}
			cs = append(cs, choice{name: at + " " + m.lbl, do: func() { w.link.deliver(dir, k, false) }, sync: true})
			if w.drops < cfg.drop {
				cs = append(cs, choice{name: "drop " + at + " " + m.lbl, optional: true, do: func() {
					w.drops++
					if h != nil {
						h.dropped = true
					}
					w.link.drop(dir, k)
				}, sync: true})
			}
			if w.dups < cfg.dup {
				cs = append(cs, choice{name: "dup " + at + " " + m.lbl, optional: true, do: func() { w.dups++; w.link.deliver(dir, k, true) }, sync: true})
			}
		}
	}
	w.mu.Lock()
	ops := slices.Clone(w.ops)
	links := make(map[string]bool, len(w.links))
	for k := range w.links {
		links[k] = true
	}
	w.mu.Unlock()
	slices.SortFunc(ops, func(a, b *xop) int { return strings.Compare(a.name, b.name) })
	for _, op := range ops {
		w.mu.Lock()
		st, canceled := op.st, op.canceled
		w.mu.Unlock()
		opAdd := func(what string, do func()) { add(what+" "+op.name, do) }
		opOpt := func(what string, do func()) { opt(what+" "+op.name, do) }
		stalls := func() {
			if canceled {
				return
			}
			set := func(s opState) func() { return func() { w.mu.Lock(); op.st = s; w.mu.Unlock() } }
			if cfg.stall {
				opOpt("stall", set(opStalled))
			}
			if cfg.stallSync {
				opOpt("stall-sync", set(opStallSync))
			}
			if cfg.freeze {
				opOpt("freeze", set(opFrozen))
			}
		}
		switch st {
		case opWaitAttach:
			opAdd("attach", op.open)
		case opRunning:
			switch {
			case op.side == dirSD && (op.ready == nil || op.ready.Complete()):
				opAdd("push", op.push)
			case op.side == dirDS && links[op.token]:
				opAdd("write", op.write)
			}
			switch {
			case canceled || op.side == dirDS && !links[op.token] && senderGone(ops, op.id):
				opAdd("fail", op.tear) // asked to stop, or its data will never come
			case cfg.fail:
				opOpt("fail", op.tear)
			}
			stalls()
		case opPushed:
			opAdd("return", func() { op.finish(nil) })
			if cfg.fail || canceled {
				opOpt("fail", op.tear)
			}
			stalls()
		case opStalled, opStallSync:
			if canceled {
				opAdd("stop", func() { op.finish(errStopped) })
			}
		}
	}
	w.mu.Lock()
	var timers []*xtimer
	for _, x := range w.timers {
		if !x.off {
			timers = append(timers, x)
		}
	}
	w.mu.Unlock()
	slices.SortFunc(timers, func(a, b *xtimer) int { return strings.Compare(a.name, b.name) })
	for _, x := range timers {
		add(x.name, func() {
			w.mu.Lock()
			x.fired, x.off = true, true
			w.mu.Unlock()
			x.tm.Stop()
			x.f()
		})
	}
	return cs
}

// Weight makes random walks inject faults and the engines' calls rarely
// and move the protocol along often, as a simulation does.
func (w *xworld) Weight(c string) int {
	word, _, _ := strings.Cut(c, " ")
	switch word {
	case "crash", "drop", "dup", "fail", "stall", "stall-sync", "freeze", "src", "dst":
		return 1
	case "deadline", "start-timeout":
		return 3
	}
	return 12
}

// senderGone reports whether handoff id's source op returned without
// pushing its data: the destination's receive then fails (its data
// connection dies) without being asked to stop.
func senderGone(ops []*xop, id uint64) bool {
	for _, op := range ops {
		if op.side == dirSD && op.id == id {
			op.w.mu.Lock()
			gone := (op.st == opReturned || op.st == opRefused) && !op.moved
			op.w.mu.Unlock()
			if gone {
				return true
			}
		}
	}
	return false
}

func (w *xworld) propose(h *xh) {
	var opts []ProposeOption
	if h.prog != nil {
		opts = append(opts, Streaming(h.prog))
	}
	o, _ := w.src.Propose(h.cfg.id, fmt.Sprintf("r%d", h.cfg.id), h.lease, h.hashes, opts...)
	w.mu.Lock()
	h.proposed, h.out = true, o
	w.mu.Unlock()
}

// prefill writes the next block of a streaming handoff's source lease
// and marks it: a prefill that runs its course.
func (w *xworld) prefill(h *xh) {
	i := h.prefilled
	// The model writes by block id, whatever the lease's state: it runs
	// until its engine stops it, and marks only what it wrote.
	copy(w.srcPool.Memory().Region(h.lease.Ref(i).ID), marker(xorigin{h.cfg.id, i}))
	h.prefilled++
	_ = h.prog.WroteBlocks(h.prefilled)
}

// Apply takes the choice named c: its call runs on a goroutine of its
// own (as the engine's, a plane's or a timer's would), and the step ends
// once the bubble is quiescent. A call that has not returned by then is
// blocked for good: a violation.
func (w *xworld) Apply(c string) error {
	var do *choice
	for _, x := range w.choices() {
		if x.name == c {
			do = &x
			break
		}
	}
	if do == nil {
		return fmt.Errorf("choice %q is not enabled", c)
	}
	w.step++
	w.link.mu.Lock()
	w.link.step = w.step
	w.link.mu.Unlock()
	if do.sync {
		do.do()
		synctest.Wait()
	} else {
		done := make(chan struct{})
		go func() { do.do(); close(done) }()
		synctest.Wait()
		select {
		case <-done:
		default:
			return fmt.Errorf("%q has not returned, and nothing left can make it", c)
		}
	}
	w.settle()
	return nil
}

// settle brings the world's records up to date after a step: the
// frames' canonical order, which timers the halves stopped, and whose
// each live timer is.
func (w *xworld) settle() {
	raced, err := w.link.settle(w.step)
	if raced {
		w.raced++
	}
	if err != nil {
		w.violation(err)
	}
	w.mu.Lock()
	timers := slices.Clone(w.timers)
	w.mu.Unlock()
	owners := map[*time.Timer]string{}
	for _, h := range w.hs {
		if o := h.out; o != nil {
			o.mu.Lock()
			if o.timer != nil {
				owners[o.timer] = fmt.Sprintf("src %d", h.cfg.id)
			}
			o.mu.Unlock()
		}
		w.mu.Lock()
		in := h.in
		w.mu.Unlock()
		if in != nil {
			in.mu.Lock()
			if in.timer != nil {
				owners[in.timer] = fmt.Sprintf("dst %d", h.cfg.id)
			}
			in.mu.Unlock()
			w.noteSeals(in)
		}
	}
	for _, x := range timers {
		if x.off {
			continue
		}
		if !x.tm.Stop() { // stopped by its half
			w.mu.Lock()
			x.off = true
			w.mu.Unlock()
			continue
		}
		x.tm.Reset(xNever)
		kind := "deadline"
		if x.d == xStartTimeout {
			kind = "start-timeout"
		}
		owner, ok := owners[x.tm]
		if !ok {
			owner = "?"
		}
		w.mu.Lock()
		x.name = kind + " " + owner
		w.mu.Unlock()
	}
}

// Fingerprint hashes the abstract state (abstract).
func (w *xworld) Fingerprint() uint64 {
	e := absEnc{h: fnvOffset}
	w.abstract(&e)
	return e.h
}

// Describe is the abstract state and each handoff's history.
func (w *xworld) Describe() string {
	e := absEnc{text: true}
	w.abstract(&e)
	b := strings.Builder{}
	b.Write(e.b)
	w.mu.Lock()
	fmt.Fprintf(&b, "step %d; steps whose frames racing writers wrote: %d; messages refused (OnError): %d\n", w.step, w.raced, w.protoErrs)
	for _, h := range w.hs {
		fmt.Fprintf(&b, "handoff %d: OnQuarantine told %d times\n", h.cfg.id, h.quarantines)
	}
	w.mu.Unlock()
	for _, h := range w.hs {
		out, in := w.handles(h)
		if out != nil {
			fmt.Fprintf(&b, "source %d history:\n", h.cfg.id)
			for _, s := range out.History() {
				fmt.Fprintf(&b, "  %v\n", s)
			}
		}
		if in != nil {
			fmt.Fprintf(&b, "destination %d history:\n", h.cfg.id)
			for _, s := range in.History() {
				fmt.Fprintf(&b, "  %v\n", s)
			}
		}
	}
	return b.String()
}

// absEnc writes the abstract state as text (Describe) or into an FNV-1a
// hash (Fingerprint), from the same calls.
type absEnc struct {
	text bool
	b    []byte
	h    uint64
}

const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

func (e *absEnc) byte1(c byte) { e.h = (e.h ^ uint64(c)) * fnvPrime }

// s writes a word.
func (e *absEnc) s(s string) {
	if e.text {
		if len(e.b) > 0 && e.b[len(e.b)-1] != '\n' {
			e.b = append(e.b, ' ')
		}
		e.b = append(e.b, s...)
		return
	}
	for i := 0; i < len(s); i++ {
		e.byte1(s[i])
	}
	e.byte1(0)
}

// n writes a number.
func (e *absEnc) n(v int) {
	if e.text {
		e.s(strconv.Itoa(v))
		return
	}
	for i := range 8 {
		e.byte1(byte(uint64(v) >> (8 * i)))
	}
}

// f writes name if v is set.
func (e *absEnc) f(name string, v bool) {
	if v {
		e.s(name)
	} else if !e.text {
		e.byte1(1)
	}
}

// nl ends a line.
func (e *absEnc) nl() {
	if e.text {
		e.b = append(e.b, '\n')
	} else {
		e.byte1('\n')
	}
}

// abstract writes what the properties and the future depend on, in a
// canonical form: per handoff both sides' states and the outcome of each
// event they saw, their transfers and leases, the engines' calls made;
// the ops, the links, the waiting messages, the live timers, the pools'
// counts and the seals. Process-wide counters (transfer and lease ids,
// session numbers) and texts are left out: they differ between runs.
func (w *xworld) abstract(e *absEnc) {
	type snap struct {
		h                                                   *xh
		in                                                  *Incoming[[]byte]
		out                                                 *Outgoing[[]byte]
		finals, deliveries, finished, forgotten             int
		proposed, released, aborted, leaseAborted, canceled bool
		dstAborted, dstRejected, dstReleased, dropped       bool
		prefilled                                           int
	}
	w.mu.Lock()
	snaps := make([]snap, len(w.hs))
	for i, h := range w.hs {
		snaps[i] = snap{h, h.in, h.out, h.finals, h.deliveries, h.finished, h.forgotten,
			h.proposed, h.released, h.aborted, h.leaseAborted, h.canceled,
			h.dstAborted, h.dstRejected, h.dstReleased, h.dropped, h.prefilled}
	}
	type opSnap struct {
		name                    string
		st                      opState
		canceled, moved, failed bool
	}
	ops := make([]opSnap, len(w.ops))
	for i, op := range w.ops {
		ops[i] = opSnap{op.name, op.st, op.canceled, op.moved, op.outcome != nil}
	}
	links := make([]string, 0, len(w.links))
	for k := range w.links {
		links = append(links, k)
	}
	var timers []string
	for _, x := range w.timers {
		if !x.off {
			timers = append(timers, x.name)
		}
	}
	w.mu.Unlock()

	for _, s := range snaps {
		e.s("h")
		e.n(int(s.h.cfg.id))
		e.f("proposed", s.proposed)
		e.f("released", s.released)
		e.f("aborted", s.aborted)
		e.f("lease-aborted", s.leaseAborted)
		e.f("canceled", s.canceled)
		e.f("dst-aborted", s.dstAborted)
		e.f("dst-rejected", s.dstRejected)
		e.f("dst-released", s.dstReleased)
		e.f("dropped", s.dropped)
		if s.h.prog != nil {
			e.s("prefilled")
			e.n(s.prefilled)
		}
		e.s("finals")
		e.n(s.finals)
		e.s("delivered")
		e.n(s.deliveries)
		e.s("finished")
		e.n(s.finished)
		e.s("forgotten")
		e.n(s.forgotten)
		e.s("lease")
		e.s(s.h.lease.State().String())
		e.f("closed", s.h.lease.Closed())
		e.nl()
		if s.out != nil {
			e.s("  src")
			sideState(e, &s.out.machine, s.out.Transfer(), w.src.has(s.h.cfg.id, s.out))
			e.nl()
		}
		if in := s.in; in != nil {
			e.s("  dst")
			sideState(e, &in.machine, in.Transfer(), in.s.has(in))
			e.s("hits")
			e.n(in.Hits())
			if l := in.Lease(); l != nil {
				e.s("lease")
				e.s(l.State().String())
				e.f("closed", l.Closed())
				for i := range l.Len() {
					_, sealed := w.dstPool.SealInfo(l.Ref(i), nil)
					e.f("sealed"+strconv.Itoa(i), sealed)
				}
			}
			e.nl()
		}
	}
	slices.SortFunc(ops, func(a, b opSnap) int { return strings.Compare(a.name, b.name) })
	for _, op := range ops {
		e.s("op")
		e.s(op.name)
		e.s(op.st.String())
		e.f("canceled", op.canceled)
		e.f("moved", op.moved)
		e.f("failed", op.failed)
		e.nl()
	}
	slices.Sort(links)
	e.s("links")
	for _, l := range links {
		e.s(l)
	}
	e.nl()
	slices.Sort(timers)
	e.s("timers")
	for _, t := range timers {
		e.s(t)
	}
	e.nl()
	e.f("closed", w.link.isClosed())
	e.s("drops")
	e.n(w.drops)
	e.s("dups")
	e.n(w.dups)
	e.nl()
	for dir := range 2 {
		e.s(dirNames[dir])
		for _, m := range w.link.pending(dir) {
			e.s("[" + m.lbl + "]")
		}
		e.nl()
	}
	for i, p := range []*kvlease.Pool[[]byte]{w.srcPool, w.dstPool} {
		st := p.Stats()
		e.s([2]string{"source", "destination"}[i])
		e.s("pool: free")
		e.n(st.Free)
		e.s("cached")
		e.n(st.Cached)
		e.s("leased")
		e.n(st.Leased)
		e.s("draining")
		e.n(st.Draining)
		e.s("quarantined")
		e.n(st.Quarantined)
		e.s("open")
		e.n(st.OpenLeases)
		e.nl()
	}
}

// sideState writes one side of a handoff: its state, each event it saw
// with whether its error was nil, whether it is still in its half's
// table, and its transfer's state.
func sideState(e *absEnc, m *machine, t *kvlease.Transfer, inTable bool) {
	var errNil [numEvents]int8 // 0 not seen, 1 nil, 2 error
	m.mu.Lock()
	st := m.state
	for _, s := range m.history {
		errNil[s.Event] = 1
		if s.Err != nil {
			errNil[s.Event] = 2
		}
	}
	m.mu.Unlock()
	e.s(st.String())
	for ev := Event(1); ev < numEvents; ev++ {
		if errNil[ev] != 0 {
			e.s(ev.String() + [3]string{"", ":ok", ":err"}[errNil[ev]])
		}
	}
	e.f("retired", !inTable)
	if t != nil {
		e.s("transfer")
		e.s(t.State().String())
		e.f("cancel-asked", t.CancelRequested())
		e.f("failed", t.State() == kvlease.TransferResolved && t.Err() != nil)
	}
}

// has reports whether the source's table still holds o.
func (s *Source[R]) has(id uint64, o *Outgoing[R]) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.out[id] == o
}

// has reports whether the session's table still holds in.
func (s *session[R]) has(in *Incoming[R]) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.in[in.id] == in
}

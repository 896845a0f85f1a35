package audit

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/inproc"
)

// namespace is the prefix-cache namespace seed of every request.
const namespace kvlease.BlockHash = 0x6b76617564697431

// mix is splitmix64's finaliser.
func mix(z uint64) uint64 {
	z += 0x9e3779b97f4a7c15
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// tokens returns request id's prompt: the first tokens of document doc
// (if doc ≥ 0), then tokens of its own.
func (w *world) tokens(id int32, doc, n int) []int32 {
	out := make([]int32, n)
	shared := 0
	if doc >= 0 {
		shared = min(n, w.cfg.DocTokens)
	}
	for k := range out {
		var v uint64
		if k < shared {
			v = mix(uint64(doc)<<32 | uint64(k) | 1<<63)
		} else {
			v = mix(w.cfg.Seed ^ mix(uint64(uint32(id))<<32|uint64(k)))
		}
		out[k] = int32(v & 0x7fffffff)
	}
	return out
}

// exec runs one operation and the checks after it. An operation that
// does not apply to the state it finds is skipped.
func (w *world) exec(o Op) {
	w.rep.Ops++
	if o.Kind.Lifecycle() {
		w.rep.Lifecycle++
	}
	if o.Kind > 0 && o.Kind < numOpKinds {
		w.rep.ByOp[o.Kind]++
	}
	r := w.reqs[o.Req]
	applied := true
	switch o.Kind {
	case OpArrive:
		if r != nil {
			applied = false
			break
		}
		r = w.arrive(o)
	case OpExtend:
		applied = w.extend(r, int(o.Tokens))
	case OpSeal:
		applied = w.status(r) == stIdle
		if applied {
			w.sealFrom(r.cur)
		}
	case OpOffer:
		applied = w.offer(r, o)
	case OpRevoke:
		applied = w.revoke(r)
	case OpStart:
		applied = w.start(r, o)
	case OpStep:
		applied = r != nil && int(o.Job) < len(r.jobs) && r.jobs[o.Job].at >= 0
		if applied {
			w.step(r.jobs[o.Job])
		}
	case OpAbort:
		applied = w.abort(r)
	case OpDeadline:
		applied = w.deadline(r)
	case OpAck:
		applied = w.ack(r)
	case OpRelease:
		applied = w.release(r)
	case OpTimeout:
		applied = w.timeout(r)
	default:
		applied = false
	}
	if !applied {
		w.rep.Skipped++
	}
	if w.stopped {
		w.collectAsync()
		return
	}
	if r != nil {
		w.settle(r)
	}
	for _, ps := range w.pools {
		w.serveWaiters(ps)
	}
	w.collectAsync()
	w.cheapCheck()
	if w.fullEach || (w.op >= 0 && (w.op+1)%w.cfg.CheckEvery == 0) {
		w.fullCheck()
	}
}

func (w *world) arrive(o Op) *request {
	if int(o.Pool) >= len(w.pools) || o.Tokens < 1 || o.MaxNew < 0 || int(o.Doc) >= max(w.cfg.Docs, 1) {
		return nil
	}
	ps := w.pools[o.Pool]
	r := &request{id: o.Req, owner: fmt.Sprintf("r%d", o.Req), prompt: int(o.Tokens), maxNew: int(o.MaxNew), live: -1, abortAt: -1, deadlineAt: -1}
	w.reqs[r.id] = r
	w.rep.Arrivals++
	if err := w.env.CheckRequest(r.prompt, r.maxNew); err != nil {
		if !errors.Is(err, kvlease.ErrExceedsCapacity) {
			w.violate(Unexpected, "admit request %d (%d+%d tokens): %v", r.id, r.prompt, r.maxNew, err)
		}
		w.rep.RejectedEnvelope++
		w.gone(r)
		return r
	}
	r.tokens = w.tokens(r.id, int(o.Doc), r.prompt)
	r.hashes = kvlease.ChainHashes(namespace, r.tokens, w.cfg.BlockTokens)
	n := w.env.BlocksFor(r.prompt)
	r.growth = w.env.BlocksFor(r.prompt+r.maxNew) - n
	if o.Wait {
		w.enqueue(r, ps, n)
		return r
	}
	l, hits, err := ps.p.AcquirePrefixTokens(r.owner, namespace, r.tokens, n)
	if err != nil {
		if !errors.Is(err, kvlease.ErrExhausted) {
			w.violate(Unexpected, "%s: acquire %d blocks for request %d: %v", ps.name, n, r.id, err)
		}
		w.rep.RejectedExhausted++
		w.gone(r)
		return r
	}
	if hits > len(r.hashes) || hits > n || l.Len() != n {
		w.violate(Unexpected, "%s: request %d asked %d blocks with %d full: got %d with %d hits", ps.name, r.id, n, len(r.hashes), l.Len(), hits)
	}
	w.rep.PrefixHits += hits
	lr := w.opened(ps, l, hits, r)
	w.prefill(r, lr, hits)
	w.addLive(r)
	return r
}

// enqueue admits r through AcquireWait: at once if the pool can serve it
// now (nobody queued, enough free or evictable blocks), else on a
// goroutine that the driver waits to see queued.
func (w *world) enqueue(r *request, ps *poolState, n int) {
	s := ps.p.Stats()
	w.addLive(r)
	if !w.cfg.Concurrent && s.Waiters == 0 && s.Free+s.Cached >= n {
		// Served at once: nobody is queued and the blocks are there.
		ctx, cancel := context.WithTimeout(context.Background(), w.cfg.StallTimeout)
		l, err := ps.p.AcquireWait(ctx, r.owner, n)
		cancel()
		if errors.Is(err, context.DeadlineExceeded) {
			w.stall(fmt.Sprintf("%s: AcquireWait of %d blocks with %d free or cached and nobody queued", ps.name, n, s.Free+s.Cached))
			return
		}
		if err != nil {
			w.violate(Unexpected, "%s: AcquireWait %d blocks with %d free or cached and no queue: %v", ps.name, n, s.Free+s.Cached, err)
			w.gone(r)
			return
		}
		w.waited(r, ps, l)
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	wr := &waitRec{ps: ps, n: n, cancel: cancel, ch: make(chan waitResult, 1)}
	r.wait = wr
	ps.fifo = append(ps.fifo, r)
	go func() {
		l, err := ps.p.AcquireWait(ctx, r.owner, n)
		wr.ch <- waitResult{l, err}
	}()
	// Wait until it is queued (or, if something freed blocks meanwhile,
	// served: serveWaiters takes it from there).
	if w.cfg.Concurrent {
		return // serveWaiters looks for its result
	}
	want := s.Waiters + 1
	w.spin(func() bool { return len(wr.ch) > 0 || ps.p.Stats().Waiters >= want }, fmt.Sprintf("request %d to queue in %s", r.id, ps.name))
}

func (w *world) timeout(r *request) bool {
	if r == nil || r.wait == nil {
		return false
	}
	wr := r.wait
	wr.cancel()
	res, ok := w.result(wr)
	if !ok {
		return true
	}
	wr.ps.fifo = removeReq(wr.ps.fifo, r)
	r.wait = nil
	if res.err == nil {
		if w.cfg.Concurrent {
			// Blocks freed by a copy served it before the cancel came.
			w.waited(r, wr.ps, res.l)
			return true
		}
		// The pool served it after all: a lease the audit did not expect.
		w.violate(Unexpected, "%s: request %d's cancelled wait returned a lease", wr.ps.name, r.id)
		res.l.Release()
	} else if !errors.Is(res.err, context.Canceled) {
		w.violate(Unexpected, "%s: request %d's cancelled wait: %v", wr.ps.name, r.id, res.err)
	}
	w.rep.TimedOut++
	w.gone(r)
	return true
}

func removeReq(list []*request, r *request) []*request {
	for i, x := range list {
		if x == r {
			return append(list[:i], list[i+1:]...)
		}
	}
	return list
}

func (w *world) extend(r *request, n int) bool {
	if w.status(r) != stIdle || n < 1 {
		return false
	}
	lr := r.cur
	if err := lr.l.Extend(n); err != nil {
		if !errors.Is(err, kvlease.ErrExhausted) && !errors.Is(err, kvlease.ErrExceedsCapacity) {
			w.violate(Unexpected, "%s: extend request %d by %d: %v", lr.ps.name, r.id, n, err)
		}
		w.rep.ExtendRejected++
		return true
	}
	from := len(lr.refs)
	if got := lr.l.Len(); got != from+n {
		w.violate(Unexpected, "%s: extend request %d from %d by %d: lease has %d blocks", lr.ps.name, r.id, from, n, got)
		return true
	}
	for i := from; i < from+n; i++ {
		w.addBlock(lr, lr.l.Ref(i), false)
		w.stamp(lr, i)
	}
	r.growth -= n
	w.rep.Extends++
	return true
}

func (w *world) offer(r *request, o Op) bool {
	if w.status(r) != stIdle || int(o.Pool) >= len(w.pools) {
		return false
	}
	to := w.pools[o.Pool]
	src := r.cur
	w.rep.Offers++
	h, err := handoff.Propose(src.l, to.p, handoff.Config{
		Envelope: w.env, Source: src.ps.name, Destination: to.name, Deadline: -1,
	})
	if err != nil {
		if !errors.Is(err, kvlease.ErrExceedsCapacity) {
			w.violate(Unexpected, "request %d: propose %s → %s: %v", r.id, src.ps.name, to.name, err)
		}
		w.rep.RejectedEnvelope++
		return true
	}
	hr := &handRec{h: h, to: to, src: src, n: h.Blocks()}
	if hr.n != len(src.refs) {
		w.violate(Unexpected, "request %d: handoff of %d blocks from a lease of %d", r.id, hr.n, len(src.refs))
	}
	if o.Reject {
		if err := h.Reject(to.name, errBusy); err != nil {
			w.violate(Unexpected, "request %d: reject proposed handoff: %v", r.id, err)
		}
		w.rep.RejectedPolicy++
		r.h = hr
		return true
	}
	r.h = hr
	if err := h.Accept(); err != nil {
		if !errors.Is(err, kvlease.ErrExhausted) {
			w.violate(Unexpected, "request %d: accept into %s: %v", r.id, to.name, err)
		}
		if h.Destination() != nil {
			w.violate(HandoffBroken, "request %d: failed accept left a destination lease", r.id)
		}
		w.rep.RejectedExhausted++
		return true
	}
	dst := h.Destination()
	if dst == nil || dst.Len() != hr.n {
		w.violate(HandoffBroken, "request %d: accepted handoff has no destination lease of %d blocks", r.id, hr.n)
		return true
	}
	// The destination's content is unknown until the transfer delivers.
	hr.dst = w.opened(to, dst, 0, r)
	return true
}

func (w *world) revoke(r *request) bool {
	if w.status(r) != stAccepted {
		return false
	}
	hr := r.h
	if err := hr.h.Reject(hr.to.name, errRevoked); err != nil {
		w.violate(Unexpected, "request %d: revoke accepted handoff: %v", r.id, err)
	}
	w.rep.RejectedPolicy++
	if w.cfg.hooks.revoked != nil {
		w.syncLease(hr.dst)
		w.cfg.hooks.revoked(w, r, hr)
	}
	return true
}

func (w *world) start(r *request, o Op) bool {
	if w.status(r) != stAccepted {
		return false
	}
	hr := r.h
	src := make([]slotRef, hr.n)
	dst := make([]slotRef, hr.n)
	for i := range hr.n {
		src[i] = slotRef{hr.src.ps, hr.src.refs[i]}
		dst[i] = slotRef{hr.dst.ps, hr.dst.refs[i]}
	}
	plan := inproc.Plan{Fate: o.Fate, FailAt: int(o.FailAt), HonourCancel: o.Honour}
	j, err := w.newJob(r, plan, src, dst)
	if err != nil {
		w.violate(Unexpected, "request %d: transport: %v", r.id, err)
		return true
	}
	j.hr = hr
	var tr kvlease.Transport[[]byte, []byte] = jobTransport{j}
	if w.cfg.hooks.transport != nil {
		tr = w.cfg.hooks.transport(tr)
	}
	err = hr.h.Start(tr)
	if !j.attached {
		w.violate(Unexpected, "request %d: start of an accepted handoff attached nothing: %v", r.id, err)
		return true
	}
	outer := hr.h.Transfer()
	if outer == nil {
		w.violate(HandoffBroken, "request %d: handoff attached a transfer but does not report it", r.id)
		outer = j.inner
	}
	j.outer.Store(outer)
	hr.x = &xferRec{t: outer, state: kvlease.TransferPending, atts: []attRec{{hr.src, hr.n}, {hr.dst, hr.n}}}
	j.x = hr.x
	w.attachRec(hr.x)
	hr.job = j
	w.launched(j)
	return true
}

func (w *world) abort(r *request) bool {
	switch w.status(r) {
	case stIdle:
		r.cur.l.Abort(errClientGone)
		w.closeRec(r.cur)
		w.rep.AbortedIdle++
		w.gone(r)
	case stAccepted:
		if err := r.h.h.Abort("client", errClientGone); err != nil {
			w.violate(Unexpected, "request %d: abort accepted handoff: %v", r.id, err)
		}
		w.rep.AbortedEarly++
	case stFlying, stStuck:
		hr := r.h
		if hr.h.State() != handoff.Transferring {
			return false
		}
		pending := hr.x.t.State() != kvlease.TransferResolved
		if err := hr.h.Abort("client", errClientGone); err != nil {
			if w.cfg.Concurrent && errors.Is(err, handoff.ErrState) {
				return true // the evidence won the race: delivered or failed
			}
			w.violate(Unexpected, "request %d: abort transferring handoff: %v", r.id, err)
		}
		w.rep.AbortedMidTransfer++
		if pending {
			if hr.job.plan.HonourCancel {
				w.rep.Cancelled++
			} else {
				w.rep.CancelsIgnored++
			}
		}
		r.aborted = true
	default:
		return false
	}
	return true
}

func (w *world) deadline(r *request) bool {
	st := w.status(r)
	if st != stFlying && st != stStuck {
		return false
	}
	hr := r.h
	if hs := hr.h.State(); hs != handoff.Transferring && hs != handoff.Aborting {
		return false
	}
	if hr.x.t.State() != kvlease.TransferPending {
		return false
	}
	w.rep.Deadlines++
	r.expired = true
	if w.cfg.hooks.deadline != nil && w.cfg.hooks.deadline(w, r) {
		return true
	}
	if err := hr.h.Expire("deadline", errDeadline); err != nil {
		w.violate(Unexpected, "request %d: expire handoff: %v", r.id, err)
	}
	// (In a concurrent run the copy may have resolved it meanwhile: late
	// evidence, or evidence that won the race.)
	if st := hr.x.t.State(); st != kvlease.TransferQuarantined && !(w.cfg.Concurrent && st == kvlease.TransferResolved) {
		w.violate(HandoffBroken, "request %d: expired handoff's transfer is %v, not quarantined", r.id, hr.x.t.State())
	}
	return true
}

func (w *world) ack(r *request) bool {
	if r == nil || r.gone {
		return false
	}
	for _, j := range r.jobs {
		if !j.lostAck() {
			continue
		}
		j.acked = true
		if !j.tp.Acknowledge(j.inner) {
			w.violate(Unexpected, "request %d: copy %d lost its acknowledgement but the transport has none to deliver", r.id, j.idx)
		}
		w.follow(j)
		w.rep.LateAcks++
		return true
	}
	return false
}

func (w *world) release(r *request) bool {
	if w.status(r) != stIdle {
		return false
	}
	w.checkLease(r.cur)
	r.cur.l.Release()
	w.closeRec(r.cur)
	w.rep.Released++
	w.gone(r)
	return true
}

package audit

import (
	"math/rand/v2"
	"slices"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/inproc"
)

// gen draws the workload: each call to next looks at the world and picks
// one operation with the run's one random source. The operations it
// returns carry every decision (sizes, fates, who refuses), so executing
// them needs no randomness: Replay runs a trace without a gen.
type gen struct {
	w      *world
	rng    *rand.Rand
	nextID int32
}

// newGen returns the generator of w's run: src, or the seed's PCG when
// src is nil.
func newGen(w *world, src rand.Source) *gen {
	if src == nil {
		src = rand.NewPCG(w.cfg.Seed, 0x6b7661756469742e)
	}
	return &gen{w: w, rng: rand.New(src)}
}

func (g *gen) chance(p float64) bool { return g.rng.Float64() < p }

// next returns the next operation.
func (g *gen) next() Op {
	w := g.w
	c := w.cfg
	for range 16 {
		if len(w.live) < c.MaxLive && (len(w.live) == 0 || g.chance(0.22)) {
			return g.arrive()
		}
		if n := len(w.limbo); n > 0 && (g.chance(0.0003) || g.limboBlocks() > g.totalBlocks()/8) {
			// Late evidence for a transfer nobody waits for any more;
			// forced when the quarantined blocks pile up.
			r := w.limbo[0]
			if !g.chance(0.5) {
				r = w.limbo[g.rng.IntN(n)]
			}
			return Op{Kind: OpAck, Req: r.id}
		}
		if n := len(w.jobs); n > 0 && g.chance(0.05) {
			// A copy nobody steps otherwise: its request is gone, or it
			// runs outside any handoff.
			if j := w.jobs[g.rng.IntN(n)]; j.at >= 0 && (j.r.gone || j.r.limbo || j.hr == nil) {
				return Op{Kind: OpStep, Req: j.r.id, Job: int16(j.idx)}
			}
		}
		if len(w.live) == 0 {
			continue
		}
		r := w.live[g.rng.IntN(len(w.live))]
		if o, ok := g.act(r); ok {
			return o
		}
	}
	// Nothing drawn: make progress with the first request that can.
	for _, r := range w.live {
		if o, ok := g.force(r); ok {
			return o
		}
	}
	return g.arrive()
}

func (g *gen) totalBlocks() int {
	n := 0
	for _, ps := range g.w.pools {
		n += len(ps.held)
	}
	return n
}

func (g *gen) limboBlocks() int {
	n := 0
	for _, r := range g.w.limbo {
		if r.h != nil {
			n += 2 * r.h.n
		}
	}
	return n
}

func (g *gen) arrive() Op {
	c := g.w.cfg
	id := g.nextID
	g.nextID++
	o := Op{Kind: OpArrive, Req: id, Pool: uint8(g.rng.IntN(c.Workers)), Doc: -1}
	if c.Docs > 0 && g.chance(c.DocShare) {
		o.Doc = int16(g.rng.IntN(c.Docs))
	}
	o.Tokens = int32(c.MinPrompt + g.rng.IntN(c.MaxPrompt-c.MinPrompt+1))
	o.MaxNew = int32(g.rng.IntN(c.MaxNew + 1))
	if g.chance(c.Faults.OverContext) {
		o.MaxNew = int32(max(c.MaxContextTokens-int(o.Tokens)+1+g.rng.IntN(64), 0))
	}
	o.Wait = g.chance(c.Faults.Wait)
	return o
}

// act draws what request r does next, if anything.
func (g *gen) act(r *request) (Op, bool) {
	w := g.w
	f := w.cfg.Faults
	if w.cfg.Concurrent {
		// Copies move on their own: look at where r is now.
		w.refresh(r)
	}
	switch w.status(r) {
	case stWaiting:
		if g.chance(f.Timeout) {
			return Op{Kind: OpTimeout, Req: r.id}, true
		}
	case stIdle:
		if j := r.rogue(); j != nil && j.at >= 0 && g.chance(0.5) {
			return Op{Kind: OpStep, Req: r.id, Job: int16(j.idx)}, true
		}
		u := g.rng.Float64()
		switch {
		case u < 0.40:
			return g.offer(r), true
		case u < 0.52:
			if r.growth > 0 {
				return Op{Kind: OpExtend, Req: r.id, Tokens: int32(1 + g.rng.IntN(min(r.growth, 4)))}, true
			}
		case u < 0.56:
			if r.cur.sealedTo < min(len(r.hashes), len(r.cur.refs)) {
				return Op{Kind: OpSeal, Req: r.id}, true
			}
		case u < 0.56+f.Leave:
			return Op{Kind: OpAbort, Req: r.id}, true
		default:
			return Op{Kind: OpRelease, Req: r.id}, true
		}
	case stAccepted:
		u := g.rng.Float64()
		switch {
		case u < f.EarlyAbort:
			return Op{Kind: OpAbort, Req: r.id}, true
		case u < f.EarlyAbort+f.Revoke:
			return Op{Kind: OpRevoke, Req: r.id}, true
		}
		return g.start(r), true
	case stFlying:
		j := r.h.job
		if w.cfg.Concurrent {
			switch {
			case r.abortAt >= 0:
				r.abortAt = -1
				return Op{Kind: OpAbort, Req: r.id}, true
			case r.deadlineAt >= 0:
				r.deadlineAt = -1
				return Op{Kind: OpDeadline, Req: r.id}, true
			}
			return Op{}, false
		}
		switch {
		case r.abortAt >= 0 && j.writes >= r.abortAt:
			r.abortAt = -1
			return Op{Kind: OpAbort, Req: r.id}, true
		case r.deadlineAt >= 0 && j.writes >= r.deadlineAt:
			r.deadlineAt = -1
			return Op{Kind: OpDeadline, Req: r.id}, true
		}
		return Op{Kind: OpStep, Req: r.id, Job: int16(j.idx)}, true
	case stStuck:
		quarantined := r.h.h.State() == handoff.Quarantined
		u := g.rng.Float64()
		switch {
		case u < 0.2:
			return Op{Kind: OpAck, Req: r.id}, true
		case u < 0.45 && !quarantined:
			return Op{Kind: OpDeadline, Req: r.id}, true
		case u < 0.5 && !r.aborted && r.h.h.State() == handoff.Transferring:
			return Op{Kind: OpAbort, Req: r.id}, true
		case u < 0.6 && quarantined && r.h.job.lostAck():
			// Nobody waits for this acknowledgement any more.
			w.toLimbo(r)
		}
	}
	return Op{}, false
}

// force returns an operation that moves r on, if one does.
func (g *gen) force(r *request) (Op, bool) {
	switch g.w.status(r) {
	case stWaiting:
		return Op{Kind: OpTimeout, Req: r.id}, true
	case stIdle:
		return Op{Kind: OpRelease, Req: r.id}, true
	case stAccepted:
		return g.start(r), true
	case stFlying:
		if g.w.cfg.Concurrent {
			return Op{}, false
		}
		return Op{Kind: OpStep, Req: r.id, Job: int16(r.h.job.idx)}, true
	case stStuck:
		return Op{Kind: OpAck, Req: r.id}, true
	}
	return Op{}, false
}

func (g *gen) offer(r *request) Op {
	w := g.w
	to := g.rng.IntN(len(w.pools))
	if len(w.pools) > 1 && to == r.at.idx {
		to = (to + 1 + g.rng.IntN(len(w.pools)-1)) % len(w.pools)
	}
	busy := 0
	for _, x := range w.live {
		if x.at == w.pools[to] && w.status(x) == stIdle {
			busy++
		}
	}
	reject := busy >= w.cfg.MaxRunningRequests || g.chance(w.cfg.Faults.PolicyReject)
	return Op{Kind: OpOffer, Req: r.id, Pool: uint8(to), Reject: reject}
}

// start draws the transfer's plan, and the request's intentions while it
// flies: abort after some blocks, or pass its deadline.
func (g *gen) start(r *request) Op {
	f := g.w.cfg.Faults
	n := r.h.n
	o := Op{Kind: OpStart, Req: r.id, FailAt: int16(g.rng.IntN(n)), Honour: !g.chance(f.IgnoreCancel)}
	switch u := g.rng.Float64(); {
	case u < f.Fail:
		o.Fate = inproc.FateFail
	case u < f.Fail+f.LostAck:
		o.Fate = inproc.FateLoseAck
	}
	r.abortAt, r.deadlineAt = -1, -1
	if g.chance(f.Abort) {
		r.abortAt = g.rng.IntN(n)
	} else if g.chance(f.Deadline) {
		r.deadlineAt = g.rng.IntN(n)
	}
	return o
}

// drainOps returns what the drain does next with the world as it is: it
// ends every wait, lets every copy finish, gives every unacknowledged
// transfer its deadline, delivers late acknowledgements to some (chosen
// from the seed and the request, so the choice survives minimisation),
// and releases everything else. nil when nothing is left to do.
func drainOps(w *world) []Op {
	var rs []*request
	for _, r := range w.reqs {
		if !r.gone {
			rs = append(rs, r)
		}
	}
	slices.SortFunc(rs, func(a, b *request) int { return int(a.id) - int(b.id) })
	var ops []Op
	js := slices.Clone(w.jobs)
	slices.SortFunc(js, func(a, b *job) int {
		if a.r.id != b.r.id {
			return int(a.r.id) - int(b.r.id)
		}
		return a.idx - b.idx
	})
	for _, j := range js {
		if j.at >= 0 {
			ops = append(ops, Op{Kind: OpStep, Req: j.r.id, Job: int16(j.idx)})
		}
	}
	for _, r := range rs {
		switch w.status(r) {
		case stWaiting:
			ops = append(ops, Op{Kind: OpTimeout, Req: r.id})
		case stIdle:
			if r.rogue() == nil {
				ops = append(ops, Op{Kind: OpRelease, Req: r.id})
			}
		case stAccepted:
			ops = append(ops, Op{Kind: OpRevoke, Req: r.id})
		case stStuck:
			if r.h.h.State() != handoff.Quarantined && r.h.x.t.State() == kvlease.TransferPending {
				ops = append(ops, Op{Kind: OpDeadline, Req: r.id})
			} else if r.h.job.lostAck() && lateAck(w.cfg, r.id) {
				ops = append(ops, Op{Kind: OpAck, Req: r.id})
			}
		}
	}
	return ops
}

// lateAck decides, from the seed and the request alone, whether a lost
// acknowledgement still pending at the drain arrives late.
func lateAck(c *Config, id int32) bool {
	return float64(mix(c.Seed^mix(uint64(uint32(id))^0x6c617465))>>11)/(1<<53) < c.Faults.LateAck
}

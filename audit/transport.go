package audit

import (
	"errors"
	"fmt"
	"go.uber.org/atomic"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/inproc"
)

// job is one copy: a handoff's transfer (or, in broken variants, a copy
// outside any handoff). Each job has its own inproc transport, so that
// Wait tells exactly when its goroutine has stopped, and its plan is the
// one its OpStart carries.
//
// The driver steps a job one block at a time: the copy goroutine parks
// in BeforeWrite (sending the pair on arrive) until the driver sends on
// proceed. So between operations every copy is parked or gone, and a
// run is a function of its operations.
type job struct {
	w    *world
	r    *request
	idx  int
	hr   *handRec // nil for a copy outside a handoff
	x    *xferRec // the transfer as the leases see it
	tp   *inproc.Transport
	plan inproc.Plan

	// What each pair reads and writes, as the leases got them; fixed
	// before the copy starts.
	src, dst []slotRef

	inner    *kvlease.Transfer                // the transport's transfer
	outer    atomic.Pointer[kvlease.Transfer] // what the leases gate (inner, unless a wrapper made its own)
	attached bool

	arrive  chan int
	proceed chan struct{}
	exited  chan struct{}
	at      int // the pair the copy is parked before, -1 if running or gone
	writes  int // pairs let through
	ended   bool
	flagged bool // an early resolve was reported
	acked   bool
}

// errRunOver stops the copies still parked when a run ends: nothing
// writes once the driver stopped stepping.
var errRunOver = errors.New("audit: the run is over")

type slotRef struct {
	ps  *poolState
	ref kvlease.BlockRef
}

func (w *world) newJob(r *request, plan inproc.Plan, src, dst []slotRef) (*job, error) {
	j := &job{
		w: w, r: r, idx: len(r.jobs), plan: plan, src: src, dst: dst, at: -1,
		arrive: make(chan int), proceed: make(chan struct{}), exited: make(chan struct{}),
	}
	ic := inproc.Config{
		Decide:      func(uint64, int) inproc.Plan { return j.plan },
		BeforeWrite: j.beforeWrite,
	}
	if w.cfg.Concurrent {
		ic.AfterWrite = j.afterWrite
		// Each block takes up to Latency, drawn from the run's seed and
		// the copy: the timing is the scheduler's anyway.
		frac := float64(mix(w.cfg.Seed^mix(uint64(uint32(r.id))<<16|uint64(len(r.jobs))))>>11) / (1 << 53)
		j.plan.Latency = time.Duration(frac * float64(w.cfg.Latency))
	}
	tp, err := inproc.New(ic)
	if err != nil {
		return nil, err
	}
	j.tp = tp
	return j, nil
}

// jobTransport is the transport a handoff starts a job with: inproc's,
// recording the transfer and whether the handoff attached it.
type jobTransport struct{ j *job }

func (t jobTransport) Start(pairs []kvlease.CopyPair[[]byte, []byte], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	j := t.j
	return j.tp.Start(pairs, func(tr *kvlease.Transfer) error {
		j.inner = tr
		err := attach(tr)
		j.attached = err == nil
		return err
	})
}

// launched finishes starting a job whose transfer was attached: the
// driver waits for its goroutine to park before its first write (or to
// stop).
func (w *world) launched(j *job) {
	w.jobs = append(w.jobs, j)
	j.r.jobs = append(j.r.jobs, j)
	w.rep.Started++
	go func() {
		j.tp.Wait()
		close(j.exited)
	}()
	if !w.cfg.Concurrent {
		w.nextStop(j)
	}
}

// poll notices, without waiting, that j's goroutine stopped (concurrent
// runs).
func (w *world) poll(j *job) {
	if j.ended {
		return
	}
	select {
	case <-j.exited:
		w.exited(j)
	default:
	}
}

// finishJob waits for j's goroutine to stop.
func (w *world) finishJob(j *job) {
	if !j.ended && w.await(j.exited, fmt.Sprintf("request %d copy %d to stop", j.r.id, j.idx)) {
		w.exited(j)
	}
}

// beforeWrite runs on the copy goroutine before each block is written:
// it parks until the driver lets the write through, then checks, at the
// moment of the write, that both blocks are still the ones the transfer
// was attached to: same slot, same generation, not free. A draining or
// quarantined block passes (the transfer still holds it); a reclaimed
// one is a late write (or read). It also checks that the transfer the
// leases wait on has not resolved: a write after the evidence.
func (j *job) beforeWrite(wr inproc.Write) error {
	w := j.w
	if w.cfg.Concurrent {
		select {
		case <-w.quit:
			return errRunOver
		default:
		}
	} else {
		select {
		case j.arrive <- wr.Pair:
			select {
			case <-j.proceed:
			case <-w.quit:
				return errRunOver
			}
		case <-w.quit:
			return errRunOver
		}
	}
	j.checkWrite(wr)
	return nil
}

// afterWrite checks again once the block is written (concurrent runs):
// the blocks must still be the transfer's, since it has not resolved.
func (j *job) afterWrite(wr inproc.Write) { j.checkWrite(wr) }

// checkWrite checks that pair wr.Pair's blocks are still the ones the
// transfer was attached to, and that the transfer has not resolved.
func (j *job) checkWrite(wr inproc.Write) {
	w := j.w
	if wr.Pair >= len(j.src) || wr.Pair >= len(j.dst) {
		w.addAsync(Violation{Kind: Unexpected, Detail: fmt.Sprintf("request %d copy %d: pair %d of %d", j.r.id, j.idx, wr.Pair, len(j.src))})
		return
	}
	s, d := j.src[wr.Pair], j.dst[wr.Pair]
	if b, err := s.ps.p.Region(s.ref); err != nil {
		w.addAsync(Violation{Kind: LateRead, Detail: fmt.Sprintf("request %d copy %d read block %d (%s slot %v) after it was reclaimed: %v",
			j.r.id, j.idx, wr.Pair, s.ps.name, s.ref, err)})
	} else if &b[0] != &wr.Src[0] {
		w.addAsync(Violation{Kind: LateRead, Detail: fmt.Sprintf("request %d copy %d reads block %d from a region that is not %s slot %v",
			j.r.id, j.idx, wr.Pair, s.ps.name, s.ref)})
	}
	if b, err := d.ps.p.Region(d.ref); err != nil {
		w.addAsync(Violation{Kind: LateWrite, Detail: fmt.Sprintf("request %d copy %d wrote block %d (%s slot %v) after it was reclaimed: %v",
			j.r.id, j.idx, wr.Pair, d.ps.name, d.ref, err)})
	} else if &b[0] != &wr.Dst[0] {
		w.addAsync(Violation{Kind: LateWrite, Detail: fmt.Sprintf("request %d copy %d writes block %d into a region that is not %s slot %v",
			j.r.id, j.idx, wr.Pair, d.ps.name, d.ref)})
	}
	if t := j.outer.Load(); t != nil && t.State() == kvlease.TransferResolved {
		w.addAsync(Violation{Kind: EarlyResolve, Detail: fmt.Sprintf("request %d copy %d wrote block %d after transfer %d resolved (%v)",
			j.r.id, j.idx, wr.Pair, t.ID(), t.Err())})
	}
}

// nextStop waits until j's goroutine is parked before its next write or
// has stopped.
func (w *world) nextStop(j *job) {
	select {
	case i := <-j.arrive:
		j.at = i
		return
	case <-j.exited:
		w.exited(j)
		return
	default:
	}
	t := time.NewTimer(w.cfg.StallTimeout)
	defer t.Stop()
	select {
	case i := <-j.arrive:
		j.at = i
	case <-j.exited:
		w.exited(j)
	case <-t.C:
		w.stall(fmt.Sprintf("request %d copy %d after %d writes", j.r.id, j.idx, j.writes))
	}
}

// exited records that j's goroutine stopped: it resolved its transfer or
// lost the acknowledgement.
func (w *world) exited(j *job) {
	j.ended = true
	j.at = -1
	w.follow(j)
	if j.tp.Stats().Lost > 0 {
		w.rep.LostAcks++
	}
	for i, x := range w.jobs {
		if x == j {
			w.jobs[i] = w.jobs[len(w.jobs)-1]
			w.jobs = w.jobs[:len(w.jobs)-1]
			break
		}
	}
	w.forget(j.r)
}

// follow waits, once j's own transfer has resolved, for the transfer the
// leases wait on to resolve too, when a wrapping transport made its own:
// evidence from below must reach them.
func (w *world) follow(j *job) {
	if j.inner == nil || j.inner.State() != kvlease.TransferResolved {
		return
	}
	if o := j.outer.Load(); o != nil && o != j.inner {
		w.await(o.Done(), fmt.Sprintf("request %d copy %d: the wrapping transport to resolve its transfer", j.r.id, j.idx))
	}
}

// step lets j write its next block and waits for it to park again or
// stop.
func (w *world) step(j *job) {
	j.at = -1
	j.writes++
	j.proceed <- struct{}{}
	w.nextStop(j)
}

// lostAck reports whether j's copy stopped without its acknowledgement,
// still undelivered.
func (j *job) lostAck() bool {
	return j.ended && !j.acked && j.plan.Fate == inproc.FateLoseAck && j.inner != nil &&
		j.inner.State() != kvlease.TransferResolved
}

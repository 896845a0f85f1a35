package ucx

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"

	"go.uber.org/atomic"
)

// Sender is the source side's plane. Pushing (the default), each handoff
// takes the sender's idle endpoint to the destination's worker (or
// connects to it; see Connections in DESIGN.md) and sends each run
// of blocks adjacent in memory, and each other block, as a tagged
// message, then the blocks' sums; pulling (Config.Pull), it starts a UCX
// worker of the handoff's own, registers the regions' pieces (one
// ucp_mem_map per contiguous run of them) and puts the worker's address
// and the packed remote keys in the Start bytes. A cancel, or Finish with
// the destination's error, revokes; Close revokes everything and
// destroys the idle connections. It is safe for concurrent use.
type Sender[R any] struct {
	side[R] // its pool holds idle connections (push)

	mu      sync.Mutex
	jobs    map[handoff.PlaneID]*sendJob[R]
	closed  bool
	closing chan struct{} // closed by Close: ends a pull SendStream's wait
	wg      sync.WaitGroup
}

var _ handoff.SendPlane[[]byte] = (*Sender[[]byte])(nil)

// NewSender initialises UCX (ucp_init; UCX_TLS and the other UCX_*
// environment variables apply) and returns a sender plane for regions of
// type R. pieces appends a region's memory to dst as the Spans of its
// pieces, in the order both sides agree on, and returns it: HostBytes
// for []byte regions, LayeredPieces for blocks of per-layer KV, a
// function of the caller's for anything else (device memory: Spans
// with Memory CUDA; see Device memory in DESIGN.md). Every region of a
// handoff must have the same number of pieces of the same sizes.
func NewSender[R any](cfg Config, pieces func(r R, dst []Span) []Span) (*Sender[R], error) {
	s := &Sender[R]{jobs: make(map[handoff.PlaneID]*sendJob[R]), closing: make(chan struct{})}
	if err := s.init(cfg, pieces, defaultSenderIdle); err != nil {
		return nil, err
	}
	return s, nil
}

// sendJob is one handoff's registration.
type sendJob[R any] struct {
	s     *Sender[R]
	id    handoff.PlaneID
	w     *worker
	memhs []*memh
	pin   runtime.Pinner
	t     *kvlease.Transfer
	once  sync.Once
	table cbuf // the run table, when it does not fit the Start bytes
	// attached is set under Sender.mu once attach succeeded: Close
	// revokes those; Send itself revokes one attached after Close.
	attached bool
	push     *pushSend // the push model's state, or nil
	c        *conn     // the push model's connection (w is its worker)
	// halt is set when the job is revoked: its worker posts no further
	// message, even before the worker is destroyed.
	halt atomic.Bool
	// sent is set (push) once every message and the table were posted
	// and every send completed: the worker's thread is done with the job.
	sent atomic.Bool
	// stall is the transfer's progress timeout (stall.go), made before
	// the transfer and watched once it is attached.
	stall *stallClock
}

// Send implements handoff.SendPlane. Pushing, it takes its idle endpoint
// to the destination's worker named in the Accept bytes (or connects to
// it), attaches the transfer,
// starts sending the blocks and returns the Start bytes (a block's piece
// sizes, the block count, the integrity mode, a random nonce, the
// handoff worker's address, the most blocks of one message, the runs).
// Pulling, it registers the regions' pieces for this handoff alone,
// attaches the transfer and returns the Start bytes: the handoff
// worker's address, a block's piece sizes, per contiguous run of pieces
// its address, its length and its packed remote key, and where the
// pieces lie (the segments). Accept bytes of the
// other model are refused with ErrCorrupt; regions whose pieces disagree
// or overlap with kvlease.ErrInvalidArgument, before anything is sent or
// registered. The transfer resolves on Finish or a cancel, after the
// revocation (see the package doc).
func (s *Sender[R]) Send(id handoff.PlaneID, regions []R, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	if !s.cfg.Pull {
		return s.sendPush(id, regions, accept, attach, nil)
	}
	return s.sendPull(id, regions, accept, attach)
}

// sendPull is Send in the pull model.
func (s *Sender[R]) sendPull(id handoff.PlaneID, regions []R, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	if s.keys.secure(id) {
		return nil, errPullSecure
	}
	blocks, err := parseAccept(accept)
	if err != nil {
		return nil, err
	}
	if blocks != len(regions) {
		return nil, fmt.Errorf("ucx: destination prepared %d blocks, source sends %d: %w", blocks, len(regions), ErrCorrupt)
	}
	j, err := s.enroll(id, nil)
	if err != nil {
		return nil, err
	}
	g, err := locate(s.pieces, regions, &j.pin)
	if err != nil {
		return j.fail(err)
	}
	regs, err := registrations(g.spans)
	if err != nil {
		return j.fail(err)
	}
	if j.w, err = s.ctx.newWorker(); err != nil {
		return j.fail(err)
	}
	var addr []byte
	if cerr := j.w.call(func() { addr, err = j.w.address() }); cerr != nil {
		err = cerr
	}
	if err != nil {
		return j.fail(err)
	}
	start := appendPullStart(nil, g.sizes, len(regions), addr)
	keys := make([][]byte, len(regs))
	for i, r := range regs {
		m, err := s.ctx.memMap(r.addr, r.n, r.mem == CUDA)
		if err != nil {
			return j.fail(err)
		}
		s.stats.add(func(st *Stats) { st.Registrations++; st.RegisteredBytes += int64(r.n) })
		j.memhs = append(j.memhs, m)
		if keys[i], err = s.ctx.rkeyPack(m); err != nil {
			return j.fail(err)
		}
	}
	segs, pieceMajor := segmentsOf(g)
	table := appendTable(nil, regs, keys, segs, pieceMajor)
	if len(start)+1+len(table) <= handoff.MaxPlane {
		start = appendInlineTable(start, table)
	} else {
		// Too many runs for the Start bytes: the destination reads the
		// table itself, from C memory registered with the handoff.
		j.table = newCbuf(len(table))
		copy(j.table.bytes(), table)
		m, err := s.ctx.memMap(j.table.addr(), j.table.n, false)
		if err != nil {
			return j.fail(err)
		}
		j.memhs = append(j.memhs, m)
		key, err := s.ctx.rkeyPack(m)
		if err != nil {
			return j.fail(err)
		}
		start = appendRemoteTable(start, j.table.addr(), j.table.n, key)
		if len(start) > handoff.MaxPlane {
			return j.fail(fmt.Errorf("ucx: start bytes %d exceed %d: %w", len(start), handoff.MaxPlane, kvlease.ErrExceedsCapacity))
		}
	}
	if err := s.attachJob(j, id, attach, false); err != nil {
		return nil, err
	}
	// The destination's gets complete on its side only: the handoff
	// worker's own progress (it serves the software-emulated gets) is the
	// progress the stall clock sees.
	j.w.do(func() {
		j.w.pollers = append(j.w.pollers, func() bool {
			if j.w.moved {
				j.stall.progress()
			}
			return false // until the worker is destroyed (the revocation)
		})
	})
	return start, nil
}

// enroll makes the job of handoff id (push: the push model's state, or
// nil pulling) and enrolls it in s.jobs and s.wg; a closed sender or an
// id already sending is refused.
func (s *Sender[R]) enroll(id handoff.PlaneID, push *pushSend) (*sendJob[R], error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, fmt.Errorf("ucx: send: %w", ErrClosed)
	}
	if _, dup := s.jobs[id]; dup {
		return nil, fmt.Errorf("ucx: send: %v already sending: %w", id, kvlease.ErrInvalidArgument)
	}
	j := &sendJob[R]{s: s, id: id, push: push}
	s.jobs[id] = j
	s.wg.Add(1)
	return j, nil
}

// fail undoes Send for job j, which was never attached: it tears the
// job down, unenrolls it and returns err.
func (j *sendJob[R]) fail(err error) ([]byte, error) {
	j.teardown()
	j.s.unenroll(j.id)
	return nil, err
}

// unenroll undoes enroll for a job that was never attached.
func (s *Sender[R]) unenroll(id handoff.PlaneID) {
	s.mu.Lock()
	delete(s.jobs, id)
	s.mu.Unlock()
	s.wg.Done()
}

// attachJob gives job j (enrolled in s.jobs under id) its transfer and
// attaches it, in both models: a failed attach tears the job down (nothing
// was published or sent yet: the registration or the data never left
// this process, so that is evidence) and unenrolls it; a Close that ran
// meanwhile, and did not see the transfer, revokes it (ErrClosed). keyed
// counts the handoff in Stats.Keyed.
func (s *Sender[R]) attachJob(j *sendJob[R], id handoff.PlaneID, attach func(*kvlease.Transfer) error, keyed bool) error {
	j.stall = newStallClock(s.cfg.StallTimeout)
	t := kvlease.NewTransfer(func() {
		go j.revoke(fmt.Errorf("ucx: source canceled: %w", ErrRevoked))
	})
	s.mu.Lock()
	j.t = t
	s.mu.Unlock()
	if err := attach(j.t); err != nil {
		j.teardown()
		j.t.Resolve(err)
		s.unenroll(id)
		return err
	}
	s.stats.add(func(st *Stats) {
		st.Started++
		if keyed {
			st.Keyed++
		}
	})
	go j.stall.watch(func(idle time.Duration) {
		j.revoke(fmt.Errorf("ucx: source: no progress for %v: %w: %w", idle.Round(time.Millisecond), ErrStalled, ErrRevoked))
	})
	s.mu.Lock()
	j.attached = true
	closed := s.closed
	s.mu.Unlock()
	if closed {
		j.revoke(fmt.Errorf("%w: %w", ErrClosed, ErrRevoked))
		return fmt.Errorf("ucx: send: %w", ErrClosed)
	}
	return nil
}

// teardown revokes everything the job exposed: each registration is
// unmapped (ucp_mem_unmap: a hardware transport's remote key stops
// working) and the handoff's worker is destroyed (ucp_worker_destroy:
// the software-emulated gets of UCX_TLS=tcp are served by this worker's
// progress, which never runs again).
func (j *sendJob[R]) teardown() {
	j.halt.Store(true)
	if j.c != nil {
		j.c.destroy() // a revocation: whatever is still being sent stops
	} else if j.w != nil {
		j.w.destroy(func() {
			if j.push != nil && j.push.ep != nil {
				// A revocation: whatever is still being sent stops.
				_ = j.w.closeEP(j.push.ep, true)
				j.push.ep = nil
			}
			j.w.settle()
		})
	}
	if j.push != nil {
		j.push.free()
	}
	for _, m := range j.memhs {
		_ = j.s.ctx.unmap(m)
	}
	j.memhs = nil
	if j.table.p != nil {
		j.table.free()
		j.table = cbuf{}
	}
	j.pin.Unpin()
}

// revoke tears the job down and resolves its transfer with cause, once.
func (j *sendJob[R]) revoke(cause error) {
	j.once.Do(func() {
		j.stall.stop()
		j.teardown()
		j.s.mu.Lock()
		delete(j.s.jobs, j.id)
		j.s.mu.Unlock()
		j.s.stats.add(func(st *Stats) {
			if cause == nil {
				st.Completed++
			} else {
				st.Revoked++
			}
			if errors.Is(cause, ErrStalled) {
				st.Stalled++
			}
		})
		j.t.Resolve(cause) // after the revocation: evidence
		j.s.wg.Done()
	})
}

// Finish revokes the handoff's worker (and, pulled, its registration).
// With the destination's done (peer nil: sent after its own evidence) the transfer
// resolves nil; otherwise the revocation is the evidence and the outcome
// wraps ErrRevoked.
func (s *Sender[R]) Finish(id handoff.PlaneID, peer error) {
	s.mu.Lock()
	j := s.jobs[id]
	if j != nil && !j.attached {
		j = nil // still in Send: its attach fails, or its cancel revokes
	}
	s.mu.Unlock()
	if j == nil {
		return
	}
	if peer == nil {
		if j.c != nil {
			j.release()
			return
		}
		j.revoke(nil)
		return
	}
	j.revoke(fmt.Errorf("ucx: destination gave no done (%v): %w", peer, ErrRevoked))
}

// Stats returns what the sender did.
func (s *Sender[R]) Stats() Stats { return s.snapshot() }

// Close revokes every handoff still registered (their transfers resolve
// with ErrClosed and ErrRevoked) and releases UCX. Closing again does
// nothing.
func (s *Sender[R]) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil // closed already (UCX is released once)
	}
	close(s.closing)
	s.closed = true
	all := make([]*sendJob[R], 0, len(s.jobs))
	for _, j := range s.jobs {
		if j.attached { // the others are in Send, which sees closed
			all = append(all, j)
		}
	}
	s.mu.Unlock()
	for _, j := range all {
		j.revoke(fmt.Errorf("%w: %w", ErrClosed, ErrRevoked))
	}
	s.wg.Wait()
	s.release()
	return nil
}

package main

// The decode process: a child of the prefill process (rig.ChildMain runs
// serveDecode), holding only its own pool. It serves the control
// connection as a handoff.Destination over the UCX receiver, injects the
// seed's faults on the reader's thread, audits every receive it posts,
// and, when the prefill process asks, checks the markers of every
// delivered lease, releases it and reports.

import (
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/internal/rig"
	"github.com/kvlease/kvlease/ucx"
)

// decode is the decode process: its pool, its plane, the seed's burst,
// and what it saw.
type decode struct {
	cfg    Config
	parent *rig.Parent
	pool   *kvlease.Pool[[]byte]
	base   uintptr // the pool memory's first byte
	recv   *ucx.Receiver[[]byte]
	reqs   map[uint64]rig.Request

	mu         sync.Mutex
	running    int
	transfers  map[uint64]*kvlease.Transfer
	blocks     map[uint64][]kvlease.BlockID
	incs       map[uint64]*handoff.Incoming[[]byte] // accepted or final
	finals     map[uint64]bool
	goCh       map[uint64]chan struct{} // the front end's abort is done
	resume     map[uint64]chan struct{} // a stalled reader may go on
	lateWrites int
}

// plane is the decode side's RecvPlane: the UCX receiver, with the
// seed's faults and the audit around it.
type plane struct{ d *decode }

func (p plane) Prepare(id handoff.PlaneID, blocks int) ([]byte, error) {
	b, err := p.d.recv.Prepare(id, blocks)
	if err == nil {
		p.d.mu.Lock()
		p.d.running++
		p.d.mu.Unlock()
	}
	return b, err
}

func (p plane) Forget(id handoff.PlaneID) { p.d.recv.Forget(id) }

func (p plane) Receive(id handoff.PlaneID, regions [][]byte, start []byte, attach func(*kvlease.Transfer) error) error {
	d := p.d
	ids := make([]kvlease.BlockID, len(regions))
	for i, r := range regions {
		ids[i] = kvlease.BlockID((uintptr(unsafe.Pointer(unsafe.SliceData(r))) - d.base) / uintptr(envelope.BlockBytes))
	}
	d.mu.Lock()
	d.blocks[id.Handoff] = ids
	d.mu.Unlock()
	if d.reqs[id.Handoff].FailAt >= 0 {
		// Corrupted in transit: the plane refuses it before attaching.
		start = append([]byte{'X'}, start[1:]...)
	}
	return d.recv.Receive(id, regions, start, func(t *kvlease.Transfer) error {
		d.mu.Lock()
		d.transfers[id.Handoff] = t
		d.mu.Unlock()
		return attach(t)
	})
}

// beforeGet runs on a handoff's reader thread before each block's
// receive is posted: the audit (a receive posted into a handoff whose
// transfer resolved would let a message write memory that may be back in
// the pool) and the seed's faults.
func (d *decode) beforeGet(id handoff.PlaneID, block int) {
	d.mu.Lock()
	t := d.transfers[id.Handoff]
	if t != nil && t.State() == kvlease.TransferResolved {
		d.lateWrites++
	}
	goCh, resume := d.goCh[id.Handoff], d.resume[id.Handoff]
	d.mu.Unlock()
	r := d.reqs[id.Handoff]
	if block == r.AbortAt {
		d.parent.Say("abort %d", r.ID)
		select {
		case <-goCh:
		case <-time.After(30 * time.Second):
		}
	}
	if block == r.StallAt {
		<-resume // never, unless the reader resumes late
	}
}

// serveDecode is the decode process: it serves the control connection,
// then reports when the prefill process asks.
func serveDecode(p *rig.Parent) (rig.Report, error) {
	ucxEnv()
	cfg := p.Cfg
	mem, err := kvlease.NewHostMemory(rig.DecodeBlocks, envelope.BlockBytes)
	if err != nil {
		return rig.Report{}, err
	}
	pool, err := kvlease.NewPool[[]byte](mem)
	if err != nil {
		return rig.Report{}, err
	}
	d := &decode{cfg: cfg, parent: p, pool: pool, base: uintptr(unsafe.Pointer(unsafe.SliceData(mem.Region(0)))),
		reqs: map[uint64]rig.Request{}, transfers: map[uint64]*kvlease.Transfer{}, blocks: map[uint64][]kvlease.BlockID{},
		incs: map[uint64]*handoff.Incoming[[]byte]{}, finals: map[uint64]bool{}, goCh: map[uint64]chan struct{}{}, resume: map[uint64]chan struct{}{}}
	for _, r := range rig.NetBurst(cfg) {
		id := uint64(r.ID)
		d.reqs[id], d.goCh[id], d.resume[id] = r, make(chan struct{}), make(chan struct{})
	}
	// One block per message (and, pulled, per get), so that a fault
	// lands between two blocks.
	if d.recv, err = ucx.NewReceiver(ucx.Config{MaxGet: envelope.BlockBytes, Window: 4, BeforeGet: d.beforeGet}, ucx.HostBytes); err != nil {
		return rig.Report{}, err
	}
	track := func(in *handoff.Incoming[[]byte], final bool) {
		d.mu.Lock()
		d.incs[in.ID()] = in
		d.finals[in.ID()] = d.finals[in.ID()] || final
		d.mu.Unlock()
	}
	dst, conn, err := rig.Destination(p, pool, plane{d}, rig.DecodeEnvelope(), cfg.Deadline, handoff.DestinationConfig[[]byte]{
		// One prefill process, authenticated: the whole pool is its to
		// fill (the default caps a session at half of it).
		MaxSessionBlocks: -1,
		Decide: func(*handoff.ProposeMsg) error {
			d.mu.Lock()
			defer d.mu.Unlock()
			if d.running >= envelope.MaxRunningRequests {
				return errBusy
			}
			return nil
		},
		OnAccept:    func(in *handoff.Incoming[[]byte]) { track(in, false) },
		OnDelivered: func(*handoff.Incoming[[]byte]) {}, // kept until the report checks its markers
		OnFinal:     func(in *handoff.Incoming[[]byte]) { track(in, true) },
	})
	if err != nil {
		return rig.Report{}, err
	}
	go func() { _ = dst.Serve(conn) }()

	for line := range p.Commands() {
		verb, arg, _ := strings.Cut(line, " ")
		id, _ := strconv.ParseUint(arg, 10, 64)
		switch verb {
		case "go", "resume":
			chans := d.goCh
			if verb == "resume" {
				chans = d.resume
			}
			d.mu.Lock()
			if ch := chans[id]; ch != nil {
				close(ch)
				chans[id] = nil
			}
			d.mu.Unlock()
		case "report":
			return d.report(), nil // a reader that never resumed stays blocked: the process exits
		}
	}
	return rig.Report{}, fmt.Errorf("the prefill process never asked for the report")
}

// report waits until every handoff has its evidence, except those whose
// reader never resumes (their blocks are quarantined), then checks the
// markers of every delivered lease, releases it, and reports every
// request.
func (d *decode) report() rig.Report {
	for limit := time.Now().Add(d.cfg.Deadline + 30*time.Second); time.Now().Before(limit) && !d.settled(); {
		time.Sleep(10 * time.Millisecond)
	}
	var rep rig.Report
	for _, r := range rig.NetBurst(d.cfg) {
		id := uint64(r.ID)
		d.mu.Lock()
		in, final := d.incs[id], d.finals[id]
		v := rig.View{ID: id, Blocks: d.blocks[id], Final: final}
		d.mu.Unlock()
		if in != nil {
			v.State, v.Steps = in.State(), rig.Steps(in.History())
			if l := in.Lease(); l != nil {
				v.Blocks = l.AppendBlockIDs(nil, 0)
			}
			if final && in.State() == handoff.Delivered {
				l := in.Lease()
				for i := range l.Len() {
					if b, err := l.Region(i); err != nil || !rig.MarkerOK(b, r.ID, i) {
						v.Mismatches++
					}
				}
				v.Checked = l.Len()
				l.Release()
			}
		}
		rep.Handoffs = append(rep.Handoffs, v)
		rep.MarkerMismatches += v.Mismatches
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	rep.Decode, rep.LateWrites = d.pool.Stats(), d.lateWrites
	return rep
}

// settled reports whether every attached handoff is final, but for those
// stalled for good, whose transfers must be quarantined (their deadline
// passed), and no block is still draining.
func (d *decode) settled() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for id, t := range d.transfers {
		if d.finals[id] {
			continue
		}
		if r := d.reqs[id]; r.StallAt < 0 || r.LateAck || t.State() != kvlease.TransferQuarantined {
			return false
		}
	}
	return d.pool.Stats().Draining == 0
}

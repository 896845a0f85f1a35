package handoff

import (
	"errors"
	"fmt"

	"github.com/kvlease/kvlease"
)

// The explorer's data planes: nothing moves until the explorer says so.
// Each Send or Receive is an op: it attaches its transfer (at once, or
// as a choice of its own when the config has slow attaches: a Reject or
// an Abort may come first, as it may while a real plane dials), and then
// waits for the explorer to push (the source reads its regions into the
// link), write (the destination writes what was pushed), return, fail,
// stall (return only once asked to stop: a blocked socket write that
// the transfer's cancel unblocks), stall-sync (the same, but the cancel
// hook resolves at once, inside Cancel) or freeze (never return: a
// transport that cannot prove anything). The bytes an op moved and the
// blocks it may touch are what the properties check.

// opState is where an op is.
type opState uint8

const (
	opWaitAttach opState = iota // Send/Receive called, attach not yet taken
	opRefused                   // attach refused: the plane resolved its transfer with the error, touched nothing
	opRunning                   // attached, may touch the regions
	opPushed                    // the source's op read every region into the link
	opStalled                   // returns only once cancelled
	opStallSync                 // returns inside the cancel hook
	opFrozen                    // never returns
	opReturned                  // resolved: will never touch the regions again
)

var opStateNames = [...]string{"wait-attach", "refused", "running", "pushed", "stalled", "stall-sync", "frozen", "returned"}

func (s opState) String() string { return opStateNames[s] }

// errPlane is the outcome of an op that failed; errStopped of one that
// returned because it was cancelled.
var (
	errPlane   = errors.New("explore: plane failed")
	errStopped = errors.New("explore: plane stopped (cancelled)")
)

// xop is one Send or Receive.
type xop struct {
	w        *xworld
	side     int // dirSD: the source's Send; dirDS: the destination's Receive
	id       uint64
	name     string // "src 1", "dst 1"
	token    string // the link it reads or writes
	regions  [][]byte
	refs     []kvlease.BlockRef // the blocks it may touch
	pool     *kvlease.Pool[[]byte]
	ready    *Ready // a streaming send's progress
	gate     chan struct{}
	opened   bool // gate closed
	t        *kvlease.Transfer
	attached bool
	st       opState // guarded by w.mu
	canceled bool    // guarded by w.mu
	moved    bool    // read (source) or wrote (destination) bytes; guarded by w.mu
	outcome  error
}

// cancelHook is the op's transfer's cancel hook: it asks the op to stop.
// A stall-sync op returns here, inside Cancel.
func (op *xop) cancelHook() {
	w := op.w
	w.mu.Lock()
	op.canceled = true
	sync := op.st == opStallSync
	w.mu.Unlock()
	if sync {
		op.finish(errStopped)
	}
}

// finish resolves the op's transfer with err: the plane's evidence.
func (op *xop) finish(err error) {
	w := op.w
	w.mu.Lock()
	op.st = opReturned
	op.outcome = err
	w.mu.Unlock()
	op.t.Resolve(err)
}

// start runs a Send or Receive: wait for the attach choice (slow
// attaches), create and attach the transfer.
func (op *xop) start(attach func(*kvlease.Transfer) error) error {
	w := op.w
	if w.cfg.slowAttach {
		<-op.gate
	}
	t := kvlease.NewTransfer(op.cancelHook)
	op.t = t
	if err := attach(t); err != nil {
		w.mu.Lock()
		op.st = opRefused
		op.outcome = err
		w.mu.Unlock()
		t.Resolve(err)
		return err
	}
	w.mu.Lock()
	op.attached = true
	if op.st == opWaitAttach {
		op.st = opRunning
	}
	w.mu.Unlock()
	return nil
}

// xsend is the source's plane; xstreamSend also streams.
type xsend struct{ w *xworld }

type xstreamSend struct{ xsend }

func (p xsend) Send(id PlaneID, regions [][]byte, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	return p.send(id, regions, nil, accept, attach)
}

func (p xstreamSend) SendStream(id PlaneID, regions [][]byte, ready Ready, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	return p.send(id, regions, &ready, accept, attach)
}

func (p xsend) send(id PlaneID, regions [][]byte, ready *Ready, accept []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	w := p.w
	h := w.byID(id.Handoff)
	if h == nil || h.out == nil {
		w.violation(fmt.Errorf("Send for handoff %d, which the source never proposed", id.Handoff))
		return nil, errPlane
	}
	o := h.out
	var refs []kvlease.BlockRef
	for i := o.from; i < o.n; i++ {
		refs = append(refs, o.src.Ref(i))
	}
	op := w.newOp(dirSD, id.Handoff, string(accept), regions, refs, w.srcPool)
	op.ready = ready
	if err := op.start(attach); err != nil {
		return nil, err
	}
	return []byte(op.token), nil
}

func (p xsend) Finish(id PlaneID, peer error) {
	w := p.w
	w.mu.Lock()
	defer w.mu.Unlock()
	if h := w.byIDLocked(id.Handoff); h != nil {
		h.finished++
	}
}

// xrecv is the destination's plane.
type xrecv struct{ w *xworld }

func (p xrecv) Prepare(id PlaneID, blocks int) ([]byte, error) {
	return fmt.Appendf(nil, "link %d", id.Handoff), nil
}

func (p xrecv) Receive(id PlaneID, regions [][]byte, start []byte, attach func(*kvlease.Transfer) error) error {
	w := p.w
	h := w.byID(id.Handoff)
	if h == nil || h.in == nil {
		w.violation(fmt.Errorf("Receive for handoff %d, which the destination never accepted", id.Handoff))
		return errPlane
	}
	in := h.in
	l := in.Lease()
	var refs []kvlease.BlockRef
	for i := in.from; i < in.n; i++ {
		refs = append(refs, l.Ref(i))
	}
	op := w.newOp(dirDS, id.Handoff, string(start), regions, refs, w.dstPool)
	return op.start(attach)
}

func (p xrecv) Forget(id PlaneID) {
	w := p.w
	w.mu.Lock()
	defer w.mu.Unlock()
	if h := w.byIDLocked(id.Handoff); h != nil {
		h.forgotten++
	}
}

// newOp registers an op; its regions must be the pool's regions of its
// refs (a plane given the wrong memory is a violation).
func (w *xworld) newOp(side int, id uint64, token string, regions [][]byte, refs []kvlease.BlockRef, pool *kvlease.Pool[[]byte]) *xop {
	name := fmt.Sprintf("%s %d", [2]string{"src", "dst"}[side], id)
	op := &xop{w: w, side: side, id: id, name: name, token: token, regions: regions, refs: refs, pool: pool, gate: make(chan struct{})}
	if len(regions) != len(refs) {
		w.violation(fmt.Errorf("%s: given %d regions for %d blocks", name, len(regions), len(refs)))
	}
	for i := range min(len(regions), len(refs)) {
		if r := pool.Memory().Region(refs[i].ID); len(regions[i]) == 0 || &regions[i][0] != &r[0] {
			w.violation(fmt.Errorf("%s: region %d is not block %v's memory", name, i, refs[i]))
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, o := range w.ops {
		if o.name == op.name {
			op.name = fmt.Sprintf("%s.%d", name, len(w.ops)+1)
		}
	}
	w.ops = append(w.ops, op)
	return op
}

// push reads the source regions into the link: what a push plane sends.
func (op *xop) push() {
	w := op.w
	data := make([][]byte, len(op.regions))
	for i, r := range op.regions {
		data[i] = append([]byte(nil), r...)
	}
	w.mu.Lock()
	w.links[op.token] = data
	op.moved = true
	op.st = opPushed
	w.mu.Unlock()
}

// write writes what the link holds into the destination regions and
// resolves: every block arrived.
func (op *xop) write() {
	w := op.w
	w.mu.Lock()
	data := w.links[op.token]
	op.moved = true
	w.mu.Unlock()
	for i := range min(len(data), len(op.regions)) {
		copy(op.regions[i], data[i])
	}
	op.finish(nil)
}

// tear fails a destination op after it wrote half of its first block (a
// connection that died mid-stream), or a source op as it is.
func (op *xop) tear() {
	if op.side == dirDS && len(op.regions) > 0 {
		r := op.regions[0]
		for i := range r[:len(r)/2] {
			r[i] = 0xEE
		}
		op.w.mu.Lock()
		op.moved = true
		op.w.mu.Unlock()
	}
	op.finish(errPlane)
}

// open lets a slow attach proceed (once).
func (op *xop) open() {
	op.w.mu.Lock()
	opened := op.opened
	op.opened = true
	op.w.mu.Unlock()
	if !opened {
		close(op.gate)
	}
}

package gpu

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/kvlease/kvlease"
)

// CopyEngine copies blocks asynchronously on one stream of its device and
// turns completion into evidence: each Start returns a *kvlease.Transfer
// that resolves only once the device has finished every copy of it.
//
// How a copy runs:
//  1. Start validates every pair (both blocks in live arenas of this
//     device, equal block sizes, no block written twice, no block both read
//     and written) and counts the copy as pending on every arena it touches,
//     so those arenas refuse to Close.
//  2. It creates the transfer and calls attach with it. If attach fails,
//     nothing is enqueued and the transfer is resolved with attach's error.
//  3. It enqueues the copies on the stream: one cuMemcpyBatchAsync when the
//     driver has it, otherwise one cuMemcpy*Async per run of adjacent blocks
//     (adjacent pairs are merged on both paths), then records an event.
//  4. A completion goroutine per engine waits for the events in stream order
//     (cuEventSynchronize on a blocking-sync event: the thread sleeps, it
//     does not spin) and resolves each transfer; the fallback's worker
//     closes a channel instead.
//
// If the driver reports a failure while waiting (a sticky error, a lost
// context), nobody can prove the copy stopped: the transfer is quarantined,
// not resolved, its arenas stay pinned, and the engine refuses further work
// (errors wrap the failure; errors.Is(err, ErrDeviceFailed) for sticky
// ones).
//
// The typed transports DeviceToHost, HostToDevice and DeviceToDevice
// implement kvlease.Transport; they share the engine's stream, so copies of
// different directions started on one engine complete in start order.
// Use several engines for concurrent streams.
//
// A CopyEngine is safe for concurrent use.
type CopyEngine struct {
	dev     *Device
	s       stream
	wake    chan struct{} // capacity 1: the completion goroutine's doorbell
	stopped chan struct{} // closed when the completion goroutine exits

	// subMu serializes submissions, so that the queue's order is the
	// stream's. It is held across the driver call; mu is not, so a long
	// enqueue delays other submissions only, never resolution, Pending or
	// Err. Lock order: subMu, then mu.
	subMu sync.Mutex

	mu          sync.Mutex
	queue       []*copyJob // submitted and not yet waited for, in stream order
	pending     int        // transfers started and not yet resolved (quarantined included)
	quarantined int
	failed      error // first unprovable completion; the engine refuses work after it
	closed      bool
}

// copyJob is one Start's transfer and what it pins.
type copyJob struct {
	t        *kvlease.Transfer
	dir      string
	pairs    int
	arenas   []*arena // distinct arenas touched, each counted pending once
	arenaBuf [4]*arena
	canceled atomic.Bool
	f        fence
	outcome  error // enqueue error to report once the fence completes
}

// NewCopyEngine creates a copy engine with its own stream (a non-blocking
// CUDA stream, or a worker goroutine on the fallback). Close it before the
// device.
func (d *Device) NewCopyEngine() (*CopyEngine, error) {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil, fmt.Errorf("gpu: %s: %w", d.name, ErrClosed)
	}
	d.engines++
	d.mu.Unlock()
	s, err := d.b.newStream()
	if err != nil {
		d.mu.Lock()
		d.engines--
		d.mu.Unlock()
		return nil, err
	}
	e := &CopyEngine{dev: d, s: s, wake: make(chan struct{}, 1), stopped: make(chan struct{})}
	go e.complete()
	return e, nil
}

// DeviceToHost copies device blocks to pinned host blocks (an offload).
// Make it with CopyEngine.DeviceToHost.
type DeviceToHost struct{ e *CopyEngine }

// HostToDevice copies pinned host blocks to device blocks (an onload).
// Make it with CopyEngine.HostToDevice.
type HostToDevice struct{ e *CopyEngine }

// DeviceToDevice copies device blocks to other device blocks of the same
// device. Make it with CopyEngine.DeviceToDevice.
type DeviceToDevice struct{ e *CopyEngine }

var (
	_ kvlease.Transport[DevicePtr, []byte]    = DeviceToHost{}
	_ kvlease.Transport[[]byte, DevicePtr]    = HostToDevice{}
	_ kvlease.Transport[DevicePtr, DevicePtr] = DeviceToDevice{}
)

// DeviceToHost returns the engine's offload transport.
func (e *CopyEngine) DeviceToHost() DeviceToHost { return DeviceToHost{e} }

// HostToDevice returns the engine's onload transport.
func (e *CopyEngine) HostToDevice() HostToDevice { return HostToDevice{e} }

// DeviceToDevice returns the engine's on-device transport.
func (e *CopyEngine) DeviceToDevice() DeviceToDevice { return DeviceToDevice{e} }

// Start copies each pair's device block (a block start in a DeviceArena)
// to its pinned host block (a whole region of a PinnedArena). See
// CopyEngine for the sequence and kvlease.Transport for the contract.
//
// Errors: invalid input (no pairs, nil attach, a region outside this
// device's live arenas, mismatched block sizes, a block written twice)
// returns a nil transfer and an error wrapping kvlease.ErrInvalidArgument;
// nothing was attached or enqueued. A closed or failed engine returns
// ErrClosed or the failure, also before attach. If attach fails, Start
// returns the transfer, resolved with attach's error, and that error. If
// the transfer was canceled before its copies were enqueued, or nothing
// could be enqueued, Start returns it already resolved, with the outcome
// as error. Otherwise it returns the pending transfer and nil.
func (t DeviceToHost) Start(pairs []kvlease.CopyPair[DevicePtr, []byte], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	return startCopy(t.e, deviceToHost, pairs, attach, (*Device).deviceBlock, (*Device).pinnedBlock)
}

// Start copies each pair's pinned host block to its device block, as
// DeviceToHost.Start does in the other direction.
func (t HostToDevice) Start(pairs []kvlease.CopyPair[[]byte, DevicePtr], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	return startCopy(t.e, hostToDevice, pairs, attach, (*Device).pinnedBlock, (*Device).deviceBlock)
}

// Start copies each pair's device block to another device block, as
// DeviceToHost.Start does. A block may be read by several pairs but not
// both read and written by one Start: copies within a batch run in no
// particular order.
func (t DeviceToDevice) Start(pairs []kvlease.CopyPair[DevicePtr, DevicePtr], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	return startCopy(t.e, deviceToDevice, pairs, attach, (*Device).deviceBlock, (*Device).deviceBlock)
}

// errAttachPanicked resolves the transfer of an attach that panicked:
// nothing was enqueued.
var errAttachPanicked = errors.New("gpu: attach panicked; nothing was enqueued")

// dirNames names each direction in errors.
var dirNames = [...]string{
	hostToDevice:   "host-to-device copy",
	deviceToHost:   "device-to-host copy",
	deviceToDevice: "device-to-device copy",
}

func startCopy[S, D any](e *CopyEngine, kind copyKind, pairs []kvlease.CopyPair[S, D], attach func(*kvlease.Transfer) error,
	srcOf func(*Device, S) (span, error), dstOf func(*Device, D) (span, error)) (*kvlease.Transfer, error) {
	dir := dirNames[kind]
	switch {
	case e == nil:
		return nil, fmt.Errorf("gpu: %s: zero transport; make it with a CopyEngine: %w", dir, kvlease.ErrInvalidArgument)
	case attach == nil:
		return nil, fmt.Errorf("gpu: %s: nil attach: a copy no lease knows about could land in reused memory: %w", dir, kvlease.ErrInvalidArgument)
	case len(pairs) == 0:
		return nil, fmt.Errorf("gpu: %s: no pairs: %w", dir, kvlease.ErrInvalidArgument)
	}
	if err := e.reserve(dir); err != nil {
		return nil, err
	}
	j := &copyJob{dir: dir, pairs: len(pairs)}
	ops, err := resolvePairs(e.dev, j, pairs, srcOf, dstOf, kind == deviceToDevice)
	if err != nil {
		e.unreserve()
		return nil, err
	}
	j.t = kvlease.NewTransfer(j.cancel)
	if err := e.runAttach(j, attach); err != nil {
		return j.t, err
	}
	return e.submit(j, ops, kind)
}

// cancel is the transfer's cancel hook. It only raises a flag: copies not
// yet enqueued are dropped, and the fallback skips copies not yet begun;
// a CUDA stream cannot recall enqueued copies, so those finish and the
// transfer resolves when they have.
func (j *copyJob) cancel() { j.canceled.Store(true) }

// reserve counts a Start in progress, so Close refuses until it settles.
func (e *CopyEngine) reserve(dir string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case e.closed:
		return fmt.Errorf("gpu: %s: copy engine of %s: %w", dir, e.dev.name, ErrClosed)
	case e.failed != nil:
		return fmt.Errorf("gpu: %s refused: %w", dir, e.failed)
	}
	e.pending++
	return nil
}

func (e *CopyEngine) unreserve() {
	e.mu.Lock()
	e.pending--
	e.mu.Unlock()
}

// keyScratch recycles the key slices resolvePairs sorts.
var keyScratch = sync.Pool{New: func() any { return new([]uint64) }}

// resolvePairs validates pairs and, if all are good, counts the copy as
// pending on every arena it touches (j.arenas). The lookups (in the
// device's published arena lists) and the checks run without the device
// lock; it is taken once at the end, to pin the arenas, after checking
// that none closed meanwhile.
func resolvePairs[S, D any](d *Device, j *copyJob, pairs []kvlease.CopyPair[S, D],
	srcOf func(*Device, S) (span, error), dstOf func(*Device, D) (span, error), sameSpace bool) ([]copyOp, error) {
	dir := j.dir
	ops := make([]copyOp, 0, len(pairs))
	arenas := j.arenaBuf[:0]
	dk := keyScratch.Get().(*[]uint64)
	defer keyScratch.Put(dk)
	dstKeys := (*dk)[:0]
	var srcKeys []uint64
	if sameSpace {
		sk := keyScratch.Get().(*[]uint64)
		defer keyScratch.Put(sk)
		srcKeys = (*sk)[:0]
		defer func() { *sk = srcKeys[:0] }()
	}
	defer func() { *dk = dstKeys[:0] }()

	for i, p := range pairs {
		src, err := srcOf(d, p.Src)
		if err != nil {
			return nil, fmt.Errorf("gpu: %s, pair %d, src: %w", dir, i, err)
		}
		dst, err := dstOf(d, p.Dst)
		if err != nil {
			return nil, fmt.Errorf("gpu: %s, pair %d, dst: %w", dir, i, err)
		}
		n := src.a.blockBytes
		if dst.a.blockBytes != n {
			return nil, fmt.Errorf("gpu: %s, pair %d: src block is %d bytes, dst block %d: %w", dir, i, n, dst.a.blockBytes, kvlease.ErrInvalidArgument)
		}
		dstKeys = append(dstKeys, dst.key())
		if sameSpace {
			srcKeys = append(srcKeys, src.key())
		}
		if k := len(ops) - 1; k >= 0 && ops[k].src == src.a && ops[k].dst == dst.a &&
			ops[k].srcOff+ops[k].n == src.off && ops[k].dstOff+ops[k].n == dst.off {
			ops[k].n += n // adjacent on both sides: one longer copy
		} else {
			ops = append(ops, copyOp{dst: dst.a, src: src.a, dstOff: dst.off, srcOff: src.off, n: n})
		}
		if !slices.Contains(arenas, src.a) {
			arenas = append(arenas, src.a)
		}
		if !slices.Contains(arenas, dst.a) {
			arenas = append(arenas, dst.a)
		}
	}
	slices.Sort(dstKeys)
	for i := 1; i < len(dstKeys); i++ {
		if dstKeys[i] == dstKeys[i-1] {
			return nil, fmt.Errorf("gpu: %s: two pairs write block 0x%x: %w", dir, dstKeys[i], kvlease.ErrInvalidArgument)
		}
	}
	if sameSpace {
		slices.Sort(srcKeys)
		for i, k := 0, 0; i < len(srcKeys) && k < len(dstKeys); {
			switch {
			case srcKeys[i] == dstKeys[k]:
				return nil, fmt.Errorf("gpu: %s: block 0x%x is both read and written: %w", dir, dstKeys[k], kvlease.ErrInvalidArgument)
			case srcKeys[i] < dstKeys[k]:
				i++
			default:
				k++
			}
		}
	}

	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("gpu: %s: %s: %w", dir, d.name, ErrClosed)
	}
	for _, a := range arenas {
		if a.closed {
			return nil, fmt.Errorf("gpu: %s: the %s at 0x%x closed during Start: %w", dir, a.kind, a.addr, kvlease.ErrInvalidArgument)
		}
	}
	for _, a := range arenas {
		a.pending++
	}
	j.arenas = arenas
	return ops, nil
}

// runAttach calls attach before anything is enqueued. On failure (or a
// panic, which propagates) the job settles at once: nothing touched the
// memory, which is evidence.
func (e *CopyEngine) runAttach(j *copyJob, attach func(*kvlease.Transfer) error) error {
	returned := false
	defer func() {
		if !returned {
			e.settle(j, errAttachPanicked)
		}
	}()
	err := attach(j.t)
	returned = true
	if err != nil {
		e.settle(j, err)
	}
	return err
}

// submit enqueues j's copies and hands the job to the completion
// goroutine. Submission and queueing happen under e.subMu, so the queue's
// order is the stream's; e.mu is taken only around the checks and the
// append, never across the driver call.
func (e *CopyEngine) submit(j *copyJob, ops []copyOp, kind copyKind) (*kvlease.Transfer, error) {
	var (
		f                fence
		outcome, failure error
	)
	e.subMu.Lock()
	e.mu.Lock()
	failed := e.failed
	e.mu.Unlock()
	switch {
	case failed != nil:
		outcome = fmt.Errorf("gpu: %s not enqueued: %w", j.dir, failed)
	case j.canceled.Load():
		outcome = fmt.Errorf("gpu: %s canceled before it was enqueued: %w", j.dir, ErrCanceled)
	default:
		f, outcome, failure = e.s.submit(ops, kind, &j.canceled)
	}
	if f != nil {
		j.f, j.outcome = f, outcome
		e.mu.Lock()
		e.queue = append(e.queue, j)
		e.mu.Unlock()
		e.subMu.Unlock()
		e.ring()
		return j.t, nil
	}
	e.subMu.Unlock()
	if failure != nil {
		err := e.quarantine(j, failure)
		return j.t, err
	}
	if outcome == nil { // cannot happen: a stream with no fence has a reason
		outcome = fmt.Errorf("gpu: %s: nothing enqueued", j.dir)
	}
	e.settle(j, outcome)
	return j.t, outcome
}

func (e *CopyEngine) ring() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// complete is the completion goroutine: it waits for each job's fence in
// stream order and resolves (or quarantines) its transfer.
func (e *CopyEngine) complete() {
	defer close(e.stopped)
	for {
		j := e.next()
		if j == nil {
			return
		}
		outcome, failure := e.s.wait(j.f)
		if failure != nil {
			_ = e.quarantine(j, failure)
			continue
		}
		e.s.recycle(j.f)
		e.settle(j, errors.Join(j.outcome, outcome))
	}
}

// next returns the oldest submitted job, blocking until there is one; nil
// once the engine is closed (Close waits until nothing is pending).
func (e *CopyEngine) next() *copyJob {
	for {
		e.mu.Lock()
		if len(e.queue) > 0 {
			j := e.queue[0]
			e.queue[0] = nil
			e.queue = e.queue[1:]
			e.mu.Unlock()
			return j
		}
		closed := e.closed
		e.mu.Unlock()
		if closed {
			return nil
		}
		<-e.wake
	}
}

// settle releases j's pins and resolves its transfer with outcome. The
// pins go first, so that anyone who saw the transfer resolve can Close the
// arenas and the engine.
func (e *CopyEngine) settle(j *copyJob, outcome error) {
	d := e.dev
	d.mu.Lock()
	for _, a := range j.arenas {
		a.pending--
	}
	d.mu.Unlock()
	e.mu.Lock()
	e.pending--
	e.mu.Unlock()
	j.t.Resolve(outcome)
}

// quarantine records that j's completion can never be proven: its pins
// stay for the life of the process, the engine refuses further work, and
// the transfer is quarantined (its blocks are never reused).
func (e *CopyEngine) quarantine(j *copyJob, failure error) error {
	err := fmt.Errorf("gpu: %s of %d blocks on %s cannot be proven finished: %w", j.dir, j.pairs, e.dev.name, failure)
	e.mu.Lock()
	if e.failed == nil {
		e.failed = err
	}
	e.quarantined++
	e.mu.Unlock()
	d := e.dev
	d.mu.Lock()
	for _, a := range j.arenas {
		a.quarantined++
	}
	d.mu.Unlock()
	j.t.Quarantine(err)
	return err
}

// Pending returns the number of transfers started on e and not yet
// resolved, quarantined ones included.
func (e *CopyEngine) Pending() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.pending
}

// Err returns the failure that stopped the engine, or nil while it works.
func (e *CopyEngine) Err() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.failed
}

// Close destroys the engine's stream. It refuses with an error wrapping
// ErrBusy while transfers are pending; an engine with quarantined
// transfers can never be closed (its stream may still be copying). A
// second Close returns nil.
func (e *CopyEngine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	if e.pending > 0 {
		msg := fmt.Sprintf("%d transfers in flight", e.pending)
		if e.quarantined > 0 {
			msg += fmt.Sprintf(", %d of them quarantined (never provably finished)", e.quarantined)
		}
		e.mu.Unlock()
		return fmt.Errorf("gpu: closing copy engine of %s: %s: %w", e.dev.name, msg, ErrBusy)
	}
	e.closed = true
	e.mu.Unlock()
	e.ring()
	<-e.stopped
	err := e.s.destroy()
	e.dev.mu.Lock()
	e.dev.engines--
	e.dev.mu.Unlock()
	return err
}

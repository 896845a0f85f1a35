package gpu

import (
	"errors"
	"fmt"
	"sync"

	"github.com/kvlease/kvlease"
)

// CopyEngine copies blocks asynchronously on one stream of its device and
// turns completion into evidence: each Start returns a *kvlease.Transfer
// that resolves only once the device has finished every copy of it.
//
// How a copy runs:
//  1. Start validates every pair (both blocks in live arenas of this
//     device, equal block sizes, no block written twice, no block both read
//     and written), merges pairs adjacent on both sides into one copy, and
//     counts the copy as pending on every arena it touches, so those arenas
//     refuse to Close.
//  2. It picks the path (see Path): the copy kernel or the copy engine.
//  3. It creates the transfer and calls attach with it. If attach fails,
//     nothing is enqueued and the transfer is resolved with attach's error.
//  4. It enqueues the copies on the stream: for the kernel, it writes the
//     launch's descriptor table into the engine's ring of mapped pinned
//     memory and launches; for the copy engine, one cuMemcpyBatchAsync when
//     the driver has it, otherwise one cuMemcpy*Async per copy. Then it
//     records an event.
//  5. A completion goroutine per engine waits for the events in stream order
//     (cuEventSynchronize on a blocking-sync event: the thread sleeps, it
//     does not spin), releases the submission's ring slot and resolves its
//     transfer; the fallback's worker signals instead.
//
// Both paths end in the same event; nothing else resolves a transfer.
// If the driver reports a failure while waiting (a sticky error, a lost
// context), nobody can prove the copy stopped: the transfer is quarantined,
// not resolved, its arenas stay pinned, its ring slot is never reused, and
// the engine refuses further work (errors wrap the failure;
// errors.Is(err, ErrDeviceFailed) for sticky ones).
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
	cfg     engineConfig
	ctr     *counters     // the device's, or a private one (uncounted)
	wake    chan struct{} // capacity 1: the completion goroutine's doorbell
	stopped chan struct{} // closed when the completion goroutine exits

	// subMu serializes submissions, so that the queue's order (and the
	// ring's) is the stream's. It is held across the driver call; mu is
	// not, so a long enqueue delays other submissions only, never
	// resolution, Pending or Err. Lock order: subMu, then mu.
	subMu   sync.Mutex
	ring    descRing // allocated at the first launch (ring.go)
	ringErr error    // why the ring could not be allocated, if it could not

	mu          sync.Mutex
	queue       []*copyJob // submitted and not yet waited for, in stream order, from qhead on
	qhead       int
	pending     int // transfers started and not yet resolved (quarantined included)
	quarantined int
	failed      error // first unprovable completion; the engine refuses work after it
	closed      bool
	free        []*copyJob // settled jobs, reused by later Starts
}

// maxFreeJobs bounds the jobs an engine keeps for reuse.
const maxFreeJobs = 8

// NewCopyEngine creates a copy engine with its own stream (a non-blocking
// CUDA stream, or a worker goroutine on the fallback). Close it before the
// device.
func (d *Device) NewCopyEngine(opts ...EngineOption) (*CopyEngine, error) {
	cfg := defaultEngineConfig()
	for _, o := range opts {
		o(&cfg)
	}
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
	e := &CopyEngine{dev: d, s: s, cfg: cfg, ctr: d.b.counters(), wake: make(chan struct{}, 1), stopped: make(chan struct{})}
	if cfg.uncounted {
		e.ctr = new(counters)
	}
	go e.complete()
	return e, nil
}

// Path returns the path the engine was made with (PathAuto by default).
func (e *CopyEngine) Path() Path { return e.cfg.path }

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
	return startCopy(t.e, deviceToHost, pairs, attach, deviceResolver, (*resolver).device, pinnedResolver, (*resolver).pinned)
}

// Start copies each pair's pinned host block to its device block, as
// DeviceToHost.Start does in the other direction.
func (t HostToDevice) Start(pairs []kvlease.CopyPair[[]byte, DevicePtr], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	return startCopy(t.e, hostToDevice, pairs, attach, pinnedResolver, (*resolver).pinned, deviceResolver, (*resolver).device)
}

// Start copies each pair's device block to another device block, as
// DeviceToHost.Start does. A block may be read by several pairs but not
// both read and written by one Start: copies within a submission run in
// no particular order.
func (t DeviceToDevice) Start(pairs []kvlease.CopyPair[DevicePtr, DevicePtr], attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	return startCopy(t.e, deviceToDevice, pairs, attach, deviceResolver, (*resolver).device, deviceResolver, (*resolver).device)
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

// startCopy is every flat transport's Start: resolve the pairs into the
// job's ops, then run it.
func startCopy[S, D any](e *CopyEngine, kind copyKind, pairs []kvlease.CopyPair[S, D], attach func(*kvlease.Transfer) error,
	srcList func(*Device) resolver, srcOf func(*resolver, S) (span, error),
	dstList func(*Device) resolver, dstOf func(*resolver, D) (span, error)) (*kvlease.Transfer, error) {
	dir := dirNames[kind]
	switch {
	case e == nil:
		return nil, fmt.Errorf("gpu: %s: zero transport; make it with a CopyEngine: %w", dir, kvlease.ErrInvalidArgument)
	case attach == nil:
		return nil, fmt.Errorf("gpu: %s: nil attach: a copy no lease knows about could land in reused memory: %w", dir, kvlease.ErrInvalidArgument)
	case len(pairs) == 0:
		return nil, fmt.Errorf("gpu: %s: no pairs: %w", dir, kvlease.ErrInvalidArgument)
	}
	j, err := e.reserve(kind, len(pairs))
	if err != nil {
		return nil, err
	}
	d := e.dev
	j.srcs, j.dsts = srcList(d), dstList(d)
	srcs, dsts := &j.srcs, &j.dsts
	for i := range pairs {
		src, err := srcOf(srcs, pairs[i].Src)
		if err != nil {
			e.unreserve(j)
			return nil, fmt.Errorf("gpu: %s, pair %d, src: %w", dir, i, err)
		}
		dst, err := dstOf(dsts, pairs[i].Dst)
		if err != nil {
			e.unreserve(j)
			return nil, fmt.Errorf("gpu: %s, pair %d, dst: %w", dir, i, err)
		}
		if err := j.add(src, dst); err != nil {
			e.unreserve(j)
			return nil, fmt.Errorf("gpu: %s, pair %d: %w", dir, i, err)
		}
	}
	return e.run(j, attach)
}

// run pins j's arenas, picks its path, creates and attaches its transfer
// and submits it: the part of a Start after its ops are built.
func (e *CopyEngine) run(j *copyJob, attach func(*kvlease.Transfer) error) (*kvlease.Transfer, error) {
	if err := j.pin(e.dev); err != nil {
		e.unreserve(j)
		return nil, err
	}
	e.plan(j)
	// The job is reused once it settles, which may happen before Start
	// returns: everything below returns t, never j.t.
	t := kvlease.NewTransfer(nil) // cancellation is polled (CancelRequested): no hook to allocate
	j.t = t
	j.sub = submission{ops: j.ops, kind: j.kind, t: t, ctr: e.ctr}
	if err := e.runAttach(j, attach); err != nil {
		return t, err
	}
	return t, e.submit(j)
}

// reserve counts a Start in progress, so Close refuses until it settles,
// and hands it a job (a reused one when there is one).
func (e *CopyEngine) reserve(kind copyKind, pairs int) (*copyJob, error) {
	e.mu.Lock()
	switch {
	case e.closed:
		e.mu.Unlock()
		return nil, fmt.Errorf("gpu: %s: copy engine of %s: %w", dirNames[kind], e.dev.name, ErrClosed)
	case e.failed != nil:
		err := fmt.Errorf("gpu: %s refused: %w", dirNames[kind], e.failed)
		e.mu.Unlock()
		return nil, err
	}
	e.pending++
	var j *copyJob
	if n := len(e.free); n > 0 {
		j = e.free[n-1]
		e.free[n-1] = nil
		e.free = e.free[:n-1]
	}
	e.mu.Unlock()
	if j == nil {
		j = &copyJob{}
	}
	j.reset(kind, pairs)
	return j, nil
}

// unreserve undoes reserve for a Start refused before it pinned anything.
func (e *CopyEngine) unreserve(j *copyJob) {
	e.mu.Lock()
	e.pending--
	e.recycleLocked(j)
	e.mu.Unlock()
}

func (e *CopyEngine) recycleLocked(j *copyJob) {
	j.t, j.f, j.outcome, j.sub = nil, nil, nil, submission{}
	j.srcs, j.dsts = resolver{}, resolver{}
	clear(j.arenaBuf[:])
	j.arenas = nil
	if len(e.free) < maxFreeJobs {
		e.free = append(e.free, j)
	}
}

// plan picks j's path: the kernel or the copy engine (see Path).
func (e *CopyEngine) plan(j *copyJob) {
	j.kernel = false
	switch e.cfg.path {
	case PathCopyEngine:
		return
	case PathAuto:
		if len(j.ops) < 2 {
			return // one contiguous copy: one DMA at the link's speed, no SM
		}
	}
	for _, a := range j.arenas {
		if a.dptr == 0 {
			return // pinned memory the device cannot map: the copy engine only
		}
	}
	if e.dev.b.loadKernel() != nil {
		return
	}
	if e.cfg.path == PathAuto && !e.dev.useKernel(j.kind, j.bytes/len(j.ops)) {
		return
	}
	j.kernel = true
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
// goroutine; the error is Start's. Submission and queueing happen under
// e.subMu, so the queue's order (and the ring's) is the stream's; e.mu is
// taken only around the checks and the append, never across the driver
// call.
func (e *CopyEngine) submit(j *copyJob) error {
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
		outcome = fmt.Errorf("gpu: %s not enqueued: %w", dirNames[j.kind], failed)
	case j.t.CancelRequested():
		outcome = fmt.Errorf("gpu: %s canceled before it was enqueued: %w", dirNames[j.kind], kvlease.ErrCanceled)
	default:
		if j.kernel {
			e.writeTable(j)
		}
		f, outcome, failure = e.s.submit(&j.sub)
	}
	if f != nil {
		j.f, j.outcome = f, outcome
		e.mu.Lock()
		e.queue = append(e.queue, j)
		e.mu.Unlock()
		e.subMu.Unlock()
		e.doorbell()
		return nil
	}
	if failure == nil && j.ringEnd != 0 {
		// Nothing in flight: the table's slot is free at once.
		e.ring.unreserve()
		j.ringEnd = 0
	}
	e.subMu.Unlock()
	if failure != nil {
		return e.quarantine(j, failure)
	}
	if outcome == nil { // cannot happen: a stream with no fence has a reason
		outcome = fmt.Errorf("gpu: %s: nothing enqueued", dirNames[j.kind])
	}
	e.settle(j, outcome)
	return outcome
}

// writeTable reserves j's descriptor table in the ring and fills it; if
// the ring cannot take it (full, or not allocatable), j goes to the copy
// engine instead. Called under subMu.
func (e *CopyEngine) writeTable(j *copyJob) {
	if e.ring.mem == nil && e.ringErr == nil {
		host, dptr, err := e.dev.b.allocPinned(e.cfg.ringDescs * descBytes)
		switch {
		case err != nil:
			e.ringErr = err
		case dptr == 0:
			_ = e.dev.b.freePinned(host)
			e.ringErr = errors.New("gpu: the device cannot map pinned memory")
		default:
			e.ring.init(host, dptr)
		}
	}
	ncta, nwarp, warpBytes := kernelItems(j.ops)
	var (
		slot      []kernelDesc
		addr, end uint64
		ok        bool
	)
	if e.ringErr == nil {
		slot, addr, end, ok = e.ring.reserve(ncta + nwarp)
	}
	if !ok {
		e.ctr.ringFull.Add(1)
		return
	}
	fillKernelTable(slot, j.ops, ncta)
	j.ringEnd = end
	j.sub.kernel = true
	j.sub.launch = launch{table: addr, ncta: uint32(ncta), nwarp: uint32(nwarp),
		grid: uint32(kernelGrid(j.kind, ncta, nwarp, warpBytes, e.cfg.ctas, e.dev.b.multiprocessors()))}
}

func (e *CopyEngine) doorbell() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// complete is the completion goroutine: it waits for each job's fence in
// stream order, releases its ring slot and resolves (or quarantines) its
// transfer.
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
		if j.ringEnd != 0 {
			e.ring.release(j.ringEnd) // the event completed: the kernel read its table
		}
		e.settle(j, errors.Join(j.outcome, outcome))
	}
}

// next returns the oldest submitted job, blocking until there is one; nil
// once the engine is closed (Close waits until nothing is pending).
func (e *CopyEngine) next() *copyJob {
	for {
		e.mu.Lock()
		if e.qhead < len(e.queue) {
			j := e.queue[e.qhead]
			e.queue[e.qhead] = nil
			e.qhead++
			if e.qhead == len(e.queue) { // empty: reuse the array from its start
				e.queue, e.qhead = e.queue[:0], 0
			}
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
// arenas and the engine; the job is reused by a later Start.
func (e *CopyEngine) settle(j *copyJob, outcome error) {
	d := e.dev
	d.mu.Lock()
	for _, a := range j.arenas {
		a.pending--
	}
	d.mu.Unlock()
	t := j.t
	e.mu.Lock()
	e.pending--
	e.recycleLocked(j)
	e.mu.Unlock()
	t.Resolve(outcome)
}

// quarantine records that j's completion can never be proven: its pins
// (and its ring slot) stay for the life of the process, the engine
// refuses further work, and the transfer is quarantined (its blocks are
// never reused). The job is never reused.
func (e *CopyEngine) quarantine(j *copyJob, failure error) error {
	err := fmt.Errorf("gpu: %s of %d blocks on %s cannot be proven finished: %w", dirNames[j.kind], j.pairs, e.dev.name, failure)
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

// Close destroys the engine's stream and frees its descriptor ring. It
// refuses with an error wrapping ErrBusy while transfers are pending; an
// engine with quarantined transfers can never be closed (its stream may
// still be copying, its kernel still reading the ring). A second Close
// returns nil.
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
	e.free = nil
	e.mu.Unlock()
	e.doorbell()
	<-e.stopped
	err := e.s.destroy()
	e.subMu.Lock()
	if e.ring.mem != nil {
		err = errors.Join(err, e.dev.b.freePinned(e.ring.mem))
		e.ring.mem, e.ring.descs = nil, nil
	}
	e.subMu.Unlock()
	e.dev.mu.Lock()
	e.dev.engines--
	e.dev.mu.Unlock()
	return err
}

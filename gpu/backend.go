package gpu

import "github.com/kvlease/kvlease"

// backend is what a Device needs from whatever owns its memory: the CUDA
// driver (driver_cgo.go) or the CPU fallback (host.go). Everything above it
// (arenas, validation, the copy engine, the descriptor ring, path choice,
// transfer resolution) is shared, so the fallback exercises the same logic
// the GPU runs.
type backend interface {
	name() string
	totalMemory() (int64, error)
	freeMemory() (int64, error)
	driverVersion() int
	// multiprocessors returns the device's SM count, 0 when unknown.
	multiprocessors() int

	// allocDevice returns the device address of bytes of device memory
	// and, on the fallback only, the host memory that backs it.
	allocDevice(bytes int) (addr uint64, host []byte, err error)
	freeDevice(addr uint64, bytes int) error
	// allocPinned returns page-locked host memory the device can copy to
	// and from asynchronously, never Go heap memory on a real device,
	// mapped into the device's address space: dptr is the address a
	// kernel reaches it by (0 when the device cannot map host memory).
	allocPinned(bytes int) (host []byte, dptr uint64, err error)
	freePinned(b []byte) error

	// readDevice and writeDevice copy synchronously between device memory
	// (arena a, offset off) and any host memory, Go memory included.
	readDevice(dst []byte, a *arena, off int) error
	writeDevice(a *arena, off int, src []byte) error

	newStream() (stream, error)
	close() error

	// counters counts submissions by path; pathState says whether batching
	// is on and why the kernel is off, if it is.
	counters() *counters
	pathState() (batchEnabled bool, kernelErr error)
	// loadKernel makes the copy kernel ready (the driver JIT-compiles it
	// at the first call) and returns why it cannot run, or nil.
	loadKernel() error
}

// A stream runs submissions in order, like a CUDA stream.
type stream interface {
	// submit enqueues s and returns a fence that completes after all of
	// it. Its results:
	//   - f != nil: work is in flight; wait(f) says when it stopped.
	//     outcome is an enqueue error to report once it has (some copies
	//     never ran).
	//   - f == nil, failure == nil: nothing is in flight (proven); outcome
	//     says why the copy did not (fully) happen.
	//   - f == nil, failure != nil: nobody can tell what is in flight.
	// A cancel of s.t, once requested, allows the stream to skip copies
	// that have not started (the fallback does; a CUDA stream cannot).
	//
	// Only one goroutine submits to a stream at a time.
	submit(s *submission) (f fence, outcome, failure error)
	// wait blocks until f completes (never by spinning). failure != nil
	// means completion cannot be proven; outcome is kvlease.ErrCanceled (wrapped)
	// when copies were skipped.
	wait(f fence) (outcome, failure error)
	// recycle returns a completed fence for reuse.
	recycle(f fence)
	destroy() error
}

// fence is a backend's completion marker: a CUDA event, or a fallback job.
type fence any

// submission is one Start's work as a stream receives it: copy ops of one
// direction, and, when kernel is set, the launch that carries them (its
// table already written to the engine's ring); the stream falls back to
// the copy engine for the ops if the launch fails.
type submission struct {
	ops    []copyOp
	kind   copyKind
	t      *kvlease.Transfer // for CancelRequested
	ctr    *counters         // where the path taken is counted: the device's, or a calibration engine's own
	kernel bool
	launch launch
}

// copyOp is one contiguous copy of n bytes between two arenas of the same
// device. Adjacent block pairs are merged into one op.
type copyOp struct {
	dst, src       *arena
	dstOff, srcOff int
	n              int
}

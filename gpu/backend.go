package gpu

import "sync/atomic"

// backend is what a Device needs from whatever owns its memory: the CUDA
// driver (driver_cgo.go) or the CPU fallback (host.go). Everything above it
// (arenas, validation, the copy engine, transfer resolution) is shared, so
// the fallback exercises the same logic the GPU runs.
type backend interface {
	name() string
	totalMemory() (int64, error)
	freeMemory() (int64, error)
	driverVersion() int

	// allocDevice returns the device address of bytes of device memory
	// and, on the fallback only, the host memory that backs it.
	allocDevice(bytes int) (addr uint64, host []byte, err error)
	freeDevice(addr uint64, bytes int) error
	// allocPinned returns page-locked host memory the device can copy to
	// and from asynchronously; never Go heap memory on a real device.
	allocPinned(bytes int) ([]byte, error)
	freePinned(b []byte) error

	// readDevice and writeDevice copy synchronously between device memory
	// (arena a, offset off) and any host memory, Go memory included.
	readDevice(dst []byte, a *arena, off int) error
	writeDevice(a *arena, off int, src []byte) error

	newStream() (stream, error)
	close() error

	// counters counts submissions by path; pathState says whether batching
	// is on and why the gather kernel is off, if it is.
	counters() *counters
	pathState() (batchEnabled bool, kernelErr error)
}

// A stream runs submissions in order, like a CUDA stream.
type stream interface {
	// submit enqueues ops (all of direction kind) and returns a fence that
	// completes after all of them. Its results:
	//   - f != nil: work is in flight; wait(f) says when it stopped.
	//     outcome is an enqueue error to report once it has (some copies
	//     never ran).
	//   - f == nil, failure == nil: nothing is in flight (proven); outcome
	//     says why the copy did not (fully) happen.
	//   - f == nil, failure != nil: nobody can tell what is in flight.
	// canceled, when it becomes true, allows the stream to skip copies that
	// have not started (the fallback does; a CUDA stream cannot).
	//
	// Only one goroutine submits to a stream at a time.
	submit(ops []copyOp, kind copyKind, canceled *atomic.Bool) (f fence, outcome, failure error)
	// wait blocks until f completes (never by spinning). failure != nil
	// means completion cannot be proven; outcome is ErrCanceled (wrapped)
	// when copies were skipped.
	wait(f fence) (outcome, failure error)
	// recycle returns a completed fence for reuse.
	recycle(f fence)
	destroy() error
}

// fence is a backend's completion marker: a CUDA event, or a fallback job.
type fence any

// copyOp is one contiguous copy of n bytes between two arenas of the same
// device. Adjacent block pairs are merged into one op.
type copyOp struct {
	dst, src       *arena
	dstOff, srcOff int
	n              int
}

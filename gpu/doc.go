// Package gpu gives kvlease real device memory and real asynchronous
// copies: CUDA device arenas and pinned host arenas usable as
// kvlease.Memory, and a copy engine whose completion events resolve
// kvlease Transfers. A CPU fallback with the same behaviour runs everywhere
// else.
//
// # The driver, loaded at run time
//
// The package talks to the CUDA driver API through cgo, but against a small
// header of its own (cudadrv.h), not the CUDA toolkit: Open loads
// libcuda.so.1 with dlopen (or the library named by $KVLEASE_LIBCUDA) and
// resolves each entry point through cuGetProcAddress at a fixed ABI version
// (CUDA 12.0; 12.8 for cuMemcpyBatchAsync), falling back to dlsym of the
// versioned names (cuMemAlloc_v2, …) on drivers without it. Building needs
// only a C compiler; running needs a driver of CUDA 12 or later. Without
// one, or in a build with CGO_ENABLED=0 (driver_nocgo.go), Open returns
// ErrNoDriver; with a driver but no device, ErrNoDevice. Every failed
// driver call is a *DriverError carrying the code and the driver's own
// name and description of it.
//
// Each call that needs the device's primary context pushes it on the
// calling thread and pops it before returning, so goroutines may call from
// any thread and a thread's own CUDA context, if the program has one, is
// left alone.
//
// # Memory
//
// Device.AllocDevice makes a DeviceArena: one cuMemAlloc cut into equal
// blocks, block i at Base()+i·BlockBytes(), a kvlease.Memory[DevicePtr].
// Device.AllocPinned makes a PinnedArena: page-locked host memory from
// cuMemHostAlloc, a kvlease.Memory[[]byte] for a host tier, whose regions
// have len and cap equal to the block size.
//
// Alignment: cuMemAlloc returns memory aligned to at least 256 bytes and
// cuMemHostAlloc page-aligned memory; the block size must be a multiple of
// Alignment (256), so every block of every arena starts 256-byte aligned.
// A block size that is not is refused with kvlease.ErrInvalidArgument.
//
// An arena is freed only when nothing can reference it: its Close refuses
// with ErrBusy, saying how many copies are still in flight (and whether
// any are quarantined), until every copy touching it has resolved. Close
// the pool that uses an arena before the arena. A Device refuses to Close
// while arenas or copy engines made from it are open.
//
// # Copies
//
// A CopyEngine owns a stream and offers three kvlease.Transport
// implementations: DeviceToHost (offload), HostToDevice (onload) and
// DeviceToDevice. Start validates the pairs, creates the transfer, calls
// attach before anything is enqueued (if attach fails, nothing is enqueued
// and the transfer is resolved with attach's error), enqueues the copies —
// one cuMemcpyBatchAsync when the driver has it, else one
// cuMemcpy*Async per run of adjacent blocks — and records an event. A
// completion goroutine per engine sleeps in cuEventSynchronize on
// blocking-sync events (no spinning) and resolves each transfer once its
// event has completed. If the driver reports a sticky error or a lost
// context, nobody can prove the copy stopped: the transfer is quarantined,
// never resolved, its arenas stay allocated, and the engine refuses new
// work.
//
// Only pinned driver memory and device memory take part in asynchronous
// copies; a Go slice that is not a block of one of the device's pinned
// arenas is refused. Device.CopyToHost and Device.CopyFromHost copy
// synchronously to and from any memory, for tests, checks and
// initialization.
//
// # The CPU fallback
//
// OpenHost returns a Device that needs neither cgo nor a driver: device
// memory is host memory addressed through a DevicePtr space of its own,
// pinned memory is Go memory, and each copy engine runs its copies on a
// worker goroutine in submission order, resolving transfers only after the
// worker is done with them. Cancel skips copies the worker has not begun.
// Every test of the copy engine and the handoff runs on it, on any machine.
//
// # Tests and the device check
//
// go test ./gpu runs everything on the fallback; tests that need a GPU say
// SKIP with the reason. In cgo builds the tests also compile a fake
// libcuda (testdata/fakecuda.c) with the C compiler and run the cgo layer
// against it. CGO_ENABLED=0 go test ./gpu checks the fallback-only build.
//
// On a GPU machine (which has no Go toolchain), the device check runs the
// test binary built here:
//
//	gpu/devicecheck.sh build   # here: builds gpu/.devcheck/gpu.test
//	gpu/devicecheck.sh run     # there, from the repository root
//
// run executes the driver tests and the shared tests' cuda subtests, then
// BenchmarkCopyBandwidth, which measures scattered block copies against one
// contiguous copy of the same bytes in the same run, and writes a table
// (the target: batched copies of blocks of 64 KiB and more reach 80 % of
// the contiguous bandwidth).
package gpu

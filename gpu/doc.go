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
// cuMemHostAlloc, mapped into the device's address space
// (CU_MEMHOSTALLOC_DEVICEMAP, its device address from
// cuMemHostGetDevicePointer) so that a kernel reads and writes it
// directly; a kvlease.Memory[[]byte] for a host tier, whose regions have
// len and cap equal to the block size.
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
// DeviceToDevice, and two per-layer ones over layouts (LayeredDeviceToHost,
// LayeredHostToDevice). Start validates the pairs, merges pairs adjacent on
// both sides, creates the transfer, calls attach before anything is
// enqueued (if attach fails, nothing is enqueued and the transfer is
// resolved with attach's error), enqueues the copies and records an event.
// A completion goroutine per engine sleeps in cuEventSynchronize on
// blocking-sync events (no spinning) and resolves each transfer once its
// event has completed. Start's own work is O(pieces) with one allocation
// (the transfer): pairs are looked up with a one-entry arena cache and
// checked against a reused hash set, and an engine reuses its settled jobs.
//
// # Two paths
//
// Scattered copies (the blocks of a paged KV cache, or the per-layer
// pieces of them) go one of two ways:
//
//   - The copy engine: the GPU's DMA engines, one cuMemcpyBatchAsync per
//     submission (or a loop of cuMemcpy*Async before CUDA 12.8). No SM is
//     used, but every copy costs a descriptor's setup, so small pieces
//     reach a fraction of the link (an H200 moved 16 KiB blocks host to
//     device at 0.08 of a contiguous copy).
//   - The copy kernel (kernel.go): a launch whose threads load and store
//     the bytes between device memory and mapped pinned memory, a warp per
//     piece of up to 8 KiB and a CTA per 64 KiB chunk of a larger one. Its
//     descriptor table is written into a ring of mapped pinned memory the
//     engine owns (ring.go): no upload before the launch, no allocation,
//     and a slot is reused only after the event of the submission that
//     used it has completed (a submission that finds the ring full takes
//     the copy engine and is counted in CopyStats.RingFull).
//
// An engine on PathAuto (the default) sends one contiguous copy to the
// copy engine, and a scattered one to whichever path the device's
// calibration measured faster at its mean piece size: Calibrate measures
// both paths in every direction at 1 to 256 KiB pieces, on the device at
// hand; the first scattered copy runs it when nobody called it (tens of
// milliseconds on a GPU; call it at startup to keep that off the first
// copy). No threshold is a constant tuned on one GPU. WithPath forces
// either path: PathCopyEngine for an engine whose model saturates the SMs
// (any grid slows its kernels more than slow copies do), PathKernel to
// test or measure the kernel. CopyStats counts each path's submissions and
// copies, and the CTAs the launches used.
//
// # What the kernel costs the SMs
//
// A host↔device launch uses at most 16 CTAs of 256 threads
// (WithKernelCTAs changes it). On an H200, with 132 SMs of 2,048 thread
// slots each, that is 16 of 132 SMs touched (12 %) and 4,096 of 270,336
// thread slots (1.5 %), with no shared memory and a few dozen registers a
// thread: the SMs it lands on keep running the model's kernels beside it.
// 16 is the default because it covers PCIe's bandwidth-delay product
// with room to spare: each thread keeps four 16-byte loads in flight, so
// 16 CTAs have 256 KiB in flight, about three times what a Gen5 x16 link
// (≈ 55 GB/s) holds over a mapped-memory round trip (≈ 1.5 µs); on an
// H200, 16 CTAs reached 0.89–0.95 of the link for 16–64 KiB pieces, and
// more CTAs buy no bandwidth while taking SM slots from compute. Launches
// of small warp pieces only (a warp keeps at most 2 KiB in flight, a 1 KiB
// piece half of that) may use up to four times as many CTAs, to keep the
// same bytes in flight. Device-to-device launches read and write HBM,
// tens of times faster than PCIe, so they use up to 4 CTAs per SM for
// the short time the copy takes, as the driver's own device copies do.
//
// # Evidence
//
// Both paths end in the same completion event on the engine's stream,
// recorded after the copies or the launch, and only that event resolves a
// transfer: not Start returning, not the launch being accepted, not a
// cancel, not anything the kernel writes. A cancel keeps copies from being
// enqueued if it comes first (the transfer then resolves with
// kvlease.ErrCanceled); what a stream holds, DMA or launch, cannot be recalled and
// resolves when its event completes. If the driver reports a sticky error
// or a lost context, nobody can prove the copy stopped: the transfer is
// quarantined, never resolved, its arenas stay allocated, its ring slot is
// never reused, and the engine refuses new work.
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
// pinned memory is Go memory mapped into that space too, and each copy
// engine runs its submissions on a worker goroutine in submission order,
// resolving transfers only after the worker is done with them. The kernel
// path runs there as the PTX would: the worker reads the table through the
// ring's device address when it gets to the launch, and every address in
// it must lie in a live allocation, or the "device" faults. Cancel skips
// copies the worker has not begun. Every test of the copy engine and the
// handoff runs on it, on any machine.
//
// # Tests and the device check
//
// go test ./gpu runs everything on the fallback; tests that need a GPU say
// SKIP with the reason. In cgo builds the tests also compile a fake
// libcuda (testdata/fakecuda.c) with the C compiler and run the cgo layer
// against it: its streams run when an event is waited for (so a table
// rewritten too early shows), it maps pinned memory at a second address
// (so a host address handed to the kernel faults) and it executes the
// kernel's table on the host. CGO_ENABLED=0 go test ./gpu checks the
// fallback-only build.
//
// On a GPU machine (which has no Go toolchain), the device check runs the
// binaries built here:
//
//	gpu/devicecheck.sh build    # here: gpu/.devcheck/ (tests, examples, kvaudit)
//	gpu/devicecheck.sh run      # there, from the repository root
//	gpu/devicecheck.sh dryrun   # here: the same run against the fake driver
//
// run measures every target of issue 35 in one run of under five minutes
// (scattered against contiguous copies in every direction at 4–256 KiB,
// per-layer round trips at 32 KiB and 1 KiB pieces, small-copy latency,
// Start's cost per piece), runs examples/tiers and examples/hybrid on the
// GPU, the tiers audit's device mode and compute-sanitizer, and prints
// each target with PASS or BELOW.
package gpu

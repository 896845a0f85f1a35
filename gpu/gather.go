package gpu

import (
	"fmt"
	"sync/atomic"
	"time"
)

// The gather kernel: scattered device-to-device copies in one launch.
//
// Copy engines move device-to-device blocks one DMA descriptor at a time
// and reach a fraction of HBM bandwidth on small scattered blocks; a kernel
// whose thread blocks each copy one chunk reaches most of it. The kernel is
// written in PTX by hand and embedded below, so building needs no CUDA
// toolkit: the driver JIT-compiles it for the device at the first scattered
// device-to-device copy (cuModuleLoadData), and the engine launches it with
// cuLaunchKernel on the engine's stream, so the copy's completion event
// follows it exactly as it follows a cuMemcpyAsync.
//
// A launch reads a table of gatherDesc (source, destination, length),
// uploaded to device memory on the same stream just before it from a
// pinned staging buffer that stays with the submission's fence until its
// event has completed. Each descriptor covers at most gatherChunk bytes of
// one copy; thread block i copies descriptor i with 16-byte vector loads
// and stores, four in flight per thread. Every block of every arena is
// 256-byte aligned and a multiple of 256 bytes long, so the vectors are
// always aligned and no length has a remainder.
//
// The PTX targets sm_70 with ISA 7.0 (CUDA 11.0): any CUDA 12 driver JITs
// it for Volta and everything newer, Hopper (sm_90) included. Its reads
// use the non-coherent path (ld.global.nc), which is valid because a
// scattered copy never reads a block it writes (Start refuses that).

const (
	// gatherEntry is the kernel's entry name; gatherParams its parameter
	// count (descriptor table, descriptor count).
	gatherEntry  = "kvl_gather"
	gatherParams = 2
	// gatherChunk is the most bytes one thread block copies.
	gatherChunk = 64 << 10
	// gatherThreads is the launch's block size (the PTX's .maxntid).
	gatherThreads = 256
	// gatherMinOps: device-to-device submissions of at least this many
	// copies (after merging adjacent blocks) go through the kernel; a
	// single contiguous copy stays on the copy engine.
	gatherMinOps = 2
	// gatherDescBytes is the size of one descriptor in the table.
	gatherDescBytes = 32
)

// gatherDesc is one row of the kernel's table: copy n bytes from src to dst
// (device addresses). The layout is the PTX's: three u64 and a pad.
type gatherDesc struct {
	src, dst, n, _ uint64
}

// gatherDescCount returns how many descriptors ops need.
func gatherDescCount(ops []copyOp) int {
	n := 0
	for _, op := range ops {
		n += (op.n + gatherChunk - 1) / gatherChunk
	}
	return n
}

// fillGatherDescs writes ops' descriptors into table, which holds exactly
// gatherDescCount(ops) rows.
func fillGatherDescs(table []gatherDesc, ops []copyOp) {
	k := 0
	for _, op := range ops {
		src, dst := op.src.addr+uint64(op.srcOff), op.dst.addr+uint64(op.dstOff)
		for off := 0; off < op.n; off += gatherChunk {
			n := min(gatherChunk, op.n-off)
			table[k] = gatherDesc{src: src + uint64(off), dst: dst + uint64(off), n: uint64(n)}
			k++
		}
	}
}

// gatherPTX is the kernel. Parameters: the descriptor table's device
// address and the number of descriptors; launched with one thread block
// of gatherThreads threads per descriptor.
const gatherPTX = `//
// kvlease gather kernel: copy descriptor ctaid.x of a table of
// {u64 src, u64 dst, u64 bytes, u64 pad}; bytes is a multiple of 16 and
// both addresses are 16-byte aligned.
//
.version 7.0
.target sm_70
.address_size 64

.visible .entry kvl_gather(
	.param .u64 kvl_gather_descs,
	.param .u32 kvl_gather_count
)
.maxntid 256, 1, 1
{
	.reg .pred 	%p<4>;
	.reg .b32 	%r<24>;
	.reg .b64 	%rd<24>;

	ld.param.u64 	%rd1, [kvl_gather_descs];
	ld.param.u32 	%r1, [kvl_gather_count];
	mov.u32 	%r2, %ctaid.x;
	setp.ge.u32 	%p1, %r2, %r1;
	@%p1 bra 	DONE;

	cvta.to.global.u64 	%rd2, %rd1;
	mul.wide.u32 	%rd3, %r2, 32;
	add.s64 	%rd4, %rd2, %rd3;
	ld.global.nc.v2.u64 	{%rd5, %rd6}, [%rd4];
	ld.global.nc.u64 	%rd7, [%rd4+16];
	cvta.to.global.u64 	%rd5, %rd5;
	cvta.to.global.u64 	%rd6, %rd6;

	mov.u32 	%r3, %tid.x;
	mov.u32 	%r4, %ntid.x;
	mul.wide.u32 	%rd8, %r3, 16;
	mul.wide.u32 	%rd9, %r4, 16;
	shl.b64 	%rd10, %rd9, 2;
	mul.lo.s64 	%rd11, %rd9, 3;

LOOP4:
	add.s64 	%rd12, %rd8, %rd11;
	setp.ge.u64 	%p2, %rd12, %rd7;
	@%p2 bra 	TAIL;
	add.s64 	%rd13, %rd5, %rd8;
	add.s64 	%rd14, %rd13, %rd9;
	add.s64 	%rd15, %rd14, %rd9;
	add.s64 	%rd16, %rd15, %rd9;
	ld.global.nc.v4.u32 	{%r5, %r6, %r7, %r8}, [%rd13];
	ld.global.nc.v4.u32 	{%r9, %r10, %r11, %r12}, [%rd14];
	ld.global.nc.v4.u32 	{%r13, %r14, %r15, %r16}, [%rd15];
	ld.global.nc.v4.u32 	{%r17, %r18, %r19, %r20}, [%rd16];
	add.s64 	%rd17, %rd6, %rd8;
	add.s64 	%rd18, %rd17, %rd9;
	add.s64 	%rd19, %rd18, %rd9;
	add.s64 	%rd20, %rd19, %rd9;
	st.global.v4.u32 	[%rd17], {%r5, %r6, %r7, %r8};
	st.global.v4.u32 	[%rd18], {%r9, %r10, %r11, %r12};
	st.global.v4.u32 	[%rd19], {%r13, %r14, %r15, %r16};
	st.global.v4.u32 	[%rd20], {%r17, %r18, %r19, %r20};
	add.s64 	%rd8, %rd8, %rd10;
	bra.uni 	LOOP4;

TAIL:
	setp.ge.u64 	%p3, %rd8, %rd7;
	@%p3 bra 	DONE;
	add.s64 	%rd13, %rd5, %rd8;
	ld.global.nc.v4.u32 	{%r5, %r6, %r7, %r8}, [%rd13];
	add.s64 	%rd17, %rd6, %rd8;
	st.global.v4.u32 	[%rd17], {%r5, %r6, %r7, %r8};
	add.s64 	%rd8, %rd8, %rd9;
	bra.uni 	TAIL;

DONE:
	ret;
}
`

// copyKind is a submission's direction; every copy of one Start has the
// same.
type copyKind uint8

const (
	hostToDevice copyKind = iota
	deviceToHost
	deviceToDevice
)

// counters count how a device's submissions were carried, for CopyStats,
// benchmarks and the device check. Each backend owns one.
type counters struct {
	batchedSubmits, batchedCopies atomic.Int64
	loopedSubmits, loopedCopies   atomic.Int64
	kernelLaunches, kernelCopies  atomic.Int64
	batchFailures, kernelFailures atomic.Int64

	kernelOn atomic.Bool // scattered device-to-device copies may use the kernel

	// GPU time of submissions, measured while timing is on (benchmarks and
	// the device check): CUDA events around the copies, or the fallback
	// worker's time.
	timing       atomic.Bool
	gpuNanos     atomic.Int64
	timedSubmits atomic.Int64
}

func (c *counters) count(path copyPath, copies int) {
	switch path {
	case pathBatch:
		c.batchedSubmits.Add(1)
		c.batchedCopies.Add(int64(copies))
	case pathKernel:
		c.kernelLaunches.Add(1)
		c.kernelCopies.Add(int64(copies))
	default:
		c.loopedSubmits.Add(1)
		c.loopedCopies.Add(int64(copies))
	}
}

func (c *counters) addGPUTime(d time.Duration) {
	c.gpuNanos.Add(int64(d))
	c.timedSubmits.Add(1)
}

// copyPath is how one submission was carried.
type copyPath uint8

const (
	pathLoop copyPath = iota
	pathBatch
	pathKernel
)

// CopyStats counts how a device's copy engines carried their submissions
// (one per Start) and copies (contiguous runs, after adjacent blocks are
// merged), by path:
//
//   - Batched: one cuMemcpyBatchAsync per submission (CUDA 12.8+).
//   - Looped: one cuMemcpy*Async per copy; on the CPU fallback, the
//     worker's copies. A single contiguous copy is always looped.
//   - Kernel: the gather kernel, for scattered device-to-device copies.
//
// A failed batch or launch is counted in BatchFailures or KernelFailures
// and turns that path off for the device (the copies then run looped), so
// a benchmark named "batch" that quietly ran looped shows it here.
type CopyStats struct {
	BatchedSubmits, BatchedCopies int64
	LoopedSubmits, LoopedCopies   int64
	KernelLaunches, KernelCopies  int64
	BatchFailures, KernelFailures int64
	// BatchEnabled: the driver has cuMemcpyBatchAsync and it has not
	// failed. KernelEnabled: scattered device-to-device copies use the
	// gather kernel (it has not failed to load or launch).
	BatchEnabled, KernelEnabled bool
	// KernelErr says why the kernel is off, once it failed to load or
	// launch (the driver's JIT log included when it has one).
	KernelErr error
}

// String formats the counts on one line, as benchmarks and the device
// check print them.
func (s CopyStats) String() string {
	return fmt.Sprintf("batched %d/%d looped %d/%d kernel %d/%d (submits/copies), failures batch %d kernel %d, batch %v kernel %v",
		s.BatchedSubmits, s.BatchedCopies, s.LoopedSubmits, s.LoopedCopies, s.KernelLaunches, s.KernelCopies,
		s.BatchFailures, s.KernelFailures, s.BatchEnabled, s.KernelEnabled)
}

// CopyStats returns how d's copy engines have carried their copies so far.
func (d *Device) CopyStats() CopyStats {
	c := d.b.counters()
	s := CopyStats{
		BatchedSubmits: c.batchedSubmits.Load(), BatchedCopies: c.batchedCopies.Load(),
		LoopedSubmits: c.loopedSubmits.Load(), LoopedCopies: c.loopedCopies.Load(),
		KernelLaunches: c.kernelLaunches.Load(), KernelCopies: c.kernelCopies.Load(),
		BatchFailures: c.batchFailures.Load(), KernelFailures: c.kernelFailures.Load(),
		KernelEnabled: c.kernelOn.Load(),
	}
	s.BatchEnabled, s.KernelErr = d.b.pathState()
	return s
}

// setKernel turns the gather kernel on or off for d's scattered
// device-to-device copies, for benchmarks comparing it with the copy
// engine. It stays off after a failure.
func setKernel(d *Device, on bool) {
	if _, kerr := d.b.pathState(); kerr != nil {
		on = false
	}
	d.b.counters().kernelOn.Store(on)
}

// setTiming turns GPU timing of submissions on or off and returns the
// time and count measured so far.
func setTiming(d *Device, on bool) { d.b.counters().timing.Store(on) }

// gpuTime returns the GPU time measured while timing was on, and over how
// many submissions.
func gpuTime(d *Device) (time.Duration, int64) {
	c := d.b.counters()
	return time.Duration(c.gpuNanos.Load()), c.timedSubmits.Load()
}

package gpu

import (
	"fmt"
	"go.uber.org/atomic"
	"time"
)

// Path is how a copy engine carries scattered copies: see the package
// doc ("Two paths").
type Path uint8

const (
	// PathAuto picks per submission: one contiguous copy goes to the copy
	// engine; scattered copies go to the kernel or the copy engine by the
	// size of their pieces, from the device's calibration (Calibrate, run
	// at the first scattered copy when nobody called it).
	PathAuto Path = iota
	// PathCopyEngine always uses the DMA copy engine: no SM is ever
	// taken. For an engine whose compute saturates the SMs, where even a
	// small grid would slow the model down more than slow copies do.
	PathCopyEngine
	// PathKernel always uses the kernel, even for one contiguous copy,
	// unless the kernel cannot run on the device (CopyStats.KernelErr).
	PathKernel
)

var pathNames = [...]string{PathAuto: "auto", PathCopyEngine: "copy engine", PathKernel: "kernel"}

func (p Path) String() string {
	if int(p) < len(pathNames) {
		return pathNames[p]
	}
	return fmt.Sprintf("Path(%d)", int(p))
}

// EngineOption configures NewCopyEngine.
type EngineOption func(*engineConfig)

type engineConfig struct {
	path      Path
	ctas      int
	ringDescs int
	// uncounted: the engine's submissions are not counted in the device's
	// CopyStats (Calibrate's scratch engines).
	uncounted bool
}

func defaultEngineConfig() engineConfig {
	return engineConfig{path: PathAuto, ctas: defaultKernelCTAs, ringDescs: defaultRingDescs}
}

// WithPath makes the engine carry every submission by path p (default
// PathAuto).
func WithPath(p Path) EngineOption { return func(c *engineConfig) { c.path = p } }

// WithKernelCTAs bounds the kernel's grid for host↔device copies to n
// CTAs of 256 threads (default 16; the package doc says what share of a
// GPU that is and why it is the default). Values below 1 mean 1.
// Device-to-device launches are sized by the device's SM count instead.
func WithKernelCTAs(n int) EngineOption { return func(c *engineConfig) { c.ctas = max(n, 1) } }

// uncounted keeps an engine's submissions out of CopyStats.
func uncounted() EngineOption { return func(c *engineConfig) { c.uncounted = true } }

// withRingDescs sets the descriptor ring's size (tests: a tiny ring).
func withRingDescs(n int) EngineOption { return func(c *engineConfig) { c.ringDescs = max(n, 1) } }

// copyKind is a submission's direction; every copy of one Start has the
// same.
type copyKind uint8

const (
	hostToDevice copyKind = iota
	deviceToHost
	deviceToDevice
)

// kindNames are the directions as rows and benchmarks name them.
var kindNames = [...]string{hostToDevice: "HtoD", deviceToHost: "DtoH", deviceToDevice: "DtoD"}

// copyPath is how one submission was carried.
type copyPath uint8

const (
	pathLoop copyPath = iota
	pathBatch
	pathKernel
)

// counters count how a device's submissions were carried, for CopyStats,
// benchmarks and the device check. Each backend owns one.
type counters struct {
	batchedSubmits, batchedCopies atomic.Int64
	loopedSubmits, loopedCopies   atomic.Int64
	kernelLaunches, kernelCopies  atomic.Int64
	kernelCTAs                    atomic.Int64
	batchFailures, kernelFailures atomic.Int64
	ringFull                      atomic.Int64

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

// CopyStats counts how a device's copy engines carried their submissions
// (one per Start) and copies (contiguous runs, after adjacent blocks are
// merged), by path:
//
//   - Batched: one cuMemcpyBatchAsync per submission (CUDA 12.8+).
//   - Looped: one cuMemcpy*Async per copy; on the CPU fallback, the
//     worker's copies.
//   - Kernel: one launch of the copy kernel per submission.
//
// A failed batch or launch is counted in BatchFailures or KernelFailures
// and turns that path off for the device (the copies then run on the copy
// engine), so a benchmark named "kernel" that quietly ran on the copy
// engine shows it here. RingFull counts submissions meant for the kernel
// that found the engine's descriptor ring full and took the copy engine.
type CopyStats struct {
	BatchedSubmits, BatchedCopies int64
	LoopedSubmits, LoopedCopies   int64
	KernelLaunches, KernelCopies  int64
	// KernelCTAs sums the grids of the launches: KernelCTAs/KernelLaunches
	// is how many CTAs of 256 threads a launch used on average.
	KernelCTAs                    int64
	BatchFailures, KernelFailures int64
	RingFull                      int64
	// BatchEnabled: the driver has cuMemcpyBatchAsync and it has not
	// failed. KernelEnabled: the kernel can run (it has not failed to
	// load or launch).
	BatchEnabled, KernelEnabled bool
	// KernelErr says why the kernel is off, once it failed to load or
	// launch (the driver's JIT log included when it has one).
	KernelErr error
}

// String formats the counts on one line, as benchmarks and the device
// check print them.
func (s CopyStats) String() string {
	return fmt.Sprintf("batched %d/%d looped %d/%d kernel %d/%d (submits/copies), failures batch %d kernel %d, ring full %d, batch %v kernel %v",
		s.BatchedSubmits, s.BatchedCopies, s.LoopedSubmits, s.LoopedCopies, s.KernelLaunches, s.KernelCopies,
		s.BatchFailures, s.KernelFailures, s.RingFull, s.BatchEnabled, s.KernelEnabled)
}

// CopyStats returns how d's copy engines have carried their copies so far.
func (d *Device) CopyStats() CopyStats {
	c := d.b.counters()
	s := CopyStats{
		BatchedSubmits: c.batchedSubmits.Load(), BatchedCopies: c.batchedCopies.Load(),
		LoopedSubmits: c.loopedSubmits.Load(), LoopedCopies: c.loopedCopies.Load(),
		KernelLaunches: c.kernelLaunches.Load(), KernelCopies: c.kernelCopies.Load(), KernelCTAs: c.kernelCTAs.Load(),
		BatchFailures: c.batchFailures.Load(), KernelFailures: c.kernelFailures.Load(),
		RingFull: c.ringFull.Load(),
	}
	s.BatchEnabled, s.KernelErr = d.b.pathState()
	s.KernelEnabled = s.KernelErr == nil
	return s
}

// setTiming turns GPU timing of submissions on or off.
func setTiming(d *Device, on bool) { d.b.counters().timing.Store(on) }

// gpuTime returns the GPU time measured while timing was on, and over how
// many submissions.
func gpuTime(d *Device) (time.Duration, int64) {
	c := d.b.counters()
	return time.Duration(c.gpuNanos.Load()), c.timedSubmits.Load()
}

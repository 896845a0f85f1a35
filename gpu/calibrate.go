package gpu

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/kvlease/kvlease"
)

// Calibration is what Calibrate measured on a device: for each direction
// and piece size, how long one scattered copy took on each path, Start
// until its transfer resolved (the fastest of a few runs). Engines on
// PathAuto send a scattered copy to the kernel when the kernel was faster
// at the measured piece size nearest to the copy's mean piece size (on a
// log scale), to the copy engine otherwise.
type Calibration struct {
	Rows []CalibrationRow
	// Err says why the kernel is never chosen, when it cannot run on the
	// device (then Rows is empty).
	Err error
}

// CalibrationRow is one measurement of Calibrate.
type CalibrationRow struct {
	Direction  string // "HtoD", "DtoH" or "DtoD"
	PieceBytes int
	Pieces     int
	CopyEngine time.Duration
	Kernel     time.Duration
}

// String formats the calibration as a table, one row a line.
func (c Calibration) String() string {
	var b strings.Builder
	if c.Err != nil {
		fmt.Fprintf(&b, "kernel off: %v\n", c.Err)
	}
	for _, r := range c.Rows {
		choice := "copy engine"
		if r.Kernel < r.CopyEngine {
			choice = "kernel"
		}
		fmt.Fprintf(&b, "%s %d KiB × %d: copy engine %v, kernel %v: %s\n",
			r.Direction, r.PieceBytes>>10, r.Pieces, r.CopyEngine, r.Kernel, choice)
	}
	return b.String()
}

// calSizes are the piece sizes Calibrate measures.
var calSizes = [...]int{1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10}

// measureFunc times one scattered copy of pieces pieces of pieceBytes
// bytes of kind on path, Start until resolved.
type measureFunc func(kind copyKind, pieceBytes, pieces int, path Path) (time.Duration, error)

// calTable is the path choice a calibration yields: per direction, per
// measured size (ascending), whether the kernel won.
type calTable struct {
	c      Calibration
	sizes  [3][]int
	kernel [3][]bool
}

func newCalTable(c Calibration) *calTable {
	t := &calTable{c: c}
	for _, r := range c.Rows {
		k := kindOf(r.Direction)
		t.sizes[k] = append(t.sizes[k], r.PieceBytes)
		t.kernel[k] = append(t.kernel[k], r.Kernel < r.CopyEngine)
	}
	return t
}

func kindOf(dir string) copyKind {
	for k, n := range kindNames {
		if n == dir {
			return copyKind(k)
		}
	}
	return deviceToDevice
}

// useKernel reports whether the kernel carries a scattered copy of kind
// whose pieces average mean bytes: the verdict at the measured size
// nearest to mean on a log scale.
func (t *calTable) useKernel(kind copyKind, mean int) bool {
	sizes := t.sizes[kind]
	if t.c.Err != nil || len(sizes) == 0 {
		return false
	}
	best, dist := 0, math.Inf(1)
	m := math.Log2(float64(max(mean, 1)))
	for i, s := range sizes {
		if d := math.Abs(math.Log2(float64(s)) - m); d < dist {
			best, dist = i, d
		}
	}
	return t.kernel[kind][best]
}

// useKernel is PathAuto's choice for a scattered copy: it calibrates the
// device at the first one, unless Calibrate ran before.
func (d *Device) useKernel(kind copyKind, mean int) bool {
	t := d.cal.Load()
	if t == nil {
		d.calMu.Lock()
		if t = d.cal.Load(); t == nil {
			c, _ := d.calibrateLocked()
			t = newCalTable(c)
			d.cal.Store(t)
		}
		d.calMu.Unlock()
	}
	return t.useKernel(kind, mean)
}

// Calibrate measures, now, each direction's scattered copies on both
// paths at piece sizes from 1 KiB to 256 KiB, and makes the device's
// PathAuto engines choose from the result. It takes tens of milliseconds
// on a GPU: call it at startup to keep it off the first scattered copy,
// which otherwise runs it. It allocates its own scratch arenas and
// engines and frees them. The error is also in Calibration.Err: the
// kernel cannot run (then PathAuto always takes the copy engine) or a
// measurement failed.
func (d *Device) Calibrate() (Calibration, error) {
	d.calMu.Lock()
	defer d.calMu.Unlock()
	c, err := d.calibrateLocked()
	d.cal.Store(newCalTable(c))
	return c, err
}

// calibrateLocked measures every row. Called under calMu.
func (d *Device) calibrateLocked() (Calibration, error) {
	if err := d.b.loadKernel(); err != nil {
		return Calibration{Err: err}, err
	}
	measure := d.calMeasure
	if measure == nil {
		sc := &calScratch{d: d}
		defer sc.close()
		measure = sc.measure
	}
	var c Calibration
	for _, size := range calSizes {
		pieces := min(max(d.calBytes()/size, 8), 512)
		for k := range kindNames {
			kind := copyKind(k)
			ce, err := measure(kind, size, pieces, PathCopyEngine)
			if err == nil {
				var kt time.Duration
				kt, err = measure(kind, size, pieces, PathKernel)
				c.Rows = append(c.Rows, CalibrationRow{Direction: kindNames[kind], PieceBytes: size, Pieces: pieces, CopyEngine: ce, Kernel: kt})
			}
			if err != nil {
				c = Calibration{Err: fmt.Errorf("gpu: calibrating %s %d KiB: %w", kindNames[kind], size>>10, err)}
				return c, c.Err
			}
		}
	}
	return c, nil
}

// calBytes is how many bytes one calibration copy moves at most: enough
// on a GPU to see the link's bandwidth past the launch's latency; little
// on the fallback, where both paths are a memcpy.
func (d *Device) calBytes() int {
	if d.host {
		return 256 << 10
	}
	return 4 << 20
}

// calScratch is the default measureFunc's state: scratch arenas of one
// piece size (reused by every direction and path of that size) and one
// engine per path, forced onto it, with a ring sized for the largest
// measurement; its copies are not counted in CopyStats.
type calScratch struct {
	d         *Device
	bb, n     int
	dev, dev2 *DeviceArena
	pin       *PinnedArena
	eng       [3]*CopyEngine // by Path
}

func (s *calScratch) close() {
	for _, e := range s.eng {
		if e != nil {
			_ = e.Close()
		}
	}
	s.eng = [3]*CopyEngine{}
	s.free()
}

func (s *calScratch) free() {
	if s.dev != nil {
		_ = s.dev.Close()
		_ = s.dev2.Close()
		_ = s.pin.Close()
	}
	s.dev, s.dev2, s.pin, s.bb, s.n = nil, nil, nil, 0, 0
}

// scratch makes sure the arenas hold pieces blocks of pieceBytes.
func (s *calScratch) scratch(pieceBytes, pieces int) error {
	if s.dev != nil && s.bb == pieceBytes && s.n >= pieces {
		return nil
	}
	s.free()
	var err error
	if s.dev, err = s.d.AllocDevice(pieces, pieceBytes); err != nil {
		return err
	}
	if s.dev2, err = s.d.AllocDevice(pieces, pieceBytes); err != nil {
		_ = s.dev.Close()
		s.dev = nil
		return err
	}
	if s.pin, err = s.d.AllocPinned(pieces, pieceBytes); err != nil {
		_ = s.dev.Close()
		_ = s.dev2.Close()
		s.dev = nil
		return err
	}
	s.bb, s.n = pieceBytes, pieces
	return nil
}

// measure is the default measureFunc: a scattered copy (random
// permutations on both sides) through the scratch engine of path, the
// fastest of three runs after one to warm up (the kernel's JIT, first
// touches).
func (s *calScratch) measure(kind copyKind, pieceBytes, pieces int, path Path) (time.Duration, error) {
	if err := s.scratch(pieceBytes, pieces); err != nil {
		return 0, err
	}
	e := s.eng[path]
	if e == nil {
		var err error
		e, err = s.d.NewCopyEngine(WithPath(path), uncounted(), withRingDescs(512*(256<<10)/kernelChunk))
		if err != nil {
			return 0, err
		}
		s.eng[path] = e
	}
	rng := rand.New(rand.NewPCG(uint64(pieceBytes), uint64(kind)))
	src, dst := rng.Perm(pieces), rng.Perm(pieces)
	id := func(i int) kvlease.BlockID { return kvlease.BlockID(i) }
	var start func() (*kvlease.Transfer, error)
	switch kind {
	case deviceToDevice:
		pairs := make([]kvlease.CopyPair[DevicePtr, DevicePtr], pieces)
		for i := range pairs {
			pairs[i] = kvlease.CopyPair[DevicePtr, DevicePtr]{Src: s.dev.Region(id(src[i])), Dst: s.dev2.Region(id(dst[i]))}
		}
		start = func() (*kvlease.Transfer, error) { return e.DeviceToDevice().Start(pairs, noAttachCal) }
	case hostToDevice:
		pairs := make([]kvlease.CopyPair[[]byte, DevicePtr], pieces)
		for i := range pairs {
			pairs[i] = kvlease.CopyPair[[]byte, DevicePtr]{Src: s.pin.Region(id(src[i])), Dst: s.dev.Region(id(dst[i]))}
		}
		start = func() (*kvlease.Transfer, error) { return e.HostToDevice().Start(pairs, noAttachCal) }
	default:
		pairs := make([]kvlease.CopyPair[DevicePtr, []byte], pieces)
		for i := range pairs {
			pairs[i] = kvlease.CopyPair[DevicePtr, []byte]{Src: s.dev.Region(id(src[i])), Dst: s.pin.Region(id(dst[i]))}
		}
		start = func() (*kvlease.Transfer, error) { return e.DeviceToHost().Start(pairs, noAttachCal) }
	}
	best := time.Duration(-1)
	for run := range 4 {
		t0 := time.Now()
		tr, err := start()
		if err != nil {
			return 0, err
		}
		<-tr.Done()
		if err := tr.Err(); err != nil {
			return 0, err
		}
		if el := time.Since(t0); run > 0 && (best < 0 || el < best) {
			best = el
		}
	}
	return max(best, 1), nil
}

func noAttachCal(*kvlease.Transfer) error { return nil }

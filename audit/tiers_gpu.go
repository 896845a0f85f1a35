package audit

import (
	"errors"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/gpu"

	"go.uber.org/atomic"
)

// runTiersGPU is RunTiers on cfg.GPU: device and pinned arenas, two
// engines (kernel, copy engine) used alternately, blocks read and written
// through synchronous copies. Whatever it allocated is freed at the end;
// an arena or engine that refuses to close (a copy still in flight) is a
// violation.
func runTiersGPU(cfg TiersConfig) (*TiersReport, error) {
	d := cfg.GPU
	var closers []func() error
	closeAll := func() error {
		var errs []error
		for i := len(closers) - 1; i >= 0; i-- {
			errs = append(errs, closers[i]())
		}
		closers = nil
		return errors.Join(errs...)
	}
	devMem, err := d.AllocDevice(cfg.DeviceBlocks, cfg.BlockBytes)
	if err != nil {
		return nil, err
	}
	closers = append(closers, devMem.Close)
	hostMem, err := d.AllocPinned(cfg.HostBlocks, cfg.BlockBytes)
	if err != nil {
		_ = closeAll()
		return nil, err
	}
	closers = append(closers, hostMem.Close)
	kern, err := d.NewCopyEngine(gpu.WithPath(gpu.PathKernel))
	if err != nil {
		_ = closeAll()
		return nil, err
	}
	closers = append(closers, kern.Close)
	ce, err := d.NewCopyEngine(gpu.WithPath(gpu.PathCopyEngine))
	if err != nil {
		_ = closeAll()
		return nil, err
	}
	closers = append(closers, ce.Close)

	r := newTiersRun[gpu.DevicePtr](cfg)
	buf := make([]byte, cfg.BlockBytes)
	r.load = func(p gpu.DevicePtr) ([]byte, error) { return buf, d.CopyToHost(buf, p) }
	r.store = func(p gpu.DevicePtr, b []byte) error { return d.CopyFromHost(p, b) }
	if r.dev, err = kvlease.NewPool[gpu.DevicePtr](devMem, tierPoolOptions()...); err != nil {
		_ = closeAll()
		return nil, err
	}
	if r.host, err = kvlease.NewPool[[]byte](hostMem, tierPoolOptions()...); err != nil {
		_ = closeAll()
		return nil, err
	}
	var n1, n2 atomic.Uint64
	offload := faultyTransport[gpu.DevicePtr, []byte]{next: [2]kvlease.Transport[gpu.DevicePtr, []byte]{kern.DeviceToHost(), ce.DeviceToHost()},
		n: &n1, after: func(*kvlease.Transfer) {}}
	onload := faultyTransport[[]byte, gpu.DevicePtr]{next: [2]kvlease.Transport[[]byte, gpu.DevicePtr]{kern.HostToDevice(), ce.HostToDevice()},
		n: &n2, after: func(*kvlease.Transfer) {}}
	st0 := d.CopyStats()
	rep, err := r.run(offload, onload)
	if err != nil {
		_ = closeAll()
		return nil, err
	}
	st := d.CopyStats()
	rep.Device = d.Name()
	rep.KernelSubmits = st.KernelLaunches - st0.KernelLaunches
	rep.EngineSubmits = st.BatchedSubmits + st.LoopedSubmits - st0.BatchedSubmits - st0.LoopedSubmits
	if rep.Requests >= 100 && (rep.KernelSubmits == 0 || rep.EngineSubmits == 0) {
		r.violate(&rep.Other, "a path never carried a copy: kernel %d, copy engine %d submissions (%v)", rep.KernelSubmits, rep.EngineSubmits, st)
	}
	if err := closeAll(); err != nil {
		r.violate(&rep.Other, "freeing the device memory and engines after the drain: %v", err)
	}
	return rep, nil
}

package gpu_test

import (
	"fmt"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/gpu"
)

// Offload a request's KV blocks from device memory to pinned host memory.
// The example runs on the CPU fallback; with a GPU, gpu.Open(0) is the only
// change.
func Example() {
	dev := gpu.OpenHost()
	const blocks, blockBytes = 16, 4096 // blockBytes: a multiple of gpu.Alignment

	devMem, _ := dev.AllocDevice(blocks, blockBytes)
	hostMem, _ := dev.AllocPinned(blocks, blockBytes)
	engine, _ := dev.NewCopyEngine()
	gpuPool, _ := kvlease.NewPool[gpu.DevicePtr](devMem)
	hostPool, _ := kvlease.NewPool[[]byte](hostMem)

	// A request's KV lives in two device blocks.
	kv, _ := gpuPool.Acquire("req-42", 2)
	for i := range kv.Len() {
		p, _ := kv.Region(i)
		block := make([]byte, blockBytes)
		for j := range block {
			block[j] = byte(10*i + 1)
		}
		_ = dev.CopyFromHost(p, block)
	}

	// Offload them: the transfer is attached to both leases before a byte
	// moves, so neither side's blocks can be reused while it is in flight.
	offload, _ := hostPool.Acquire("req-42", 2)
	pairs := make([]kvlease.CopyPair[gpu.DevicePtr, []byte], kv.Len())
	for i := range pairs {
		pairs[i].Src, _ = kv.Region(i)
		pairs[i].Dst, _ = offload.Region(i)
	}
	tr, err := engine.DeviceToHost().Start(pairs, func(t *kvlease.Transfer) error {
		if err := kv.AttachRange(t, 0, kv.Len(), kvlease.Read); err != nil {
			return err
		}
		return offload.AttachRange(t, 0, offload.Len(), kvlease.Write)
	})
	if err != nil {
		fmt.Println("start:", err)
		return
	}

	// The device blocks may be released at once: they drain until the
	// copy's completion resolves the transfer, then return to the pool.
	kv.Release()
	<-kv.Settled()
	fmt.Println("transfer:", tr.State(), tr.Err())
	for i := range offload.Len() {
		r, _ := offload.Region(i)
		fmt.Printf("host block %d: len %d, first byte %d\n", i, len(r), r[0])
	}
	fmt.Println("device pool free:", gpuPool.Stats().Free)

	// Tear down in order: leases, pools, engine and arenas, device.
	offload.Release()
	<-offload.Settled()
	_ = gpuPool.Close()
	_ = hostPool.Close()
	fmt.Println(engine.Close(), devMem.Close(), hostMem.Close(), dev.Close())
	// Output:
	// transfer: resolved <nil>
	// host block 0: len 4096, first byte 1
	// host block 1: len 4096, first byte 11
	// device pool free: 16
	// <nil> <nil> <nil> <nil>
}

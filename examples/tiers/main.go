// Command tiers runs a tiered KV cache (device, pinned host, disk) on the
// gpu package's CPU fallback over a trace whose working set is four times
// the device pool, and prints each tier's hits, the hit rates of a
// device-only cache and of an unbounded one on the same trace, and the
// marker check of every onboarded block:
//
//	go run ./examples/tiers
//	go run ./examples/tiers -gpu    # on CUDA device 0 (gpu.Open), same output
//
// Output (scripts read the first and last lines' forms):
//
//	tier device hits N of M
//	tier host hits N of M
//	tier disk hits N of M
//	hit rate device-only X% tiered Y% unbounded Z%
//	marker mismatches 0
package main

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/gpu"
	"github.com/kvlease/kvlease/tiers"
)

const blockBytes = 4096

func main() {
	var (
		requests = flag.Int("requests", 2000, "requests in the trace")
		seed     = flag.Uint64("seed", 17, "trace seed")
		devN     = flag.Int("device", 64, "device pool blocks")
		hostN    = flag.Int("host", 192, "host pool blocks")
		diskN    = flag.Int("disk", 1024, "disk slots (0: no disk tier)")
		docs     = flag.Int("docs", 32, "documents (each a shared prefix)")
		docLen   = flag.Int("doc-blocks", 8, "blocks per document")
		policy   = flag.String("policy", "write-back", "write-back or write-through")
		onGPU    = flag.Bool("gpu", false, "run on CUDA device 0 (gpu.Open) instead of the CPU fallback")
	)
	flag.Parse()
	open := func() (*gpu.Device, error) { return gpu.OpenHost(), nil }
	if *onGPU {
		open = func() (*gpu.Device, error) {
			d, err := gpu.Open(0)
			if err == nil {
				fmt.Fprintf(os.Stderr, "tiers: on %s (CUDA device 0)\n", d.Name())
			}
			return d, err
		}
	}
	if err := run(os.Stdout, open, *requests, *seed, *devN, *hostN, *diskN, *docs, *docLen, *policy); err != nil {
		fmt.Fprintln(os.Stderr, "tiers:", err)
		os.Exit(1)
	}
}

// stamp fills b with content only hash h produces: the audit's marker
// for tiered KV (content is a function of the prefix).
func stamp(b []byte, h kvlease.BlockHash) {
	var x [16]byte
	for off := 0; off < len(b); off += 8 {
		binary.LittleEndian.PutUint64(x[:], uint64(h))
		binary.LittleEndian.PutUint64(x[8:], uint64(off))
		binary.LittleEndian.PutUint64(b[off:], xxhash.Sum64(x[:]))
	}
}

func run(w io.Writer, open func() (*gpu.Device, error), requests int, seed uint64, devN, hostN, diskN, docs, docLen int, policyName string) error {
	var pol tiers.Policy
	switch policyName {
	case "write-back":
		pol = tiers.WriteBack
	case "write-through":
		pol = tiers.WriteThrough
	default:
		return fmt.Errorf("unknown policy %q (write-back or write-through)", policyName)
	}
	dev, err := open()
	if err != nil {
		return err
	}
	devMem, err := dev.AllocDevice(devN, blockBytes)
	if err != nil {
		return err
	}
	hostMem, err := dev.AllocPinned(hostN, blockBytes)
	if err != nil {
		return err
	}
	engine, err := dev.NewCopyEngine()
	if err != nil {
		return err
	}
	devPool, err := kvlease.NewPool[gpu.DevicePtr](devMem, kvlease.WithSealRecords())
	if err != nil {
		return err
	}
	hostPool, err := kvlease.NewPool[[]byte](hostMem, kvlease.WithSealRecords())
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "kvlease-tiers-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	var disk *tiers.Disk
	if diskN > 0 {
		if disk, err = tiers.OpenDisk(tiers.DiskConfig{Dir: dir, Slots: diskN, BlockBytes: blockBytes, Workers: 4, Direct: true}); err != nil {
			return err
		}
	}
	cache, err := tiers.New(tiers.Config[gpu.DevicePtr]{
		Device: devPool, Host: hostPool, Disk: disk,
		Offload: engine.DeviceToHost(), Onload: engine.HostToDevice(), Policy: pol,
		DeviceReserve: devN / 4, HostReserve: hostN / 8,
	})
	if err != nil {
		return err
	}

	// The same trace drives a device-only cache (a plain pool of the
	// device's size) and an unbounded one (a set).
	plainMem, _ := kvlease.NewHostMemory(devN, 64)
	plain, _ := kvlease.NewPool[[]byte](plainMem)
	seen := map[kvlease.BlockHash]bool{}
	var plainHits, unboundedHits, queried, mismatches int

	chains := make([][]kvlease.BlockHash, docs)
	for d := range chains {
		toks := make([]int32, docLen*16)
		for i := range toks {
			toks[i] = int32(d*1_000_000 + i)
		}
		chains[d] = kvlease.ChainHashes(kvlease.BlockHash(seed), toks, 16)
	}
	rng := rand.New(rand.NewPCG(seed, 1))
	buf := make([]byte, blockBytes)
	want := make([]byte, blockBytes)
	for range requests {
		hashes := chains[rng.IntN(docs)]
		n := len(hashes)
		queried += n

		// Unbounded and device-only.
		k := 0
		for k < n && seen[hashes[k]] {
			k++
		}
		unboundedHits += k
		for _, h := range hashes {
			seen[h] = true
		}
		pl, hits, err := plain.AcquirePrefix("r", hashes, n)
		if err != nil {
			return err
		}
		plainHits += hits
		for i := hits; i < n; i++ {
			_ = pl.Seal(i, hashes[i])
		}
		pl.Release()

		// Tiered.
		o, err := cache.Acquire("r", hashes, n)
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		valid, err := o.Wait(ctx)
		cancel()
		if err != nil {
			return err
		}
		for i := range valid {
			p, err := devPool.Region(o.Lease.Ref(i))
			if err != nil {
				return err
			}
			if err := dev.CopyToHost(buf, p); err != nil {
				return err
			}
			stamp(want, hashes[i])
			if string(buf) != string(want) {
				mismatches++
			}
		}
		for i := valid; i < n; i++ {
			p, err := devPool.Region(o.Lease.Ref(i))
			if err != nil {
				return err
			}
			stamp(want, hashes[i])
			if err := dev.CopyFromHost(p, want); err != nil {
				return err
			}
			var parent kvlease.BlockHash
			if i > 0 {
				parent = hashes[i-1]
			}
			if err := cache.Seal(o.Lease, i, parent, hashes[i]); err != nil {
				return err
			}
		}
		o.Lease.Release()
		// Let this request's offloads land before the next one, as a
		// serving engine's step time would.
		for devPool.Stats().Draining+hostPool.Stats().Draining > 0 || devPool.Stats().Leased > 0 {
			time.Sleep(20 * time.Microsecond)
		}
	}
	st := cache.Stats()
	for t := tiers.TierDevice; t <= tiers.TierDisk; t++ {
		fmt.Fprintf(w, "tier %s hits %d of %d\n", t, st.Tiers[t].Hits, st.Queried)
	}
	tiered := st.Tiers[0].Hits + st.Tiers[1].Hits + st.Tiers[2].Hits
	pct := func(n int) float64 { return 100 * float64(n) / float64(queried) }
	fmt.Fprintf(w, "hit rate device-only %.1f%% tiered %.1f%% unbounded %.1f%%\n", pct(plainHits), pct(int(tiered)), pct(unboundedHits))
	fmt.Fprintf(w, "offloaded host %d disk %d, onboarded host %d disk %d, copy failures %d\n",
		st.Tiers[1].Offloaded, st.Tiers[2].Offloaded, st.Tiers[1].Onboarded, st.Tiers[2].Onboarded,
		st.Tiers[0].CopyFailures+st.Tiers[1].CopyFailures+st.Tiers[2].CopyFailures)

	// Tear down in order: every pool at rest first (nothing open, leased,
	// draining or quarantined), or the run failed.
	_ = cache.Close()
	if err := errors.Join(devPool.CheckQuiescent(), hostPool.CheckQuiescent()); err != nil {
		return err
	}
	if disk != nil {
		if err := disk.Pool().CheckQuiescent(); err != nil {
			return err
		}
	}
	_ = devPool.Close()
	_ = hostPool.Close()
	if disk != nil {
		if err := disk.Close(); err != nil {
			return err
		}
	}
	if err := engine.Close(); err != nil {
		return err
	}
	_ = devMem.Close()
	_ = hostMem.Close()
	_ = dev.Close()
	fmt.Fprintf(w, "marker mismatches %d\n", mismatches)
	return nil
}

package kvlease

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"

	"go.uber.org/atomic"
)

// Churn: many owners acquire, stamp, extend, seal, attach transfers and
// release or abort concurrently, while transports read and write the
// blocks late, fail, get cancelled or quarantined and late-resolved.
//
// Isolation is checked with markers: every block a lease owns privately
// holds leaseMarker(id, i) in every word, every sealed block holds its
// hash, and owners and transports verify them. A block handed to a new
// owner while a transport may still touch it shows up as a foreign marker
// or (under -race) as a data race, since the only happens-before edge
// between them is the pool's evidence of quiescence.
//
// The outcome is deterministic: no timing is asserted; every wait ends
// because every transfer is eventually resolved.

const churnBlockBytes = 64

func leaseMarker(id uint64, i int) uint64 { return 1<<63 | id<<8 | uint64(i) }

func churnStamp(r []byte, m uint64) {
	for off := 0; off+8 <= len(r); off += 8 {
		binary.LittleEndian.PutUint64(r[off:], m)
	}
}

func churnCheck(r []byte, m uint64) error {
	for off := 0; off+8 <= len(r); off += 8 {
		if got := binary.LittleEndian.Uint64(r[off:]); got != m {
			return fmt.Errorf("word %d holds %#x, want %#x", off/8, got, m)
		}
	}
	return nil
}

// churnChain is the hashes of prefix chain c (not real token hashes: the
// index only needs distinct, chain-shaped keys).
func churnChain(c int) []BlockHash {
	h := make([]BlockHash, 4)
	for k := range h {
		h[k] = BlockHash(100*(c+1) + k)
	}
	return h
}

// churnTransport simulates an asynchronous copy over some regions. It
// touches memory only under mu and checks stopped first, so a cancel hook
// that sets stopped under mu has proof of quiescence when it unlocks.
type churnTransport struct {
	mu      sync.Mutex
	stopped bool
	tr      *Transfer
}

type churnEnv struct {
	t         *testing.T
	p         *Pool[[]byte]
	transport sync.WaitGroup
	failures  atomic.Int64
	firstErr  sync.Once
	acquired  atomic.Int64
	leasesMu  sync.Mutex
	leases    []*Lease[[]byte]
}

func (e *churnEnv) fail(format string, args ...any) {
	e.failures.Add(1)
	e.firstErr.Do(func() { e.t.Errorf(format, args...) })
}

// newTransport makes a transfer whose cancel hook stops the copy and then
// resolves (the fence is the mutex).
func (e *churnEnv) newTransport() *churnTransport {
	ct := &churnTransport{}
	ct.tr = NewTransfer(func() {
		ct.mu.Lock()
		ct.stopped = true
		ct.mu.Unlock()
		ct.tr.Resolve(errors.New("cancelled; copy engine fenced"))
	})
	return ct
}

// run copies block by block: a send checks the markers, a receive writes
// them. Then it ends the transfer the way end says.
func (e *churnEnv) run(ct *churnTransport, regions [][]byte, markers []uint64, write bool, end int, rng *rand.Rand) {
	e.transport.Add(1)
	yields, late := rng.IntN(30), rng.IntN(20) // not inside the goroutine: rng is the worker's
	go func() {
		defer e.transport.Done()
		for i, r := range regions {
			for range yields / len(regions) {
				runtime.Gosched()
			}
			ct.mu.Lock()
			if ct.stopped {
				ct.mu.Unlock()
				return // the cancel hook resolved it
			}
			if write {
				churnStamp(r, markers[i])
			} else if err := churnCheck(r, markers[i]); err != nil {
				e.fail("transport read block %d: %v", i, err)
			}
			ct.mu.Unlock()
		}
		switch end {
		case 0:
			ct.tr.Resolve(nil)
		case 1:
			ct.tr.Resolve(errors.New("copy failed, engine stopped"))
		default:
			// The ack was lost: quarantined, then the evidence arrives late.
			ct.tr.Quarantine(errors.New("ack lost"))
			for range late {
				runtime.Gosched()
			}
			ct.tr.Resolve(nil)
		}
	}()
}

func (e *churnEnv) acquire(rng *rand.Rand, owner string) (*Lease[[]byte], int, []BlockHash) {
	n := 1 + rng.IntN(6)
	switch rng.IntN(4) {
	case 0: // prefix
		hs := churnChain(rng.IntN(3))[:1+rng.IntN(4)]
		l, hits, err := e.p.AcquirePrefix(owner, hs, n)
		if err == nil {
			return l, hits, hs
		}
		if !errors.Is(err, ErrExhausted) {
			e.fail("AcquirePrefix: %v", err)
		}
	case 1: // plain
		l, err := e.p.Acquire(owner, n)
		if err == nil {
			return l, 0, nil
		}
		if !errors.Is(err, ErrExhausted) {
			e.fail("Acquire: %v", err)
		}
	case 2: // a wait that may be cut short
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rng.IntN(200))*time.Microsecond)
		l, err := e.p.AcquireWait(ctx, owner, n)
		cancel()
		if err == nil {
			return l, 0, nil
		}
		if !errors.Is(err, context.DeadlineExceeded) {
			e.fail("AcquireWait with a deadline: %v", err)
		}
	}
	l, err := e.p.AcquireWait(context.Background(), owner, n)
	if err != nil {
		e.fail("AcquireWait: %v", err)
		return nil, 0, nil
	}
	return l, 0, nil
}

func (e *churnEnv) worker(w, iters int) {
	rng := rand.New(rand.NewPCG(uint64(w), 0x6b766c65617365))
	for it := range iters {
		owner := fmt.Sprintf("w%d-%d", w, it)
		l, hits, hs := e.acquire(rng, owner)
		if l == nil {
			return
		}
		e.acquired.Add(1)
		e.leasesMu.Lock()
		e.leases = append(e.leases, l)
		e.leasesMu.Unlock()
		id := l.ID()
		region := func(i int) []byte {
			r, err := l.Region(i)
			if err != nil {
				e.fail("Region(%d) of an open lease: %v", i, err)
			}
			return r
		}
		readRegion := func(i int) []byte {
			r, err := l.ReadRegion(i)
			if err != nil {
				e.fail("ReadRegion(%d) of an open lease: %v", i, err)
			}
			return r
		}
		// What every block must hold: hits hold their hash (immutable
		// sealed content); the owner stamps the rest.
		want := make([]uint64, l.Len())
		sealed := hits // blocks [0, sealed) are sealed with hs[i]
		for i := range want {
			switch {
			case i < hits:
				want[i] = uint64(hs[i])
			case i == sealed && i < len(hs) && rng.IntN(2) == 0:
				// A fresh block of the chain: fill it, then seal it.
				want[i] = uint64(hs[i])
				churnStamp(region(i), want[i])
				if err := l.Seal(i, hs[i]); err != nil {
					e.fail("Seal(%d): %v", i, err)
				}
				sealed++
			default:
				want[i] = leaseMarker(id, i)
				churnStamp(region(i), want[i])
			}
		}
		for i := 0; i < hits; i++ {
			if err := churnCheck(readRegion(i), want[i]); err != nil {
				e.fail("prefix hit %d of lease %d: %v", i, id, err)
			}
		}
		if rng.IntN(3) == 0 {
			k := 1 + rng.IntN(2)
			switch err := l.Extend(k); {
			case err == nil:
				for i := len(want); i < l.Len(); i++ {
					want = append(want, leaseMarker(id, i))
					churnStamp(region(i), want[i])
				}
			case errors.Is(err, ErrExhausted):
			default:
				e.fail("Extend: %v", err)
			}
		}
		n := l.Len()

		// Transfers: reads anywhere, writes only on the unsealed tail
		// [sealed, n), disjoint from the reads.
		var writes []*churnTransport
		writeFrom := n
		if sealed < n && rng.IntN(2) == 0 {
			writeFrom = sealed + rng.IntN(n-sealed)
			ct := e.newTransport()
			if err := l.AttachRange(ct.tr, writeFrom, n, Write); err != nil {
				e.fail("AttachRange write [%d,%d) sealed=%d: %v", writeFrom, n, sealed, err)
			}
			var regs [][]byte
			for i := writeFrom; i < n; i++ {
				regs = append(regs, region(i))
			}
			e.run(ct, regs, want[writeFrom:n], true, rng.IntN(3), rng)
			writes = append(writes, ct)
		}
		if writeFrom > 0 && rng.IntN(2) == 0 {
			from := rng.IntN(writeFrom)
			to := from + 1 + rng.IntN(writeFrom-from)
			ct := e.newTransport()
			if err := l.AttachRange(ct.tr, from, to, Read); err != nil {
				e.fail("AttachRange read: %v", err)
			}
			var regs [][]byte
			for i := from; i < to; i++ {
				regs = append(regs, readRegion(i))
			}
			e.run(ct, regs, want[from:to], false, rng.IntN(3), rng)
		}
		if rng.IntN(4) == 0 {
			// A fence over the whole lease that touches no memory.
			fence := NewTransfer(nil)
			if err := l.Attach(fence); err != nil {
				e.fail("Attach: %v", err)
			}
			e.transport.Add(1)
			go func(q bool) {
				defer e.transport.Done()
				runtime.Gosched()
				if q {
					fence.Quarantine(nil)
					runtime.Gosched()
				}
				fence.Resolve(nil)
			}(rng.IntN(2) == 0)
		}

		// Check every block the owner may read now.
		waitWrites := rng.IntN(2) == 0
		if waitWrites {
			for _, ct := range writes {
				<-ct.tr.Done()
			}
		}
		for i := 0; i < n; i++ {
			if i >= writeFrom && !waitWrites {
				continue // a transport may still be writing it
			}
			if err := churnCheck(readRegion(i), want[i]); err != nil {
				e.fail("owner of lease %d block %d (%v): %v", id, i, l.Ref(i), err)
			}
		}

		// Close, sometimes racing an Extend from another goroutine.
		var racer sync.WaitGroup
		if rng.IntN(4) == 0 {
			racer.Add(1)
			go func() {
				defer racer.Done()
				err := l.Extend(1)
				if err != nil && !errors.Is(err, ErrLeaseClosed) && !errors.Is(err, ErrExhausted) &&
					!errors.Is(err, ErrExceedsCapacity) {
					e.fail("Extend racing close: %v", err)
				}
			}()
		}
		if rng.IntN(2) == 0 {
			l.Release()
		} else {
			l.Abort(nil)
		}
		racer.Wait()
		if _, err := l.Region(0); !errors.Is(err, ErrLeaseClosed) {
			e.fail("Region after close: %v", err)
		}
	}
}

func TestChurn(t *testing.T) {
	workers, iters := 8, 300
	if testing.Short() {
		iters = 30
	}
	const capacity = 64
	var settledMu sync.Mutex
	settled := map[uint64]int{}
	var leaked atomic.Int64
	obs := ObserverFunc(func(ev Event) {
		switch ev.Kind {
		case EventSettled:
			settledMu.Lock()
			settled[ev.Lease]++
			settledMu.Unlock()
		case EventLeaked:
			leaked.Add(1)
		}
	})
	e := &churnEnv{t: t, p: corePool(t, capacity, WithObserver(obs), WithLeakCheck(true))}
	mem := e.p.Memory()
	if mem.BlockBytes() != churnBlockBytes {
		t.Fatalf("block size %d", mem.BlockBytes())
	}

	// Sample the counts concurrently: they always sum to capacity.
	stop := make(chan struct{})
	sampled := make(chan int)
	go func() {
		n := 0
		for {
			select {
			case <-stop:
				sampled <- n
				return
			default:
			}
			st := e.p.Stats()
			if sum := st.Free + st.Cached + st.Leased + st.Draining + st.Quarantined; sum != st.Capacity {
				e.fail("sampled counts %+v sum to %d", coreCountsOf(st), sum)
			}
			if n%64 == 0 {
				if err := e.p.Check(); err != nil {
					e.fail("Check during churn: %v", err)
				}
			}
			n++
			runtime.Gosched()
		}
	}()

	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() { defer wg.Done(); e.worker(w, iters) }()
	}
	wg.Wait()
	e.transport.Wait()
	close(stop)
	samples := <-sampled
	if e.failures.Load() > 0 {
		t.Fatalf("%d isolation or API failures", e.failures.Load())
	}

	coreAllFree(t, e.p)
	st := e.p.Stats()
	if st.Acquires != uint64(e.acquired.Load()) || st.Waiters != 0 {
		t.Fatalf("stats %+v, %d acquired", st, e.acquired.Load())
	}
	for _, l := range e.leases {
		if l.State() != LeaseSettled {
			t.Fatalf("lease %d (%s) is %v", l.ID(), l.Owner(), l.State())
		}
		<-l.Settled()
	}
	settledMu.Lock()
	nSettled := len(settled)
	for id, n := range settled {
		if n != 1 {
			t.Errorf("lease %d reported settled %d times", id, n)
		}
	}
	settledMu.Unlock()
	if nSettled != len(e.leases) {
		t.Fatalf("%d leases reported settled, %d leases", nSettled, len(e.leases))
	}
	if leaked.Load() != 0 {
		t.Fatalf("%d leak reports for closed leases", leaked.Load())
	}
	// Every cached block still holds its hash: sealed content is immutable.
	for c := range 3 {
		hs := churnChain(c)
		if k := e.p.CachedPrefix(hs); k > 0 {
			l, hits, err := e.p.AcquirePrefix("final", hs, k)
			coreNoErr(t, err, "final AcquirePrefix")
			for i := range hits {
				r, _ := l.ReadRegion(i)
				if err := churnCheck(r, uint64(hs[i])); err != nil {
					t.Fatalf("cached block %d of chain %d: %v", i, c, err)
				}
			}
			l.Release()
		}
	}
	coreAllFree(t, e.p)
	t.Logf("%d leases, %d stats samples, final %+v", len(e.leases), samples, coreCountsOf(st))
}

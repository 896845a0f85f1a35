package kvlease

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// sealedContent is what a block sealed with hash h holds in the churn
// test: anyone hitting h must read exactly this.
func sealedContent(dst []byte, h BlockHash) {
	for i := 0; i+8 <= len(dst); i += 8 {
		binary.LittleEndian.PutUint64(dst[i:], uint64(h)+uint64(i))
	}
}

// privateContent marks a block only its lease may see.
func privateContent(dst []byte, lease uint64, i int) {
	for j := 0; j+8 <= len(dst); j += 8 {
		binary.LittleEndian.PutUint64(dst[j:], lease<<20|uint64(i)<<8|uint64(j)|1<<63)
	}
}

// TestPrefixChurnMarkers runs many requests that share system prompts
// through a small verified-mode pool: hits must see exactly the sealed
// content, private blocks exactly their owner's marker, under eviction
// pressure, late transfers and aborts. Run it under -race.
func TestPrefixChurnMarkers(t *testing.T) {
	const (
		workers   = 8
		iters     = 300
		bt        = 4
		blockSize = 64
		seed      = BlockHash(0x5eed)
	)
	mem, err := NewHostMemory(48, blockSize)
	require.NoError(t, err)
	p, err := NewPool[[]byte](mem, WithVerifiedPrefix(bt))
	require.NoError(t, err)

	var wg sync.WaitGroup
	var pending sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			fail := func(format string, args ...any) {
				select {
				case errs <- fmt.Errorf(format, args...):
				default:
				}
			}
			for it := range iters {
				sys := rng.IntN(3)
				toks := prompt(sys, bt*(2+sys))                                    // shared system prompt
				toks = append(toks, prompt(100+w, bt*rng.IntN(3)+rng.IntN(bt))...) // the user's turn
				full := len(toks) / bt
				n := full + 1
				l, hits, err := p.AcquirePrefixTokens(fmt.Sprintf("w%d-%d", w, it), seed, toks, n)
				if errors.Is(err, ErrExhausted) {
					continue
				}
				if err != nil {
					fail("acquire: %v", err)
					return
				}
				hashes := ChainHashes(seed, toks, bt)
				for i := range hits {
					r, _ := l.ReadRegion(i)
					want := make([]byte, blockSize)
					sealedContent(want, hashes[i])
					if string(r) != string(want) {
						fail("lease %d hit block %d (%v) holds foreign content", l.ID(), i, l.Ref(i))
					}
				}
				parent := seed
				if hits > 0 {
					parent = hashes[hits-1]
				}
				for i := hits; i < n; i++ {
					r, _ := l.Region(i)
					if i < full {
						sealedContent(r, hashes[i])
						h, err := l.SealTokens(i, parent, toks[i*bt:(i+1)*bt])
						if err != nil || h != hashes[i] {
							fail("seal block %d: %v", i, err)
						}
						parent = h
					} else {
						privateContent(r, l.ID(), i)
					}
				}
				// Sometimes an asynchronous send reads the whole lease.
				var tr *Transfer
				if rng.IntN(3) == 0 {
					tr = NewTransfer(nil)
					if err := l.Attach(tr); err != nil {
						fail("attach: %v", err)
					}
				}
				r, _ := l.ReadRegion(n - 1)
				want := make([]byte, blockSize)
				privateContent(want, l.ID(), n-1)
				if string(r) != string(want) {
					fail("lease %d private block overwritten", l.ID())
				}
				if rng.IntN(4) == 0 {
					l.Abort(nil)
				} else {
					l.Release()
				}
				if tr != nil {
					pending.Add(1)
					go func() {
						defer pending.Done()
						if rng := rand.New(rand.NewPCG(tr.ID(), 1)); rng.IntN(4) == 0 {
							tr.Quarantine(nil)
						}
						tr.Resolve(nil)
					}()
				}
			}
		}()
	}
	done := make(chan struct{})
	go func() {
		for {
			select {
			case <-done:
				return
			default:
			}
			s := p.Stats()
			if sum := s.Free + s.Cached + s.Leased + s.Draining + s.Quarantined; sum != s.Capacity {
				errs <- fmt.Errorf("state counts %+v sum to %d", s, sum)
				return
			}
		}
	}()
	wg.Wait()
	pending.Wait()
	close(done)
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	require.NoError(t, p.Check())
	s := p.Stats()
	require.Zero(t, s.Leased+s.Draining+s.Quarantined, "%+v", s)
	require.Equal(t, s.Capacity, s.Free+s.Cached)
	require.NotZero(t, s.PrefixHits, "the workload must exercise hits")
	require.NotZero(t, s.Evictions, "the workload must exercise eviction")
}

package tiers

import (
	"context"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
)

// BenchmarkTieredAdmit measures a request admitted with its prefix in the
// host tier through a Sequence (Cache.Admit: check, hash, look up across
// tiers, onboard, Wait recording the hits, release) next to the bare
// tiers path an engine writes without one (ChainHashes of the prompt's
// hittable blocks, Cache.Acquire, Wait, release), alternating in the same
// run (issue 31: within 1.10×). A 256-token prompt in blocks of 16: 15
// blocks onboarded from the host each time. Between requests the prompt's
// blocks are offered down again and the copies allowed to land, untimed.
func BenchmarkTieredAdmit(b *testing.B) {
	const bt, promptLen = 16, 256
	dm, _ := kvlease.NewHostMemory(64, 4096)
	hm, _ := kvlease.NewHostMemory(256, 4096)
	dev, _ := kvlease.NewPool[[]byte](dm, kvlease.WithBlockTokens(bt), kvlease.WithSealRecords())
	host, _ := kvlease.NewPool[[]byte](hm, kvlease.WithBlockTokens(bt), kvlease.WithSealRecords())
	c, err := New(Config[[]byte]{Device: dev, Host: host, Offload: NewMemCopy(dm, hm), Onload: NewMemCopy(dm, hm), DeviceReserve: -1})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	prompt := seqPrompt(7, promptLen)
	hb := (promptLen - 1) / bt
	settle := func() {
		for i := 0; ; i++ {
			d, h := dev.Stats(), host.Stats()
			if d.Leased+d.Draining+h.Leased+h.Draining == 0 {
				return
			}
			if i > 1_000_000 {
				b.Fatal("copies never landed")
			}
			time.Sleep(10 * time.Microsecond)
		}
	}
	down := func() { // every cached device block to the host
		dev.OfferCached(dev.Stats().Cached)
		settle()
	}
	tb := &tieredBench{b: b, c: c, prompt: prompt, hb: hb, bt: bt}
	// The prompt's blocks, sealed once and sent down.
	s, err := dev.Admit(kvlease.SequenceSpec{Owner: "warm", Seed: 3, Prompt: prompt})
	if err != nil {
		b.Fatal(err)
	}
	if err := s.Commit(s.Len()); err != nil {
		b.Fatal(err)
	}
	s.Lease().Release()
	down()
	var tSeq, tBare time.Duration
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		for k := range 2 {
			start := time.Now()
			if (i+k)%2 == 0 {
				tb.seqOp()
				tSeq += time.Since(start)
			} else {
				tb.bareOp()
				tBare += time.Since(start)
			}
			b.StopTimer()
			down()
			b.StartTimer()
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(tSeq.Nanoseconds())/float64(b.N), "seq-ns/op")
	b.ReportMetric(float64(tBare.Nanoseconds())/float64(b.N), "bare-ns/op")
	b.ReportMetric(float64(tSeq)/float64(tBare), "x-bare")
}

// tieredBench holds BenchmarkTieredAdmit's two requests, each a method
// of its own (not inlined) so that bench/instr counts each whole.
type tieredBench struct {
	b      *testing.B
	c      *Cache[[]byte]
	prompt []int32
	hb, bt int
}

//go:noinline
func (tb *tieredBench) seqOp() {
	o, err := tb.c.Admit(kvlease.SequenceSpec{Owner: "seq", Seed: 3, Prompt: tb.prompt})
	if err != nil {
		tb.b.Fatal(err)
	}
	if v, err := o.Wait(context.Background()); err != nil || v != tb.hb || o.Sequence.CachedTokens() != tb.hb*tb.bt {
		tb.b.Fatalf("valid %d cached %d: %v", v, o.Sequence.CachedTokens(), err)
	}
	o.Sequence.Lease().Release()
}

//go:noinline
func (tb *tieredBench) bareOp() {
	hashes := kvlease.ChainHashes(3, tb.prompt[:tb.hb*tb.bt], tb.bt)
	o, err := tb.c.Acquire("bare", hashes, (len(tb.prompt)+tb.bt-1)/tb.bt)
	if err != nil {
		tb.b.Fatal(err)
	}
	if v, err := o.Wait(context.Background()); err != nil || v != tb.hb {
		tb.b.Fatalf("valid %d: %v", v, err)
	}
	o.Lease.Release()
}

package kvlease

import (
	"testing"
)

// BenchmarkSequenceDecode measures a Sequence's bookkeeping per generated
// token, amortised over a request (admission of a one-block prompt, 256
// decoded tokens handed over one at a time, growth and a seal at every
// block boundary, release), next to the hand-written glue an engine
// writes without it (Extend at the boundary, SealTokens with a tracked
// parent), interleaved in the same run. Target (issue 24): ≤ 50 ns/token.
// Every request generates other tokens, so every seal is a fresh index
// entry and the pool evicts as it fills, in both.
func BenchmarkSequenceDecode(b *testing.B) {
	const (
		bt  = 16
		gen = 256
	)
	p := seqPool(b, 4096, WithBlockTokens(bt))
	prompt := seqTokens(bt, 1)
	var reqSeq, reqGlue int32
	op := func() {
		reqSeq++
		base := reqSeq << 12
		s, err := p.Admit(SequenceSpec{Owner: "seq", Prompt: prompt, MaxTokens: bt + gen})
		if err != nil {
			b.Fatal(err)
		}
		if err := s.Commit(bt); err != nil {
			b.Fatal(err)
		}
		for i := range int32(gen) {
			if err := s.AppendComputed(base + i); err != nil {
				b.Fatal(err)
			}
		}
		s.Lease().Release()
	}
	buf := make([]int32, 0, bt+gen)
	glue := func() {
		reqGlue++
		base := -reqGlue << 12
		l, err := p.Acquire("glue", 1)
		if err != nil {
			b.Fatal(err)
		}
		toks := append(buf[:0], prompt...)
		parent, err := l.SealTokens(0, 0, toks)
		if err != nil {
			b.Fatal(err)
		}
		for i := range int32(gen) {
			toks = append(toks, base+i)
			n := len(toks)
			if (n+bt-1)/bt > l.Len() {
				if err := l.Extend(1); err != nil {
					b.Fatal(err)
				}
			}
			if n%bt == 0 {
				k := n/bt - 1
				if parent, err = l.SealTokens(k, parent, toks[k*bt:n]); err != nil {
					b.Fatal(err)
				}
			}
		}
		l.Release()
	}
	b.ReportAllocs()
	spent := interleave(b, op, glue)
	tokens := float64(b.N) * gen
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/tokens, "ns/token")
	b.ReportMetric(float64(spent[0].Nanoseconds())/tokens, "glue-ns/token")
	b.ReportMetric(float64(b.Elapsed())/float64(spent[0]), "x-glue")
}

// BenchmarkAdmitPrefix4096 admits a 4,096-token prompt whose every block
// but the last token's is cached (Admit: hash the prompt once, look
// it up, lease 255 hits and a fresh block) and releases it, next to
// ChainHashes of the same prompt alone, interleaved in the same run
// (issue 24: the admission cost printed next to the hashing it cannot
// avoid). TestSequenceHashesOnce counts the hashing.
func BenchmarkAdmitPrefix4096(b *testing.B) {
	const bt = 16
	p := seqPool(b, 1024, WithBlockTokens(bt))
	prompt := seqTokens(4096, 11)
	warm, err := p.Admit(SequenceSpec{Owner: "warm", Seed: 3, Prompt: prompt})
	if err != nil {
		b.Fatal(err)
	}
	if err := warm.Commit(warm.Len()); err != nil {
		b.Fatal(err)
	}
	warm.Lease().Release()
	var sink BlockHash
	op := func() {
		s, err := p.Admit(SequenceSpec{Owner: "req", Seed: 3, Prompt: prompt})
		if err != nil || s.Hits() != 255 {
			b.Fatalf("hits %d: %v", s.Hits(), err)
		}
		s.Lease().Release()
	}
	chain := func() { sink += ChainHashes(3, prompt, bt)[255] }
	b.ReportAllocs()
	spent := interleave(b, op, chain)
	reportRatio(b, "chain", spent[0])
	_ = sink
}

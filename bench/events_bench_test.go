package bench_test

import (
	"context"
	"runtime"
	"runtime/pprof"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"go.uber.org/atomic"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/bench/replay"
	"github.com/kvlease/kvlease/bench/trace"
	"github.com/kvlease/kvlease/events"
)

// tokenAlloc is a kvlease pool as a replay.Allocator whose leases seal
// with SealTokens, as an engine that publishes KV events must (routers
// key blocks by their tokens): each block's parent and tokens are looked
// up by its hash in a table built from the trace before the run.
type tokenAlloc struct {
	pool   *kvlease.Pool[[]byte]
	mem    kvlease.Memory[[]byte]
	blocks map[kvlease.BlockHash]sealedBlock
}

type sealedBlock struct {
	parent kvlease.BlockHash
	tokens []int32
}

func (a *tokenAlloc) Name() string { return "kvlease" }

func (a *tokenAlloc) AcquirePrefix(owner string, hashes []kvlease.BlockHash, n int) (replay.Lease, int, error) {
	l, hits, err := a.pool.AcquirePrefix(owner, hashes, n)
	if err != nil {
		return nil, 0, err
	}
	return tokenLease{l, a.blocks}, hits, nil
}

func (a *tokenAlloc) Region(id kvlease.BlockID) []byte { return a.mem.Region(id) }
func (a *tokenAlloc) Stats() kvlease.Stats             { return a.pool.Stats() }
func (a *tokenAlloc) Check() error                     { return a.pool.Check() }

type tokenLease struct {
	*kvlease.Lease[[]byte]
	blocks map[kvlease.BlockHash]sealedBlock
}

func (l tokenLease) Seal(i int, h kvlease.BlockHash) error {
	bt, ok := l.blocks[h]
	if !ok {
		return l.Lease.Seal(i, h)
	}
	_, err := l.SealTokens(i, bt.parent, bt.tokens)
	return err
}

// traceBlocks maps every block hash a replay of tr can seal (prompts and
// generated tokens, under seed) to its parent and tokens.
func traceBlocks(tr *trace.Trace, seed kvlease.BlockHash, bt int) map[kvlease.BlockHash]sealedBlock {
	m := map[kvlease.BlockHash]sealedBlock{}
	for i := range tr.Requests {
		r := &tr.Requests[i]
		toks := r.Prompt.AppendTokens(nil)
		for j := range r.MaxNew {
			toks = append(toks, r.OutputToken(j))
		}
		parent := seed
		for k, h := range kvlease.ChainHashes(seed, toks, bt) {
			m[h] = sealedBlock{parent, toks[k*bt : (k+1)*bt]}
			parent = h
		}
	}
	return m
}

func newTokenAlloc(b *testing.B, blocks int, m map[kvlease.BlockHash]sealedBlock, opts ...kvlease.Option) *tokenAlloc {
	b.Helper()
	mem, err := kvlease.NewHostMemory(blocks, 64)
	if err != nil {
		b.Fatal(err)
	}
	p, err := kvlease.NewPool[[]byte](mem, append([]kvlease.Option{kvlease.WithLeakCheck(false), kvlease.WithBlockTokens(16)}, opts...)...)
	if err != nil {
		b.Fatal(err)
	}
	return &tokenAlloc{pool: p, mem: mem, blocks: m}
}

// BenchmarkReplayEvents is BenchmarkReplay's pool replay (1000 requests,
// the default mix) with a KV-event publisher attached: the pool records
// KV events (WithKVEvents) and an events.Publisher sends them in vLLM's
// wire format over TCP loopback to one subscriber in the process. x-nopub
// is the wall-time ratio to the same replay through the same allocator
// (SealTokens, so both arms hash the tokens) with no events and no
// publisher, in the same run (target ≤ 1.10); x-nopub-cpu is the ratio of
// the replaying thread's CPU time, the allocator's own cost, which a
// machine short of cores does not blur (on Linux; 0 elsewhere).
// x-record-cpu is the same CPU ratio for a third arm whose pool records
// KV events with no publisher attached (drained between replays, off the
// clock): the pool's own recording, the floor under x-nopub-cpu; the rest
// of x-nopub-cpu is what a drainer running at the same time costs the
// replaying thread (the ring's cache lines moving between cores, the
// pool's lock taken by each drain). The pools are reused across replays,
// emptied by ResetCache before each. The publisher's drops and the stored
// events it could not publish are reported too (both expected 0).
func BenchmarkReplayEvents(b *testing.B) {
	g := trace.DefaultGenConfig()
	g.Requests = 1000
	tr := trace.Generate(g)
	cfg := replay.Config{Blocks: 4096, MaxRunning: 128}
	m := traceBlocks(tr, cfg.Seed, 16)

	plain := newTokenAlloc(b, cfg.Blocks, m)
	pubbed := newTokenAlloc(b, cfg.Blocks, m, kvlease.WithKVEvents(1<<16))
	recorded := newTokenAlloc(b, cfg.Blocks, m, kvlease.WithKVEvents(1<<18)) // holds a replay's events
	pub, err := events.NewPublisher(events.Config{Endpoint: "tcp://127.0.0.1:0", Bind: true, Pod: "bench", Model: "m"},
		events.Source{Pool: pubbed.pool})
	if err != nil {
		b.Fatal(err)
	}
	defer pub.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	if err := sub.Dial("tcp://" + pub.Addr().String()); err != nil {
		b.Fatal(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		b.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); len(pub.Subscriptions()) == 0; {
		if time.Now().After(deadline) {
			b.Fatal("subscriber never joined")
		}
		time.Sleep(time.Millisecond)
	}
	var got atomic.Uint64
	go func() {
		for {
			if _, err := sub.Recv(); err != nil {
				return
			}
			got.Inc()
		}
	}()

	// Each replay runs on a thread of its own, whose CPU time is the
	// allocator's alone (the publisher, the socket and the subscriber run
	// on other threads; GC assists the replay pays count).
	// The arm is a profile label (go test -cpuprofile, then pprof
	// -tagfocus arm=pub or arm=plain) so the two can be compared.
	var cpuPub, cpuPlain, cpuRec time.Duration
	var recBuf []kvlease.KVEvent
	once := func(a *tokenAlloc, cpu *time.Duration) {
		errc := make(chan error, 1)
		arm := "plain"
		switch a {
		case pubbed:
			arm = "pub"
		case recorded:
			arm = "record"
		}
		go pprof.Do(context.Background(), pprof.Labels("arm", arm), func(context.Context) {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			c0 := threadCPU()
			a.pool.ResetCache(false)
			_, err := replay.Run(tr, cfg, a)
			*cpu += threadCPU() - c0
			errc <- err
		})
		if err := <-errc; err != nil {
			b.Fatal(err)
		}
		if a == recorded {
			var dropped uint64
			if recBuf, dropped = a.pool.DrainKVEvents(recBuf[:0]); dropped > 0 {
				b.Fatalf("the recording arm's ring dropped %d events", dropped)
			}
		}
	}
	paired(b, func(k int) {
		for range k {
			once(pubbed, &cpuPub)
		}
	}, base{"x-nopub", func(k int) {
		for range k {
			once(plain, &cpuPlain)
		}
	}}, base{"x-record", func(k int) {
		for range k {
			once(recorded, &cpuRec)
		}
	}})
	if cpuPlain > 0 {
		b.ReportMetric(float64(cpuPub)/float64(cpuPlain), "x-nopub-cpu")
		b.ReportMetric(float64(cpuRec)/float64(cpuPlain), "x-record-cpu")
	}
	if err := pub.Flush(ctx); err != nil {
		b.Fatal(err)
	}
	st := pub.Stats()
	b.ReportMetric(float64(st.DroppedBatches+st.DroppedEvents), "drops")
	b.ReportMetric(float64(st.Unpublishable), "unpublishable")
	b.ReportMetric(float64(st.Blocks)/float64(b.N), "blocks-published/op")
}

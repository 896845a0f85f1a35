package llmd

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache/kvblock"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"
	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/events"
)

const (
	blockTokens = 4
	pod         = "engine-0"
	model       = "test-model"
)

// indexer is llm-d's consumer side, in process.
type indexer struct {
	index kvblock.Index
	tp    kvblock.TokenProcessor
	pool  *kvevents.Pool
	subs  *kvevents.SubscriberManager
}

func newIndexer(t *testing.T, ctx context.Context) *indexer {
	t.Helper()
	index, err := kvblock.NewInMemoryIndex(kvblock.DefaultInMemoryIndexConfig())
	require.NoError(t, err)
	tp, err := kvblock.NewChunkedTokenDatabase(&kvblock.TokenProcessorConfig{BlockSizeTokens: blockTokens})
	require.NoError(t, err)
	cfg := kvevents.DefaultConfig()
	cfg.Concurrency = 1
	cfg.DiscoverPods = false
	pool := kvevents.NewPool(cfg, index, tp, engineadapter.NewVLLMAdapter())
	pool.Start(ctx)
	subs := kvevents.NewSubscriberManager(pool)
	t.Cleanup(func() {
		subs.Shutdown(ctx)
		pool.Shutdown(ctx)
	})
	return &indexer{index: index, tp: tp, pool: pool, subs: subs}
}

// hits is how many leading blocks of prompt llm-d's index says pod holds.
func (ix *indexer) hits(t *testing.T, prompt []int32) int {
	t.Helper()
	toks := make([]uint32, len(prompt))
	for i, v := range prompt {
		toks[i] = uint32(v)
	}
	keys, err := ix.tp.TokensToKVBlockKeys(kvblock.EmptyBlockHash, toks, model, nil)
	require.NoError(t, err)
	found, err := ix.index.Lookup(context.Background(), keys, nil)
	require.NoError(t, err)
	n := 0
	for _, k := range keys {
		held := false
		for _, e := range found[k] {
			held = held || e.PodIdentifier == pod
		}
		if !held {
			break
		}
		n++
	}
	return n
}

func (ix *indexer) waitHits(t *testing.T, prompt []int32, want int) {
	t.Helper()
	require.Eventually(t, func() bool { return ix.hits(t, prompt) == want }, 10*time.Second, 2*time.Millisecond,
		"want %d blocks of the prompt indexed", want)
}

func prompt(seed, blocks int) []int32 {
	p := make([]int32, blocks*blockTokens)
	for i := range p {
		p[i] = int32(seed*10_000 + i)
	}
	return p
}

// seal acquires a lease for prompt and seals its blocks with SealTokens
// under kvlease's own hash chain (the engine's keys; llm-d maps them to
// its request keys through the tokens), flushing the publisher after the
// blocks in flushAt so a chain arrives in several events.
func seal(t *testing.T, p *kvlease.Pool[[]byte], pub *events.Publisher, prompt []int32, flushAt ...int) *kvlease.Lease[[]byte] {
	t.Helper()
	n := len(prompt) / blockTokens
	l, err := p.Acquire("req", n)
	require.NoError(t, err)
	parent := kvlease.BlockHash(42) // namespace seed: never sent (first blocks have no parent)
	for i := range n {
		h, err := l.SealTokens(i, parent, prompt[i*blockTokens:(i+1)*blockTokens])
		require.NoError(t, err)
		parent = h
		for _, f := range flushAt {
			if f == i {
				flush(t, pub)
			}
		}
	}
	flush(t, pub)
	return l
}

func flush(t *testing.T, pub *events.Publisher) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, pub.Flush(ctx))
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// TestLLMDIndexerFollowsKVLease runs llm-d's subscriber, event pool and
// index against kvlease's publisher: seals become lookups that hit,
// evictions and ResetCache make them miss; in both encodings, with the
// publisher binding (llm-d dials, as with a pod's endpoint) and with the
// subscriber binding (the engine dials a central indexer).
func TestLLMDIndexerFollowsKVLease(t *testing.T) {
	for _, enc := range []events.Encoding{events.MapEncoding, events.ArrayEncoding} {
		for _, pubBinds := range []bool{true, false} {
			t.Run(fmt.Sprintf("%v/publisher-binds=%v", enc, pubBinds), func(t *testing.T) {
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				ix := newIndexer(t, ctx)

				mem, err := kvlease.NewHostMemory(8, 64)
				require.NoError(t, err)
				pool, err := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(blockTokens), kvlease.WithKVEvents(1024))
				require.NoError(t, err)
				defer pool.Close()

				cfg := events.Config{Pod: pod, Model: model, Encoding: enc}
				var pub *events.Publisher
				if pubBinds {
					cfg.Endpoint = "tcp://*:0"
					pub, err = events.NewPublisher(cfg, events.Source{Pool: pool, Medium: "GPU"})
					require.NoError(t, err)
					port := pub.Addr().(*net.TCPAddr).Port
					require.NoError(t, ix.subs.EnsureSubscriber(ctx, pod, fmt.Sprintf("tcp://127.0.0.1:%d", port), "kv@", true))
				} else {
					ep := fmt.Sprintf("tcp://127.0.0.1:%d", freePort(t))
					require.NoError(t, ix.subs.EnsureSubscriber(ctx, pod, ep, "kv@", false))
					cfg.Endpoint = ep // no "*": the publisher dials
					require.Eventually(t, func() bool {
						pub, err = events.NewPublisher(cfg, events.Source{Pool: pool, Medium: "GPU"})
						return err == nil
					}, 10*time.Second, 10*time.Millisecond)
				}
				defer pub.Close()
				require.Eventually(t, func() bool { return len(pub.Subscriptions()) > 0 }, 10*time.Second, time.Millisecond)

				a := prompt(1, 3)
				la := seal(t, pool, pub, a)
				ix.waitHits(t, a, 3)

				// A chain published in three events: each later one names
				// its parent, which llm-d resolves through its engine keys.
				b := prompt(2, 3)
				lb := seal(t, pool, pub, b, 0, 1)
				ix.waitHits(t, b, 3)
				require.Equal(t, 3, ix.hits(t, a))

				// Eviction: release both, then take the whole pool.
				la.Release()
				lb.Release()
				x, err := pool.Acquire("x", 8)
				require.NoError(t, err)
				flush(t, pub)
				ix.waitHits(t, a, 0)
				ix.waitHits(t, b, 0)
				x.Release()

				// ResetCache: a cached chain, dropped.
				c := prompt(3, 2)
				lc := seal(t, pool, pub, c)
				ix.waitHits(t, c, 2)
				lc.Release()
				require.Equal(t, 2, pool.ResetCache(false))
				flush(t, pub)
				ix.waitHits(t, c, 0)
				require.Zero(t, pub.Stats().DroppedBatches)
			})
		}
	}
}

// TestLLMDIndexerAfterLoss: events the pool's ring dropped are recovered by
// the publisher's clear-and-re-announce, and llm-d ends up with exactly
// the cache.
func TestLLMDIndexerAfterLoss(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ix := newIndexer(t, ctx)
	mem, err := kvlease.NewHostMemory(8, 64)
	require.NoError(t, err)
	pool, err := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(blockTokens), kvlease.WithKVEvents(2))
	require.NoError(t, err)
	defer pool.Close()
	// Sealed before anyone drains: 4 events into a ring of 2.
	a := prompt(1, 4)
	l, err := pool.Acquire("req", 4)
	require.NoError(t, err)
	parent := kvlease.BlockHash(7)
	for i := range 4 {
		parent, err = l.SealTokens(i, parent, a[i*blockTokens:(i+1)*blockTokens])
		require.NoError(t, err)
	}
	defer l.Release()

	pub, err := events.NewPublisher(events.Config{Endpoint: "tcp://*:0", Pod: pod, Model: model}, events.Source{Pool: pool})
	require.NoError(t, err)
	defer pub.Close()
	port := pub.Addr().(*net.TCPAddr).Port
	require.NoError(t, ix.subs.EnsureSubscriber(ctx, pod, fmt.Sprintf("tcp://127.0.0.1:%d", port), "kv@", true))
	require.Eventually(t, func() bool { return len(pub.Subscriptions()) > 0 }, 10*time.Second, time.Millisecond)
	flush(t, pub)
	st := pub.Stats()
	require.EqualValues(t, 2, st.DroppedEvents)
	require.EqualValues(t, 1, st.Resyncs)
	// That re-announcement may have gone out before llm-d subscribed (a
	// PUB socket keeps nothing for late joiners); ask for another one now.
	pub.Resync()
	flush(t, pub)
	ix.waitHits(t, a, 4)
	require.EqualValues(t, 2, pub.Stats().Resyncs)
}

// TestLLMDIndexerReadsMergedExtraKeys: a chain whose middle blocks hold
// an image (extra keys) goes out as one BlockStored, extra_keys holding
// one entry per block (nil for text), as vLLM sends it; llm-d's decoder
// and index take it: a lookup with the same image finds every block, one
// without the image only the text before it.
func TestLLMDIndexerReadsMergedExtraKeys(t *testing.T) {
	for _, enc := range []events.Encoding{events.MapEncoding, events.ArrayEncoding} {
		t.Run(enc.String(), func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			ix := newIndexer(t, ctx)
			mem, err := kvlease.NewHostMemory(8, 64)
			require.NoError(t, err)
			pool, err := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(blockTokens), kvlease.WithKVEvents(1024))
			require.NoError(t, err)
			defer pool.Close()
			pub, err := events.NewPublisher(events.Config{Endpoint: "tcp://127.0.0.1:0", Bind: true, Pod: pod, Model: model, Encoding: enc},
				events.Source{Pool: pool})
			require.NoError(t, err)
			defer pub.Close()
			port := pub.Addr().(*net.TCPAddr).Port
			require.NoError(t, ix.subs.EnsureSubscriber(ctx, pod, fmt.Sprintf("tcp://127.0.0.1:%d", port), "kv@", true))
			require.Eventually(t, func() bool { return len(pub.Subscriptions()) > 0 }, 10*time.Second, time.Millisecond)

			// Blocks 1 and 2 cover the image's placeholder tokens.
			p := prompt(4, 4)
			extra := [][]string{nil, {"img-a"}, {"img-a"}, nil}
			l, err := pool.Acquire("req", 4)
			require.NoError(t, err)
			defer l.Release()
			parent := kvlease.BlockHash(42)
			for i := range 4 {
				parent, err = l.SealTokens(i, parent, p[i*blockTokens:(i+1)*blockTokens], extra[i]...)
				require.NoError(t, err)
			}
			before := pub.Stats()
			flush(t, pub)
			after := pub.Stats()
			require.EqualValues(t, 1, after.Events-before.Events, "one BlockStored for the chain")
			require.EqualValues(t, 4, after.Blocks-before.Blocks)

			features := make([]*kvblock.BlockExtraFeatures, 4)
			for i, keys := range extra {
				if keys != nil {
					features[i] = &kvblock.BlockExtraFeatures{MMHashes: []kvblock.MMHash{{Hash: keys[0]}}}
				}
			}
			ix.waitHitsExtra(t, p, features, 4)
			require.Equal(t, 1, ix.hits(t, p), "without the image only the text before it matches")
		})
	}
}

// hitsExtra is hits for a prompt with per-block extra features.
func (ix *indexer) hitsExtra(t *testing.T, prompt []int32, features []*kvblock.BlockExtraFeatures) int {
	t.Helper()
	toks := make([]uint32, len(prompt))
	for i, v := range prompt {
		toks[i] = uint32(v)
	}
	keys, err := ix.tp.TokensToKVBlockKeys(kvblock.EmptyBlockHash, toks, model, features)
	require.NoError(t, err)
	found, err := ix.index.Lookup(context.Background(), keys, nil)
	require.NoError(t, err)
	n := 0
	for _, k := range keys {
		held := false
		for _, e := range found[k] {
			held = held || e.PodIdentifier == pod
		}
		if !held {
			break
		}
		n++
	}
	return n
}

func (ix *indexer) waitHitsExtra(t *testing.T, prompt []int32, features []*kvblock.BlockExtraFeatures, want int) {
	t.Helper()
	require.Eventually(t, func() bool { return ix.hitsExtra(t, prompt, features) == want }, 10*time.Second, 2*time.Millisecond,
		"want %d blocks of the prompt indexed with its extra keys", want)
}

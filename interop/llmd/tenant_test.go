package llmd

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache/kvblock"
	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/events"
)

// nsFeatures is the extra features a router looks a prompt of n blocks
// up with for a tenant: the tenant's namespace on the first block.
func nsFeatures(ns string, n int) []*kvblock.BlockExtraFeatures {
	f := make([]*kvblock.BlockExtraFeatures, n)
	f[0] = &kvblock.BlockExtraFeatures{MMHashes: []kvblock.MMHash{{Hash: ns}}}
	return f
}

// TestLLMDIndexerKeepsTenantsApart: two tenants send the same prompt.
// In the pool their roots keep them apart (neither hits the other's
// blocks); with the namespace on the wire, llm-d's real indexer keeps
// them apart too: a lookup for one tenant never counts the other's
// blocks, and one tenant's repeat is a hit in both the index and the
// pool.
func TestLLMDIndexerKeepsTenantsApart(t *testing.T) {
	for _, enc := range []events.Encoding{events.MapEncoding, events.ArrayEncoding} {
		t.Run(enc.String(), func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			ix := newIndexer(t, ctx)
			mem, err := kvlease.NewHostMemory(16, 64)
			require.NoError(t, err)
			pool, err := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(blockTokens), kvlease.WithKVEvents(1024),
				kvlease.WithTenantKey([]byte("a tenant key of thirty-two bytes")))
			require.NoError(t, err)
			defer pool.Close()
			pub, err := events.NewPublisher(events.Config{Endpoint: "tcp://127.0.0.1:0", Bind: true, Pod: pod, Model: model, Encoding: enc},
				events.Source{Pool: pool})
			require.NoError(t, err)
			defer pub.Close()
			port := pub.Addr().(*net.TCPAddr).Port
			require.NoError(t, ix.subs.EnsureSubscriber(ctx, pod, fmt.Sprintf("tcp://127.0.0.1:%d", port), "kv@", true))
			require.Eventually(t, func() bool { return len(pub.Subscriptions()) > 0 }, 10*time.Second, time.Millisecond)

			acme, err := pool.Tenant("acme")
			require.NoError(t, err)
			globex, err := pool.Tenant("globex")
			require.NoError(t, err)
			require.NotEqual(t, acme.Namespace(), globex.Namespace())

			const n = 3
			p := prompt(5, n)
			chain := func(tn *kvlease.Tenant[[]byte]) []kvlease.BlockHash {
				seed, err := pool.TenantSeed(tn.Name(), 0)
				require.NoError(t, err)
				return kvlease.ChainHashes(seed, p, blockTokens)
			}
			sealFor := func(tn *kvlease.Tenant[[]byte]) *kvlease.Lease[[]byte] {
				hs := chain(tn)
				l, hits, err := tn.AcquirePrefix("req", hs, n)
				require.NoError(t, err)
				require.Zero(t, hits)
				seed, _ := pool.TenantSeed(tn.Name(), 0)
				parent := seed
				for i := range n {
					parent, err = l.SealTokens(i, parent, p[i*blockTokens:(i+1)*blockTokens])
					require.NoError(t, err)
				}
				flush(t, pub)
				return l
			}
			hitsFor := func(tn *kvlease.Tenant[[]byte]) int { return ix.hitsExtra(t, p, nsFeatures(tn.Namespace(), n)) }

			la := sealFor(acme)
			ix.waitHitsExtra(t, p, nsFeatures(acme.Namespace(), n), n)
			// Globex's lookup of the same prompt counts none of acme's
			// blocks, nor does a lookup with no namespace.
			require.Zero(t, hitsFor(globex), "globex's lookup counted acme's blocks")
			require.Zero(t, ix.hits(t, p), "a lookup without a namespace counted acme's blocks")

			// Globex seals the same prompt: a miss in the pool (its root
			// is its own), then indexed under its own namespace.
			lg := sealFor(globex)
			ix.waitHitsExtra(t, p, nsFeatures(globex.Namespace(), n), n)
			require.Equal(t, n, hitsFor(acme))

			// Acme's repeat: a hit in the index and in the pool.
			la.Release()
			lg.Release()
			flush(t, pub)
			require.Equal(t, n, hitsFor(acme))
			again, hits, err := acme.AcquirePrefix("repeat", chain(acme), n)
			require.NoError(t, err)
			require.Equal(t, n, hits, "acme's repeat is a hit in the pool")
			again.Release()
		})
	}
}

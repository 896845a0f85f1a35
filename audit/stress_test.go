package audit

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
)

// TestStress is CI's bounded stress: every configuration below runs a
// fixed number of lifecycle operations (fewer under the race detector, so
// that the whole test stays near 20 s there) and must find nothing.
// The bound does not depend on -short.
func TestStress(t *testing.T) {
	ops := 60000
	if raceEnabled {
		ops = 16000
	}
	for _, tc := range []struct {
		name string
		mod  func(*Config)
	}{
		{"default", func(*Config) {}},
		{"crowded", func(c *Config) { c.Blocks, c.MaxLive, c.Faults.Wait = 160, 96, 0.3 }},
		{"one-worker", func(c *Config) { c.Workers = 1 }},
		{"verified-uneven", func(c *Config) {
			c.Workers, c.PoolBlocks = 3, []int{128, 700, 300}
			c.PoolOptions = func(int) []kvlease.Option { return []kvlease.Option{kvlease.WithVerifiedPrefix(c.BlockTokens)} }
		}},
		{"concurrent", func(c *Config) { c.Concurrent = true }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Seed = 1000 + uint64(len(tc.name))
			cfg.Ops = ops
			tc.mod(&cfg)
			rep, err := Run(cfg)
			require.NoError(t, err)
			requireClean(t, rep)
			t.Logf("%d operations (%d lifecycle) in %v: %.0f lifecycle ops/s; rejections %.1f%%, aborts mid-transfer %.1f%%, failed %.1f%%, lost acks %.2f%%",
				rep.Ops, rep.Lifecycle, rep.Elapsed, rep.Throughput(),
				100*rep.RejectionRate(), 100*rep.AbortRate(), 100*rep.FailRate(), 100*rep.LostAckRate())
		})
	}
}

package audit

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// choices is a random source that the fuzzer controls: every draw of the
// generator takes one byte of input as its top bits (so each byte steers
// one decision: which request, which operation, which fate), and once the
// input is used up the draws come from the seed.
type choices struct {
	b    []byte
	i    int
	rest *rand.PCG
}

func (c *choices) Uint64() uint64 {
	low := c.rest.Uint64() >> 8
	if c.i < len(c.b) {
		v := uint64(c.b[c.i])<<56 | low
		c.i++
		return v
	}
	return c.rest.Uint64()
}

// fuzzConfig is a deployment small enough that a few hundred operations
// reach every corner: two crowded workers, many waits and faults.
func fuzzConfig(seed uint64) Config {
	cfg := DefaultConfig()
	cfg.Seed = seed
	cfg.Ops = 300
	cfg.Workers = 2
	cfg.Blocks = 96
	cfg.MaxLive = 12
	cfg.MaxPrompt = 200
	cfg.MaxContextTokens = 512
	cfg.MaxPrefillTokens = 256
	cfg.MaxNew = 128
	cfg.DocTokens = 96
	cfg.CheckEvery = 1
	cfg.Minimise = false
	f := &cfg.Faults
	f.Fail, f.LostAck, f.Abort, f.Deadline, f.Wait = 0.15, 0.15, 0.25, 0.1, 0.3
	return cfg
}

// FuzzDriver runs the driver over operation sequences the fuzzer steers
// and requires every check to pass. Its seed corpus runs in plain go test.
func FuzzDriver(f *testing.F) {
	f.Add(uint64(1), []byte{})
	f.Add(uint64(2), []byte{0, 0, 0, 0, 255, 255, 255, 255})
	f.Add(uint64(3), []byte("arrive offer start abort deadline ack release"))
	f.Add(uint64(4), []byte{10, 200, 30, 240, 50, 220, 70, 180, 90, 160, 110, 140, 130, 120, 150, 100})
	f.Add(uint64(5), make([]byte, 64))
	f.Fuzz(func(t *testing.T, seed uint64, steer []byte) {
		if len(steer) > 4096 {
			steer = steer[:4096]
		}
		cfg := fuzzConfig(seed)
		rep, err := run(cfg, &choices{b: steer, rest: rand.NewPCG(seed, 0)})
		require.NoError(t, err)
		requireClean(t, rep)
	})
}

// FuzzParseOp: whatever ParseOp accepts, it writes back the same way.
func FuzzParseOp(f *testing.F) {
	f.Add("arrive r=3 pool=1 doc=-1 tokens=40 new=8 wait")
	f.Add("start r=7 fate=lose-ack failat=2 honour")
	f.Add("offer r=1 to=0 reject")
	f.Add("step r=9 job=1")
	f.Add("deadline r=2")
	f.Fuzz(func(t *testing.T, s string) {
		o, err := ParseOp(s)
		if err != nil {
			return
		}
		again, err := ParseOp(o.String())
		require.NoError(t, err)
		require.Equal(t, o.String(), again.String())
	})
}

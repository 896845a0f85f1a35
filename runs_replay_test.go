package kvlease_test

import (
	"slices"
	"testing"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/bench/replay"
	"github.com/kvlease/kvlease/bench/trace"
)

// runCounter is a replay allocator that measures, for every acquire, how
// many runs of block ids its fresh part came in, next to the fewest the
// free space allowed.
type runCounter struct {
	*replay.KVLease
	leases, fresh int
	runs, minRuns int
	free          []kvlease.BlockID
	ids           []kvlease.BlockID
	// Decode growth: extends, those whose block continued the lease's
	// last run, and those the free space allowed to (the block after the
	// lease's last was free).
	extends, continued, couldContinue int
}

// countingLease counts, for each Extend, whether the new block continued
// the lease's last run.
type countingLease struct {
	replay.Lease
	c *runCounter
}

func (l countingLease) Extend(n int) error {
	c := l.c
	c.ids = l.AppendBlockIDs(c.ids[:0], 0)
	last := c.ids[len(c.ids)-1]
	c.free = kvlease.FreeIDsForTest(c.Pool, c.free[:0])
	_, nextFree := slices.BinarySearch(c.free, last+1)
	err := l.Lease.Extend(n)
	if err != nil {
		return err
	}
	c.ids = l.AppendBlockIDs(c.ids[:0], len(c.ids))
	c.extends++
	if nextFree {
		c.couldContinue++
	}
	if c.ids[0] == last+1 {
		c.continued++
	}
	return nil
}

func (c *runCounter) AcquirePrefix(owner string, hashes []kvlease.BlockHash, n int) (replay.Lease, int, error) {
	c.free = kvlease.FreeIDsForTest(c.Pool, c.free[:0])
	l, hits, err := c.KVLease.AcquirePrefix(owner, hashes, n)
	if err != nil {
		return l, hits, err
	}
	if hits == n {
		return countingLease{l, c}, hits, err
	}
	c.ids = l.AppendBlockIDs(c.ids[:0], hits)
	c.leases++
	c.fresh += len(c.ids)
	c.runs += countRuns(c.ids)
	c.minRuns += fewestRuns(c.free, c.ids)
	return countingLease{l, c}, hits, err
}

// countRuns is the number of runs of ascending consecutive ids in ids, in
// order (kvlease.AppendRuns's count).
func countRuns(ids []kvlease.BlockID) int {
	n := 0
	for i, id := range ids {
		if i == 0 || id != ids[i-1]+1 {
			n++
		}
	}
	return n
}

// fewestRuns is the fewest runs that could have held the fresh blocks
// taken: when the free space (free, ascending) held them all, its longest
// runs first; when it did not, every free block and the least recently
// used cached ones were taken (the set is forced), so the runs of the set
// taken, sorted.
func fewestRuns(free, taken []kvlease.BlockID) int {
	if len(free) < len(taken) {
		s := slices.Clone(taken)
		slices.Sort(s)
		return countRuns(s)
	}
	var lens []int
	for i := 0; i < len(free); {
		j := i + 1
		for j < len(free) && free[j] == free[j-1]+1 {
			j++
		}
		lens = append(lens, j-i)
		i = j
	}
	slices.Sort(lens)
	need, k := len(taken), 0
	for i := len(lens) - 1; need > 0; i-- {
		need -= lens[i]
		k++
	}
	return k
}

// TestReplayRuns replays a production-shaped Mooncake trace (bench/trace)
// through a pool and reports the runs of block ids each acquire's fresh
// blocks came in, next to the fewest the free space allowed; the replay
// ends whole (bench/README.md, "Contiguous runs", has the numbers).
func TestReplayRuns(t *testing.T) {
	mc := trace.ProductionMooncake()
	mc.Requests = 200
	if testing.Short() {
		mc.Requests = 60
	}
	tr := trace.FromMooncake(trace.GenerateMooncake(mc), 20)
	cfg := replay.Config{BlockTokens: 16, Blocks: 32768, MaxRunning: 64}
	a, err := replay.NewKVLease(cfg.Blocks, 64)
	if err != nil {
		t.Fatal(err)
	}
	c := &runCounter{KVLease: a}
	res, err := replay.Run(tr, cfg, c)
	if err != nil {
		t.Fatal(err)
	}
	if res.Finished != len(tr.Requests) || c.leases == 0 {
		t.Fatalf("finished %d of %d, %d leases with fresh blocks", res.Finished, len(tr.Requests), c.leases)
	}
	if c.runs < c.minRuns || c.minRuns < c.leases {
		t.Fatalf("runs %d, fewest %d, leases %d: the count is wrong", c.runs, c.minRuns, c.leases)
	}
	t.Logf("%d leases, %.1f fresh blocks each: %.2f runs per lease, fewest the free space allowed %.2f",
		c.leases, float64(c.fresh)/float64(c.leases), float64(c.runs)/float64(c.leases), float64(c.minRuns)/float64(c.leases))
	t.Logf("decode growth: %d extends of one block, %d continued the lease's last run, %d could have (the next block was free)",
		c.extends, c.continued, c.couldContinue)
	if c.extends == 0 || c.continued > c.couldContinue {
		t.Fatalf("extends %d, continued %d, could %d: the count is wrong", c.extends, c.continued, c.couldContinue)
	}
}

package kvlease_test

import (
	"fmt"

	"github.com/kvlease/kvlease"
)

// A lease's fresh blocks come as contiguous runs of block ids, so a copy
// path can move each run with one descriptor. Blocks a lease gives back
// return as a run, and a later lease, or a later Extend, continues it.
func ExampleLease_AppendRuns() {
	mem, _ := kvlease.NewHostMemory(16, 4096)
	pool, _ := kvlease.NewPool[[]byte](mem)

	a, _ := pool.Acquire("req-a", 4)
	b, _ := pool.Acquire("req-b", 6)
	runs := make([]kvlease.Run, 0, 4) // AppendRuns allocates nothing while runs has room
	fmt.Println("a:", a.AppendRuns(runs[:0], 0))
	fmt.Println("b:", b.AppendRuns(runs[:0], 0))

	b.Release() // blocks 4..9 go back as one run
	c, _ := pool.Acquire("req-c", 3)
	fmt.Println("c:", c.AppendRuns(runs[:0], 0))
	_ = c.Extend(2) // a decode step's blocks continue the run
	fmt.Println("c extended:", c.AppendRuns(runs[:0], 0))
	fmt.Println("c from block 3:", c.AppendRuns(runs[:0], 3))
	// Output:
	// a: [{0 4}]
	// b: [{4 6}]
	// c: [{4 3}]
	// c extended: [{4 5}]
	// c from block 3: [{7 2}]
}

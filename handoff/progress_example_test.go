package handoff_test

import (
	"fmt"

	"github.com/kvlease/kvlease/handoff"
)

// A prefill of 4 blocks computed layer by layer marks each layer as it
// writes it; a streaming plane that sends the blocks past the
// destination's 1 hit sees what it may read (Source.Propose with
// handoff.Streaming(p) wires the two).
func ExampleProgress() {
	p, _ := handoff.NewProgress(4, 3) // 4 blocks of 3 layers
	ready, _ := p.Ready(1)            // the plane sends blocks 1..3
	for layer := 1; layer <= 3; layer++ {
		_ = p.WroteLayers(layer) // the model wrote layer-1 of every block
		l, b := ready.Written()
		fmt.Printf("layers %d of every block, %d whole blocks, complete %v\n", l, b, ready.Complete())
	}
	// Output:
	// layers 1 of every block, 0 whole blocks, complete false
	// layers 2 of every block, 0 whole blocks, complete false
	// layers 3 of every block, 3 whole blocks, complete true
}

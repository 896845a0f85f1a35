// Package benchswitch holds switches that this module's benchmarks flip
// to measure an older code path next to the current one in the same run.
// Production code never sets them; they are read once, when a pool is
// made.
package benchswitch

import "sync/atomic"

// MapIndex makes pools created while it is set keep their prefix index in
// a Go map, as kvlease did before issue 16, instead of the flat
// open-addressing table.
var MapIndex atomic.Bool

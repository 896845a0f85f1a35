//go:build race

package bench_test

// raceEnabled: the race detector (and with it kvlease's checked build) is
// on, so allocation counts are not production counts.
const raceEnabled = true

//go:build race

package audit

// raceEnabled scales the stress test down under the race detector, which
// slows the driver about fivefold.
const raceEnabled = true

//go:build !race

package kvlease_test

// raceEnabled: see linearize_race_test.go.
const raceEnabled = false

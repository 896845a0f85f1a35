//go:build !race

package handoff

// raceEnabled: see explore_race_test.go.
const raceEnabled = false

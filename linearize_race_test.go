//go:build race

package kvlease_test

// raceEnabled: TestLinearizable checks fewer histories under the race
// detector.
const raceEnabled = true

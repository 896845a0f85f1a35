//go:build race

package handoff

// raceEnabled: the explorer's tests take their small bounds under the
// race detector (the root CI run); .ci/steps/55-explore.sh runs them in
// full without it.
const raceEnabled = true

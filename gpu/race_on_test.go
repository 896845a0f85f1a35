//go:build race

package gpu

// raceOn: the race detector allocates on paths that otherwise do not.
const raceOn = true

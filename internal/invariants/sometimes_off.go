//go:build !race && !invariants

package invariants

// Sometimes is false in production builds: the fast paths always run.
func Sometimes(percent int) bool { return false }

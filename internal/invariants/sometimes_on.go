//go:build race || invariants

package invariants

import "math/rand/v2"

// Sometimes returns true percent% of the time in checked builds (and
// never in production builds, where it is the constant false). A fast
// path that mirrors a general one takes the general path when it returns
// true, so that tests and fuzzers run both and prove them equal.
func Sometimes(percent int) bool { return rand.IntN(100) < percent }

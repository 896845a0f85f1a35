//go:build race || invariants

package invariants

// Enabled is true in checked builds: under the race detector or with the
// invariants build tag. Checked builds verify internal consistency after
// every operation and register leak cleanups on every lease.
const Enabled = true

//go:build !race && !invariants

// Package invariants switches kvlease's extra consistency checks on in
// checked builds (-race or -tags invariants), following pebble's
// internal/invariants: the checks cost nothing in production builds because
// Enabled is a constant false there and the compiler drops them.
package invariants

// Enabled is false in production builds.
const Enabled = false

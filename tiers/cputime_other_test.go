//go:build !unix

package tiers

import "time"

// cpuTime is not measured here: the CPU-time metrics read zero.
func cpuTime() time.Duration { return 0 }

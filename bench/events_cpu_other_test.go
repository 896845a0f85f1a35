//go:build !linux

package bench_test

import "time"

// threadCPU is unknown here: 0.
func threadCPU() time.Duration { return 0 }

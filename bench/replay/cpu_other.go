//go:build !unix

package replay

import "time"

// processCPU is not available here: CPU stays zero.
func processCPU() time.Duration { return 0 }

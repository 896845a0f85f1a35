//go:build !cgo || !linux

package gpu

import "fmt"

// Without cgo (or off Linux) the driver cannot be loaded: Open reports
// ErrNoDriver and OpenHost is the only device.
func openCUDA(path string, _ int) (backend, error) {
	return nil, fmt.Errorf("gpu: cannot load %s: package built without cgo or not on linux: %w", path, ErrNoDriver)
}

func cudaStats(*Device) (batched, looped int64, batchAvailable, ok bool) { return 0, 0, false, false }

func setBatch(*Device, bool) {}

func deviceAttrs(*Device) (major, minor, sms int) { return 0, 0, 0 }

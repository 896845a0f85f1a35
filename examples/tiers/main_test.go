package main

import (
	"errors"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/kvlease/kvlease/gpu"
)

// TestOutputForm checks the lines scripts read (DESIGN.md, "Examples that
// checks run"): one `tier <name> hits N of M` line per tier, fastest
// first, all of the same M, and a last line `marker mismatches 0`.
func TestOutputForm(t *testing.T) {
	checkOutput(t, fallback)
}

// TestGPUFlag: -gpu opens CUDA device 0 through gpu.Open, never the
// fallback: with a driver (a GPU, or $KVLEASE_LIBCUDA naming the gpu
// package's fake driver, as CI does) the output is the same as on the
// fallback; without one the run fails with gpu.ErrNoDriver or
// gpu.ErrNoDevice before printing anything.
func TestGPUFlag(t *testing.T) {
	open := func() (*gpu.Device, error) { return gpu.Open(0) }
	if d, err := gpu.Open(0); err != nil {
		if !errors.Is(err, gpu.ErrNoDriver) && !errors.Is(err, gpu.ErrNoDevice) {
			t.Fatalf("gpu.Open(0): %v", err)
		}
		var out strings.Builder
		err := run(&out, open, 10, 17, 64, 192, 0, 32, 8, "write-back")
		if !errors.Is(err, gpu.ErrNoDriver) && !errors.Is(err, gpu.ErrNoDevice) || out.Len() != 0 {
			t.Fatalf("-gpu without a driver: %v, output %q", err, out.String())
		}
		return
	} else {
		_ = d.Close()
	}
	checkOutput(t, open)
}

func checkOutput(t *testing.T, open func() (*gpu.Device, error)) {
	for _, policy := range []string{"write-back", "write-through"} {
		t.Run(policy, func(t *testing.T) {
			var out strings.Builder
			if err := run(&out, open, 300, 17, 64, 192, 1024, 32, 8, policy); err != nil {
				t.Fatal(err)
			}
			t.Log("\n" + out.String())
			lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
			re := regexp.MustCompile(`^tier (\S+) hits (\d+) of (\d+)$`)
			var names []string
			var of string
			for _, l := range lines {
				m := re.FindStringSubmatch(l)
				if m == nil {
					continue
				}
				names = append(names, m[1])
				if of != "" && m[3] != of {
					t.Errorf("tiers count hits of different totals: %q", l)
				}
				of = m[3]
				if m[1] == "host" {
					if n, _ := strconv.Atoi(m[2]); n == 0 {
						t.Errorf("the host tier never hit: %q", l)
					}
				}
			}
			if strings.Join(names, ",") != "device,host,disk" {
				t.Errorf("tier lines %q, want device,host,disk", names)
			}
			if want := strconv.Itoa(300 * 8); of != want {
				t.Errorf("hits of %s blocks, want %s", of, want)
			}
			if last := lines[len(lines)-1]; last != "marker mismatches 0" {
				t.Errorf("last line %q, want %q", last, "marker mismatches 0")
			}
		})
	}
	if err := run(&strings.Builder{}, fallback, 1, 1, 8, 8, 0, 1, 1, "sometimes"); err == nil {
		t.Error("an unknown policy was accepted")
	}
}

func fallback() (*gpu.Device, error) { return gpu.OpenHost(), nil }

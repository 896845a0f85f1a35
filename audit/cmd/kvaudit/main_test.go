package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/kvlease/kvlease/gpu"
)

func TestRunClean(t *testing.T) {
	var out, errs strings.Builder
	code := run([]string{"-ops", "2000", "-seed", "4", "-workers", "3", "-pool-blocks", "200,300,400"}, &out, &errs)
	if code != 0 {
		t.Fatalf("exit %d\n%s\n%s", code, out.String(), errs.String())
	}
	for _, want := range []string{"seed 4", "lifecycle ops/s", "target rates:", "pool w2: capacity 400", "OK"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("report lacks %q:\n%s", want, out.String())
		}
	}
}

// TestProgressAndDuration: a -duration run (without -ops) ends and prints
// progress lines on stderr; -quiet prints none. However starved the run
// (its periodic lines are wall-clock; the audit package tests them on a
// fake clock), it prints its last one at the end.
func TestProgressAndDuration(t *testing.T) {
	progress := regexp.MustCompile(`(?m)^kvaudit: +[0-9.]+s  \d+ ops \(\d+ lifecycle, [0-9.]+/s\)  \d+ live  0 violations$`)
	for _, quiet := range []bool{false, true} {
		args := []string{"-duration", "200ms", "-seed", "5"}
		if quiet {
			args = append(args, "-quiet")
		}
		var out, errs strings.Builder
		if code := run(args, &out, &errs); code != 0 {
			t.Fatalf("%q: exit %d\n%s\n%s", args, code, out.String(), errs.String())
		}
		if got := progress.MatchString(errs.String()); got == quiet {
			t.Errorf("%q: progress line printed %v: %q", args, got, errs.String())
		}
		if !strings.HasSuffix(strings.TrimSpace(out.String()), "OK") {
			t.Errorf("%q: report:\n%s", args, out.String())
		}
	}
}

func TestReplayFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "trace.txt")
	trace := "0: arrive r=0 pool=0 doc=1 tokens=100 new=10\n1: offer r=0 to=1\n2: start r=0 fate=complete failat=0 honour\n3: step r=0 job=0\n"
	if err := os.WriteFile(path, []byte(trace), 0o644); err != nil {
		t.Fatal(err)
	}
	var out, errs strings.Builder
	if code := run([]string{"-seed", "1", "-replay", path, "-quiet"}, &out, &errs); code != 0 {
		t.Fatalf("exit %d\n%s\n%s", code, out.String(), errs.String())
	}
	if !strings.Contains(out.String(), "arrive=1") || !strings.Contains(out.String(), "OK") {
		t.Errorf("replay report:\n%s", out.String())
	}
}

func TestBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-workers", "0"},
		{"-fail", "2"},
		{"-pool-blocks", "10,x"},
		{"-replay", "/nonexistent/trace"},
		{"extra"},
		{"-nosuchflag"},
	} {
		var out, errs strings.Builder
		if code := run(args, &out, &errs); code != 2 {
			t.Errorf("%q: exit %d, want 2", args, code)
		}
	}
}

func TestTiersMode(t *testing.T) {
	for _, args := range [][]string{{"-tiers", "-ops", "300", "-seed", "3"}, {"-tiers", "-write-through", "-ops", "300"}} {
		var out, errs strings.Builder
		if code := run(args, &out, &errs); code != 0 {
			t.Fatalf("%q: exit %d\n%s\n%s", args, code, out.String(), errs.String())
		}
		lines := strings.Split(strings.TrimSpace(out.String()), "\n")
		if lines[len(lines)-1] != "OK" || !strings.Contains(out.String(), "marker mismatches 0") ||
			!strings.Contains(out.String(), "unknown reads 0") || !strings.Contains(out.String(), "requests") {
			t.Errorf("%q: report:\n%s", args, out.String())
		}
	}
	var out, errs strings.Builder
	if code := run([]string{"-tiers", "-ops", "-1"}, &out, &errs); code != 2 {
		t.Errorf("-tiers -ops -1: exit %d, want 2", code)
	}
}

// TestTiersGPU: -tiers -gpu runs the device mode on CUDA device 0: with a
// driver (a GPU, or $KVLEASE_LIBCUDA naming the gpu package's fake
// driver, as CI does) it ends OK with the device line; without one it
// exits 2 saying why. -gpu without -tiers is refused.
func TestTiersGPU(t *testing.T) {
	var out, errs strings.Builder
	code := run([]string{"-tiers", "-gpu", "-ops", "300", "-seed", "5"}, &out, &errs)
	if d, err := gpu.Open(0); err != nil {
		if code != 2 || !strings.Contains(errs.String(), "kvaudit: -gpu: ") {
			t.Fatalf("without a driver: exit %d, stderr %q", code, errs.String())
		}
	} else {
		_ = d.Close()
		lines := strings.Split(strings.TrimSpace(out.String()), "\n")
		if code != 0 || lines[len(lines)-1] != "OK" || !strings.Contains(out.String(), "copies by the kernel") {
			t.Fatalf("exit %d\n%s\n%s", code, out.String(), errs.String())
		}
	}
	errs.Reset()
	if code := run([]string{"-gpu"}, &out, &errs); code != 2 {
		t.Errorf("-gpu without -tiers: exit %d", code)
	}
}

package main

import (
	"bytes"
	"errors"
	"regexp"
	"strings"
	"testing"

	"github.com/kvlease/kvlease/gpu"
)

// TestRun runs the README's command and checks what it teaches: the hit
// lengths per group, the trim under a pending offload, the layout round
// trip in one submission per direction, and a clean marker check.
func TestRun(t *testing.T) {
	checkRun(t, config{})
}

// TestGPUFlag: -gpu opens CUDA device 0 through gpu.Open, never the
// fallback: with a driver (a GPU, or $KVLEASE_LIBCUDA naming the gpu
// package's fake driver, as CI does) the run teaches the same; without
// one it fails with gpu.ErrNoDriver or gpu.ErrNoDevice before printing.
func TestGPUFlag(t *testing.T) {
	if d, err := gpu.Open(0); err != nil {
		if !errors.Is(err, gpu.ErrNoDriver) && !errors.Is(err, gpu.ErrNoDevice) {
			t.Fatalf("gpu.Open(0): %v", err)
		}
		var out bytes.Buffer
		_, err := run(&out, config{gpu: true})
		if !errors.Is(err, gpu.ErrNoDriver) && !errors.Is(err, gpu.ErrNoDevice) || out.Len() != 0 {
			t.Fatalf("-gpu without a driver: %v, output %q", err, out.String())
		}
		return
	} else {
		_ = d.Close()
	}
	checkRun(t, config{gpu: true})
}

func checkRun(t *testing.T, cfg config) {
	t.Helper()
	var out bytes.Buffer
	n, err := run(&out, cfg)
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	s := out.String()
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if last := lines[len(lines)-1]; last != "marker mismatches 0" || n != 0 {
		t.Fatalf("last line %q, %d mismatches\n%s", last, n, s)
	}
	for _, want := range []string{
		"admit A: 136 prompt tokens; cached prefix: full 0 blocks (0 tokens), swa 0 blocks (0 tokens); hit 0 tokens",
		// The first trim happens while an offload reads the blocks: they
		// drain, and come back cached once it resolves.
		"A: offload of swa blocks 0-1 to host started",
		"A token 136: swa window starts at block 2: trimmed blocks 0-1 (full leased 9 draining 0 cached 0 free 55, swa leased 3 draining 2 cached 0 free 27)",
		"A: offload resolved: the trimmed blocks are back, cached for hits (full leased 9 draining 0 cached 0 free 55, swa leased 3 draining 0 cached 2 free 27)",
		// Growth in every group.
		"A token 160: full extends to 11 blocks",
		"A token 160: swa extends to 6 blocks",
		// One submission per direction for 12 blocks × 8 pieces.
		"offload layer-separated → block-contiguous: 1 submission, 96 copies",
		"onload block-contiguous → layer-separated: 1 submission, 96 copies",
		// A layout mismatch is refused before anything is acquired.
		"handoff of A's full blocks to a pool of 8 layers × 128 B pieces: refused at propose time, decode pool leased 0: " +
			"kvlease: propose handoff of lease 1 (A): kvlease: handoff: source layout 4×2×256B(bf16 t16 h1 d8), destination layout 8×2×128B(bf16 t16 h1 d8): layout: 4 layers vs 8",
		// B shares the system prompt; the window group takes only the
		// blocks of its window before the hit.
		"admit B: 150 prompt tokens; cached prefix: full 6 blocks (96 tokens), swa 3 blocks (96 tokens); hit 96 tokens",
		"  swa: shares blocks 1-2 (the 64 tokens before the hit), its lease starts at block 1, computes blocks 3-4",
		// C has 112 tokens cached in the full group, but the hit valid in
		// both groups is 96.
		"admit C: 136 prompt tokens; cached prefix: full 7 blocks (112 tokens), swa 3 blocks (96 tokens); hit 96 tokens",
		"release B, C: full leased 0 draining 0",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	if t.Failed() {
		t.Log(s)
	}
	if strings.Contains(s, "MISMATCH") {
		t.Fatalf("mismatches reported:\n%s", s)
	}
}

// TestCorruptionIsCaught flips one byte of a cached block shared by B and
// C: the marker check must see it where the block is shared.
func TestCorruptionIsCaught(t *testing.T) {
	var out bytes.Buffer
	n, err := run(&out, config{corrupt: true})
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	s := out.String()
	if n == 0 || !strings.Contains(s, "MISMATCH B: group full block 2 layer 1 kv 1") {
		t.Fatalf("%d mismatches for a corrupted shared block:\n%s", n, s)
	}
	if !regexp.MustCompile(`marker mismatches [1-9][0-9]*\n$`).MatchString(s) {
		t.Fatalf("last line does not report the mismatches:\n%s", s)
	}
}

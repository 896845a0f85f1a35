package rig

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvlease/kvlease"
)

func TestRanges(t *testing.T) {
	for _, tt := range []struct {
		ids  []int32
		want string
	}{{nil, ""}, {[]int32{3}, "3"}, {[]int32{5, 4, 3, 9, 12, 11}, "3-5,9,11-12"}} {
		var ids []kvlease.BlockID
		for _, id := range tt.ids {
			ids = append(ids, kvlease.BlockID(id))
		}
		if got := Ranges(ids); got != tt.want {
			t.Errorf("Ranges(%v) = %q, want %q", tt.ids, got, tt.want)
		}
	}
}

// Problems names each failure and nothing for a clean run.
func TestProblems(t *testing.T) {
	clean := Ledger{Requests: 3, Delivered: 1, RejectedPolicy: 1, Failed: 1,
		Prefill: kvlease.Stats{Capacity: 4, Free: 3, Quarantined: 1}, Decode: kvlease.Stats{Capacity: 2, Free: 2}}
	if p := clean.Problems(); len(p) != 0 {
		t.Fatalf("clean ledger: %v", p)
	}
	bad := clean
	bad.MarkerMismatches, bad.LateWrites, bad.Disagreements, bad.ProtocolErrors = 1, 2, 3, 4
	bad.Decode.Free = 1
	bad.Requests = 4
	bad.Child = ChildExit{Ran: true, Exited: true, Code: 3}
	if p := bad.Problems(); len(p) != 7 {
		t.Fatalf("want 7 problems, got %d: %v", len(p), p)
	}
}

// TestQuiescent: a pool holding only closed quarantined leases is what a
// run expects; an open lease or a draining one is unsettled, and a
// problem.
func TestQuiescent(t *testing.T) {
	mem, _ := kvlease.NewHostMemory(8, 64)
	p, _ := kvlease.NewPool[[]byte](mem)
	var l Ledger
	l.Quiescent("prefill", p.CheckQuiescent())
	if l.Unsettled != "" {
		t.Fatalf("a fresh pool: %q", l.Unsettled)
	}
	q, _ := p.Acquire("lost", 2)
	stuck := kvlease.NewTransfer(nil)
	_ = q.Attach(stuck)
	q.Release()
	stuck.Quarantine(errors.New("no ack"))
	l.Quiescent("prefill", p.CheckQuiescent())
	if l.Unsettled != "" || len(l.Problems()) != 0 {
		t.Fatalf("quarantine only: %q %v", l.Unsettled, l.Problems())
	}
	open, _ := p.Acquire("forgotten", 1)
	l.Quiescent("decode", p.CheckQuiescent())
	if !strings.HasPrefix(l.Unsettled, "decode: ") || !strings.Contains(strings.Join(l.Problems(), "|"), "pools not at rest") {
		t.Fatalf("an open lease: %q %v", l.Unsettled, l.Problems())
	}
	open.Release()
	stuck.Resolve(nil)
}

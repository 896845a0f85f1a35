package ledger

import (
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

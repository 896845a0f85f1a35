package ucx_test

import (
	"testing"

	"github.com/kvlease/kvlease/handoff"
)

func TestLoopbackDelivered(t *testing.T) {
	l := newLoop(t, loopConfig{keepLeases: true})
	lease, err := l.srcPool.Acquire("r1", 10)
	if err != nil {
		t.Fatal(err)
	}
	stamp(t, lease, 11)
	o, err := l.src.Propose(1, "r1", lease, nil)
	if err != nil {
		t.Fatal(err)
	}
	waitFinal(t, o)
	if o.State() != handoff.Delivered {
		t.Fatalf("source %v: %v", o.State(), o.History())
	}
	in := waitIncoming(t, l, 1)
	if in.State() != handoff.Delivered {
		t.Fatalf("destination %v: %v", in.State(), in.History())
	}
	if err := marked(in.Lease(), 11); err != nil {
		t.Fatal(err)
	}
	if err := marked(lease, 11); err != nil {
		t.Fatalf("source blocks changed: %v", err)
	}
	in.Lease().Release()
	lease.Release()
	t.Logf("send %+v recv %+v", l.sender.Stats(), l.recv.Stats())
}

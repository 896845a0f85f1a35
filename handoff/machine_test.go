package handoff

import (
	"errors"
	"runtime"
	"testing"
)

// TestMachineWalksEveryEdge drives machine.fire, the one place that
// performs transitions, through every cell of the table: a move changes
// the state and records one step (closing Done on a final state); a note
// records one step, keeps the state, and is a no-op when repeated; a
// no-op and a refusal record nothing and change nothing.
func TestMachineWalksEveryEdge(t *testing.T) {
	cause := errors.New("cause")
	notes := map[[2]uint8]bool{
		{uint8(Transferring), uint8(EventQuiescent)}:   true,
		{uint8(Transferring), uint8(EventPeerOutcome)}: true,
		{uint8(Aborting), uint8(EventPeerOutcome)}:     true,
		{uint8(Quarantined), uint8(EventPeerOutcome)}:  true,
	}
	for s := State(0); s < numStates; s++ {
		for e := Event(1); e < numEvents; e++ {
			m := newMachine()
			m.state = s
			m.tid = 7
			finals := 0
			m.onFinal = func() { finals++ }
			m.mu.Lock()
			kind, from := m.fire("walker", e, cause)
			want := table[s][e]
			if from != s || kind != want.kind {
				t.Errorf("%v on %v: kind %v from %v, want %v from %v", e, s, kind, from, want.kind, s)
			}
			if notes[[2]uint8{uint8(s), uint8(e)}] != (want.kind == edgeNote) {
				t.Errorf("%v on %v: note %v, not as specified", e, s, want.kind == edgeNote)
			}
			switch want.kind {
			case edgeMove, edgeNote:
				if m.state != want.to || len(m.history) != 1 || !m.saw(e) {
					t.Fatalf("%v on %v: state %v, history %v", e, s, m.state, m.history)
				}
				st := m.history[0]
				if st.From != s || st.To != want.to || st.Event != e || st.By != "walker" || st.Err != cause || st.Transfer != 7 {
					t.Errorf("%v on %v: step %v", e, s, st)
				}
				if err, ok := m.noted(e); !ok || err != cause {
					t.Errorf("%v on %v: noted %v %v", e, s, err, ok)
				}
				closed := isClosed(m.done)
				if closed != want.to.Final() || finals != map[bool]int{true: 1}[want.to.Final()] {
					t.Errorf("%v on %v → %v: Done closed %v, onFinal ran %d times", e, s, want.to, closed, finals)
				}
				if want.kind == edgeNote {
					if want.to != s {
						t.Errorf("note %v on %v changes the state to %v", e, s, want.to)
					}
					if k, _ := m.fire("walker", e, nil); k != edgeNoop || len(m.history) != 1 {
						t.Errorf("repeated note %v on %v: %v, history %d", e, s, k, len(m.history))
					}
				}
			default:
				if m.state != s || len(m.history) != 0 || m.saw(e) || isClosed(m.done) || finals != 0 {
					t.Errorf("%v on %v (%v) changed something: %v %v", e, s, want.kind, m.state, m.history)
				}
			}
			m.unlock()
		}
	}
}

// Effects queued with later run in order after the lock is released,
// and evidence parked during an effect goes to the lock's holder.
func TestMachineEffects(t *testing.T) {
	m := newMachine()
	var order []string
	m.mu.Lock()
	m.later(func() {
		if !m.mu.TryLock() {
			t.Error("a later effect ran with the lock held")
		} else {
			m.mu.Unlock()
		}
		order = append(order, "a")
	})
	m.later(func() { order = append(order, "b") })
	outcome := errors.New("resolved in the cancel hook")
	err, ok := m.effect(func() {
		// A transport's cancel hook resolving on this goroutine: the
		// callback must not wait for m.mu.
		if _, got := m.arrive(outcome); got {
			t.Error("arrive took the lock during an effect")
		}
	})
	if !ok || err != outcome {
		t.Fatalf("effect returned %v %v, want the parked evidence", err, ok)
	}
	m.unlock()
	if len(order) != 2 || order[0] != "a" || order[1] != "b" {
		t.Fatalf("effects ran %v", order)
	}
	// Outside an effect, arrive takes the lock and hands the evidence
	// to its caller.
	err, ok = m.arrive(outcome)
	if !ok || err != outcome {
		t.Fatalf("arrive: %v %v", err, ok)
	}
	m.unlock()
	if _, ok := m.unpark(); ok {
		t.Fatal("evidence left parked")
	}
}

func isClosed(ch chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// Evidence arriving on another goroutine while the lock's holder runs an
// effect is handled exactly once, by one of the two, never lost.
func TestMachineArriveRacesEffect(t *testing.T) {
	for range 500 {
		m := newMachine()
		handled := 0 // under m.mu
		done := make(chan struct{})
		go func() {
			defer close(done)
			if _, ok := m.arrive(nil); ok {
				handled++
				m.unlock()
			}
		}()
		m.mu.Lock()
		if _, ok := m.effect(runtime.Gosched); ok {
			handled++
		}
		m.unlock()
		<-done
		m.mu.Lock()
		if _, ok := m.unpark(); ok {
			handled++ // parked after the effect: the next holder takes it
		}
		if handled != 1 {
			t.Fatalf("evidence handled %d times", handled)
		}
		m.mu.Unlock()
	}
}

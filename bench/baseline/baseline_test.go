package baseline

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
)

// distinct fails if ids repeat or fall outside [0, n).
func distinct(t *testing.T, n int, ids []kvlease.BlockID) {
	t.Helper()
	seen := make(map[kvlease.BlockID]bool)
	for _, id := range ids {
		if id < 0 || int(id) >= n || seen[id] {
			t.Fatalf("id %d repeated or out of range in %v", id, ids)
		}
		seen[id] = true
	}
}

func TestBareList(t *testing.T) {
	b := NewBareList(8)
	ids, ok := b.Pop(nil, 5)
	if !ok || len(ids) != 5 {
		t.Fatalf("pop 5 of 8: %v %v", ids, ok)
	}
	distinct(t, 8, ids)
	if got, ok := b.Pop(ids, 4); ok || len(got) != 5 {
		t.Fatalf("pop 4 of 3 free: ok=%v len=%d", ok, len(got))
	}
	b.Push(ids)
	if b.Free() != 8 {
		t.Fatalf("free %d after push", b.Free())
	}
}

func TestBareListPopWaitFIFO(t *testing.T) {
	b := NewBareList(4)
	held, _ := b.Pop(nil, 4)
	got := make([]chan []kvlease.BlockID, 3)
	for i, n := range []int{3, 1, 2} {
		got[i] = make(chan []kvlease.BlockID, 1)
		go func() {
			ids, err := b.PopWait(context.Background(), nil, n)
			if err != nil || len(ids) != n {
				t.Errorf("waiter %d: %v %v", i, ids, err)
			}
			got[i] <- ids
		}()
		waitQueued(t, b, i+1)
	}
	if _, ok := b.Pop(nil, 1); ok {
		t.Fatal("Pop overtook queued waiters")
	}
	// One id back: the head needs 3, so the 1-id waiter behind it must
	// not be served.
	b.Push(held[:1])
	waitQueued(t, b, 3)
	b.Push(held[1:3]) // 3 free: the head (3) is served, then 0 left
	a := <-got[0]
	waitQueued(t, b, 2)
	b.Push(held[3:]) // 1 free: waiter 1 (1 id) is served
	c := <-got[1]
	b.Push(a) // 3 free: waiter 2 (2 ids) is served
	d := <-got[2]
	distinct(t, 4, append(append(append([]kvlease.BlockID{}, a...), c...), d[:0]...))
	b.Push(c)
	b.Push(d)
	if b.Free() != 4 {
		t.Fatalf("free %d, want 4", b.Free())
	}

	held, _ = b.Pop(nil, 4)
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	if _, err := b.PopWait(ctx, nil, 1); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("cancelled wait: %v", err)
	}
	b.Push(held)
	if b.Free() != 4 {
		t.Fatalf("free %d after cancel", b.Free())
	}
}

// waitQueued waits until exactly q PopWait callers are queued.
func waitQueued(t *testing.T, b *BareList, q int) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; {
		b.mu.Lock()
		n := len(b.waiters) - b.whead
		b.mu.Unlock()
		if n == q {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d waiters queued, want %d", n, q)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

func TestChanPool(t *testing.T) {
	p := NewChanPool(8)
	ids, ok := p.Pop(nil, 6)
	if !ok {
		t.Fatal("pop 6 of 8")
	}
	distinct(t, 8, ids)
	if got, ok := p.Pop(ids, 3); ok || len(got) != 6 || p.Free() != 2 {
		t.Fatalf("short pop: ok=%v len=%d free=%d", ok, len(got), p.Free())
	}
	p.Push(ids)
	if p.Free() != 8 {
		t.Fatalf("free %d", p.Free())
	}
}

func TestMapPool(t *testing.T) {
	p := NewMapPool(8)
	if err := p.Acquire("a", 3); err != nil {
		t.Fatal(err)
	}
	if err := p.Acquire("a", 1); !errors.Is(err, kvlease.ErrInvalidArgument) {
		t.Fatalf("second table for a: %v", err)
	}
	if err := p.Extend("a", 2); err != nil {
		t.Fatal(err)
	}
	if err := p.Acquire("b", 4); !errors.Is(err, kvlease.ErrExhausted) {
		t.Fatalf("acquire 4 of 3: %v", err)
	}
	if err := p.Extend("b", 1); !errors.Is(err, kvlease.ErrLeaseClosed) {
		t.Fatalf("extend without table: %v", err)
	}
	distinct(t, 8, p.Table("a"))
	if len(p.Table("a")) != 5 || p.owner[p.Table("a")[4]] != "a" {
		t.Fatalf("table %v", p.Table("a"))
	}
	p.Release("a")
	p.Release("a")
	if p.Free() != 8 || len(p.owner) != 0 {
		t.Fatalf("free %d owners %d", p.Free(), len(p.owner))
	}
}

func TestSlotList(t *testing.T) {
	s := NewSlotList(4)
	refs, ok := s.Pop(nil, 3)
	if !ok || len(refs) != 3 || refs[0].Gen != 1 {
		t.Fatalf("pop: %v %v", refs, ok)
	}
	if _, ok := s.Pop(nil, 2); ok {
		t.Fatal("pop 2 of 1 free")
	}
	if !s.Push(refs) || s.Free() != 4 {
		t.Fatalf("push: free %d", s.Free())
	}
	if s.Push(refs[:1]) {
		t.Fatal("pushed a ref twice")
	}
	again, _ := s.Pop(nil, 4)
	if s.Push([]kvlease.BlockRef{refs[0]}) {
		t.Fatal("pushed a stale ref")
	}
	s.Push(again)
}

package kvlease

import (
	"testing"
)

// Pool.Check finds a prefix index out of step with the slot table (it is
// the tool every other test relies on, so it must be able to fail; the
// slot table's own corruptions are internal/slots' TestCheckFindsCorruption).
func TestCheckFindsCorruption(t *testing.T) {
	corrupt := []struct {
		name string
		f    func(p *Pool[[]byte])
	}{
		{"indexed slot's hash changed", func(p *Pool[[]byte]) { p.pre[0].hash++ }},
		{"index entry lost", func(p *Pool[[]byte]) { p.index.remove(p.pre[0].hash, 0) }},
	}
	for _, c := range corrupt {
		p := smPool(t, 4)
		l, _ := p.Acquire("a", 1)
		if err := l.Seal(0, 42); err != nil {
			t.Fatal(err)
		}
		if err := p.Check(); err != nil {
			t.Fatalf("%s: before: %v", c.name, err)
		}
		p.mu.Lock()
		c.f(p)
		p.mu.Unlock()
		if err := p.Check(); err == nil {
			t.Errorf("%s: Check found nothing", c.name)
		}
		_ = l
	}
}

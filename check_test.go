package kvlease

import (
	"testing"
)

// Pool.Check finds a corrupted slot table (it is the tool every other test
// relies on, so it must be able to fail).
func TestCheckFindsCorruption(t *testing.T) {
	corrupt := []struct {
		name string
		f    func(p *Pool[[]byte])
	}{
		{"wrong class", func(p *Pool[[]byte]) { p.slots[1].class = classLeased }},
		{"count drift", func(p *Pool[[]byte]) { p.counts[classFree]--; p.counts[classCached]++ }},
		{"negative refs", func(p *Pool[[]byte]) { p.slots[0].refs = -1 }},
		{"free but held", func(p *Pool[[]byte]) { p.slots[2].pins = 1 }},
		{"free stack short", func(p *Pool[[]byte]) { p.free = p.free[:len(p.free)-1] }},
	}
	for _, c := range corrupt {
		p := smPool(t, 4)
		l, _ := p.Acquire("a", 1)
		p.mu.Lock()
		c.f(p)
		p.mu.Unlock()
		if err := p.Check(); err == nil {
			t.Errorf("%s: Check found nothing", c.name)
		}
		_ = l
	}
	if err := smPool(t, 4).Check(); err != nil {
		t.Fatal(err)
	}
}

package slots

import (
	"fmt"
	"testing"
)

func checkTable(t *testing.T, tab *Table) {
	t.Helper()
	var errs []string
	tab.Check(func(format string, args ...any) { errs = append(errs, fmt.Sprintf(format, args...)) })
	if len(errs) > 0 {
		t.Fatalf("table inconsistent: %v", errs)
	}
}

// Check finds a corrupted table (it is the tool every other test relies
// on, so it must be able to fail).
func TestCheckFindsCorruption(t *testing.T) {
	corrupt := []struct {
		name string
		f    func(tab *Table)
	}{
		{"wrong class", func(tab *Table) { tab.s[1].class = Leased }},
		{"count drift", func(tab *Table) { tab.counts[Free]--; tab.counts[Cached]++ }},
		{"negative refs", func(tab *Table) { tab.s[0].refs = -1 }},
		{"free but held", func(tab *Table) { tab.s[2].pins = 1 }},
		{"free stack short", func(tab *Table) { tab.free = tab.free[:len(tab.free)-1] }},
		{"quarantined leased miscounted", func(tab *Table) { tab.quarLeased++ }},
		{"LRU tail", func(tab *Table) { tab.tail = 3 }},
	}
	for _, c := range corrupt {
		var tab Table
		tab.Init(4)
		tab.Take()
		c.f(&tab)
		found := false
		tab.Check(func(string, ...any) { found = true })
		if !found {
			t.Errorf("%s: Check found nothing", c.name)
		}
	}
	var tab Table
	tab.Init(4)
	checkTable(t, &tab)
}

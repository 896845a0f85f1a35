package kvlease

import "github.com/kvlease/kvlease/internal/slots"

// FreeIDsForTest appends the ids of p's free blocks (neither held nor
// cached), ascending, to dst: the free space a fill chooses from, for the
// runs measurement of the external tests.
func FreeIDsForTest[R any](p *Pool[R], dst []BlockID) []BlockID {
	p.mu.Lock()
	defer p.mu.Unlock()
	for id := range p.tab.Len() {
		if p.tab.ClassOf(int32(id)) == slots.Free {
			dst = append(dst, BlockID(id))
		}
	}
	return dst
}

// AppendRunsForTest is appendRuns (Lease.AppendRuns' split) over any
// block table, for the external tests' table of cases.
func AppendRunsForTest(dst []Run, blocks []BlockRef) []Run { return appendRuns(dst, blocks) }

// tenantLine is t's line of Pool.TenantStats.
func tenantLine[R any](t *Tenant[R]) TenantStats {
	c := &t.p.core
	c.mu.Lock()
	defer c.unlock()
	return c.tenantStats(t.ix)
}

package kvlease

// Run is a contiguous run of block ids: Start, Start+1, …, Start+Len-1.
// Memory lays block id at offset id×BlockBytes (HostMemory, the gpu
// arenas), so a run is one span of bytes: a copy path moves it with one
// copy, one write or one read instead of Len.
type Run struct {
	Start BlockID
	Len   int
}

// end is the id one past the run's last block.
func (r Run) end() BlockID { return r.Start + BlockID(r.Len) }

// AppendRuns appends the runs of blocks from..Len()-1 to dst, in the
// lease's block order, and returns it: block from is the first block of
// the first run, and consecutive blocks whose ids ascend by one share a
// run. A lease's fresh blocks come as few runs as the pool's free space
// allows (see the README's "Contiguous runs"), so a transfer or a copy
// moves each run with one descriptor. It allocates nothing when dst has
// room; a from outside [Trimmed(), Len()] panics like AppendBlockIDs.
func (l *Lease[R]) AppendRuns(dst []Run, from int) []Run {
	return appendRuns(dst, l.ls.liveFrom(from))
}

// appendRuns appends the runs of blocks, in order, to dst and returns it
// (Lease.AppendRuns). It allocates nothing when dst has room.
func appendRuns(dst []Run, blocks []BlockRef) []Run {
	if len(blocks) == 0 {
		return dst
	}
	cur := Run{Start: blocks[0].ID, Len: 1}
	for _, r := range blocks[1:] {
		if r.ID == cur.end() {
			cur.Len++
			continue
		}
		dst = append(dst, cur)
		cur = Run{Start: r.ID, Len: 1}
	}
	return append(dst, cur)
}

package overtcp

// The -net -stream run: streaming handoffs. A prefill computes a prompt
// layer by layer; each layer writes its share of every block of the
// request. Without streaming the handoff starts only once the last layer
// is written, so the whole copy comes after the prefill. With streaming
// (handoff.Streaming) the source proposes before the prefill starts, the
// decode side accepts, and the plane sends each layer as the prefill
// marks it written (handoff.Progress.WroteLayers), while the next layer
// is being computed: after the last write only the last layer's share is
// left to send.
//
// Every request is run both ways, one after the other, with the same
// simulated compute time per layer, and its timeline prints when each
// layer was written here and when its last byte arrived in the decode
// process, for both. The decode side notes arrivals as its data plane
// reads bytes into the lease's regions (its data connections are wrapped:
// a read into a region is a layer's bytes arriving), checks that every
// such region is still the lease's (late writes), and checks each layer
// of each block against its marker on delivery (marker mismatches).
//
// The ownership rules do not change: the source's transfer gates the
// whole lease from the start, a layer not yet marked is never read, and
// the delivered lease is the decode side's. The injected faults of the
// -net run do not apply here; the handoff/tcp tests kill peers and abort
// between layers.

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"time"
	"unsafe"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/audit"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
	"github.com/kvlease/kvlease/internal/rig"
)

// The -stream run's envelope: blocks of 8 layers of K and V for 16 tokens
// (16 KiB a block, 2 KiB a layer); a prompt of up to 1024 tokens is up
// to 64 blocks, 1 MiB.
const (
	streamLayers     = 8
	streamBlockBytes = 16 << 10
	streamPoolBlocks = 256
)

var streamEnvelope = handoff.Envelope{
	BlockTokens: 16, BlockBytes: streamBlockBytes, PoolBlocks: streamPoolBlocks,
	MaxContextTokens: 1024, MaxPrefillTokens: 1024, MaxRunningRequests: 8,
}

// layerMarker is the marker of layer l of block i of handoff id: each
// layer's share of a block carries its own, so a layer sent before it was
// written (stale bytes) fails its check.
func layerMarker(id uint64, i, l int) audit.Marker {
	return audit.Marker{Request: id, Block: uint32(i*streamLayers + l)}
}

// layerOf returns layer l's share of block b.
func layerOf(b []byte, l int) []byte {
	n := len(b) / streamLayers
	return b[l*n : (l+1)*n]
}

// streamID is the handoff id of request r's streaming handoff; its
// start-after-prefill handoff is the next one.
func streamID(r rig.Request) uint64 { return 2 * uint64(r.ID) }

// streamRun is one handoff of the -stream run, seen from the prefill
// process.
type streamRun struct {
	id        uint64
	out       *handoff.Outgoing[[]byte]
	t0        time.Time   // the prefill's start
	written   []time.Time // when each layer was written
	delivered time.Time
	view      *rig.View
}

// prefillLayers runs the simulated prefill of lease: per layer, the
// compute delay, then that layer's share of every block, then the mark
// (if the handoff streams). It returns when each layer was written.
func prefillLayers(lease *kvlease.Lease[[]byte], id uint64, delay time.Duration, p *handoff.Progress) ([]time.Time, error) {
	written := make([]time.Time, streamLayers)
	for l := range streamLayers {
		time.Sleep(delay) // the layer's compute
		for i := range lease.Len() {
			b, err := lease.Region(i)
			if err != nil {
				return nil, err
			}
			audit.Stamp(layerOf(b, l), layerMarker(id, i, l))
		}
		written[l] = time.Now()
		if p != nil {
			if err := p.WroteLayers(l + 1); err != nil {
				return nil, err
			}
		}
	}
	return written, nil
}

// runOne runs request r's handoff id on pool and src, streaming or not,
// and waits for its end.
func runOne(pool *kvlease.Pool[[]byte], src *handoff.Source[[]byte], r rig.Request, id uint64, stream bool, cfg rig.Config) (*streamRun, error) {
	n := streamEnvelope.BlocksFor(r.Prompt)
	lease, err := pool.Acquire(r.Name, n)
	if err != nil {
		return nil, err
	}
	defer lease.Release()
	run := &streamRun{id: id, t0: time.Now()}
	if stream {
		p, err := handoff.NewProgress(n, streamLayers)
		if err != nil {
			return nil, err
		}
		if run.out, err = src.Propose(id, r.Name, lease, nil, handoff.Streaming(p)); err != nil {
			return nil, err
		}
		if run.written, err = prefillLayers(lease, id, cfg.LayerDelay, p); err != nil {
			return nil, err
		}
	} else {
		if run.written, err = prefillLayers(lease, id, cfg.LayerDelay, nil); err != nil {
			return nil, err
		}
		if run.out, err = src.Propose(id, r.Name, lease, nil); err != nil {
			return nil, err
		}
	}
	select {
	case <-run.out.Done():
		run.delivered = time.Now()
	case <-time.After(30*time.Second + 4*cfg.Deadline):
		return nil, fmt.Errorf("%s: handoff %d not final: %v", r.Name, id, run.out.History())
	}
	return run, nil
}

// RunStream runs the -net -stream burst: every admitted request handed
// off twice, streaming and after its prefill, to a decode child process.
func RunStream(cfg rig.Config, out io.Writer) (rig.Ledger, error) {
	return runStream(cfg, out, os.Stderr, nil)
}

// runStream is RunStream; seen, if set, gets each admitted request's two
// runs (streaming, after prefill) once the decode side reported.
func runStream(cfg rig.Config, out, childErr io.Writer, seen func(r rig.Request, st, aft *streamRun)) (l rig.Ledger, err error) {
	cfg.Stream = true
	if err := cfg.Check(); err != nil {
		return rig.Ledger{}, err
	}
	pool, err := rig.NewPool(streamPoolBlocks, streamBlockBytes)
	if err != nil {
		return rig.Ledger{}, err
	}
	sender := tcp.NewSender(tcp.Config{})
	defer sender.Close()
	pre, err := rig.StartPrefill[[]byte](cfg, streamEnvelope, sender, childErr)
	if err != nil {
		return rig.Ledger{}, err
	}
	defer pre.Close()
	src := pre.Src

	reqs := rig.Burst(cfg)
	refused := map[int]string{}
	runs := map[uint64]*streamRun{}
	for _, r := range reqs {
		if err := streamEnvelope.CheckRequest(r.Prompt, r.MaxNew); err != nil {
			refused[r.ID] = "envelope: " + err.Error()
			continue
		}
		for k, stream := range []bool{true, false} {
			run, err := runOne(pool, src, r, streamID(r)+uint64(k), stream, cfg)
			if err != nil {
				return rig.Ledger{}, err
			}
			runs[run.id] = run
		}
	}
	l.Prefill = pool.Stats()
	l.Quiescent("prefill", pool.CheckQuiescent())
	_ = src.Close()
	rep, err := pre.Child.Finish(30*time.Second + 4*cfg.Deadline)
	if err != nil {
		l.Child = pre.Child.Exit()
		return l, err
	}
	for i := range rep.Handoffs {
		if run := runs[rep.Handoffs[i].ID]; run != nil {
			run.view = &rep.Handoffs[i]
		}
	}
	l.Requests = len(reqs)
	for _, r := range reqs {
		if why := refused[r.ID]; why != "" {
			l.Count(why, 0, false, false)
			if !cfg.Quiet {
				fmt.Fprintf(out, "%s %4d tokens  rejected by %s\n", r.Name, r.Prompt, why)
			}
			continue
		}
		st, aft := runs[streamID(r)], runs[streamID(r)+1]
		state := st.out.State()
		if state == handoff.Delivered {
			state = aft.out.State()
		}
		for _, run := range []*streamRun{st, aft} {
			if run.view == nil || run.view.State != run.out.State() {
				l.Disagreements++
			}
		}
		l.Count("", state, false, false)
		if seen != nil {
			seen(r, st, aft)
		}
		if !cfg.Quiet {
			printStreamTimeline(out, r, st, aft)
		}
	}
	pre.Settle(&l, rep, out)
	rig.PrintLedger(out, cfg.Seed, l, netLedger("none expected: no faults injected"))
	return l, nil
}

// ms is d in milliseconds, for the timelines.
func ms(d time.Duration) string { return fmt.Sprintf("%7.2f ms", float64(d)/1e6) }

// printStreamTimeline writes request r's two timelines side by side.
func printStreamTimeline(out io.Writer, r rig.Request, st, aft *streamRun) {
	n := streamEnvelope.BlocksFor(r.Prompt)
	fmt.Fprintf(out, "%s %4d tokens  %d blocks × %d layers (%d KiB a layer)\n", r.Name, r.Prompt, n, streamLayers, n*streamBlockBytes/streamLayers>>10)
	fmt.Fprintf(out, "    layer    streaming: written    arrived    start after prefill: written    arrived\n")
	arrived := func(run *streamRun, layer int) string {
		if run.view == nil || layer >= len(run.view.Arrived) || run.view.Arrived[layer] == 0 {
			return "          -"
		}
		return ms(time.Unix(0, run.view.Arrived[layer]).Sub(run.t0))
	}
	for layer := range streamLayers {
		fmt.Fprintf(out, "    %5d  %20s %s  %30s %s\n", layer, ms(st.written[layer].Sub(st.t0)), arrived(st, layer), ms(aft.written[layer].Sub(aft.t0)), arrived(aft, layer))
	}
	fmt.Fprintf(out, "    %-7s  %20s %s  %30s %s\n", "final", st.out.State(), ms(st.delivered.Sub(st.t0)), aft.out.State(), ms(aft.delivered.Sub(aft.t0)))
	tail := func(run *streamRun) time.Duration { return run.delivered.Sub(run.written[streamLayers-1]) }
	fmt.Fprintf(out, "    from the last write to %v: streaming %s, start after prefill %s\n", handoff.Delivered, ms(tail(st)), ms(tail(aft)))
}

// The decode process of a -stream run.

// streamDecoder is the decode process's state in a -stream run.
type streamDecoder struct {
	pool       *kvlease.Pool[[]byte]
	base, size uintptr // the pool's host memory: its address and bytes

	mu    sync.Mutex
	incs  map[uint64]*streamIncoming
	live  map[kvlease.BlockID]liveBlock // blocks live handoffs receive
	stray int                           // reads into blocks no live handoff receives
}

// liveBlock is a block a live handoff receives: its handoff and its
// place among the handoff's wanted blocks.
type liveBlock struct {
	inc *streamIncoming
	j   int
}

// streamIncoming is one handoff as the decode side of a -stream run
// sees it.
type streamIncoming struct {
	in                  *handoff.Incoming[[]byte]
	refs                []kvlease.BlockRef
	regions             [][]byte // the lease's wanted blocks, in order
	got                 []int    // bytes arrived per layer
	arrived             []int64  // when each layer's last byte arrived (Unix ns)
	ids                 []kvlease.BlockID
	checked, mismatches int
	// live: the handoff is not final, its transfer may still write;
	// late: a read landed in one of its blocks no longer its lease's.
	live, late bool
	final      bool // OnFinal ran (after OnDelivered released the lease)
}

// arrivalConn is a data connection as the decode side of a -stream run
// reads it: every read into a lease's region is noted.
type arrivalConn struct {
	net.Conn
	d *streamDecoder
}

func (c *arrivalConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.d.arrived(p[:n], time.Now().UnixNano())
	}
	return n, err
}

// locate returns the block of the decode pool's memory that b starts in,
// and b's offset in it; ok is false for bytes outside the pool (a
// frame's header or check). The pool is one host memory, blocks laid out
// by id, so the address alone says which block a read fills, whatever
// slice of it (one block, part of one, a run of several) the plane reads
// into. Only the address is compared; nothing is read through it.
func (d *streamDecoder) locate(b []byte) (id kvlease.BlockID, off int, ok bool) {
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	if p < d.base || p >= d.base+uintptr(d.size) {
		return 0, 0, false
	}
	o := int(p - d.base)
	return kvlease.BlockID(o / streamBlockBytes), o % streamBlockBytes, true
}

// arrived notes b, just read, in the layers it belongs to: each block it
// covers must be one a live handoff is receiving (else it is a late
// write: the block is no longer, or never was, a receiving lease's).
func (d *streamDecoder) arrived(b []byte, now int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for len(b) > 0 {
		id, off, ok := d.locate(b)
		if !ok {
			return // a frame's header or check, not a region
		}
		t := min(len(b), streamBlockBytes-off)
		at, live := d.live[id]
		if !live {
			d.stray++
			b = b[t:]
			continue
		}
		inc := at.inc
		if cur, err := d.pool.Region(inc.refs[inc.in.Hits()+at.j]); err != nil || &cur[0] != &inc.regions[at.j][0] {
			inc.late = true // the block is no longer the lease's
		}
		lb := streamBlockBytes / streamLayers
		for pos := off; pos < off+t; {
			l := pos / lb
			k := min(off+t, (l+1)*lb) - pos
			inc.got[l] += k
			if inc.got[l] == len(inc.regions)*lb {
				inc.arrived[l] = now
			}
			pos += k
		}
		b = b[t:]
	}
}

func (d *streamDecoder) accepted(in *handoff.Incoming[[]byte]) {
	l := in.Lease()
	inc := &streamIncoming{in: in, live: true, got: make([]int, streamLayers), arrived: make([]int64, streamLayers), ids: l.AppendBlockIDs(nil, 0)}
	for i := range l.Len() {
		inc.refs = append(inc.refs, l.Ref(i))
		if i >= in.Hits() {
			b, _ := l.Region(i)
			inc.regions = append(inc.regions, b)
		}
	}
	d.mu.Lock()
	d.incs[in.ID()] = inc
	for j, ref := range inc.refs[in.Hits():] {
		d.live[ref.ID] = liveBlock{inc, j}
	}
	d.mu.Unlock()
}

// delivered checks every layer of every block against its marker, then
// releases the lease.
func (d *streamDecoder) delivered(in *handoff.Incoming[[]byte]) {
	d.retire(in)
	l := in.Lease()
	bad := 0
	for i := range l.Len() {
		b, err := l.ReadRegion(i)
		for layer := range streamLayers {
			if err != nil || audit.Check(layerOf(b, layer), layerMarker(in.ID(), i, layer)) != nil {
				bad++
			}
		}
	}
	l.Release()
	d.mu.Lock()
	inc := d.incs[in.ID()]
	inc.checked, inc.mismatches = l.Len()*streamLayers, bad
	d.mu.Unlock()
}

// retire notes that in's transfer will never write again: a read into
// its blocks from now on is a late write.
func (d *streamDecoder) retire(in *handoff.Incoming[[]byte]) {
	d.mu.Lock()
	if inc := d.incs[in.ID()]; inc != nil && inc.live {
		inc.live = false
		for _, ref := range inc.refs[in.Hits():] {
			delete(d.live, ref.ID)
		}
	}
	d.mu.Unlock()
}

// final is OnFinal: in is final, and its lease released if delivered.
func (d *streamDecoder) final(in *handoff.Incoming[[]byte]) {
	d.retire(in)
	d.mu.Lock()
	if inc := d.incs[in.ID()]; inc != nil {
		inc.final = true
	}
	d.mu.Unlock()
}

// settled reports whether every handoff is final.
func (d *streamDecoder) settled() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, inc := range d.incs {
		if !inc.final {
			return false
		}
	}
	return true
}

// runStreamDecode is the decode process of a -stream run: it serves the
// control connection until it ends and reports.
func runStreamDecode(p *rig.Parent) (rig.Report, error) {
	d := &streamDecoder{incs: map[uint64]*streamIncoming{}, live: map[kvlease.BlockID]liveBlock{}}
	mem, err := kvlease.NewHostMemory(streamPoolBlocks, streamBlockBytes)
	if err != nil {
		return rig.Report{}, err
	}
	if d.pool, err = kvlease.NewPool[[]byte](mem); err != nil {
		return rig.Report{}, err
	}
	all := mem.Span(kvlease.Run{Start: 0, Len: streamPoolBlocks})
	d.base, d.size = uintptr(unsafe.Pointer(unsafe.SliceData(all))), uintptr(len(all))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return rig.Report{}, err
	}
	recv := tcp.NewReceiver(ln, tcp.Config{WrapConn: func(c net.Conn) net.Conn { return &arrivalConn{Conn: c, d: d} }})
	defer recv.Close()
	dst, conn, err := rig.Destination(p, d.pool, recv, streamEnvelope, p.Cfg.Deadline, handoff.DestinationConfig[[]byte]{
		OnAccept:    d.accepted,
		OnDelivered: d.delivered,
		OnFinal:     d.final,
	})
	if err != nil {
		return rig.Report{}, err
	}
	if err := dst.Serve(conn); errors.Is(err, handoff.ErrProtocol) {
		p.Fail(err)
	}
	// Every handoff ended before the prefill side closed the connection
	// (it waits for each), but this side's last OnFinal may still run.
	for end := time.Now().Add(10 * time.Second); !d.settled() && time.Now().Before(end); {
		time.Sleep(time.Millisecond)
	}
	var rep rig.Report
	d.mu.Lock()
	defer d.mu.Unlock()
	ids := make([]uint64, 0, len(d.incs))
	for id := range d.incs {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		inc := d.incs[id]
		v := rig.View{ID: id, State: inc.in.State(), Final: inc.final, Blocks: inc.ids, Checked: inc.checked, Mismatches: inc.mismatches, Late: inc.late, Arrived: inc.arrived,
			Steps: rig.Steps(inc.in.History())}
		rep.Handoffs = append(rep.Handoffs, v)
		rep.MarkerMismatches += v.Mismatches
		if v.Late {
			rep.LateWrites++
		}
	}
	rep.LateWrites += d.stray
	rep.Decode = d.pool.Stats()
	return rep, nil
}

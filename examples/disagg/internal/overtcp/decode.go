package overtcp

// The decode process of a -net run: a child of the prefill process,
// holding only its own pool. It serves one control connection as a
// handoff.Destination over a handoff/tcp Receiver, checks the markers of
// every delivered lease on delivery and again before it releases it (the
// moment its blocks may be reused), audits every block the receiver
// writes, and, when the control connection ends, reports everything to
// the prefill process (rig.Report) and exits.

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
	"github.com/kvlease/kvlease/internal/rig"
)

// ServeDecode is the decode process of a -net or -stream run: the
// program's main (and a test binary's TestMain) has rig.ChildMain run it
// when rig.IsChild.
func ServeDecode(p *rig.Parent) (rig.Report, error) {
	if p.Cfg.Stream {
		return runStreamDecode(p)
	}
	return runDecode(p)
}

// decoder is the decode process's state.
type decoder struct {
	cfg  rig.Config
	reqs map[uint64]rig.Request // the burst, drawn from the same seed
	pool *kvlease.Pool[[]byte]

	mu      sync.Mutex
	tokens  map[[16]byte]uint64 // data-connection token → handoff id
	incs    map[uint64]*incoming
	running int // handoffs accepted whose lease this side still holds
}

// incoming is the decode side's record of one handoff.
type incoming struct {
	id      uint64
	in      *handoff.Incoming[[]byte]
	req     rig.Request
	refs    []kvlease.BlockRef // the lease's blocks, at acceptance
	regions [][]byte           // the regions of the blocks it wants, in order
	ids     []kvlease.BlockID
	// admitted: counted as running; final: OnFinal ran; aborted: the
	// client went away mid-transfer; late: a block was written after it
	// stopped being the lease's.
	admitted, final, delivered, aborted, late bool
	checked, mismatches                       int
}

// get returns id's record, making it. Called with d.mu held.
func (d *decoder) get(id uint64) *incoming {
	inc := d.incs[id]
	if inc == nil {
		inc = &incoming{id: id, req: d.reqs[id]} // the zero Request if none: ID 0 matches no handoff
		d.incs[id] = inc
	}
	return inc
}

// decide is the decode side's policy: at most MaxRunningRequests running.
func (d *decoder) decide(p *handoff.ProposeMsg) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	inc := d.get(p.ID)
	if d.running >= envelope.MaxRunningRequests {
		return errBusy
	}
	inc.admitted = true
	d.running++
	return nil
}

// accepted takes the handle of an accepted handoff before any block moves.
func (d *decoder) accepted(in *handoff.Incoming[[]byte]) {
	l := in.Lease()
	refs := make([]kvlease.BlockRef, l.Len())
	for i := range refs {
		refs[i] = l.Ref(i)
	}
	var regions [][]byte
	for i := in.Hits(); i < l.Len(); i++ {
		if b, err := l.Region(i); err == nil {
			regions = append(regions, b)
		}
	}
	d.mu.Lock()
	inc := d.get(in.ID())
	inc.in, inc.refs, inc.regions, inc.ids = in, refs, regions, l.AppendBlockIDs(nil, 0)
	d.mu.Unlock()
}

// check checks the markers of every block of a delivered lease.
func (d *decoder) check(inc *incoming, l *kvlease.Lease[[]byte]) {
	bad := 0
	for i := range l.Len() {
		b, err := l.ReadRegion(i)
		if err != nil || !rig.MarkerOK(b, int(inc.id), i) {
			bad++
		}
	}
	d.mu.Lock()
	inc.checked += l.Len()
	inc.mismatches += bad
	d.mu.Unlock()
}

func (d *decoder) delivered(in *handoff.Incoming[[]byte]) {
	d.mu.Lock()
	inc := d.get(in.ID())
	inc.delivered = true
	d.mu.Unlock()
	d.check(inc, in.Lease()) // the decode side keeps the lease: it is running
}

func (d *decoder) finalized(in *handoff.Incoming[[]byte]) {
	st := in.State()
	d.mu.Lock()
	defer d.mu.Unlock()
	inc := d.get(in.ID())
	inc.in, inc.final = in, true
	if inc.admitted && st != handoff.Delivered {
		d.running--
	}
}

// decodePlane is handoff/tcp's Receiver, noting which token names which
// handoff so the audit can tell the data connections apart.
type decodePlane struct {
	*tcp.Receiver
	d *decoder
}

func (p decodePlane) Prepare(id handoff.PlaneID, blocks int) ([]byte, error) {
	accept, err := p.Receiver.Prepare(id, blocks)
	if err == nil && len(accept) >= 16 { // the address, then the 16-byte token
		var tok [16]byte
		copy(tok[:], accept[len(accept)-16:])
		p.d.mu.Lock()
		p.d.tokens[tok] = id.Handoff
		p.d.mu.Unlock()
	}
	return accept, err
}

// recvConn is one data connection as the decode side reads it. Once its
// hello names the handoff, every block the receiver reads into the lease
// is audited when its first byte is about to arrive and when its last
// has (the block must still be the lease's, at its generation: leased or
// draining, never reclaimed), and the client of a request that goes away
// mid-transfer aborts it from here, while its block abortAt is being
// written.
type recvConn struct {
	net.Conn
	d       *decoder
	hello   []byte // the hello's bytes so far
	inc     *incoming
	regions [][]byte // inc's wanted blocks, in order
	next    int      // the next of them to arrive
	left    int      // bytes of block next-1 still to come
}

func (c *recvConn) Read(p []byte) (int, error) {
	i := -1 // the block this read fills
	if len(p) > 0 && c.left > 0 {
		if r := c.regions[c.next-1]; &p[0] == &r[len(r)-c.left] {
			i = c.next - 1
		}
	}
	if len(p) > 0 && i < 0 && c.next < len(c.regions) && &p[0] == &c.regions[c.next][0] {
		i, c.left, c.next = c.next, len(c.regions[c.next]), c.next+1
		c.d.beforeWrite(c.inc, i, p)
	}
	n, err := c.Conn.Read(p)
	if c.inc == nil && len(c.hello) < tcpHello {
		c.hello = append(c.hello, p[:min(n, tcpHello-len(c.hello))]...)
		if len(c.hello) == tcpHello {
			var tok [16]byte
			copy(tok[:], c.hello[tcpTokenAt:])
			c.d.mu.Lock()
			if id, ok := c.d.tokens[tok]; ok && c.d.incs[id] != nil {
				c.inc, c.regions = c.d.incs[id], c.d.incs[id].regions
			}
			c.d.mu.Unlock()
		}
	}
	if i >= 0 {
		if c.left -= n; c.left == 0 {
			c.d.audit(c.inc, i, c.regions[i])
		}
	}
	return n, err
}

func (d *decoder) beforeWrite(inc *incoming, i int, p []byte) {
	d.audit(inc, i, p)
	d.mu.Lock()
	in := inc.in
	block := in.Hits() + i
	abort := inc.req.ID != 0 && block == inc.req.AbortAt && !inc.aborted
	inc.aborted = inc.aborted || abort
	d.mu.Unlock()
	if abort {
		_ = in.Abort("frontend", fmt.Errorf("%w while block %d of %d was being written", errClientGone, block, in.Blocks()))
	}
	if d.cfg.Lie && in.State() == handoff.Aborting {
		in.Transfer().Resolve(nil) // "quiescent", says the transport, mid-copy
	}
}

// audit checks that p, the region the receiver writes for block i of
// inc's stream, is still the lease's block at its generation.
func (d *decoder) audit(inc *incoming, i int, p []byte) {
	d.mu.Lock()
	ref := inc.refs[inc.in.Hits()+i]
	d.mu.Unlock()
	b, err := d.pool.Region(ref)
	if err != nil || &b[0] != &p[0] {
		d.mu.Lock()
		inc.late = true
		d.mu.Unlock()
	}
}

// runDecode serves the control connection until it ends, settles, and
// builds the report.
func runDecode(p *rig.Parent) (rig.Report, error) {
	cfg := p.Cfg
	d := &decoder{cfg: cfg, reqs: map[uint64]rig.Request{}, tokens: map[[16]byte]uint64{}, incs: map[uint64]*incoming{}}
	for _, r := range rig.NetBurst(cfg) {
		d.reqs[uint64(r.ID)] = r
	}
	var err error
	if d.pool, err = rig.NewPool(rig.DecodeBlocks, envelope.BlockBytes); err != nil {
		return rig.Report{}, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return rig.Report{}, err
	}
	recv := tcp.NewReceiver(ln, tcp.Config{WrapConn: func(c net.Conn) net.Conn { return &recvConn{Conn: c, d: d} }})
	defer recv.Close() // after the report's snapshot: stalled streams end now
	dst, conn, err := rig.Destination(p, d.pool, decodePlane{recv, d}, rig.DecodeEnvelope(), cfg.Deadline/2, handoff.DestinationConfig[[]byte]{
		// The one prefill process may hold the whole pool: the pool's
		// own admission decides (RejectedDecode).
		MaxSessionBlocks: -1,
		Decide:           d.decide,
		OnAccept:         d.accepted,
		OnDelivered:      d.delivered,
		OnFinal:          d.finalized,
	})
	if err != nil {
		return rig.Report{}, err
	}
	if err := dst.Serve(conn); errors.Is(err, handoff.ErrProtocol) {
		p.Fail(err)
	}

	// The prefill side is done. Wait for this side's own evidence: every
	// handoff final, but for the streams whose sender stalls for good
	// (the burst says which): those wait until their deadline quarantined
	// them. A stream whose sender resumed may still be quarantined here,
	// its late evidence on its way: it is waited for.
	end := time.Now().Add(30*time.Second + 4*cfg.Deadline)
	for {
		d.mu.Lock()
		all := make([]*incoming, 0, len(d.incs))
		for _, inc := range d.incs {
			all = append(all, inc)
		}
		d.mu.Unlock()
		settled := true
		for _, inc := range all {
			d.mu.Lock()
			in, final := inc.in, inc.final
			forever := inc.req.ID != 0 && inc.req.StallAt >= 0 && !inc.req.LateAck
			d.mu.Unlock()
			if !final && (!forever || in == nil || in.State() != handoff.Quarantined) {
				settled = false
			}
		}
		if settled {
			break
		}
		if time.Now().After(end) {
			p.Fail(fmt.Errorf("handoffs still unsettled after %v", 30*time.Second+4*cfg.Deadline))
			break
		}
		time.Sleep(5 * time.Millisecond)
	}

	// Decode finishes: every delivered request checks its markers once
	// more, then releases its blocks (the moment they may be reused).
	var rep rig.Report
	ids := make([]uint64, 0, len(d.incs))
	d.mu.Lock()
	for id := range d.incs {
		ids = append(ids, id)
	}
	d.mu.Unlock()
	slices.Sort(ids)
	for _, id := range ids {
		d.mu.Lock()
		inc := d.incs[id]
		delivered := inc.delivered
		d.mu.Unlock()
		if delivered {
			l := inc.in.Lease()
			d.check(inc, l)
			l.Release()
			d.mu.Lock()
			d.running--
			d.mu.Unlock()
		}
	}
	for _, id := range ids {
		d.mu.Lock()
		inc := d.incs[id]
		v := rig.View{ID: id, Blocks: inc.ids, Checked: inc.checked, Mismatches: inc.mismatches, Late: inc.late, Final: inc.final}
		d.mu.Unlock()
		if inc.in != nil {
			v.State = inc.in.State()
			v.Steps = rig.Steps(inc.in.History())
		}
		rep.Handoffs = append(rep.Handoffs, v)
		rep.MarkerMismatches += v.Mismatches
		if v.Late {
			rep.LateWrites++
		}
	}
	rep.Decode = d.pool.Stats()
	return rep, nil
}

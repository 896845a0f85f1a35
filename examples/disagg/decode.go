package main

// The decode process of a -net run: a child of the prefill process,
// holding only its own pool. It serves one control connection as a
// handoff.Destination over a handoff/tcp Receiver, checks the markers of
// every delivered lease on delivery and again before it releases it (the
// moment its blocks may be reused), audits every block the receiver
// writes, and, when the control connection ends, reports everything as
// JSON on stdout and exits.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
)

// decodeReport is what the decode process tells the prefill process at
// the end.
type decodeReport struct {
	Handoffs []decodeView
	Decode   kvlease.Stats // the pool at the end
	// MarkerMismatches counts delivered blocks that did not hold their
	// request's marker (on delivery or before release); LateWrites the
	// transfers that wrote a block no longer theirs.
	MarkerMismatches, LateWrites int
	Errors                       []string // protocol errors, and anything that went wrong
}

// decodeView is one handoff as the decode side saw it.
type decodeView struct {
	ID      uint64
	State   handoff.State
	Blocks  []kvlease.BlockID // the decode lease's blocks, nil if none was acquired
	Steps   []wireStep
	Checked int // block markers checked
	// Mismatches counts the checked blocks without their marker; Late
	// says the transfer wrote a block no longer its lease's.
	Mismatches int
	Late       bool
	// Arrived (-stream) is when each layer's last byte arrived (Unix
	// ns; 0 if it never did).
	Arrived []int64 `json:",omitempty"`
}

// wireStep is a handoff.Step as it crosses the process boundary.
type wireStep struct {
	From, To handoff.State
	Event    handoff.Event
	By, Err  string
	Transfer uint64
}

// wireSteps is a history as it crosses the process boundary.
func wireSteps(h []handoff.Step) []wireStep {
	out := make([]wireStep, len(h))
	for i, s := range h {
		out[i] = wireStep{From: s.From, To: s.To, Event: s.Event, By: s.By, Err: errText(s.Err), Transfer: s.Transfer}
	}
	return out
}

// decodeMain is the decode process: spec is decodeEnv's value. It exits
// (os.Exit) as soon as stdin, a pipe from the prefill process, closes: the
// parent is gone. It returns the exit status.
func decodeMain(spec string, stdin io.Reader, stdout, stderr io.Writer) int {
	var s decodeSpec
	if err := json.Unmarshal([]byte(spec), &s); err != nil {
		fmt.Fprintln(stderr, "disagg decode: bad spec:", err)
		return 1
	}
	go func() {
		_, _ = io.Copy(io.Discard, stdin)
		fmt.Fprintln(stderr, "disagg decode: stdin closed, the prefill process is gone: exiting")
		os.Exit(3)
	}()
	limit := 2*time.Minute + 10*s.Cfg.Deadline
	time.AfterFunc(limit, func() {
		fmt.Fprintf(stderr, "disagg decode: still running after %v: exiting\n", limit)
		os.Exit(4)
	})
	run := runDecode
	if s.Cfg.Stream {
		run = runStreamDecode
	}
	rep, err := run(s)
	if err != nil {
		fmt.Fprintln(stderr, "disagg decode:", err)
		return 1
	}
	if err := json.NewEncoder(stdout).Encode(rep); err != nil {
		fmt.Fprintln(stderr, "disagg decode: report:", err)
		return 1
	}
	return 0
}

// decoder is the decode process's state.
type decoder struct {
	cfg  Config
	lie  bool
	reqs map[uint64]*request // the burst, drawn from the same seed
	pool *kvlease.Pool[[]byte]

	mu      sync.Mutex
	tokens  map[[16]byte]uint64 // data-connection token → handoff id
	incs    map[uint64]*incoming
	running int // handoffs accepted whose lease this side still holds
	errs    []string
}

// incoming is the decode side's record of one handoff.
type incoming struct {
	id      uint64
	in      *handoff.Incoming[[]byte]
	req     *request
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
		inc = &incoming{id: id, req: d.reqs[id]}
		d.incs[id] = inc
	}
	return inc
}

func (d *decoder) fail(err error) {
	d.mu.Lock()
	d.errs = append(d.errs, err.Error())
	d.mu.Unlock()
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
		if err != nil || !markerOK(b, int(inc.id), i) {
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
	abort := inc.req != nil && block == inc.req.abortAt && !inc.aborted
	inc.aborted = inc.aborted || abort
	d.mu.Unlock()
	if abort {
		_ = in.Abort("frontend", fmt.Errorf("%w while block %d of %d was being written", errClientGone, block, in.Blocks()))
	}
	if d.lie && in.State() == handoff.Aborting {
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

// readKey reads the pre-shared key from the pipe the prefill process
// handed down as descriptor keyFD, once.
func readKey() ([]byte, error) {
	f := os.NewFile(keyFD, "kvlease-key")
	if f == nil {
		return nil, errors.New("no key descriptor: the prefill process hands the key down a pipe")
	}
	defer f.Close()
	key := make([]byte, 32)
	if _, err := io.ReadFull(f, key); err != nil {
		return nil, fmt.Errorf("read the key from descriptor %d: %w", keyFD, err)
	}
	return key, nil
}

// runDecode serves the control connection until it ends, settles, and
// builds the report.
func runDecode(s decodeSpec) (decodeReport, error) {
	cfg := s.Cfg
	d := &decoder{cfg: cfg, lie: s.Lie, reqs: map[uint64]*request{}, tokens: map[[16]byte]uint64{}, incs: map[uint64]*incoming{}}
	reqs := generate(cfg)
	netFaults(cfg, reqs)
	for _, r := range reqs {
		d.reqs[uint64(r.id)] = r
	}
	var err error
	if d.pool, err = newPool(decodeBlocks); err != nil {
		return decodeReport{}, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return decodeReport{}, err
	}
	recv := tcp.NewReceiver(ln, tcp.Config{WrapConn: func(c net.Conn) net.Conn { return &recvConn{Conn: c, d: d} }})
	defer recv.Close() // after the report's snapshot: stalled streams end now
	var key []byte
	if !cfg.Insecure {
		if key, err = readKey(); err != nil {
			return decodeReport{}, err
		}
	}
	a, insecure := auth(key)
	dst, err := handoff.NewDestination(d.pool, decodePlane{recv, d}, handoff.DestinationConfig[[]byte]{
		HalfConfig: handoff.HalfConfig{Envelope: decodeEnvelope(), Name: "decode", Peer: "prefill", Deadline: cfg.Deadline / 2,
			OnError: d.fail, Auth: a, Insecure: insecure},
		// The one prefill process may hold the whole pool: the pool's
		// own admission decides (RejectedDecode).
		MaxSessionBlocks: -1,
		Decide:           d.decide,
		OnAccept:         d.accepted,
		OnDelivered:      d.delivered,
		OnFinal:          d.finalized,
	})
	if err != nil {
		return decodeReport{}, err
	}
	conn, err := dialParent(s)
	if err != nil {
		return decodeReport{}, err
	}
	if err := dst.Serve(conn); errors.Is(err, handoff.ErrProtocol) {
		d.fail(err)
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
			forever := inc.req != nil && inc.req.stallAt >= 0 && !inc.req.lateAck
			d.mu.Unlock()
			if !final && (!forever || in == nil || in.State() != handoff.Quarantined) {
				settled = false
			}
		}
		if settled {
			break
		}
		if time.Now().After(end) {
			d.fail(fmt.Errorf("handoffs still unsettled after %v", 30*time.Second+4*cfg.Deadline))
			break
		}
		time.Sleep(5 * time.Millisecond)
	}

	// Decode finishes: every delivered request checks its markers once
	// more, then releases its blocks (the moment they may be reused).
	var rep decodeReport
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
		v := decodeView{ID: id, Blocks: inc.ids, Checked: inc.checked, Mismatches: inc.mismatches, Late: inc.late}
		d.mu.Unlock()
		if inc.in != nil {
			v.State = inc.in.State()
			v.Steps = wireSteps(inc.in.History())
		}
		rep.Handoffs = append(rep.Handoffs, v)
		rep.MarkerMismatches += v.Mismatches
		if v.Late {
			rep.LateWrites++
		}
	}
	rep.Decode = d.pool.Stats()
	d.mu.Lock()
	rep.Errors = slices.Clone(d.errs)
	d.mu.Unlock()
	return rep, nil
}

// dialParent dials the prefill process's control listener and proves
// with the token that this is its child.
func dialParent(s decodeSpec) (net.Conn, error) {
	conn, err := net.DialTimeout("tcp", s.Ctl, 10*time.Second)
	if err != nil {
		return nil, fmt.Errorf("dial the prefill process: %w", err)
	}
	_ = conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
	if _, err := conn.Write(s.Token); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("send the token: %w", err)
	}
	_ = conn.SetWriteDeadline(time.Time{})
	return conn, nil
}

package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/ucx"
	"github.com/kvlease/kvlease/internal/keypipe"
)

// IsDecode reports whether this process is the decode side that Run
// started.
func IsDecode() bool { return os.Getenv(roleEnv) == "decode" }

// decode is the decode process: its pool, its plane, the seed's plan,
// and what it saw.
type decode struct {
	cfg   Config
	pool  *kvlease.Pool[[]byte]
	base  uintptr // the pool memory's first byte
	recv  *ucx.Receiver[[]byte]
	out   sync.Mutex
	plans map[uint64]plan

	mu         sync.Mutex
	running    int
	transfers  map[uint64]*kvlease.Transfer
	blocks     map[uint64][]kvlease.BlockID
	finals     map[uint64]*handoff.Incoming[[]byte]
	goCh       map[uint64]chan struct{} // the front end's abort is done
	resume     map[uint64]chan struct{} // a stalled reader may go on
	lateWrites int
}

func (d *decode) say(format string, args ...any) {
	d.out.Lock()
	defer d.out.Unlock()
	fmt.Printf(format+"\n", args...)
}

// plane is the decode side's RecvPlane: the UCX receiver, with the
// seed's faults and the audit around it.
type plane struct{ d *decode }

func (p plane) Prepare(id handoff.PlaneID, blocks int) ([]byte, error) {
	b, err := p.d.recv.Prepare(id, blocks)
	if err == nil {
		p.d.mu.Lock()
		p.d.running++
		p.d.mu.Unlock()
	}
	return b, err
}

func (p plane) Forget(id handoff.PlaneID) { p.d.recv.Forget(id) }

func (p plane) Receive(id handoff.PlaneID, regions [][]byte, start []byte, attach func(*kvlease.Transfer) error) error {
	d := p.d
	ids := make([]kvlease.BlockID, len(regions))
	for i, r := range regions {
		ids[i] = kvlease.BlockID((uintptr(unsafe.Pointer(unsafe.SliceData(r))) - d.base) / uintptr(envelope.BlockBytes))
	}
	d.mu.Lock()
	d.blocks[id.Handoff] = ids
	d.mu.Unlock()
	if d.plans[id.Handoff].fail {
		// Corrupted in transit: the plane refuses it before attaching.
		start = append([]byte{'X'}, start[1:]...)
	}
	return d.recv.Receive(id, regions, start, func(t *kvlease.Transfer) error {
		d.mu.Lock()
		d.transfers[id.Handoff] = t
		d.mu.Unlock()
		return attach(t)
	})
}

// beforeGet runs on a handoff's reader thread before each block's
// receive is posted: the audit (a receive posted into a handoff whose
// transfer resolved would let a message write memory that may be back in
// the pool) and the seed's faults.
func (d *decode) beforeGet(id handoff.PlaneID, block int) {
	d.mu.Lock()
	t := d.transfers[id.Handoff]
	if t != nil && t.State() == kvlease.TransferResolved {
		d.lateWrites++
	}
	goCh, resume := d.goCh[id.Handoff], d.resume[id.Handoff]
	d.mu.Unlock()
	p := d.plans[id.Handoff]
	if block == p.abortAt {
		d.say("abort %d", p.id)
		select {
		case <-goCh:
		case <-time.After(30 * time.Second):
		}
	}
	if block == p.stallAt {
		<-resume // never, unless the reader resumes late
	}
}

// RunDecode is the decode process's main: it serves the control
// connection, then reports every request on stdout when told.
func RunDecode(Config) int {
	var cfg Config
	if err := json.Unmarshal([]byte(os.Getenv(configEnv)), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "disagg decode:", err)
		return 1
	}
	ucxEnv()
	// The pre-shared key comes down the pipe the prefill process handed
	// us; without one, only an -insecure run goes on.
	key, ok, err := keypipe.Read()
	if err != nil || (!ok && !cfg.Insecure) {
		fmt.Fprintln(os.Stderr, "disagg decode: no key from the prefill process:", err)
		return 1
	}
	mem, err := kvlease.NewHostMemory(decodeBlocks, envelope.BlockBytes)
	if err != nil {
		fmt.Fprintln(os.Stderr, "disagg decode:", err)
		return 1
	}
	pool, _ := kvlease.NewPool[[]byte](mem)
	d := &decode{cfg: cfg, pool: pool, base: uintptr(unsafe.Pointer(unsafe.SliceData(mem.Region(0)))),
		plans: map[uint64]plan{}, transfers: map[uint64]*kvlease.Transfer{}, blocks: map[uint64][]kvlease.BlockID{},
		finals: map[uint64]*handoff.Incoming[[]byte]{}, goCh: map[uint64]chan struct{}{}, resume: map[uint64]chan struct{}{}}
	for _, p := range generate(cfg) {
		d.plans[uint64(p.id)] = p
		d.goCh[uint64(p.id)] = make(chan struct{})
		d.resume[uint64(p.id)] = make(chan struct{})
	}
	// One block per message (and, pulled, per get), so that a fault
	// lands between two blocks.
	if d.recv, err = ucx.NewReceiver(ucx.Config{MaxGet: envelope.BlockBytes, Window: 4, BeforeGet: d.beforeGet}); err != nil {
		fmt.Fprintln(os.Stderr, "disagg decode:", err)
		return 1
	}
	decodeEnv := envelope
	decodeEnv.PoolBlocks = decodeBlocks
	dst, err := handoff.NewDestination(pool, plane{d}, handoff.DestinationConfig[[]byte]{
		HalfConfig: auth(handoff.HalfConfig{Envelope: decodeEnv, Name: "decode", Peer: "prefill", Deadline: cfg.Deadline}, key),
		// One prefill process, authenticated: the whole pool is its to
		// fill (the default caps a session at half of it).
		MaxSessionBlocks: -1,
		Decide: func(*handoff.ProposeMsg) error {
			d.mu.Lock()
			defer d.mu.Unlock()
			if d.running >= envelope.MaxRunningRequests {
				return errBusy
			}
			return nil
		},
		OnDelivered: func(*handoff.Incoming[[]byte]) {}, // kept until the report checks its markers
		OnFinal: func(in *handoff.Incoming[[]byte]) {
			d.mu.Lock()
			d.finals[in.ID()] = in
			d.mu.Unlock()
		},
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "disagg decode:", err)
		return 1
	}
	conn, err := net.DialTimeout("tcp", os.Getenv(ctrlEnv), 10*time.Second)
	if err != nil {
		fmt.Fprintln(os.Stderr, "disagg decode:", err)
		return 1
	}
	go func() { _ = dst.Serve(conn) }()

	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		verb, arg, _ := strings.Cut(in.Text(), " ")
		id, _ := strconv.ParseUint(arg, 10, 64)
		switch verb {
		case "go", "resume":
			chans := d.goCh
			if verb == "resume" {
				chans = d.resume
			}
			d.mu.Lock()
			if ch := chans[id]; ch != nil {
				close(ch)
				chans[id] = nil
			}
			d.mu.Unlock()
		case "report":
			d.report()
			return 0 // a reader that never resumed stays blocked: exit
		}
	}
	return 0
}

// report waits until every handoff has its evidence, except those whose
// reader never resumes (their blocks are quarantined), then prints one
// report line per request and the summary.
func (d *decode) report() {
	limit := time.Now().Add(d.cfg.Deadline + 30*time.Second)
	for time.Now().Before(limit) {
		if d.settled() {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, p := range generate(d.cfg) {
		id := uint64(p.id)
		d.mu.Lock()
		in := d.finals[id]
		rep := report{ID: p.id, Blocks: d.blocks[id]}
		d.mu.Unlock()
		if in != nil {
			rep.State, rep.History = in.State().String(), steps(in.History())
			if l := in.Lease(); l != nil {
				rep.Blocks = l.AppendBlockIDs(nil, 0)
			}
			if in.State() == handoff.Delivered {
				l := in.Lease()
				for i := range l.Len() {
					if b, err := l.Region(i); err != nil || !markerOK(b, p.id, i) {
						rep.Mismatch++
					}
				}
				l.Release()
			}
		}
		js, _ := json.Marshal(rep)
		d.say("report %s", js)
	}
	d.mu.Lock()
	sum := summary{Pool: d.pool.Stats(), LateWrites: d.lateWrites}
	d.mu.Unlock()
	js, _ := json.Marshal(sum)
	d.say("summary %s", js)
}

// settled reports whether every attached handoff is final, but for those
// stalled for good, whose transfers must be quarantined (their deadline
// passed), and no block is still draining.
func (d *decode) settled() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for id, t := range d.transfers {
		if d.finals[id] != nil {
			continue
		}
		if p := d.plans[id]; p.stallAt < 0 || p.late || t.State() != kvlease.TransferQuarantined {
			return false
		}
	}
	return d.pool.Stats().Draining == 0
}

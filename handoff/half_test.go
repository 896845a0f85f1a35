package handoff

import (
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff/internal/wire"
)

// Tests of the two halves over a control connection with manual data
// planes: the test decides when each side's transfer resolves.

// manualPlane is a SendPlane and a RecvPlane that attach a transfer and
// hand it to the test; nothing moves until the test resolves it.
type manualPlane struct {
	transfers chan *kvlease.Transfer
}

func newManualPlane() *manualPlane { return &manualPlane{transfers: make(chan *kvlease.Transfer, 8)} }

func (p *manualPlane) attach(attach func(*kvlease.Transfer) error) error {
	t := kvlease.NewTransfer(nil)
	if err := attach(t); err != nil {
		t.Resolve(err)
		return err
	}
	p.transfers <- t
	return nil
}

func (p *manualPlane) Send(_ PlaneID, _ [][]byte, _ []byte, attach func(*kvlease.Transfer) error) ([]byte, error) {
	return nil, p.attach(attach)
}
func (p *manualPlane) Finish(PlaneID, error) {}
func (p *manualPlane) Prepare(PlaneID, int) ([]byte, error) {
	return []byte("manual"), nil
}
func (p *manualPlane) Receive(_ PlaneID, _ [][]byte, _ []byte, attach func(*kvlease.Transfer) error) error {
	return p.attach(attach)
}
func (p *manualPlane) Forget(PlaneID) {}

func (p *manualPlane) next(t *testing.T) *kvlease.Transfer {
	t.Helper()
	select {
	case tr := <-p.transfers:
		return tr
	case <-time.After(10 * time.Second):
		t.Fatal("no transfer attached")
		return nil
	}
}

// testPSK is the key the halves of these tests share.
var testPSK = &PSK{ID: "test", Key: []byte("0123456789abcdef0123456789abcdef")}

// quiet drops the insecure sessions' log lines.
func quiet(string, ...any) {}

type halves struct {
	srcPool, dstPool *kvlease.Pool[[]byte]
	src              *Source[[]byte]
	send, recv       *manualPlane
	incoming         chan *Incoming[[]byte]
}

// start proposes handoff 1 of a 3-block lease from the source and
// returns it on both halves once both planes have its transfer.
func (h *halves) start(t *testing.T) (lease *kvlease.Lease[[]byte], o *Outgoing[[]byte], in *Incoming[[]byte], st, dt *kvlease.Transfer) {
	t.Helper()
	lease, err := h.srcPool.Acquire("r", 3)
	if err != nil {
		t.Fatal(err)
	}
	if o, err = h.src.Propose(1, "r", lease, nil); err != nil {
		t.Fatal(err)
	}
	in = <-h.incoming
	return lease, o, in, h.send.next(t), h.recv.next(t)
}

func newHalves(t *testing.T, deadline time.Duration) *halves {
	t.Helper()
	h := &halves{srcPool: newHostPool(t, 32, hbBytes), dstPool: newHostPool(t, 32, hbBytes),
		send: newManualPlane(), recv: newManualPlane(), incoming: make(chan *Incoming[[]byte], 8)}
	a, b := net.Pipe()
	dst, err := NewDestination(h.dstPool, h.recv, DestinationConfig[[]byte]{
		HalfConfig: HalfConfig{Envelope: testEnvelope(), Deadline: deadline, Auth: testPSK},
		OnAccept:   func(in *Incoming[[]byte]) { h.incoming <- in },
	})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() { _ = dst.Serve(b); close(served) }()
	if h.src, err = NewSource(a, h.send, HalfConfig{Envelope: testEnvelope(), Deadline: deadline, Auth: testPSK}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = h.src.Close()
		<-served
		for _, p := range []*kvlease.Pool[[]byte]{h.srcPool, h.dstPool} {
			if err := p.Check(); err != nil {
				t.Error(err)
			}
		}
	})
	return h
}

func waitHalf(t *testing.T, what string, state func() State, want State) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(time.Millisecond) {
		if state() == want {
			return
		}
	}
	t.Fatalf("%s is %v, want %v", what, state(), want)
}

// TestHalvesStateCurrentAfterResolve: on both halves, State says what
// the evidence says as soon as Resolve returns: the destination's
// delivery, and the late evidence that lifts either side's quarantine
// (issue 12, item 7), with the blocks already back.
func TestHalvesStateCurrentAfterResolve(t *testing.T) {
	for range 20 {
		h := newHalves(t, -1)
		lease, o, in, st, dt := h.start(t)
		dt.Resolve(nil)
		if s := in.State(); s != Delivered {
			t.Fatalf("destination right after Resolve: %v", s)
		}
		st.Resolve(nil)
		waitHalf(t, "source", o.State, Delivered)
		lease.Release()
	}
	for range 20 {
		h := newHalves(t, 20*time.Millisecond)
		_, o, in, st, dt := h.start(t)
		waitHalf(t, "source", o.State, Quarantined)
		waitHalf(t, "destination", in.State, Quarantined)
		if q := h.srcPool.Stats().Quarantined; q != 3 {
			t.Fatalf("source quarantines %d blocks, want 3", q)
		}
		st.Resolve(errors.New("late"))
		if s := o.State(); s != Aborted {
			t.Fatalf("source right after the late Resolve: %v", s)
		}
		if s := h.srcPool.Stats(); s.Quarantined != 0 || s.Free != 32 {
			t.Fatalf("source pool right after the late Resolve: %+v", s)
		}
		dt.Resolve(errors.New("late"))
		if s := in.State(); s != Aborted {
			t.Fatalf("destination right after the late Resolve: %v", s)
		}
		if s := h.dstPool.Stats(); s.Quarantined != 0 || s.Free != 32 {
			t.Fatalf("destination pool right after the late Resolve: %+v", s)
		}
	}
}

func TestCheckTokens(t *testing.T) {
	tokens := make([]int32, 40)
	for i := range tokens {
		tokens[i] = int32(i)
	}
	good := kvlease.ChainHashes(3, tokens, 16)
	cases := map[string]*ProposeMsg{
		"too many tokens": {ID: 1, Blocks: 2, Seed: 3, Tokens: make([]int32, 33)},
		"missing hash":    {ID: 1, Blocks: 3, Seed: 3, Tokens: tokens, Hashes: good[:1]},
		"wrong seed":      {ID: 1, Blocks: 3, Seed: 4, Tokens: tokens, Hashes: good},
		"wrong hash":      {ID: 1, Blocks: 3, Seed: 3, Tokens: tokens, Hashes: []kvlease.BlockHash{good[0], good[0]}},
	}
	for name, m := range cases {
		if err := checkTokens(m, 16); !errors.Is(err, kvlease.ErrInvalidArgument) {
			t.Errorf("%s: %v", name, err)
		}
	}
	if err := checkTokens(&ProposeMsg{ID: 1, Blocks: 3, Seed: 3, Tokens: tokens, Hashes: good}, 16); err != nil {
		t.Fatal(err)
	}
}

// TestSourceRefusesBadMessages: a raw destination sends the source
// duplicated, reordered, unknown and wrong-direction messages; each is
// reported as an ErrProtocol error and changes nothing; a corrupted
// frame ends the connection, which rejects only what had not started.
func TestSourceRefusesBadMessages(t *testing.T) {
	pool := newHostPool(t, 32, hbBytes)
	plane := newManualPlane()
	// A real socket: its buffers let each side write before the other reads.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	b, err := ln.Accept()
	_ = ln.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	errs := make(chan error, 16)
	go func() { _, _ = authenticate(b, false, nil, testEnvelope().Fingerprint(), 0) }()
	src, err := NewSource(a, plane, HalfConfig{Envelope: testEnvelope(), Deadline: -1, Insecure: true, Logf: quiet, OnError: func(err error) { errs <- err }})
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	var buf []byte
	read := func() wire.Message {
		t.Helper()
		_ = b.SetReadDeadline(time.Now().Add(10 * time.Second))
		m, nb, err := wire.ReadFrame(b, buf)
		buf = nb
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	write := func(m wire.Message) {
		t.Helper()
		_ = b.SetWriteDeadline(time.Now().Add(10 * time.Second))
		if _, err := b.Write(wire.AppendFrame(nil, m)); err != nil {
			t.Fatal(err)
		}
	}
	refused := func(substr string) {
		t.Helper()
		select {
		case err := <-errs:
			if !errors.Is(err, ErrProtocol) || !errors.Is(err, wire.ErrProtocolRefused) || errors.Is(err, wire.ErrProtocolFatal) || !strings.Contains(err.Error(), substr) {
				t.Fatalf("reported %v, want ErrProtocolRefused and %q", err, substr)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("nothing reported, want %q", substr)
		}
	}
	lease, _ := pool.Acquire("r", 3)
	defer lease.Release()
	o, err := src.Propose(1, "r", lease, nil)
	if err != nil {
		t.Fatal(err)
	}
	if m, ok := read().(*ProposeMsg); !ok || m.ID != 1 || m.Blocks != 3 {
		t.Fatalf("proposal %#v", m)
	}
	write(&wire.DoneMsg{ID: 1}) // before Accept and Start
	refused("done while proposed")
	write(&wire.AcceptMsg{ID: 1, From: 4}) // more blocks than proposed
	refused("accept wants blocks from 4 of 3")
	write(&wire.AcceptMsg{ID: 1, Plane: []byte("x")})
	tr := plane.next(t)
	if m, ok := read().(*wire.StartMsg); !ok || m.ID != 1 {
		t.Fatalf("start %#v", m)
	}
	write(&wire.AcceptMsg{ID: 1}) // a duplicate
	refused("accept while transferring")
	write(&wire.DoneMsg{ID: 99})
	refused("unknown handoff 99")
	write(&ProposeMsg{ID: 5, Blocks: 1}) // the wrong direction
	refused("unexpected propose")
	write(&wire.AckMsg{ID: 7, Of: wire.MsgAbort})
	refused("unknown handoff 7")
	if s := o.State(); s != Transferring {
		t.Fatalf("source %v after refused messages", s)
	}
	write(&wire.DoneMsg{ID: 1})
	if m, ok := read().(*wire.AckMsg); !ok || m.ID != 1 || m.Of != wire.MsgDone {
		t.Fatalf("ack %#v", m)
	}
	write(&wire.DoneMsg{ID: 1}) // a duplicate: no second Ack
	refused("done while transferring")
	tr.Resolve(nil)
	if s := o.State(); s != Delivered {
		t.Fatalf("source %v", s)
	}
	// A handoff the source aborts while the destination's Accept and
	// Done are on their way: both crossed the abort, so neither is
	// reported; the next report is the unknown handoff's.
	lease3, _ := pool.Acquire("r3", 1)
	defer lease3.Release()
	o3, _ := src.Propose(3, "r3", lease3, nil)
	read()
	if err := o3.Abort("test", nil); err != nil {
		t.Fatal(err)
	}
	if m, ok := read().(*wire.AbortMsg); !ok || m.ID != 3 {
		t.Fatalf("abort %#v", m)
	}
	write(&wire.AbortMsg{ID: 3}) // the destination's own abort crossing ours
	write(&wire.AckMsg{ID: 3, Of: wire.MsgAbort})
	<-o3.Done()
	write(&wire.AcceptMsg{ID: 3})
	write(&wire.DoneMsg{ID: 3})
	write(&wire.DoneMsg{ID: 98})
	refused("unknown handoff 98")
	if s := o3.State(); s != Aborted {
		t.Fatalf("aborted handoff %v", s)
	}
	if c := src.Stats().Crossed; c != 2 {
		t.Fatalf("%d crossings counted, want the Accept and the Done", c)
	}
	// A second handoff, not yet started, then a corrupted frame.
	lease2, _ := pool.Acquire("r2", 2)
	defer lease2.Release()
	o2, _ := src.Propose(2, "r2", lease2, nil)
	read()
	bad := wire.AppendFrame(nil, &wire.AcceptMsg{ID: 2})
	bad[len(bad)-1] ^= 1
	if _, err := b.Write(bad); err != nil {
		t.Fatal(err)
	}
	<-o2.Done()
	if s, err := o2.State(), o2.Err(); s != Rejected || !errors.Is(err, ErrConnLost) || !errors.Is(err, wire.ErrProtocolFatal) {
		t.Fatalf("unstarted handoff after a corrupted frame: %v %v", s, err)
	}
	if s := o.State(); s != Delivered {
		t.Fatalf("the delivered handoff became %v", s)
	}
	if _, err := src.Propose(3, "r", lease, nil); !errors.Is(err, ErrConnLost) {
		t.Fatalf("propose on a lost connection: %v", err)
	}
	if s := pool.Stats(); s.Leased != 5 || s.Quarantined != 0 {
		t.Fatalf("%+v", s)
	}
}

// TestSourceNotes: the source's two facts show in History as notes, the
// reads change nothing, and the source is final only with both.
func TestSourceNotes(t *testing.T) {
	h := newHalves(t, -1)
	lease, o, in, st, dt := h.start(t)
	waitHalf(t, "source", o.State, Transferring)
	n, m := len(o.History()), len(in.History())
	for range 3 {
		_, _, _ = o.State(), o.Err(), o.History()
		_, _, _ = in.State(), in.Err(), in.History()
	}
	if len(o.History()) != n || len(in.History()) != m {
		t.Fatalf("reads changed the histories: %d → %d, %d → %d", n, len(o.History()), m, len(in.History()))
	}
	st.Resolve(nil)
	hist := o.History()
	if last := hist[len(hist)-1]; o.State() != Transferring || last.Event != EventQuiescent || last.From != Transferring || last.To != Transferring || last.By != "transport" {
		t.Fatalf("after our own Resolve: %v, last step %v", o.State(), last)
	}
	dt.Resolve(nil)
	waitHalf(t, "source", o.State, Delivered)
	notes := map[Event]int{}
	for _, s := range o.History() {
		if s.From == s.To {
			notes[s.Event]++
			if s.Event == EventPeerOutcome && (s.By != "destination" || s.Err != nil) {
				t.Errorf("peer outcome %v", s)
			}
		}
	}
	if len(notes) != 2 || notes[EventQuiescent] != 1 || notes[EventPeerOutcome] != 1 {
		t.Fatalf("notes %v in %v", notes, o.History())
	}
	lease.Release()
}

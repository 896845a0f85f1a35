package ucx_test

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/ucx"
)

// UCX over TCP on loopback only: shared-memory transports lack
// peer-failure handling, and nothing leaves the machine.
func init() {
	os.Setenv("UCX_TLS", "tcp")
	os.Setenv("UCX_NET_DEVICES", "lo")
	if os.Getenv("UCX_LOG_LEVEL") == "" {
		// The fault and exposure suites make UCX log the peers' failures
		// and the refused requests they cause. The variable reaches the
		// peer processes; this process loaded UCX already.
		os.Setenv("UCX_LOG_LEVEL", "fatal")
		_ = ucx.SetLogLevel("fatal")
	}
}

const blockBytes = 4096

// testKey is this process's pre-shared key: the tests' halves
// authenticate with it, and their peer processes get it through an
// inherited pipe (keypipe), never the command line or the environment.
var testKey = func() []byte {
	k, err := handoff.GenerateKey()
	if err != nil {
		panic(err)
	}
	return k
}()

// withAuth authenticates hc with key (PSK), or runs it Insecure when key
// is nil (the pull model's tests: pull refuses authenticated sessions).
func withAuth(hc handoff.HalfConfig, key []byte) handoff.HalfConfig {
	if key == nil {
		hc.Insecure = true
	} else {
		hc.Auth = &handoff.PSK{ID: "ucx-test", Key: key}
	}
	return hc
}

// keyFor is the key of a test whose plane config is cfg.
func keyFor(cfg ucx.Config) []byte {
	if cfg.Pull {
		return nil
	}
	return testKey
}

func env(poolBlocks int) handoff.Envelope {
	return handoff.Envelope{BlockTokens: 16, BlockBytes: blockBytes, PoolBlocks: poolBlocks,
		MaxContextTokens: 16 * 64, MaxPrefillTokens: 512, MaxRunningRequests: 4}
}

func hostPool(t testing.TB, blocks int) *kvlease.Pool[[]byte] {
	t.Helper()
	return hostPoolOf(t, blocks, blockBytes)
}

func hostPoolOf(t testing.TB, blocks, bb int) *kvlease.Pool[[]byte] {
	t.Helper()
	mem, err := kvlease.NewHostMemory(blocks, bb)
	if err != nil {
		t.Fatal(err)
	}
	p, err := kvlease.NewPool[[]byte](mem)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// stamp writes the marker of (seed, i) into block i of l.
func stamp(t testing.TB, l *kvlease.Lease[[]byte], seed uint32) {
	t.Helper()
	if err := stampLease(l, seed); err != nil {
		t.Fatal(err)
	}
}

func stampLease(l *kvlease.Lease[[]byte], seed uint32) error {
	for i := range l.Len() {
		r, err := l.Region(i)
		if err != nil {
			return err
		}
		mark(r, seed, i)
	}
	return nil
}

// regionsOf returns the lease's regions (to check the memory itself once
// the lease is closed).
func regionsOf(t testing.TB, l *kvlease.Lease[[]byte]) [][]byte {
	t.Helper()
	var out [][]byte
	for i := range l.Len() {
		r, err := l.Region(i)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, r)
	}
	return out
}

// markedRegions reports the first region that is not marker (seed, i).
func markedRegions(rs [][]byte, seed uint32) error {
	for i, r := range rs {
		want := make([]byte, len(r))
		mark(want, seed, i)
		if string(r) != string(want) {
			return fmt.Errorf("block %d is not marker (%d, %d)", i, seed, i)
		}
	}
	return nil
}

func mark(b []byte, seed uint32, i int) {
	binary.LittleEndian.PutUint32(b, seed)
	binary.LittleEndian.PutUint32(b[4:], uint32(i))
	for j := 8; j < len(b); j++ {
		b[j] = byte(seed) + byte(i) + byte(j%7)
	}
}

// marked reports the first block of l whose content is not (seed, i).
func marked(l *kvlease.Lease[[]byte], seed uint32) error {
	for i := range l.Len() {
		r, err := l.Region(i)
		if err != nil {
			return err
		}
		want := make([]byte, len(r))
		mark(want, seed, i)
		if string(r) != string(want) {
			return fmt.Errorf("block %d is not marker (%d, %d)", i, seed, i)
		}
	}
	return nil
}

// loop is both halves in one process over 127.0.0.1, each with its own
// UCX context.
type loop struct {
	srcPool, dstPool *kvlease.Pool[[]byte]
	src              *handoff.Source[[]byte]
	dst              *handoff.Destination[[]byte]
	sender           *ucx.Sender[[]byte]
	recv             *ucx.Receiver[[]byte]

	mu       sync.Mutex
	finals   map[uint64]*handoff.Incoming[[]byte]
	serveErr chan error
	accepted chan *handoff.Incoming[[]byte] // each accepted handoff (while there is room)
}

type loopConfig struct {
	deadline   time.Duration
	recv, send ucx.Config
	keepLeases bool
	insecure   bool // both halves Insecure (the pull model's are anyway)
	tls        bool // mutual TLS instead of the test key
	// blockBytes and poolBlocks, when set, size both pools (else 64
	// blocks of blockBytes, env(64)).
	blockBytes, poolBlocks int
}

// key is the loop's pre-shared key for a side configured with cfg.
func (lc loopConfig) key(cfg ucx.Config) []byte {
	if lc.insecure {
		return nil
	}
	return keyFor(cfg)
}

func newLoop(t testing.TB, lc loopConfig) *loop {
	t.Helper()
	e, srcPool, dstPool := env(64), hostPool(t, 64), hostPool(t, 64)
	if lc.blockBytes != 0 {
		e = handoff.Envelope{BlockTokens: 16, BlockBytes: lc.blockBytes, PoolBlocks: lc.poolBlocks,
			MaxContextTokens: 16 * lc.poolBlocks, MaxPrefillTokens: 16 * lc.poolBlocks, MaxRunningRequests: 4}
		srcPool, dstPool = hostPoolOf(t, lc.poolBlocks, lc.blockBytes), hostPoolOf(t, lc.poolBlocks, lc.blockBytes)
	}
	l := &loop{srcPool: srcPool, dstPool: dstPool, finals: map[uint64]*handoff.Incoming[[]byte]{}, serveErr: make(chan error, 1),
		accepted: make(chan *handoff.Incoming[[]byte], 16)}
	ctlLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if l.recv, err = ucx.NewReceiver(lc.recv, ucx.HostBytes); err != nil {
		t.Fatal(err)
	}
	if l.sender, err = ucx.NewSender(lc.send, ucx.HostBytes); err != nil {
		t.Fatal(err)
	}
	dl := lc.deadline
	if dl == 0 {
		dl = 10 * time.Second
	}
	dstHC := withAuth(handoff.HalfConfig{Envelope: e, Name: "decode", Peer: "prefill", Deadline: dl}, lc.key(lc.recv))
	srcHC := withAuth(handoff.HalfConfig{Envelope: e, Name: "prefill", Peer: "decode", Deadline: dl}, lc.key(lc.send))
	if lc.tls {
		s, d := testTLS(t)
		srcHC.Auth, dstHC.Auth = &handoff.TLS{Config: s}, &handoff.TLS{Config: d}
	}
	l.dst, err = handoff.NewDestination(l.dstPool, l.recv, handoff.DestinationConfig[[]byte]{
		HalfConfig: dstHC,
		OnAccept: func(in *handoff.Incoming[[]byte]) {
			select {
			case l.accepted <- in:
			default: // nobody is waiting for them
			}
		},
		OnDelivered: func(in *handoff.Incoming[[]byte]) {
			if !lc.keepLeases {
				in.Lease().Release()
			}
		},
		OnFinal: func(in *handoff.Incoming[[]byte]) {
			l.mu.Lock()
			l.finals[in.ID()] = in
			l.mu.Unlock()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		c, err := ctlLn.Accept()
		_ = ctlLn.Close()
		if err != nil {
			l.serveErr <- err
			return
		}
		l.serveErr <- l.dst.Serve(c)
	}()
	c, err := net.Dial("tcp", ctlLn.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	l.src, err = handoff.NewSource(c, l.sender, srcHC)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = l.src.Close()
		<-l.serveErr
		_ = l.sender.Close()
		_ = l.recv.Close()
		for _, p := range []*kvlease.Pool[[]byte]{l.srcPool, l.dstPool} {
			if err := p.Check(); err != nil {
				t.Error(err)
			}
		}
	})
	return l
}

func waitFinal(t *testing.T, in interface {
	Done() <-chan struct{}
	State() handoff.State
}) {
	t.Helper()
	select {
	case <-in.Done():
	case <-time.After(20 * time.Second):
		t.Fatalf("still %v after 20 s", in.State())
	}
}

func waitIncoming(t *testing.T, l *loop, id uint64) *handoff.Incoming[[]byte] {
	t.Helper()
	for range 2000 {
		l.mu.Lock()
		in := l.finals[id]
		l.mu.Unlock()
		if in != nil {
			return in
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("destination never finished handoff %d", id)
	return nil
}

// startOnce starts handoff id through the planes alone (no control
// connection): Prepare, Send, Receive. It returns the source's and the
// destination's transfers, attached; an error fails the test.
func startOnce[S, D any](t testing.TB, s *ucx.Sender[S], r *ucx.Receiver[D], id handoff.PlaneID, src []S, dst []D) (st, dt *kvlease.Transfer) {
	t.Helper()
	accept, err := r.Prepare(id, len(dst))
	if err != nil {
		t.Fatal(err)
	}
	start, err := s.Send(id, src, accept, func(t *kvlease.Transfer) error { st = t; return nil })
	if err != nil {
		t.Fatal(err)
	}
	if len(start) > handoff.MaxPlane {
		t.Fatalf("%d start bytes", len(start))
	}
	if err := r.Receive(id, dst, start, func(t *kvlease.Transfer) error { dt = t; return nil }); err != nil {
		t.Fatal(err)
	}
	return st, dt
}

// moveOnce moves src into dst over one plane-level handoff: startOnce,
// the destination's evidence, Finish with its done, the source's. Either
// side's outcome other than nil fails the test.
func moveOnce[S, D any](t testing.TB, s *ucx.Sender[S], r *ucx.Receiver[D], id handoff.PlaneID, src []S, dst []D) {
	t.Helper()
	st, dt := startOnce(t, s, r, id, src, dst)
	<-dt.Done()
	if err := dt.Err(); err != nil {
		t.Fatal(err)
	}
	s.Finish(id, nil)
	<-st.Done()
	if err := st.Err(); err != nil {
		t.Fatal(err)
	}
}

// cancelStuck cancels dt while its reader is stopped (stuck is closed,
// the reader waits for release) and checks that the cancel is a request:
// dt stays pending until release lets the reader go on, then resolves
// with kvlease.ErrCanceled.
func cancelStuck(t *testing.T, dt *kvlease.Transfer, stuck <-chan struct{}, release chan struct{}) {
	t.Helper()
	<-stuck
	dt.Cancel()
	if dt.State() != kvlease.TransferPending {
		t.Fatalf("a cancel resolved the transfer: %v", dt.State())
	}
	close(release)
	<-dt.Done()
	if err := dt.Err(); !errors.Is(err, kvlease.ErrCanceled) {
		t.Fatalf("after the cancel: %v", err)
	}
}

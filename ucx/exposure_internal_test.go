package ucx

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// exposureSetup is a source pool holding two requests' blocks side by
// side: the handoff's (two blocks, stamped 0xAA) and another request's
// block right after them (stamped 0x5E, the secret a hostile destination
// wants).
func exposureSetup(t *testing.T) (handoffRegions [][]byte, secret []byte) {
	t.Helper()
	mem, err := kvlease.NewHostMemory(3, expBlock)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := kvlease.NewPool[[]byte](mem)
	if err != nil {
		t.Fatal(err)
	}
	mine, err := pool.Acquire("handoff", 2)
	if err != nil {
		t.Fatal(err)
	}
	other, err := pool.Acquire("another request", 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mine.Release(); other.Release() })
	for i := range 2 {
		r, _ := mine.Region(i)
		for k := range r {
			r[k] = 0xAA
		}
		handoffRegions = append(handoffRegions, r)
	}
	secret, _ = other.Region(0)
	for k := range secret {
		secret[k] = 0x5E
	}
	return handoffRegions, secret
}

// hostile is a destination that does not follow the protocol: a worker
// of a context with remote memory access, ready to read whatever
// address it likes from the source's worker.
type hostile struct {
	ctx *context
	w   *worker
	ep  *endpoint
}

func newHostile(t *testing.T) (*hostile, []byte) {
	t.Helper()
	ctx, err := newContext(true)
	if err != nil {
		t.Fatal(err)
	}
	w, err := ctx.newWorker()
	if err != nil {
		t.Fatal(err)
	}
	h := &hostile{ctx: ctx, w: w}
	var addr []byte
	if cerr := w.call(func() { addr, err = w.address() }); cerr != nil || err != nil {
		t.Fatal(cerr, err)
	}
	return h, addr
}

// connect connects to the source worker's address from the Start bytes.
func (h *hostile) connect(t *testing.T, addr []byte) {
	t.Helper()
	var err error
	if cerr := h.w.call(func() {
		if h.ep, err = h.w.connect(addr); err == nil {
			err = h.w.flushWait(h.ep, 1_000_000)
		}
	}); cerr != nil || err != nil {
		t.Fatal(cerr, err)
	}
}

// read asks the source's worker for n bytes at raddr with key (a packed
// remote key: the source's own, or one of the attacker's making) and
// progresses for a while. It returns what landed and whether the get
// completed without error.
func (h *hostile) read(t *testing.T, raddr uint64, key []byte, n int) ([]byte, bool) {
	t.Helper()
	buf := newCbuf(n)
	clear(buf.bytes())
	var ok bool
	if cerr := h.w.call(func() {
		k, err := h.ep.unpack(key)
		if err != nil {
			t.Log("unpack:", err)
			return
		}
		done, err := h.w.getWait(h.ep, buf, raddr, k, 300_000)
		ok = done && err == nil
		if !done {
			t.Log("the get never completed")
		} else if err != nil {
			t.Log("the get failed:", err)
		}
	}); cerr != nil {
		t.Fatal(cerr)
	}
	// buf may still be the target of a get that never completed: it
	// stays allocated (a few KiB, for the test's life).
	return bytes.Clone(buf.bytes()), ok
}

func (h *hostile) close() {
	h.w.destroy(func() {
		if h.ep != nil {
			_ = h.w.closeEP(h.ep, true)
		}
		h.w.settle()
	})
}

// ownKey is a remote key the attacker packs from memory of its own: it
// names no registration of the source, so UCX would emulate the get in
// software from any address, if the source's worker served such gets.
func (h *hostile) ownKey(t *testing.T) []byte {
	t.Helper()
	b := newCbuf(64)
	m, err := h.ctx.memMap(b.addr(), b.n, false)
	if err != nil {
		t.Fatal(err)
	}
	k, err := h.ctx.rkeyPack(m)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestPushExposesNothing(t *testing.T) {
	// Pushed, a destination that asks the source's worker for an address
	// outside its pieces (its blocks shifted by one, another request's
	// block of the same pool) gets nothing: the source's context has no
	// remote memory access, so its worker serves no get, emulated or
	// not, and not one byte of the other block leaves the source.
	regions, secret := exposureSetup(t)
	s, err := NewSender(Config{}, HostBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	h, addr := newHostile(t)
	defer h.close()
	accept := appendPushAccept(nil, 2, 7, 1<<20, addr)
	id := handoff.PlaneID{Session: 1, Handoff: 1}
	start, err := s.Send(id, regions, accept, func(*kvlease.Transfer) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	defer s.Finish(id, errors.New("test over"))
	st, err := parsePushStart(start)
	if err != nil {
		t.Fatal(err)
	}
	// The Start bytes name no address of the source's memory at all;
	// the attacker guesses well (it knows the pool's layout).
	h.connect(t, st.addr)
	shifted := uint64(max(hostSpan(regions[0]).Addr, hostSpan(regions[1]).Addr)) + expBlock
	other := uint64(hostSpan(secret).Addr)
	if shifted != other {
		t.Fatalf("test setup: the other block is not right after the handoff's (%#x, %#x)", shifted, other)
	}
	for _, raddr := range []uint64{other, uint64(hostSpan(regions[0]).Addr)} {
		got, ok := h.read(t, raddr, h.ownKey(t), expBlock)
		if ok {
			t.Fatalf("a get of %#x from the pushing source completed", raddr)
		}
		if bytes.Contains(got, []byte{0x5E}) || bytes.Contains(got, []byte{0xAA}) {
			t.Fatalf("bytes of the source's pool reached the attacker: %x", got[:16])
		}
	}
	if st := s.Stats(); st.Registrations != 0 {
		t.Fatalf("the pushing source registered memory: %+v", st)
	}
}

func TestPullTrustsTheDestination(t *testing.T) {
	// Why pull is opt-in: pulled, the same attacker with the source's
	// own remote key reads the block right after its pieces (UCX 1.13's
	// software-emulated get over tcp serves any address). If this test
	// fails, UCX started checking: revisit Config.Pull's doc.
	regions, secret := exposureSetup(t)
	s, err := NewSender(Config{Pull: true}, HostBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	h, _ := newHostile(t)
	defer h.close()
	accept := binary.LittleEndian.AppendUint32([]byte{'K', 'U', version}, 2)
	id := handoff.PlaneID{Session: 1, Handoff: 2}
	start, err := s.Send(id, regions, accept, func(*kvlease.Transfer) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	defer s.Finish(id, errors.New("test over"))
	st, err := parseStart(start)
	if err != nil {
		t.Fatal(err)
	}
	regs, _, err := parseTable(st.table, st.blocks, st.sizes)
	if err != nil {
		t.Fatal(err)
	}
	h.connect(t, st.addr)
	shifted := regs[0].addr + regs[0].n // one past the registration
	if shifted != uint64(hostSpan(secret).Addr) {
		t.Fatalf("test setup: the other block is not right after the registration")
	}
	got, ok := h.read(t, shifted, regs[0].key, expBlock)
	if !ok || !bytes.Equal(got, secret) {
		t.Fatalf("this UCX refused the out-of-registration get (ok %v): pull no longer exposes the source, revisit Config.Pull", ok)
	}
}

const expBlock = 4096

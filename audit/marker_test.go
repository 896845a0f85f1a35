package audit

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
)

func TestMarkerRoundTrip(t *testing.T) {
	m := Marker{Request: 0x1122334455667788, Block: 7, Gen: 3}
	for n := 0; n <= 130; n++ {
		b := make([]byte, n)
		Stamp(b, m)
		require.NoError(t, Check(b, m), "len %d", n)
		got, ok := Decode(b)
		require.Equal(t, n >= MarkerBytes, ok, "len %d", n)
		if ok {
			require.Equal(t, m, got)
		}
	}
}

// Every single-byte change is caught, at its offset.
func TestMarkerCatchesEveryByte(t *testing.T) {
	m := Marker{Request: 9, Block: 1, Gen: 2}
	b := make([]byte, 77)
	Stamp(b, m)
	for i := range b {
		b[i] ^= 0x40
		err := Check(b, m)
		var me *MismatchError
		require.ErrorAs(t, err, &me, "byte %d", i)
		require.ErrorIs(t, err, ErrMarkerMismatch)
		require.Equal(t, i, me.Offset)
		b[i] ^= 0x40
	}
}

// Another request's block, another block of the same request, a stale
// generation, a shifted copy and zeros are all told apart.
func TestMarkerMismatches(t *testing.T) {
	want := Marker{Request: 5, Block: 2, Gen: 4}
	for name, tc := range map[string]struct {
		fill    func([]byte)
		foreign bool
	}{
		"other request": {func(b []byte) { Stamp(b, Marker{Request: 6, Block: 2, Gen: 4}) }, true},
		"other block":   {func(b []byte) { Stamp(b, Marker{Request: 5, Block: 3, Gen: 4}) }, true},
		"stale gen":     {func(b []byte) { Stamp(b, Marker{Request: 5, Block: 2, Gen: 3}) }, true},
		"zeros":         {func(b []byte) { clear(b) }, false},
		"shifted": {func(b []byte) {
			Stamp(b, want)
			copy(b[MarkerBytes:], b[MarkerBytes+8:])
		}, false},
		"torn": {func(b []byte) {
			Stamp(b, want)
			Stamp(b[:MarkerBytes+16], Marker{Request: 1})
		}, true},
	} {
		t.Run(name, func(t *testing.T) {
			b := make([]byte, 64)
			tc.fill(b)
			err := Check(b, want)
			var me *MismatchError
			require.ErrorAs(t, err, &me)
			require.Equal(t, tc.foreign, me.Foreign(), "%v", err)
			require.Contains(t, err.Error(), "request 5 block 2 gen 4")
		})
	}
}

func newTestPool(t *testing.T, blocks int) *kvlease.Pool[[]byte] {
	t.Helper()
	mem, err := kvlease.NewHostMemory(blocks, 64)
	require.NoError(t, err)
	p, err := kvlease.NewPool[[]byte](mem)
	require.NoError(t, err)
	return p
}

func TestStampCheckLease(t *testing.T) {
	p := newTestPool(t, 4)
	a, err := p.Acquire("a", 4)
	require.NoError(t, err)
	require.NoError(t, StampLease(a, 1))
	require.NoError(t, CheckLease(a, 1))
	err = CheckLease(a, 2)
	require.ErrorIs(t, err, ErrMarkerMismatch)
	require.Contains(t, err.Error(), "holds request 1 block 0")

	// The same slots at a new generation: the old markers are stale.
	a.Release()
	require.ErrorIs(t, CheckLease(a, 1), kvlease.ErrLeaseClosed)
	b, err := p.Acquire("b", 4)
	require.NoError(t, err)
	err = CheckLease(b, 1)
	var me *MismatchError
	require.ErrorAs(t, err, &me)
	require.Equal(t, uint64(1), me.Got.Request)
	require.NotEqual(t, me.Got.Gen, me.Want.Gen)
	require.NoError(t, StampLease(b, 1))
	require.NoError(t, CheckLease(b, 1))
}

// devMemory is memory the host cannot address: regions are handles, read
// and written only through its BlockIO, like device memory behind a copy
// engine.
type devMemory struct {
	blocks     [][]byte
	failWrites bool
}

func (d *devMemory) Blocks() int                    { return len(d.blocks) }
func (d *devMemory) BlockBytes() int                { return len(d.blocks[0]) }
func (d *devMemory) Region(id kvlease.BlockID) int  { return int(id) }
func (d *devMemory) Read(src int, dst []byte) error { copy(dst, d.blocks[src]); return nil }
func (d *devMemory) Write(dst int, src []byte) error {
	if d.failWrites {
		return errors.New("device lost")
	}
	copy(d.blocks[dst], src)
	return nil
}

func TestStampCheckLeaseIO(t *testing.T) {
	dev := &devMemory{blocks: make([][]byte, 6)}
	for i := range dev.blocks {
		dev.blocks[i] = make([]byte, 48)
	}
	p, err := kvlease.NewPool[int](dev)
	require.NoError(t, err)
	l, err := p.Acquire("gpu", 3)
	require.NoError(t, err)
	require.NoError(t, StampLeaseIO[int](l, dev, 11))
	require.NoError(t, CheckLeaseIO[int](l, dev, 11))

	// A copy that lands in the wrong block is caught after copying back.
	copy(dev.blocks[l.Ref(1).ID], dev.blocks[l.Ref(0).ID])
	err = CheckLeaseIO[int](l, dev, 11)
	var me *MismatchError
	require.ErrorAs(t, err, &me)
	require.Equal(t, uint32(0), me.Got.Block)
	require.Equal(t, uint32(1), me.Want.Block)

	dev.failWrites = true
	require.ErrorContains(t, StampLeaseIO[int](l, dev, 11), "device lost")
	l.Release()
	require.ErrorIs(t, CheckLeaseIO[int](l, dev, 11), kvlease.ErrLeaseClosed)
}

func TestHostIO(t *testing.T) {
	var io BlockIO[[]byte] = HostIO{}
	src := []byte("0123456789")
	dst := make([]byte, 10)
	require.NoError(t, io.Write(dst, src))
	require.Equal(t, src, dst)
	require.ErrorIs(t, io.Write(dst[:3], src), kvlease.ErrInvalidArgument)
	require.ErrorIs(t, io.Read(src, dst[:3]), kvlease.ErrInvalidArgument)
}

func TestOpStringParse(t *testing.T) {
	for _, o := range []Op{
		{Kind: OpArrive, Req: 3, Pool: 2, Doc: -1, Tokens: 40, MaxNew: 9, Wait: true},
		{Kind: OpOffer, Req: 4, Pool: 1, Reject: true},
		{Kind: OpStart, Req: 5, FailAt: 3, Honour: true},
		{Kind: OpStep, Req: 6, Job: 2},
		{Kind: OpExtend, Req: 7, Tokens: 2},
		{Kind: OpAck, Req: 8},
	} {
		got, err := ParseOp(o.String())
		require.NoError(t, err, o.String())
		require.Equal(t, o, got)
	}
	for _, bad := range []string{"", "fly r=1", "arrive r=x", "arrive r=1 speed=3", "start fate=maybe", "arrive loud"} {
		_, err := ParseOp(bad)
		require.Error(t, err, bad)
	}
	ops, err := ParseTrace("# a comment\n0: arrive r=1 pool=0 doc=2 tokens=30 new=5\n\nrelease r=1\n")
	require.NoError(t, err)
	require.Equal(t, []Op{{Kind: OpArrive, Req: 1, Doc: 2, Tokens: 30, MaxNew: 5}, {Kind: OpRelease, Req: 1}}, ops)
	require.Equal(t, "0: arrive r=1 pool=0 doc=2 tokens=30 new=5\n1: release r=1\n", FormatTrace(ops))
	require.Equal(t, "op(99)", fmt.Sprint(OpKind(99)))
}

package audit

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/kvlease/kvlease"
)

// ErrMarkerMismatch is wrapped by every error that reports a block not
// holding the marker it should.
var ErrMarkerMismatch = errors.New("audit: marker mismatch")

// A Marker names what a block should hold: the request that computed it,
// the block's index in that request, and the generation of the block slot
// it was computed in (BlockRef.Gen). Two different markers never stamp the
// same bytes, so a block that holds another request's marker, another
// block's, or a stale generation's is caught by Check.
//
// Markers are synthetic and carry no data of their own: run the audit with
// them, never with real tenants' KV.
type Marker struct {
	Request uint64
	Block   uint32
	Gen     uint32
}

// String renders the marker as "request R block B gen G".
func (m Marker) String() string {
	return fmt.Sprintf("request %d block %d gen %d", m.Request, m.Block, m.Gen)
}

// MarkerBytes is the length of a marker's header. A block at least this
// long identifies its marker (Decode); the rest of the block is a pattern
// derived from the marker and the offset, so a partial or shifted
// overwrite is caught as well. A shorter block holds a prefix of the
// header and is checked as far as it goes.
const MarkerBytes = 24

const markerMagic = 0x3141564b // "KVA1" little-endian

// header is the marker's first MarkerBytes bytes: magic, generation,
// request, block, and a check word over them.
func (m Marker) header() (h [MarkerBytes]byte) {
	binary.LittleEndian.PutUint32(h[0:], markerMagic)
	binary.LittleEndian.PutUint32(h[4:], m.Gen)
	binary.LittleEndian.PutUint64(h[8:], m.Request)
	binary.LittleEndian.PutUint32(h[16:], m.Block)
	binary.LittleEndian.PutUint32(h[20:], uint32(m.seed()>>17))
	return h
}

// seed mixes the marker into one word (splitmix64's finaliser).
func (m Marker) seed() uint64 {
	z := m.Request*0x9e3779b97f4a7c15 ^ uint64(m.Block)<<32 ^ uint64(m.Gen)
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// chunk is the pattern word at offset MarkerBytes+8k.
func chunk(seed uint64, k int) uint64 { return seed + uint64(k+1)*0x9e3779b97f4a7c15 }

// Stamp fills b with m's bytes: the header, then the pattern, up to
// len(b).
func Stamp(b []byte, m Marker) {
	h := m.header()
	n := copy(b, h[:])
	if n < MarkerBytes {
		return
	}
	seed := m.seed()
	rest := b[MarkerBytes:]
	k := 0
	for ; len(rest) >= 8; k++ {
		binary.LittleEndian.PutUint64(rest, chunk(seed, k))
		rest = rest[8:]
	}
	if len(rest) > 0 {
		var w [8]byte
		binary.LittleEndian.PutUint64(w[:], chunk(seed, k))
		copy(rest, w[:])
	}
}

// Check reports whether b holds exactly m's bytes. The error is nil or a
// *MismatchError (wrapping ErrMarkerMismatch) that says what b holds
// instead.
func Check(b []byte, m Marker) error {
	if off := mismatchAt(b, m); off >= 0 {
		e := &MismatchError{Want: m, Offset: off}
		e.Got, e.GotOK = Decode(b)
		return e
	}
	return nil
}

// mismatchAt returns the first offset where b differs from m's bytes, or
// -1.
func mismatchAt(b []byte, m Marker) int {
	h := m.header()
	for i := 0; i < len(b) && i < MarkerBytes; i++ {
		if b[i] != h[i] {
			return i
		}
	}
	if len(b) <= MarkerBytes {
		return -1
	}
	seed := m.seed()
	rest := b[MarkerBytes:]
	k := 0
	for ; len(rest) >= 8; k++ {
		if binary.LittleEndian.Uint64(rest) != chunk(seed, k) {
			return MarkerBytes + 8*k + firstDiff(rest[:8], chunk(seed, k))
		}
		rest = rest[8:]
	}
	if len(rest) > 0 {
		var w [8]byte
		binary.LittleEndian.PutUint64(w[:], chunk(seed, k))
		for i := range rest {
			if rest[i] != w[i] {
				return MarkerBytes + 8*k + i
			}
		}
	}
	return -1
}

func firstDiff(b []byte, w uint64) int {
	var x [8]byte
	binary.LittleEndian.PutUint64(x[:], w)
	for i := range b {
		if b[i] != x[i] {
			return i
		}
	}
	return 0
}

// Decode reads the marker whose header b starts with. ok is false when b
// is shorter than MarkerBytes or starts with no intact header (zeros, a
// torn write, foreign bytes).
func Decode(b []byte) (m Marker, ok bool) {
	if len(b) < MarkerBytes || binary.LittleEndian.Uint32(b[0:]) != markerMagic {
		return Marker{}, false
	}
	m = Marker{
		Gen:     binary.LittleEndian.Uint32(b[4:]),
		Request: binary.LittleEndian.Uint64(b[8:]),
		Block:   binary.LittleEndian.Uint32(b[16:]),
	}
	if binary.LittleEndian.Uint32(b[20:]) != uint32(m.seed()>>17) {
		return Marker{}, false
	}
	return m, true
}

// MismatchError says that a block does not hold the marker it should.
type MismatchError struct {
	Want   Marker
	Got    Marker // the marker whose header the block holds, if GotOK
	GotOK  bool
	Offset int // the first byte that differs
	// Where names the block, when the caller knows it ("lease 7 block 3
	// (slot 12@4)"); empty otherwise.
	Where string
}

// Error says what the block holds instead of the marker it should.
func (e *MismatchError) Error() string {
	where := "block"
	if e.Where != "" {
		where = e.Where
	}
	switch {
	case e.GotOK && e.Got != e.Want:
		return fmt.Sprintf("audit: %s holds %v, want %v", where, e.Got, e.Want)
	case e.GotOK:
		return fmt.Sprintf("audit: %s holds %v with its pattern overwritten from byte %d", where, e.Want, e.Offset)
	}
	return fmt.Sprintf("audit: %s holds no intact marker (differs from byte %d), want %v", where, e.Offset, e.Want)
}

// Unwrap returns ErrMarkerMismatch.
func (e *MismatchError) Unwrap() error { return ErrMarkerMismatch }

// Foreign reports whether the block holds another marker's intact header:
// someone else's data, the failure markers exist to catch.
func (e *MismatchError) Foreign() bool { return e.GotOK && e.Got != e.Want }

// LeaseMarker is the marker that StampLease writes into block i of a lease
// held for request req, whose ref is ref.
func LeaseMarker(req uint64, i int, ref kvlease.BlockRef) Marker {
	return Marker{Request: req, Block: uint32(i), Gen: ref.Gen}
}

// BlockIO reads and writes whole blocks of a region type that the host
// cannot address directly (device memory): Write copies src (BlockBytes
// long) into the region, Read copies the region into dst, both complete
// when they return. The GPU copy engine (package gpu) provides the copies;
// audit does not depend on it.
type BlockIO[R any] interface {
	Write(dst R, src []byte) error
	Read(src R, dst []byte) error
}

// HostIO is the BlockIO of host memory ([]byte regions): plain copies.
type HostIO struct{}

// Write copies src into dst, which must have the same length.
func (HostIO) Write(dst, src []byte) error {
	if len(dst) != len(src) {
		return fmt.Errorf("audit: write %d bytes into a %d-byte region: %w", len(src), len(dst), kvlease.ErrInvalidArgument)
	}
	copy(dst, src)
	return nil
}

// Read copies src into dst, which must have the same length.
func (HostIO) Read(src, dst []byte) error {
	if len(dst) != len(src) {
		return fmt.Errorf("audit: read a %d-byte region into %d bytes: %w", len(src), len(dst), kvlease.ErrInvalidArgument)
	}
	copy(dst, src)
	return nil
}

// StampLease stamps every block of an open lease with LeaseMarker(req, i,
// l.Ref(i)).
func StampLease(l *kvlease.Lease[[]byte], req uint64) error {
	for i := range l.Len() {
		b, err := l.Region(i)
		if err != nil {
			return err
		}
		Stamp(b, LeaseMarker(req, i, l.Ref(i)))
	}
	return nil
}

// CheckLease checks every block of an open lease against LeaseMarker(req,
// i, l.Ref(i)). It returns nil, the lease's error (ErrLeaseClosed), or
// every mismatch joined (each a *MismatchError).
func CheckLease(l *kvlease.Lease[[]byte], req uint64) error {
	var errs []error
	for i := range l.Len() {
		b, err := l.ReadRegion(i)
		if err != nil {
			return err
		}
		if err := Check(b, LeaseMarker(req, i, l.Ref(i))); err != nil {
			err.(*MismatchError).Where = fmt.Sprintf("lease %d (%s) block %d (slot %v)", l.ID(), l.Owner(), i, l.Ref(i))
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// StampLeaseIO is StampLease for any region type, through bio: each
// marker is built in a host buffer and written with bio.Write.
func StampLeaseIO[R any](l *kvlease.Lease[R], bio BlockIO[R], req uint64) error {
	buf := make([]byte, l.Pool().Memory().BlockBytes())
	for i := range l.Len() {
		r, err := l.Region(i)
		if err != nil {
			return err
		}
		Stamp(buf, LeaseMarker(req, i, l.Ref(i)))
		if err := bio.Write(r, buf); err != nil {
			return fmt.Errorf("audit: stamp block %d of lease %d (%s): %w", i, l.ID(), l.Owner(), err)
		}
	}
	return nil
}

// CheckLeaseIO is CheckLease for any region type, through bio: each block
// is read back into a host buffer with bio.Read and checked there.
func CheckLeaseIO[R any](l *kvlease.Lease[R], bio BlockIO[R], req uint64) error {
	buf := make([]byte, l.Pool().Memory().BlockBytes())
	var errs []error
	for i := range l.Len() {
		r, err := l.ReadRegion(i)
		if err != nil {
			return err
		}
		if err := bio.Read(r, buf); err != nil {
			return fmt.Errorf("audit: check block %d of lease %d (%s): %w", i, l.ID(), l.Owner(), err)
		}
		if err := Check(buf, LeaseMarker(req, i, l.Ref(i))); err != nil {
			err.(*MismatchError).Where = fmt.Sprintf("lease %d (%s) block %d (slot %v)", l.ID(), l.Owner(), i, l.Ref(i))
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

package ucx

import (
	"crypto/aes"
	"crypto/cipher"
	"encoding/binary"
	"fmt"
	"hash/crc32"

	"github.com/kvlease/kvlease/handoff"
)

// integrityMode is how the destination checks each block it received in the
// push model.
type integrityMode byte

const (
	// integrityNone: no check (device memory, which the CPU cannot read;
	// insecure sessions only).
	integrityNone integrityMode = iota
	// integrityCRC: crc32c (Castagnoli) of each block. It catches
	// corruption, not forgery: the insecure mode's check.
	integrityCRC
	// integrityMAC: a GMAC (AES-256-GCM) of each block under a key
	// derived from the control session's key for this handoff alone, with
	// the block index in its nonce: a block of another handoff, another
	// session, another place in this handoff, or from anyone who does not
	// hold the session key, is refused.
	integrityMAC
)

// String returns the mode's name: none, crc32c or gmac.
func (m integrityMode) String() string {
	switch m {
	case integrityNone:
		return "none"
	case integrityCRC:
		return "crc32c"
	case integrityMAC:
		return "gmac"
	}
	return fmt.Sprintf("Integrity(%d)", byte(m))
}

func (m integrityMode) sumLen() int {
	switch m {
	case integrityCRC:
		return 4
	case integrityMAC:
		return macLen
	}
	return 0
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// keyLabel is the HKDF label of this plane's keys (handoff.Peer.Key).
const keyLabel = "kvlease ucx data v1"

// keyContext is what a handoff's MAC key is derived for: the handoff id,
// the source's random nonce and the destination's salt, so the key is
// new for every handoff (even if an id repeated in a session, as long as
// either side is honest) and a nonce never repeats under it.
func keyContext(handoffID uint64, nonce []byte, salt uint32) []byte {
	c := binary.LittleEndian.AppendUint64(nil, handoffID)
	c = append(c, nonce...)
	return binary.LittleEndian.AppendUint32(c, salt)
}

// summer computes blocks' integrity sums. One per job, used on one
// thread at a time.
//
// The keyed sum is GMAC (AES-256-GCM over no plaintext, the data as
// additional data) under the handoff's key: one GMAC per unit, the
// source's pieces (so both sides cut a block the same way, however their
// own pieces lie), each with the nonce (block, unit); a block of one
// unit's sum is that GMAC, a block of several units' is a GMAC of their
// GMACs with the nonce (block, all units). The block index is in every
// nonce, the handoff (and the session) in the key. A unit that straddles
// two of a side's pieces is copied into a scratch buffer first.
type summer struct {
	mode    integrityMode
	units   []int // the source's piece sizes
	gcm     cipher.AEAD
	scratch []byte
	tags    []byte
	nonce   [12]byte
	spans   []Span // unit's slices (stream.go)
	folded  []byte // fold's GMAC
}

func newSummer(mode integrityMode, key []byte, units []int) (*summer, error) {
	s := &summer{mode: mode, units: units}
	if mode != integrityMAC {
		return s, nil
	}
	c, err := aes.NewCipher(key)
	if err != nil {
		return nil, fmt.Errorf("ucx: block key: %w", err)
	}
	if s.gcm, err = cipher.NewGCM(c); err != nil {
		return nil, fmt.Errorf("ucx: block key: %w", err)
	}
	return s, nil
}

// gmac appends the GMAC of data under nonce (block, unit) to dst.
func (s *summer) gmac(dst, data []byte, block, unit uint32) []byte {
	binary.LittleEndian.PutUint32(s.nonce[0:], block)
	binary.LittleEndian.PutUint32(s.nonce[4:], unit)
	return s.gcm.Seal(dst, s.nonce[:], nil, data)
}

// sum writes block b's sum of the block's bytes (its pieces, in piece
// order) to dst.
func (s *summer) sum(dst []byte, b int, pieces []Span) {
	switch s.mode {
	case integrityCRC:
		var c uint32
		for _, sp := range pieces {
			c = crc32.Update(c, castagnoli, hostBytes(sp))
		}
		binary.LittleEndian.PutUint32(dst, c)
	case integrityMAC:
		s.tags = s.tags[:0]
		pi, off := 0, 0 // the piece and offset the next unit starts at
		for u, n := range s.units {
			var data []byte
			if p := hostBytes(pieces[pi]); len(p)-off >= n {
				data = p[off : off+n]
				if off += n; off == len(p) {
					pi, off = pi+1, 0
				}
			} else {
				if cap(s.scratch) < n {
					s.scratch = make([]byte, n)
				}
				data = s.scratch[:n]
				for got := 0; got < n; {
					p := hostBytes(pieces[pi])
					c := copy(data[got:], p[off:])
					got += c
					if off += c; off == len(p) {
						pi, off = pi+1, 0
					}
				}
			}
			s.tags = s.gmac(s.tags, data, uint32(b), uint32(u))
		}
		if len(s.units) == 1 {
			copy(dst, s.tags)
			return
		}
		copy(dst, s.gmac(s.tags[len(s.tags):], s.tags, uint32(b), tableIndex))
	}
}

// allHost reports whether every span is host memory (which the CPU can
// sum).
func allHost(spans []Span) bool {
	for _, sp := range spans {
		if sp.Memory != Host {
			return false
		}
	}
	return true
}

// integrityFor picks the sums for a handoff: keyed when the session has
// a key, crc32c without one, none for device memory (insecure sessions
// only: see checkIntegrity).
func integrityFor(key []byte, spans []Span) integrityMode {
	switch {
	case key != nil:
		return integrityMAC
	case !allHost(spans):
		return integrityNone
	}
	return integrityCRC
}

// checkIntegrity is the rule of a session's block sums, on both sides:
// with a session key (an authenticated session) every block carries its
// keyed sum (integrityMAC), whatever the regions (plain, pieces,
// streamed), and a Start that names anything else (none, crc32c) is
// refused, as are regions in device memory, whose sums nobody could
// check; without a key, keyed sums are refused (nothing to check them
// against). mode is the Start's (or the sender's) integrity.
func checkIntegrity(key []byte, mode integrityMode, spans []Span) error {
	switch {
	case key != nil && mode != integrityMAC:
		return fmt.Errorf("an authenticated session's blocks carry %v sums, not keyed ones: %w", mode, ErrCorrupt)
	case key != nil && !allHost(spans):
		return errDeviceKeyed
	case key == nil && mode == integrityMAC:
		return fmt.Errorf("keyed block sums without a session key: %w", ErrCorrupt)
	}
	return nil
}

// sessionKeys derives a handoff's 32-byte MAC key from its control
// session for context; nil, nil when the session is not authenticated.
// The planes use handoff.Peer.Key (nil sessionKeys); tests substitute
// their own.
type sessionKeys func(id handoff.PlaneID, context []byte) ([]byte, error)

// derive returns id's handoff key for context, or nil for an
// unauthenticated session.
func (k sessionKeys) derive(id handoff.PlaneID, context []byte) ([]byte, error) {
	if k != nil {
		return k(id, context)
	}
	if !id.Peer.Secure() {
		return nil, nil
	}
	return id.Peer.Key(keyLabel, context, 32)
}

// secure reports whether id's session is authenticated.
func (k sessionKeys) secure(id handoff.PlaneID) bool {
	if k != nil {
		key, _ := k(id, nil)
		return key != nil
	}
	return id.Peer.Secure()
}

package tcp

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash/crc32"

	"github.com/kvlease/kvlease/handoff"
	"go.uber.org/atomic"
)

// seal is one handoff's integrity on the data plane. In an authenticated
// session (the PlaneID's Peer is secure) it is keyed: both sides derive,
// from the session's secret, the handoff id and the Accept's random
// token, a key for the hello's HMAC-SHA256 and one for each block's tag,
// a GMAC (AES-256-GCM over no plaintext, the block as additional data,
// the block index as nonce: 16 bytes). The key is new for every handoff
// (the token is), so a nonce never repeats under it; a block of another
// handoff or session, or at another index, fails its tag. Unkeyed
// (insecure sessions, ids made by hand) the hello carries no MAC and each
// block a crc32c, which catches accidents, not attackers.
type seal struct {
	keyed    bool
	stream   bool // the data connection's hello said stream mode (stream.go)
	helloKey []byte
	gmac     cipher.AEAD
	nonce    [12]byte
}

// sealLabel is the HKDF label of the TCP plane's keys.
const sealLabel = "kvlease tcp data v2"

func newSeal(id handoff.PlaneID, tok [16]byte) (*seal, error) {
	if !id.Peer.Secure() {
		return &seal{}, nil
	}
	ctx := binary.LittleEndian.AppendUint64(append([]byte(nil), tok[:]...), id.Handoff)
	k, err := id.Peer.Key(sealLabel, ctx, 64)
	if err != nil {
		return nil, err
	}
	b, err := aes.NewCipher(k[32:])
	if err != nil {
		return nil, err
	}
	g, err := cipher.NewGCM(b)
	if err != nil {
		return nil, err
	}
	return &seal{keyed: true, helloKey: k[:32], gmac: g}, nil
}

// trailer is the length of a block's check.
func (s *seal) trailer() int {
	if s.keyed {
		return tagLength
	}
	return crcLength
}

// checkLen is the length of the check of a frame of run blocks: one
// crc32c over the run, or one tag per block.
func (s *seal) checkLen(run int) int {
	if s.keyed {
		return tagLength * run
	}
	return crcLength
}

const (
	tagLength = 16
	crcLength = 4
)

// sum writes block i's check into dst (trailer() bytes).
func (s *seal) sum(dst []byte, i int, block []byte) {
	if !s.keyed {
		putCRC(dst, crc32.Checksum(block, castagnoli))
		return
	}
	binary.LittleEndian.PutUint32(s.nonce[:], uint32(i))
	s.gmac.Seal(dst[:0], s.nonce[:], nil, block)
}

// verify checks block i against its check.
func (s *seal) verify(i int, block, check []byte) error {
	if !s.keyed {
		if got, want := crc32.Checksum(block, castagnoli), crcOf(check); got != want {
			return fmt.Errorf("crc32c %08x, frame says %08x: %w", got, want, ErrCorrupt)
		}
		return nil
	}
	binary.LittleEndian.PutUint32(s.nonce[:], uint32(i))
	if _, err := s.gmac.Open(nil, s.nonce[:], check, block); err != nil {
		return fmt.Errorf("its tag does not verify under this handoff's key (corrupt, or from another handoff or session): %w", ErrCorrupt)
	}
	return nil
}

func (s *seal) hello(tok [16]byte, blocks, bb int) []byte {
	return s.helloFlags(tok, blocks, bb, 0)
}

// helloFlags is hello with extra flags (flagStream).
func (s *seal) helloFlags(tok [16]byte, blocks, bb int, flags byte) []byte {
	if s.keyed {
		flags |= flagKeyed
	}
	h := appendHello(make([]byte, 0, helloLength), flags, tok, blocks, bb)
	if !s.keyed {
		return append(h, make([]byte, sha256.Size)...)
	}
	m := hmac.New(sha256.New, s.helloKey)
	m.Write(h)
	return m.Sum(h)
}

// zeroMAC is the MAC field of an unkeyed hello.
var zeroMAC [sha256.Size]byte

// checkHello verifies a hello against the slot's seal: its flags (no
// unknown bit), and its MAC (keyed) or the zero MAC field (unkeyed).
func (s *seal) checkHello(h []byte) error {
	keyed := h[3]&flagKeyed != 0
	switch {
	case h[3]&^(flagKeyed|flagStream) != 0:
		return fmt.Errorf("a hello with unknown flags %#x: %w", h[3], ErrCorrupt)
	case s.keyed && !keyed:
		return fmt.Errorf("an unkeyed hello for an authenticated session's handoff (a downgrade): %w", ErrUnauthenticated)
	case !s.keyed && keyed:
		return fmt.Errorf("a keyed hello for an unauthenticated session's handoff: %w", ErrCorrupt)
	case !s.keyed:
		if !bytes.Equal(h[helloBody:helloLength], zeroMAC[:]) {
			return fmt.Errorf("an unkeyed hello whose MAC field is not zero: %w", ErrCorrupt)
		}
		return nil
	}
	m := hmac.New(sha256.New, s.helloKey)
	m.Write(h[:helloBody])
	if !hmac.Equal(m.Sum(nil), h[helloBody:]) {
		return fmt.Errorf("the hello's MAC does not verify under the session (a stolen, guessed or replayed token): %w", ErrUnauthenticated)
	}
	return nil
}

// A keyed tag costs a pass over the block (AES-GMAC: several GB/s, a
// good fraction of what loopback TCP moves), so both sides take it off
// the goroutine that drives the socket: the sender's tags are computed
// ahead of its writer, the receiver's checks behind its reader, each on
// a goroutine of its own that reads the regions. That goroutine is part
// of the side's evidence: the loop that owns it waits for it to return
// before it returns itself, so the transfer never resolves while it may
// still read.

// pipelineBytes is the smallest transfer whose keyed checks run on a
// goroutine of their own: below it the checks cost less than waking
// one (16 blocks of 4 KiB take about 10 µs to tag), so they run inline.
const pipelineBytes = 1 << 20

// pipelined reports whether a transfer of regions checks its blocks on
// a goroutine of its own.
func (s *seal) pipelined(regions [][]byte) bool {
	return s.keyed && len(regions) > 0 && len(regions)*len(regions[0]) >= pipelineBytes
}

// tagAhead computes the tags of regions, in order, ahead of the writer.
type tagAhead struct {
	tags  []byte
	ready chan struct{} // one receive per tag, in order
	stop  atomic.Bool
	done  chan struct{}
}

func (s *seal) ahead(regions [][]byte) *tagAhead {
	t := &tagAhead{tags: make([]byte, tagLength*len(regions)), ready: make(chan struct{}, len(regions)), done: make(chan struct{})}
	go func() {
		defer close(t.done)
		for i, r := range regions {
			if t.stop.Load() {
				return
			}
			s.sum(t.tags[tagLength*i:], i, r)
			t.ready <- struct{}{}
		}
	}()
	return t
}

// tag waits for block i's tag (called for i = 0, 1, ... in order).
func (t *tagAhead) tag(i int) []byte {
	<-t.ready
	return t.tags[tagLength*i : tagLength*(i+1)]
}

// close stops the goroutine and waits for it: once close returns,
// nothing of the tagger reads the regions.
func (t *tagAhead) close() {
	t.stop.Store(true)
	<-t.done
}

// checkBehind verifies blocks, in order, behind the reader.
type checkBehind struct {
	s      *seal
	blocks chan int
	tags   []byte
	bad    atomic.Pointer[error]
	done   chan struct{}
}

func (s *seal) behind(regions [][]byte) *checkBehind {
	c := &checkBehind{s: s, blocks: make(chan int, len(regions)), tags: make([]byte, tagLength*len(regions)), done: make(chan struct{})}
	go func() {
		defer close(c.done)
		for i := range c.blocks {
			if c.bad.Load() != nil {
				continue
			}
			if err := s.verify(i, regions[i], c.tags[tagLength*i:tagLength*(i+1)]); err != nil {
				err = fmt.Errorf("tcp: block %d of %d: %w", i, len(regions), err)
				c.bad.Store(&err)
			}
		}
	}()
	return c
}

// check queues block i, whose bytes are all in its region, with its tag.
func (c *checkBehind) check(i int, tag []byte) {
	copy(c.tags[tagLength*i:], tag)
	c.blocks <- i
}

// failed returns the first block that did not verify so far, if any.
func (c *checkBehind) failed() error {
	if p := c.bad.Load(); p != nil {
		return *p
	}
	return nil
}

// close waits for the checks queued so far and returns the first
// failure: once it returns, nothing of the checker reads the regions.
func (c *checkBehind) close() error {
	close(c.blocks)
	<-c.done
	return c.failed()
}

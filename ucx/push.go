package ucx

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"slices"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// The push model (the default). The destination exposes nothing and
// names no address of the source: its Prepare takes a worker for the
// handoff alone (an idle one of the session, or a new one; see pool.go)
// and puts that worker's address and a tag salt new on it in the Accept
// bytes; the source connects to it and sends each block as
// one tagged message (ucp_tag_send_nbx; a block of several pieces is
// gathered from its pieces with an iov datatype), then a table of the
// blocks' integrity sums. The destination receives each block into its
// own pieces (ucp_tag_recv_nbx with the block's exact tag, scattered
// with an iov datatype), so a message lands only where the destination
// put it, and only into a block of this handoff. Both contexts are
// created without UCP_FEATURE_RMA: no worker of this model serves a
// software-emulated get or put (UCX registers those handlers only for
// that feature).
//
// Runs: consecutive blocks that lie one after the other in the source's
// memory (all their pieces, block by block) form a run, and a run moves
// as one message (tagged with its first block), cut at the smaller of
// the two sides' Config.MaxGet (the destination's travels in the Accept
// bytes); the Start bytes list the runs of two blocks or more, and every
// other block is a message of its own, as before. The destination
// receives a run's message into its own blocks: one buffer where they
// are adjacent in its memory too, scattered with an iov datatype where
// they are not. The sums stay per block.

const (
	// pushVersion is the version byte of the push model's plane bytes
	// (4: the destination's message bound in Accept, the run list in
	// Start).
	pushVersion = 4
	// pushStreamVersion is the version byte of a streaming handoff's
	// Start bytes (pushVersion's, plus the layer count; see stream.go).
	pushStreamVersion = 5
	// pushAcceptMin is "KU", version, blocks, salt, the destination's
	// message bound, address length.
	pushAcceptMin = 2 + 1 + 4 + 4 + 4 + 2
	// runBytes is the bytes of a run in the Start bytes' run list: its
	// first block and its block count.
	runBytes = 4 + 4
	// tableIndex is the low half of the integrity table's tag.
	tableIndex = 0xFFFF_FFFF
	// macLen is the bytes of a block's keyed sum (a GMAC tag).
	macLen = 16
	// nonceLen is the bytes of the source's random nonce in Start.
	nonceLen = 16
)

// Integrity is how the destination checks each block it received in the
// push model.
type Integrity byte

const (
	// IntegrityNone: no check (device memory, which the CPU cannot read;
	// insecure sessions only).
	IntegrityNone Integrity = iota
	// IntegrityCRC: crc32c (Castagnoli) of each block. It catches
	// corruption, not forgery: the insecure mode's check.
	IntegrityCRC
	// IntegrityMAC: a GMAC (AES-256-GCM) of each block under a key
	// derived from the control session's key for this handoff alone, with
	// the block index in its nonce: a block of another handoff, another
	// session, another place in this handoff, or from anyone who does not
	// hold the session key, is refused.
	IntegrityMAC
)

// String returns the mode's name: none, crc32c or gmac.
func (m Integrity) String() string {
	switch m {
	case IntegrityNone:
		return "none"
	case IntegrityCRC:
		return "crc32c"
	case IntegrityMAC:
		return "gmac"
	}
	return fmt.Sprintf("Integrity(%d)", byte(m))
}

func (m Integrity) sumLen() int {
	switch m {
	case IntegrityCRC:
		return 4
	case IntegrityMAC:
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
	mode    Integrity
	units   []int // the source's piece sizes
	gcm     cipher.AEAD
	scratch []byte
	tags    []byte
	nonce   [12]byte
	spans   []Span // unit's slices (stream.go)
	folded  []byte // fold's GMAC
}

func newSummer(mode Integrity, key []byte, units []int) (*summer, error) {
	s := &summer{mode: mode, units: units}
	if mode != IntegrityMAC {
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
	case IntegrityCRC:
		var c uint32
		for _, sp := range pieces {
			c = crc32.Update(c, castagnoli, hostBytes(sp))
		}
		binary.LittleEndian.PutUint32(dst, c)
	case IntegrityMAC:
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

func tagOf(salt uint32, i uint32) uint64 { return uint64(salt)<<32 | uint64(i) }

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
func integrityFor(key []byte, spans []Span) Integrity {
	switch {
	case key != nil:
		return IntegrityMAC
	case !allHost(spans):
		return IntegrityNone
	}
	return IntegrityCRC
}

// errDeviceKeyed is the refusal of device memory in an authenticated
// session: its blocks must carry keyed sums, which the CPU can neither
// compute nor check over memory it cannot read.
var errDeviceKeyed = fmt.Errorf("an authenticated session's blocks must carry keyed sums, and blocks in device memory cannot (the CPU cannot read them): move host memory, or run an insecure session on a trusted network: %w", kvlease.ErrInvalidArgument)

// checkIntegrity is the rule of a session's block sums, on both sides:
// with a session key (an authenticated session) every block carries its
// keyed sum (IntegrityMAC), whatever the regions (plain, pieces,
// streamed), and a Start that names anything else (none, crc32c) is
// refused, as are regions in device memory, whose sums nobody could
// check; without a key, keyed sums are refused (nothing to check them
// against). mode is the Start's (or the sender's) integrity.
func checkIntegrity(key []byte, mode Integrity, spans []Span) error {
	switch {
	case key != nil && mode != IntegrityMAC:
		return fmt.Errorf("an authenticated session's blocks carry %v sums, not keyed ones: %w", mode, ErrCorrupt)
	case key != nil && !allHost(spans):
		return errDeviceKeyed
	case key == nil && mode == IntegrityMAC:
		return fmt.Errorf("keyed block sums without a session key: %w", ErrCorrupt)
	}
	return nil
}

// preparePush checks out an idle worker of id's session (or starts one)
// and returns the Accept bytes: "KU", pushVersion, blocks, salt, the
// most bytes of one message (Config.MaxGet), the worker's address. The
// salt is new on the worker for every handoff: a random start, then one
// more per handoff, so no two handoffs of a worker share a tag.
func (r *Receiver[R]) preparePush(id handoff.PlaneID, p *prepared) ([]byte, error) {
	c := r.pool.take(keyOf(id), nil)
	if c != nil {
		r.stats.add(func(st *Stats) { st.Reuses++ })
	} else {
		w, err := r.ctx.newWorker()
		if err != nil {
			return nil, err
		}
		c = &conn{w: w, dest: true}
		if cerr := w.call(func() { c.own, err = w.address() }); cerr != nil {
			err = cerr
		}
		if err != nil {
			c.destroy()
			return nil, err
		}
		var salt [4]byte
		if _, err := rand.Read(salt[:]); err != nil {
			c.destroy()
			return nil, fmt.Errorf("ucx: prepare: %w", err)
		}
		c.salt = binary.LittleEndian.Uint32(salt[:])
		r.stats.add(func(st *Stats) { st.Workers++ })
	}
	p.c, p.w = c, c.w
	p.salt = c.salt
	c.salt++
	b := appendPushAccept(nil, p.blocks, p.salt, r.cfg.MaxGet, c.own)
	if len(b) > handoff.MaxPlane {
		p.release()
		return nil, fmt.Errorf("ucx: accept bytes %d exceed %d: %w", len(b), handoff.MaxPlane, kvlease.ErrExceedsCapacity)
	}
	return b, nil
}

// appendPushAccept appends the push model's Accept bytes (read by
// parsePushAccept).
func appendPushAccept(b []byte, blocks int, salt uint32, maxMsg int, addr []byte) []byte {
	b = append(b, 'K', 'U', pushVersion)
	b = binary.LittleEndian.AppendUint32(b, uint32(blocks))
	b = binary.LittleEndian.AppendUint32(b, salt)
	b = binary.LittleEndian.AppendUint32(b, uint32(maxMsg))
	b = binary.LittleEndian.AppendUint16(b, uint16(len(addr)))
	return append(b, addr...)
}

// pushAccept is the push model's parsed Accept bytes.
type pushAccept struct {
	blocks int
	salt   uint32
	maxMsg int // the most bytes the destination takes in one message
	addr   []byte
}

// parsePushAccept parses the push model's Accept bytes.
func parsePushAccept(b []byte) (*pushAccept, error) {
	if len(b) >= 3 && b[0] == 'K' && b[1] == 'U' && b[2] == version {
		return nil, fmt.Errorf("ucx: the destination asks to read this source's memory (the pull model); this sender pushes (set Config.Pull on both sides to trust the destination with it): %w", ErrCorrupt)
	}
	if len(b) < pushAcceptMin || b[0] != 'K' || b[1] != 'U' || b[2] != pushVersion {
		return nil, fmt.Errorf("ucx: accept bytes of %d: %w", len(b), ErrCorrupt)
	}
	a := &pushAccept{
		blocks: int(binary.LittleEndian.Uint32(b[3:])),
		salt:   binary.LittleEndian.Uint32(b[7:]),
		maxMsg: int(binary.LittleEndian.Uint32(b[11:])),
	}
	n := int(binary.LittleEndian.Uint16(b[15:]))
	if n == 0 || len(b) != pushAcceptMin+n || a.blocks <= 0 || a.blocks > handoff.MaxBlocks || a.maxMsg <= 0 {
		return nil, fmt.Errorf("ucx: accept bytes: %d blocks, messages of %d bytes, address of %d bytes in %d: %w", a.blocks, a.maxMsg, n, len(b), ErrCorrupt)
	}
	a.addr = b[pushAcceptMin:]
	return a, nil
}

// pushStart is the push model's parsed Start bytes: "KU", pushVersion,
// the piece count and sizes of a block, the block count, the integrity
// mode, a random nonce of the source's, the source worker's address (the
// destination connects to it to learn of the source's failure; it reads
// nothing there), the most blocks of one message, and the runs.
type pushStart struct {
	sizes  []int
	blocks int
	mode   Integrity
	nonce  []byte // the source's, for the handoff's MAC key
	addr   []byte
	per    int        // the most blocks of one message
	layers int        // streaming: the layers of each block (0: not streaming)
	runs   []blockRun // runs of two blocks or more, in block order
}

// blockRun is a run of count consecutive blocks from first that lie one
// after the other in the source's memory.
type blockRun struct{ first, count int }

func appendPushStart(b []byte, st *pushStart) []byte {
	ver := byte(pushVersion)
	if st.layers > 0 {
		ver = pushStreamVersion
	}
	b = appendStartHead(b, ver, st.sizes, st.blocks)
	b = append(b, byte(st.mode))
	b = append(b, st.nonce...)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(st.addr)))
	b = append(b, st.addr...)
	b = binary.LittleEndian.AppendUint32(b, uint32(st.per))
	if st.layers > 0 {
		b = binary.LittleEndian.AppendUint16(b, uint16(st.layers))
	}
	b = binary.LittleEndian.AppendUint32(b, uint32(len(st.runs)))
	for _, r := range st.runs {
		b = binary.LittleEndian.AppendUint32(b, uint32(r.first))
		b = binary.LittleEndian.AppendUint32(b, uint32(r.count))
	}
	return b
}

// parsePushStart parses the push model's Start bytes. The runs must be
// in block order, disjoint, of two blocks or more, inside the handoff,
// and their count must fit the bytes left (checked before anything is
// allocated for them); a streaming handoff's (pushStreamVersion) layer
// count must be 1 to handoff.MaxLayers and split the block; anything
// else wraps ErrCorrupt.
func parsePushStart(b []byte) (*pushStart, error) {
	r := &reader{b: b}
	ver := byte(pushVersion)
	if len(b) > 2 && b[2] == pushStreamVersion {
		ver = pushStreamVersion
	}
	sizes, blocks, err := r.startHead(ver)
	if err != nil {
		return nil, err
	}
	s := &pushStart{sizes: sizes, blocks: blocks}
	mode := r.take(1)
	s.nonce = r.take(nonceLen)
	s.addr = r.take(r.u16())
	s.per = r.u32()
	if ver == pushStreamVersion {
		s.layers = r.u16()
	}
	nr := r.u32()
	if r.err != nil {
		return nil, r.err
	}
	if ver == pushStreamVersion {
		bb := 0
		for _, n := range s.sizes {
			bb += n
		}
		if s.layers < 1 || s.layers > handoff.MaxLayers || bb%s.layers != 0 {
			return nil, fmt.Errorf("ucx: start bytes: a stream of %d layers over blocks of %d bytes: %w", s.layers, bb, ErrCorrupt)
		}
	}
	s.mode = Integrity(mode[0])
	if len(s.addr) == 0 || s.blocks <= 0 || s.blocks > handoff.MaxBlocks || s.mode > IntegrityMAC || s.per <= 0 || s.per > handoff.MaxBlocks {
		return nil, fmt.Errorf("ucx: start bytes: %d blocks, integrity %d, address of %d bytes, messages of %d blocks: %w", s.blocks, mode[0], len(s.addr), s.per, ErrCorrupt)
	}
	if nr > len(r.b)/runBytes || len(r.b) != nr*runBytes {
		return nil, fmt.Errorf("ucx: start bytes: %d runs in %d bytes: %w", nr, len(r.b), ErrCorrupt)
	}
	if nr > 0 {
		s.runs = make([]blockRun, 0, nr)
	}
	end := 0
	for range nr {
		run := blockRun{first: r.u32(), count: r.u32()}
		if run.first < end || run.count < 2 || run.count > s.blocks-run.first {
			return nil, fmt.Errorf("ucx: start bytes: a run of %d blocks at block %d (after block %d, of %d): %w", run.count, run.first, end, s.blocks, ErrCorrupt)
		}
		end = run.first + run.count
		s.runs = append(s.runs, run)
	}
	return s, nil
}

// message is one tagged message of the push model: count blocks from
// first (its tag's index), in one buffer of count·bb bytes at addr when
// contig, else gathered or scattered with the iov entries of its pieces.
type message struct {
	first, count int
	addr         uintptr
	contig       bool
}

// adjacentSpans reports whether spans lie one after the other in memory
// of one type.
func adjacentSpans(spans []Span) bool {
	for i := 1; i < len(spans); i++ {
		if spans[i].Addr != spans[i-1].Addr+uintptr(spans[i-1].Len) || spans[i].Memory != spans[i-1].Memory {
			return false
		}
	}
	return true
}

// blockRuns returns g's runs of two blocks or more: consecutive blocks
// whose pieces, block by block, lie one after the other in memory.
func blockRuns(g *geometry) []blockRun {
	np := len(g.sizes)
	var out []blockRun
	for b := 0; b < g.blocks(); {
		n := 1
		for b+n < g.blocks() && adjacentSpans(g.spans[(b+n-1)*np:(b+n+1)*np]) {
			n++
		}
		if n >= 2 {
			out = append(out, blockRun{first: b, count: n})
		}
		b += n
	}
	return out
}

// fitRuns keeps the longest of runs that fit in room bytes of a run list
// (the Start bytes are bounded), in block order; the blocks of the runs
// left out move one message each.
func fitRuns(runs []blockRun, room int) []blockRun {
	k := max(0, room/runBytes)
	if len(runs) <= k {
		return runs
	}
	kept := slices.Clone(runs)
	slices.SortStableFunc(kept, func(a, b blockRun) int { return b.count - a.count })
	kept = kept[:k]
	slices.SortFunc(kept, func(a, b blockRun) int { return a.first - b.first })
	return kept
}

// messagesOf cuts the handoff's blocks into messages: each run into
// messages of at most per blocks, every other block one message; each
// is one buffer where its pieces in g (this side's memory) are adjacent.
func messagesOf(g *geometry, runs []blockRun, per int) []message {
	np := len(g.sizes)
	out := make([]message, 0, g.blocks()-len(runs))
	add := func(first, count int) {
		spans := g.spans[first*np : (first+count)*np]
		out = append(out, message{first: first, count: count, addr: spans[0].Addr, contig: adjacentSpans(spans)})
	}
	b := 0
	for _, r := range runs {
		for ; b < r.first; b++ {
			add(b, 1)
		}
		for ; b < r.first+r.count; b += min(per, r.first+r.count-b) {
			add(b, min(per, r.first+r.count-b))
		}
	}
	for ; b < g.blocks(); b++ {
		add(b, 1)
	}
	return out
}

// pushSend is a source job's push state. Everything is owned by the
// job's worker thread once it is polled.
type pushSend struct {
	ep     *endpoint
	salt   uint32
	g      *geometry
	msgs   []message
	iov    iovs // the pieces of every block, when a message is not one buffer
	sums   cbuf // the integrity table, sent after the last block
	summer *summer
	b      batch
	next   int // messages posted
	inline int // sends that completed at once
	tabled bool
	err    error       // a send that could not be posted
	stream *streamSend // a streaming handoff's state (stream.go), or nil
}

// units is how many sends the job's blocks take: its messages, or
// streaming its parts.
func (p *pushSend) units() int {
	if p.stream != nil {
		return len(p.stream.parts)
	}
	return len(p.msgs)
}

func (p *pushSend) free() {
	if p.stream != nil {
		p.stream.end()
	}
	p.iov.free()
	p.iov = iovs{}
	if p.sums.p != nil {
		p.sums.free()
		p.sums = cbuf{}
	}
	if p.b.b != nil {
		p.b.free()
		p.b = batch{}
	}
}

// needIov reports whether a message of msgs is not one buffer.
func needIov(msgs []message) bool {
	return slices.ContainsFunc(msgs, func(m message) bool { return !m.contig })
}

// sendPush is Send in the push model: it connects to the destination's
// worker, attaches the transfer and sends the blocks (a message per run
// of blocks adjacent in memory, one per other block) from the worker's
// thread. The transfer resolves as in the pull model: on Finish or a
// cancel, after the revocation (the handoff's endpoint closed, its
// worker destroyed: nothing of UCX reads the regions any more).
//
// Streaming (SendStream: ready not nil), the Start bytes say so and the
// worker sends each (message, layer) once ready marks it (stream.go).
func (s *Sender[R]) sendPush(id handoff.PlaneID, regions []R, accept []byte, attach func(*kvlease.Transfer) error, ready *handoff.Ready) ([]byte, error) {
	acc, err := parsePushAccept(accept)
	if err != nil {
		return nil, err
	}
	blocks := acc.blocks
	if blocks != len(regions) {
		return nil, fmt.Errorf("ucx: send: accept for %d blocks, %d regions: %w", blocks, len(regions), ErrCorrupt)
	}
	j, err := s.enroll(id, &pushSend{salt: acc.salt})
	if err != nil {
		return nil, err
	}
	fail := func(err error) ([]byte, error) {
		j.teardown()
		s.unenroll(id)
		return nil, err
	}
	p := j.push
	if p.g, err = locate(s.pieces, regions, &j.pin); err != nil {
		return fail(err)
	}
	if _, err := registrations(p.g.spans); err != nil {
		return fail(err) // overlapping pieces
	}
	var nonce [nonceLen]byte
	if _, err := rand.Read(nonce[:]); err != nil {
		return fail(fmt.Errorf("ucx: send: %w", err))
	}
	key, err := s.keys.derive(id, keyContext(id.Handoff, nonce[:], acc.salt))
	if err != nil {
		return fail(fmt.Errorf("ucx: send: block key: %w", err))
	}
	mode := integrityFor(key, p.g.spans)
	if err := checkIntegrity(key, mode, p.g.spans); err != nil {
		return fail(fmt.Errorf("ucx: send: %w", err))
	}
	units := p.g.sizes
	if ready != nil {
		units = layerUnits(p.g.bb, ready.Layers())
	}
	if p.summer, err = newSummer(mode, key, units); err != nil {
		return fail(err)
	}
	if j.c, err = s.connection(id, acc.addr); err != nil {
		return fail(err)
	}
	j.w, p.ep = j.c.w, j.c.ep
	st := &pushStart{sizes: p.g.sizes, blocks: blocks, mode: mode, nonce: nonce[:], addr: j.c.own,
		per: max(1, min(s.cfg.MaxGet, acc.maxMsg)/p.g.bb)}
	if ready != nil {
		st.layers = ready.Layers()
	}
	start := appendPushStart(nil, st)
	if len(start) > handoff.MaxPlane {
		return fail(fmt.Errorf("ucx: start bytes %d exceed %d: %w", len(start), handoff.MaxPlane, kvlease.ErrExceedsCapacity))
	}
	if st.per > 1 {
		// The runs the Start bytes hold (the longest, if not all fit).
		st.runs = fitRuns(blockRuns(p.g), handoff.MaxPlane-len(start))
		start = appendPushStart(start[:0], st)
	}
	p.msgs = messagesOf(p.g, st.runs, st.per)
	if ready != nil {
		if err := p.startStream(*ready); err != nil {
			return fail(err)
		}
	} else if needIov(p.msgs) {
		p.iov = newIovs(p.g.spans)
	}
	if n := mode.sumLen(); n > 0 {
		p.sums = newCbuf(n * blocks)
	}
	p.b = newBatch()
	if err := s.attachJob(j, id, attach, mode == IntegrityMAC); err != nil {
		return nil, err
	}
	if !j.w.do(func() { j.w.pollers = append(j.w.pollers, j.pushStep) }) {
		go j.revoke(fmt.Errorf("ucx: send: %w: %w", errWorkerGone, ErrRevoked))
	} else if p.stream != nil {
		go j.waitProgress(p.stream, j.w)
	}
	return start, nil
}

// connection checks out an idle connection of id's session to the
// destination worker at addr, or makes one: an endpoint to addr and a
// flush of it (the handshake completes before anything is attached),
// from an idle worker of the session whose endpoint goes elsewhere (its
// old endpoint closed), else from a worker of its own. An idle
// connection whose endpoint failed is destroyed (Stats.Broken) and
// replaced.
func (s *Sender[R]) connection(id handoff.PlaneID, addr []byte) (*conn, error) {
	k := keyOf(id)
	for range 2 * max(s.cfg.MaxIdle, 1) { // bounded: at most the idle ones
		c := s.pool.take(k, func(c *conn) bool { return c.peer == string(addr) })
		if c == nil {
			break
		}
		if c.healthy() {
			s.stats.add(func(st *Stats) { st.Reuses++ })
			return c, nil
		}
		c.destroy()
		s.stats.add(func(st *Stats) { st.Broken++ })
	}
	// The destinations's workers and ours are evicted independently: a
	// worker of ours may be idle with an endpoint to one the destination
	// no longer names. Connect it to this one instead.
	if c := s.pool.take(k, nil); c != nil {
		var err error
		if cerr := c.w.call(func() {
			if c.ep != nil {
				_ = c.w.closeEP(c.ep, true)
				c.ep, c.peer = nil, ""
			}
			if c.ep, err = c.w.connect(addr); err != nil {
				return
			}
			c.peer = string(addr)
			err = c.w.flushWait(c.ep, s.cfg.ConnectSpins)
		}); cerr != nil {
			err = cerr
		}
		if err == nil {
			s.stats.add(func(st *Stats) { st.Connects++ })
			return c, nil
		}
		c.destroy()
	}
	w, err := s.ctx.newWorker()
	if err != nil {
		return nil, err
	}
	c := &conn{w: w, peer: string(addr)}
	s.stats.add(func(st *Stats) { st.Workers++ })
	if cerr := w.call(func() {
		if c.own, err = w.address(); err != nil {
			return
		}
		if c.ep, err = w.connect(addr); err != nil {
			return
		}
		err = w.flushWait(c.ep, s.cfg.ConnectSpins)
	}); cerr != nil {
		err = cerr
	}
	if err != nil {
		c.destroy()
		return nil, err
	}
	s.stats.add(func(st *Stats) { st.Connects++ })
	return c, nil
}

// release ends a handoff whose destination reported done without error:
// once every send the job posted has completed (UCX is done with the
// regions: that is the evidence), its connection goes back to the idle
// pool and the transfer resolves nil. Sends that do not complete within
// settleTimeout, or a connection that failed meanwhile, make it a
// revocation instead (the connection is destroyed, then the transfer
// resolves nil: the destination's done stands).
func (j *sendJob[R]) release() {
	j.once.Do(func() {
		if j.sent.Load() || j.quiesced() {
			j.push.free()
			j.pin.Unpin()
			j.s.pool.put(keyOf(j.id), j.c)
		} else {
			j.teardown()
		}
		j.s.mu.Lock()
		delete(j.s.jobs, j.id)
		j.s.mu.Unlock()
		j.s.stats.add(func(st *Stats) { st.Completed++ })
		j.t.Resolve(nil)
		j.s.wg.Done()
	})
}

// quiesced waits, on the worker's thread, until every message and the
// sums table are posted and every posted send completed; false if the
// endpoint failed, a send could not be posted, or settleTimeout passed.
func (j *sendJob[R]) quiesced() bool {
	done := make(chan bool, 1)
	deadline := time.Now().Add(settleTimeout)
	p := j.push
	check := func() bool {
		switch {
		case p.ep.failed() != nil || p.err != nil:
			done <- false
		case p.next == p.units() && (p.sums.p == nil || p.tabled) && p.inline+p.b.completed() == p.posted():
			done <- true
		case time.Now().After(deadline):
			done <- false
		default:
			return false
		}
		return true
	}
	if !j.w.do(func() {
		if !check() {
			j.w.pollers = append(j.w.pollers, check)
		}
	}) {
		return false
	}
	return <-done
}

// posted is how many sends the job posted: its messages and the table.
func (p *pushSend) posted() int {
	if p.tabled {
		return p.next + 1
	}
	return p.next
}

// pushStep posts the job's messages, at most Window outstanding, then
// the integrity table; true once everything is posted (or posting
// failed). The source's evidence does not come from the sends'
// completions but from Finish or a cancel (the revocation), as in the
// pull model. Worker thread only.
func (j *sendJob[R]) pushStep() bool {
	p := j.push
	if p.ep == nil || p.ep.failed() != nil {
		return true
	}
	var posted int
	if p.stream != nil {
		posted = j.postParts()
	} else {
		posted = j.postMessages()
	}
	if posted > 0 {
		j.s.stats.add(func(st *Stats) { st.Messages += posted })
	}
	if p.err != nil || j.halt.Load() {
		return true
	}
	if p.next < p.units() {
		return false
	}
	if p.sums.p != nil && !p.tabled {
		p.tabled = true
		if done, err := p.ep.send(p.sums.addr(), p.sums.n, false, tagOf(p.salt, tableIndex), p.b); err != nil {
			p.err = err
			return true
		} else if done {
			p.inline++
		}
	}
	if p.inline+p.b.completed() < p.posted() {
		return false // until every send completed: release then needs no wait
	}
	j.sent.Store(true)
	return true
}

// postMessages posts the job's messages, at most Window outstanding, and
// returns how many it posted. Worker thread only.
func (j *sendJob[R]) postMessages() int {
	p := j.push
	np := len(p.g.sizes)
	completed := p.inline + p.b.completed()
	posted := 0
	for p.next < len(p.msgs) && p.next-completed < j.s.cfg.Window {
		m := p.msgs[p.next]
		for b := m.first; b < m.first+m.count; b++ {
			if hook := j.s.cfg.BeforeSend; hook != nil {
				hook(j.id, b)
			}
			if n := p.summer.mode.sumLen(); n > 0 {
				p.summer.sum(p.sums.bytes()[b*n:(b+1)*n], b, p.g.spans[b*np:(b+1)*np])
			}
		}
		if j.halt.Load() {
			break // revoked: nothing more is posted
		}
		var done bool
		var err error
		tag := tagOf(p.salt, uint32(m.first))
		if m.contig {
			done, err = p.ep.send(m.addr, m.count*p.g.bb, false, tag, p.b)
		} else {
			done, err = p.ep.send(p.iov.at(m.first*np), m.count*np, true, tag, p.b)
		}
		if err != nil {
			p.err = err
			break
		}
		p.next++
		posted++
		if done {
			p.inline++
			completed++
		}
	}
	return posted
}

// pushRecv is a destination job's push state.
type pushRecv struct {
	prep   *prepared
	g      *geometry
	msgs   []message
	iov    iovs
	rv     recvs // one per message, then the integrity table's
	sums   cbuf
	mode   Integrity
	summer *summer
	tabled bool   // the table's receive is posted
	layers int    // streaming: the layers of each block (0: not streaming)
	parts  []part // streaming: message i's layer l is parts[i*layers+l]
	cancel bool   // outstanding receives were asked to cancel
	epErr  error  // streaming: the source's endpoint failed (stopGrace)
	utags  []byte // streaming, keyed: each (block, layer)'s GMAC (unitTags), or nil
	summed int    // streaming: parts [0, summed) have their unit tags
	stray  bool   // at the end, a message no receive asked for waited in the worker
}

func (p *pushRecv) free() {
	p.iov.free()
	p.iov = iovs{}
	p.rv.free()
	p.rv = recvs{}
	if p.sums.p != nil {
		p.sums.free()
		p.sums = cbuf{}
	}
}

// receivePush is Receive in the push model: it checks the Start bytes
// against the regions, connects to the source's worker (to hear of its
// failure), attaches the transfer and posts the receives from the
// handoff worker's thread.
func (r *Receiver[R]) receivePush(id handoff.PlaneID, prep *prepared, regions []R, startBytes []byte, attach func(*kvlease.Transfer) error) error {
	j := &recvJob[R]{r: r, id: id, w: prep.w, push: &pushRecv{prep: prep}}
	p := j.push
	fail := func(err error) error {
		j.teardown()
		p.free()
		return err
	}
	st, err := parsePushStart(startBytes)
	if err != nil {
		return fail(err)
	}
	if len(regions) != prep.blocks || st.blocks != prep.blocks {
		return fail(fmt.Errorf("ucx: receive: start describes %d blocks; %d prepared, %d regions: %w",
			st.blocks, prep.blocks, len(regions), ErrCorrupt))
	}
	if p.g, err = locate(r.pieces, regions, &j.pin); err != nil {
		return fail(err)
	}
	if err := matchPieces(st.sizes, p.g.sizes); err != nil {
		return fail(err)
	}
	if _, err := registrations(p.g.spans); err != nil {
		return fail(err)
	}
	if limit := max(1, r.cfg.MaxGet/p.g.bb); st.per > limit {
		return fail(fmt.Errorf("ucx: receive: the source sends up to %d blocks per message, this destination takes %d: %w", st.per, limit, ErrCorrupt))
	}
	key, err := r.keys.derive(id, keyContext(id.Handoff, st.nonce, prep.salt))
	if err != nil {
		return fail(fmt.Errorf("ucx: receive: block key: %w", err))
	}
	if err := checkIntegrity(key, st.mode, p.g.spans); err != nil {
		return fail(fmt.Errorf("ucx: receive: %w", err))
	}
	p.mode = st.mode
	if st.mode != IntegrityNone && !allHost(p.g.spans) {
		p.mode = IntegrityNone // device memory, insecure: the CPU cannot check it
	}
	units := st.sizes
	if st.layers > 0 {
		units = layerUnits(p.g.bb, st.layers)
	}
	if p.summer, err = newSummer(p.mode, key, units); err != nil {
		return fail(err)
	}
	// The endpoint only carries the source's failure to us (peer error
	// handling): nothing waits for its handshake, so a source that
	// stalls does not stall the destination's Receive. (If the
	// handshake never completes, teardown's bounded flush abandons the
	// worker rather than destroy it; see Limits in the package doc.)
	c := prep.c
	var connected, broken bool
	if c.ep != nil && c.peer == string(st.addr) && c.healthy() {
		j.ep = c.ep // the source's worker of the last handoff: reused
	} else if cerr := j.w.call(func() {
		broken = c.ep != nil && c.peer == string(st.addr)
		if c.ep != nil {
			_ = j.w.closeEP(c.ep, true)
			c.ep, c.peer = nil, ""
		}
		if j.ep, err = j.w.connect(st.addr); err == nil {
			c.ep, c.peer, connected = j.ep, string(st.addr), true
		}
	}); cerr != nil {
		err = cerr
	}
	if connected || broken {
		r.stats.add(func(s *Stats) {
			if connected {
				s.Connects++
			}
			if broken {
				s.Broken++
			}
		})
	}
	if err != nil {
		return fail(err)
	}
	p.msgs = messagesOf(p.g, st.runs, st.per)
	if st.layers > 0 {
		// Streaming: a receive per (message, layer), all posted at once
		// (the source sends the parts in the order the prefill marks
		// them).
		p.layers = st.layers
		var spans []Span
		if p.parts, spans, err = planParts(p.g, p.msgs, st.layers); err != nil {
			return fail(fmt.Errorf("%w: %w", err, ErrCorrupt))
		}
		p.iov = newIovs(spans)
		p.utags = unitTags(p.mode, st.blocks, st.layers)
	} else if needIov(p.msgs) {
		p.iov = newIovs(p.g.spans)
	}
	p.rv = newRecvs(p.units() + 1)
	if n := st.mode.sumLen(); n > 0 {
		p.sums = newCbuf(n * st.blocks)
	}
	return j.launch(attach, p.mode == IntegrityMAC, j.stepPush)
}

// units is how many receives the job's blocks take: its messages, or
// streaming its parts.
func (p *pushRecv) units() int {
	if p.layers > 0 {
		return len(p.parts)
	}
	return len(p.msgs)
}

// stepPush advances a push job on its worker's thread: it posts the
// integrity table's receive, then the messages' receives (at most Window
// outstanding; streaming, every part's at once), and once every posted receive has completed (its
// message landed, or it was canceled before one matched) it checks the
// blocks and resolves. True when it is done.
func (j *recvJob[R]) stepPush() bool {
	if j.dead {
		return true
	}
	p := j.push
	if err := j.ep.failed(); err != nil && p.layers == 0 {
		go j.finish(fmt.Errorf("%w: %w", err, ErrRevoked), true)
		return true
	} else if err != nil && p.epErr == nil {
		// Streaming: the source's worker is gone (its abort revoked it,
		// or it died). Stop as on a cancel; once every receive is done,
		// give the abort, which travels on the control connection and
		// may come second, a grace (streamStopGrace) to arrive.
		p.epErr = err
	}
	msgs := p.units()
	np := len(p.g.sizes)
	window := j.r.cfg.Window
	if p.layers > 0 {
		window = msgs
	}
	if !p.tabled && p.sums.p != nil {
		p.tabled = true
		if err := j.w.recv(p.rv, msgs, p.sums.addr(), p.sums.n, false, tagOf(p.prep.salt, tableIndex)); err != nil {
			j.postErr = err
		}
	}
	table := 0
	if p.tabled {
		table = 1
	}
	completed := p.rv.b.completed()
	stopping := j.canceled.Load() || j.postErr != nil || p.rv.b.failedN() > 0 || p.epErr != nil
	for !stopping && j.next < msgs && j.next+table-completed < window+table {
		if p.layers > 0 {
			stopping = j.postPart()
			completed = p.rv.b.completed()
			continue
		}
		m := p.msgs[j.next]
		if hook := j.r.cfg.BeforeGet; hook != nil {
			for b := m.first; b < m.first+m.count && !stopping; b++ {
				hook(j.id, b)
				stopping = j.canceled.Load()
			}
			if stopping {
				break
			}
		}
		var err error
		tag := tagOf(p.prep.salt, uint32(m.first))
		if m.contig {
			err = j.w.recv(p.rv, j.next, m.addr, m.count*p.g.bb, false, tag)
		} else {
			err = j.w.recv(p.rv, j.next, p.iov.at(m.first*np), m.count*np, true, tag)
		}
		j.next++ // posted, or failed at once (counted as completed)
		if err != nil {
			j.postErr = err
			stopping = true
		}
		completed = p.rv.b.completed()
	}
	if stopping && !p.cancel {
		p.cancel = true
		for i := range j.next {
			j.w.cancel(p.rv, i)
		}
		if p.tabled {
			j.w.cancel(p.rv, msgs)
		}
	}
	if p.utags != nil && !stopping {
		j.sumArrived()
	}
	if p.rv.b.completed() < j.next+table {
		return false // wait for the posted receives
	}
	if !stopping && j.next < msgs {
		return false
	}
	// Every posted receive completed: UCX writes none of the regions
	// any more. Evidence; the outcome says whether every block arrived
	// intact. A worker holding a message nobody asked for (of an earlier
	// handoff, or from anyone who reached it) is not kept.
	p.stray = j.w.stray()
	if p.epErr != nil && !j.canceled.Load() {
		go j.stopGrace(p.epErr)
		return true
	}
	go j.finish(j.pushOutcome(), false)
	return true
}

// pushOutcome checks what the completed receives delivered. Worker
// thread only, once every posted receive completed.
func (j *recvJob[R]) pushOutcome() error {
	p := j.push
	blocks := p.g.blocks()
	var canceled bool
	check := func(i, want int, what string) error {
		_, n, err := p.rv.result(i)
		switch {
		case errors.Is(err, kvlease.ErrCanceled):
			canceled = true
			return nil
		case err != nil:
			return fmt.Errorf("ucx: %s: %w: %w", what, err, ErrCorrupt)
		case n != want:
			return fmt.Errorf("ucx: %s: %d bytes, want %d: %w", what, n, want, ErrCorrupt)
		}
		return nil
	}
	for i, pt := range p.parts[:min(j.next, len(p.parts))] {
		what := fmt.Sprintf("layer %d of block %d of %d", pt.layer, pt.first, blocks)
		if pt.count > 1 {
			what = fmt.Sprintf("layer %d of blocks %d to %d of %d", pt.layer, pt.first, pt.first+pt.count-1, blocks)
		}
		if err := check(i, pt.n, what); err != nil {
			return err
		}
	}
	for i, m := range p.msgs[:min(j.next, len(p.msgs))] {
		if p.layers > 0 {
			break
		}
		what := fmt.Sprintf("block %d of %d", m.first, blocks)
		if m.count > 1 {
			what = fmt.Sprintf("blocks %d to %d of %d", m.first, m.first+m.count-1, blocks)
		}
		if err := check(i, m.count*p.g.bb, what); err != nil {
			return err
		}
	}
	if p.tabled {
		if err := check(p.units(), p.sums.n, "integrity table"); err != nil {
			return err
		}
	}
	if j.postErr != nil {
		return j.postErr
	}
	if canceled || j.next < p.units() {
		return fmt.Errorf("ucx: stopped after %d of %d messages: %w", j.next, p.units(), kvlease.ErrCanceled)
	}
	if n := p.mode.sumLen(); n > 0 {
		got := make([]byte, n)
		want := p.sums.bytes()
		np := len(p.g.sizes)
		folded := p.utags != nil && p.summed == len(p.parts)
		for b := range blocks {
			if folded {
				L := p.layers
				p.summer.fold(got, p.utags[b*L*macLen:(b+1)*L*macLen], b)
			} else {
				p.summer.sum(got, b, p.g.spans[b*np:(b+1)*np])
			}
			if !hmac.Equal(got, want[b*n:(b+1)*n]) {
				return fmt.Errorf("ucx: block %d of %d fails its %v check: %w", b, blocks, p.mode, ErrCorrupt)
			}
		}
	}
	j.bytes = int64(blocks) * int64(p.g.bb)
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

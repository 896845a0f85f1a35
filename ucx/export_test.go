package ucx

import "time"

// SetLogLevel lets the external tests quiet UCX in their own process.
func SetLogLevel(level string) error { return setLogLevel(level) }

// HostileRead is a destination that does not follow the protocol, for
// the cross-process attack tests: given the Start bytes it got, it
// connects to the source's handoff worker from a context with remote
// memory access of its own and asks for n bytes at raddr, with the
// source's own remote key when the Start bytes carry one (pull) or one it
// packed itself (push: there is none to take). It returns what landed
// and whether the get completed without error.
func HostileRead(start []byte, raddr uint64, n int) ([]byte, bool, error) {
	var addr, key []byte
	if pst, err := parsePushStart(start); err == nil {
		addr = pst.addr
	} else if st, err := parseStart(start); err == nil && st.table != nil {
		regs, _, err := parseTable(st.table, st.blocks, st.sizes)
		if err != nil {
			return nil, false, err
		}
		addr, key = st.addr, regs[0].key
	} else {
		return nil, false, err
	}
	ctx, err := newContext(true)
	if err != nil {
		return nil, false, err
	}
	w, err := ctx.newWorker()
	if err != nil {
		return nil, false, err
	}
	var ep *endpoint
	defer w.destroy(func() {
		if ep != nil {
			_ = w.closeEP(ep, true)
		}
		w.settle()
	})
	if key == nil {
		own := newCbuf(64)
		m, err := ctx.memMap(own.addr(), own.n, false)
		if err != nil {
			return nil, false, err
		}
		if key, err = ctx.rkeyPack(m); err != nil {
			return nil, false, err
		}
	}
	buf := newCbuf(n) // stays allocated: a get that never completes may still target it
	clear(buf.bytes())
	var ok bool
	if cerr := w.call(func() {
		if ep, err = w.connect(addr); err != nil {
			return
		}
		if err = w.flushWait(ep, 1_000_000); err != nil {
			return
		}
		k, kerr := ep.unpack(key)
		if kerr != nil {
			err = kerr
			return
		}
		done, gerr := w.getWait(ep, buf, raddr, k, 300_000)
		ok = done && gerr == nil
	}); cerr != nil {
		return nil, false, cerr
	}
	if err != nil {
		return nil, false, err
	}
	return append([]byte(nil), buf.bytes()...), ok, nil
}

// ForgeSessionKeys makes s derive its block keys from secret instead of
// its sessions: a source whose blocks nobody in the session vouches for
// (the blocks of another session, or of someone without the key).
func ForgeSessionKeys[R any](s *Sender[R], secret []byte) { s.keys = keyed(secret) }

// TagRoundTrip returns a measurer of the round trip of one 64-byte
// tagged message between two workers of a push context (UCX_TLS as the
// environment says), and a function that releases them.
func TagRoundTrip() (func() (time.Duration, error), func(), error) { return tagRoundTrip() }

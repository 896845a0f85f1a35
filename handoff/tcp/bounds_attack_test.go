//go:build unix

package tcp_test

// The attack suite's second part: what a peer can hold. An outsider
// holding connections to the control and data ports before they prove
// anything (redialling each one the victim closes), from one address or
// from several; a key holder whose sessions propose half the pool each
// and never start; a key holder that opens 2,000 idle sessions. Each
// case measures an honest client beside the attack: how many of its
// handoffs were served, and how fast (logged, never asserted on time).

import (
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/tcp"
)

// hogAuth is the key of the victim's second identity, "psk:hog": a key
// holder that attacks.
var hogAuth = &handoff.PSK{ID: "hog", Key: []byte("the hog's key, also 32 bytes....")}

// keyring is the victim's PSK: the honest sources' key and the hog's.
func keyring() *handoff.PSK {
	return &handoff.PSK{ID: testAuth.ID, Key: testAuth.Key, Keys: map[string][]byte{hogAuth.ID: hogAuth.Key}}
}

// redialPause is how long a flooding attacker waits before it redials a
// connection the victim closed.
const redialPause = 20 * time.Millisecond

// boundsAttack plays the modes of this file; it reports whether it knew
// s.Mode.
func boundsAttack(s attackSpec, say func(string, ...any)) bool {
	env := envFor(atkBlockBytes, atkPool)
	switch s.Mode {
	case "hold-pending":
		// s.Conns connections to each of the control and data ports,
		// from the addresses in s.Local in turn, that never say a word;
		// each one the victim closes is redialled (after redialPause)
		// until "exit".
		stop := make(chan struct{})
		var wg sync.WaitGroup
		var redials atomic.Int64
		var ready sync.WaitGroup
		for _, target := range []string{s.Ctrl, s.Data} {
			for k := range s.Conns {
				d := net.Dialer{Timeout: bound, LocalAddr: &net.TCPAddr{IP: net.ParseIP(s.Local[k%len(s.Local)])}}
				wg.Add(1)
				ready.Add(1)
				go func() {
					defer wg.Done()
					first := true
					for range 100000 { // bounded; "exit" ends it first
						c, err := d.Dial("tcp", target)
						if first {
							ready.Done()
							first = false
						}
						if err == nil && !held(c, stop) {
							return
						}
						select {
						case <-stop:
							return
						case <-time.After(redialPause):
						}
						redials.Add(1)
					}
				}()
			}
		}
		ready.Wait()
		say("holding %d", 2*s.Conns)
		waitExit()
		close(stop)
		wg.Wait()
		say("result redialled %d", redials.Load())
		return true
	case "identity-hog":
		// s.Sessions sessions under the hog's key, each proposing
		// s.Blocks and never starting, re-proposing at once when its
		// handoff ends (the start timeout), after redialPause when it is
		// refused, until "exit".
		stop := make(chan struct{})
		var wg sync.WaitGroup
		var accepted, refused atomic.Int64
		var ready sync.WaitGroup
		for k := range s.Sessions {
			c, err := net.Dial("tcp", s.Ctrl)
			if err != nil {
				say("result error %v", err)
				return true
			}
			src, err := handoff.NewSource(c, neverSend{}, handoff.HalfConfig{Envelope: env, Auth: hogAuth})
			if err != nil {
				say("result refused %s", oneLine(err))
				return true
			}
			pool := attackerPool(atkPool)
			wg.Add(1)
			ready.Add(1)
			go func() {
				defer wg.Done()
				first := true
				for id := uint64(1); id < 100000; id++ { // bounded; "exit" ends it first
					l, err := pool.Acquire(fmt.Sprint("hog", k, id), s.Blocks)
					if err != nil {
						say("result error %v", err)
						return
					}
					o, err := src.Propose(id, "hog", l, nil)
					if err != nil {
						l.Release()
						return
					}
					if first { // ready once the first answer came
						for end := time.Now().Add(bound); o.State() == handoff.Proposed && time.Now().Before(end); {
							time.Sleep(time.Millisecond)
						}
						ready.Done()
						first = false
					}
					select {
					case <-o.Done():
					case <-time.After(bound):
					}
					l.Release()
					pause := time.Duration(0) // re-proposed at once after the start timeout
					if st := o.State(); st == handoff.Rejected {
						refused.Add(1)
						pause = redialPause
					} else {
						accepted.Add(1)
					}
					select {
					case <-stop:
						return
					case <-time.After(pause):
					}
				}
			}()
		}
		ready.Wait()
		say("hogging")
		waitExit()
		close(stop)
		wg.Wait()
		say("result accepted %d refused %d", accepted.Load(), refused.Load())
		return true
	case "idle-sessions":
		// s.Sessions authenticated sessions under the hog's key, opened
		// eight at a time (a line "progress" every 100 tried), held idle
		// until "exit".
		var mu sync.Mutex
		var open []*handoff.Source[[]byte]
		var refused, other atomic.Int64
		var wg sync.WaitGroup
		next := atomic.Int64{}
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					k := next.Add(1)
					if k > int64(s.Sessions) {
						return
					}
					if k%100 == 0 {
						say("progress %d", k)
					}
					c, err := net.Dial("tcp", s.Ctrl)
					if err != nil {
						other.Add(1)
						continue
					}
					src, err := handoff.NewSource(c, neverSend{}, handoff.HalfConfig{Envelope: env, Auth: hogAuth})
					switch {
					case err == nil:
						mu.Lock()
						open = append(open, src)
						mu.Unlock()
					case errors.Is(err, handoff.ErrLimit):
						refused.Add(1)
					default:
						other.Add(1)
					}
				}
			}()
		}
		wg.Wait()
		say("result opened=%d refused=%d other=%d", len(open), refused.Load(), other.Load())
		waitExit()
		for _, src := range open {
			_ = src.Close()
		}
		return true
	}
	return false
}

// held holds c, silent, until the victim closes it (true) or stop is
// closed (false); c is closed either way.
func held(c net.Conn, stop <-chan struct{}) bool {
	defer c.Close()
	buf := make([]byte, 1)
	for range 100000 { // bounded; the victim's timeouts end it first
		_ = c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		if _, err := c.Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
			return true
		}
		select {
		case <-stop:
			return false
		default:
		}
	}
	return true
}

// honestRun is an honest source's handoffs beside an attack: each on a
// fresh control session (a handshake) and a fresh data connection (a
// hello), 4 blocks, timed from the dial to Delivered.
type honestRun struct {
	served int
	took   []time.Duration
	errs   []string
}

func (r honestRun) String() string {
	if len(r.took) == 0 {
		return fmt.Sprintf("%d served, none in time: %v", r.served, r.errs)
	}
	s := slices.Clone(r.took)
	slices.Sort(s)
	return fmt.Sprintf("%d served, median %v, slowest %v; refused: %v", r.served, s[len(s)/2], s[len(s)-1], r.errs)
}

func honestHandoffs(t *testing.T, v *victim, first uint64, n, blocks int) honestRun {
	t.Helper()
	var r honestRun
	pool := hostPool2(t, atkPool, atkBlockBytes)
	for id := first; id < first+uint64(n); id++ {
		start := time.Now()
		err := func() error {
			c, err := net.Dial("tcp", v.ctl.Addr().String())
			if err != nil {
				return err
			}
			sender := tcp.NewSender(tcp.Config{MaxIdleConns: -1})
			defer sender.Close()
			src, err := handoff.NewSource(c, sender, handoff.HalfConfig{Envelope: envFor(atkBlockBytes, atkPool), Auth: testAuth, Deadline: bound})
			if err != nil {
				return err
			}
			defer src.Close()
			l, err := pool.Acquire(fmt.Sprint("r", id), blocks)
			if err != nil {
				return err
			}
			defer l.Release()
			if err := stampLease(l, byte(id)); err != nil {
				return err
			}
			o, err := src.Propose(id, fmt.Sprint("seed=", id), l, nil)
			if err != nil {
				return err
			}
			if st := o.Wait(bound); st != handoff.Delivered {
				return fmt.Errorf("%v: %v", st, o.Err())
			}
			return nil
		}()
		if err != nil {
			r.errs = append(r.errs, oneLine(err))
			continue
		}
		r.took = append(r.took, time.Since(start))
		r.served++
		v.checkDelivered(id)
	}
	return r
}

// TestAttackHoldPending: an outsider holds connections to each of the
// control port (never a handshake) and the data port (never a hello),
// redialling each one the victim closes: 80 from one address, then 128
// from eight (more than the total caps, 64). Honest handoffs from another
// address, each on a fresh session and data connection, are all served:
// the per-host caps keep one address to 16 pending, and at the total cap
// the busiest address's oldest gives way. Before the per-address bounds:
// 0 of 3.
func TestAttackHoldPending(t *testing.T) {
	for _, tc := range []struct {
		name  string
		conns int
		local []string
	}{
		{"one address", 80, []string{"127.0.0.2"}},
		{"eight addresses", 128, []string{"127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6", "127.0.0.7", "127.0.0.8", "127.0.0.9"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := newVictim(t, victimOpts{})
			a := startAttacker(t, attackSpec{Mode: "hold-pending", Ctrl: v.ctl.Addr().String(), Data: v.data, Conns: tc.conns, Local: tc.local})
			a.expect("holding")
			// The flood is on both ports: the victim has closed some.
			waitStats(t, "control port", v.dst.Stats, func(s handoff.HalfStats) bool { return s.Busy > 0 })
			waitStats(t, "data port", v.recv.Stats, func(s handoff.PlaneStats) bool { return s.RefusedBusy > 0 })
			r := honestHandoffs(t, v, 1, 3, 4)
			t.Logf("honest source beside the flood from %d address(es): %v (control port busy %d, data port busy %d)",
				len(tc.local), r, v.dst.Stats().Busy, v.recv.Stats().RefusedBusy)
			if r.served != 3 {
				t.Fatalf("honest handoffs: %v", r)
			}
			a.do("exit")
			a.expect("result redialled")
			v.untouched()
		})
	}
}

// TestAttackIdentityHog: the hog. One key holder, three
// sessions, each proposing half the pool and never starting,
// re-proposing at each start timeout. Its identity holds half the pool
// at most (the other sessions' proposals are refused, counted), and an
// honest source under another key is served beside it. Before the
// per-identity caps: the hog held 64 of 64 blocks and 0 honest handoffs
// got through.
func TestAttackIdentityHog(t *testing.T) {
	v := newVictim(t, victimOpts{auth: keyring(), startTimeout: 200 * time.Millisecond})
	a := startAttacker(t, attackSpec{Mode: "identity-hog", Ctrl: v.ctl.Addr().String(), Sessions: 3, Blocks: atkPool / 2})
	a.expect("hogging") // each of its sessions has had its first answer
	r := honestHandoffs(t, v, 1, 3, atkPool/4)
	st := v.dst.Stats()
	t.Logf("honest source beside the hog: %v (victim: %d proposals refused by the hog's identity cap, %d start timeouts)", r, st.IdentityRefused, st.StartTimeouts)
	if r.served != 3 || st.IdentityRefused == 0 {
		t.Fatalf("honest handoffs: %v; victim %+v", r, st)
	}
	a.do("exit")
	f := a.expect("result accepted")
	t.Logf("the hog: %s", strings.Join(f[1:], " "))
	v.untouched()
}

// TestAttackIdleSessions: one key holder opens 2,000 authenticated
// sessions and holds them idle. The victim admits DefaultIdentitySessions
// of them and refuses the rest at the end of their handshakes (counted;
// the attacker's NewSource fails with ErrLimit); an honest source under
// another key is served beside them; and with an idle timeout, the idle
// sessions are closed. Before: all 2,000 held (+2,000 goroutines).
func TestAttackIdleSessions(t *testing.T) {
	t.Run("2000 sessions", func(t *testing.T) {
		v := newVictim(t, victimOpts{auth: keyring(), sessionIdle: -1})
		g0 := runtime.NumGoroutine()
		const n = 2000
		a := startAttacker(t, attackSpec{Mode: "idle-sessions", Ctrl: v.ctl.Addr().String(), Sessions: n})
		for range n / 100 { // each within bound, however slow the machine
			a.expect("progress")
		}
		f := fields(a.expect("result opened")[1:])
		opened := atoiField(t, f, "opened")
		refused := atoiField(t, f, "refused")
		st := waitStats(t, "victim", v.dst.Stats, func(s handoff.HalfStats) bool { return s.Sessions+s.SessionsRefused >= n })
		grown := runtime.NumGoroutine() - g0
		r := honestHandoffs(t, v, 1, 3, 4)
		t.Logf("%d sessions tried: %d opened, %d refused (victim: %d sessions, %d refused, +%d goroutines); honest source beside them: %v",
			n, opened, refused, st.Sessions, st.SessionsRefused, grown, r)
		if opened != handoff.DefaultIdentitySessions || refused != n-handoff.DefaultIdentitySessions ||
			st.Sessions != handoff.DefaultIdentitySessions || st.SessionsRefused != n-handoff.DefaultIdentitySessions {
			t.Errorf("want %d sessions admitted and %d refused", handoff.DefaultIdentitySessions, n-handoff.DefaultIdentitySessions)
		}
		if r.served != 3 {
			t.Errorf("honest handoffs: %v", r)
		}
		a.do("exit")
		v.untouched()
	})
	t.Run("idle timeout", func(t *testing.T) {
		v := newVictim(t, victimOpts{auth: keyring(), sessionIdle: 300 * time.Millisecond})
		const n = 64
		a := startAttacker(t, attackSpec{Mode: "idle-sessions", Ctrl: v.ctl.Addr().String(), Sessions: n})
		f := fields(a.expect("result opened")[1:])
		if opened := atoiField(t, f, "opened"); opened != n {
			t.Fatalf("attacker: %v", f)
		}
		waitStats(t, "victim", v.dst.Stats, func(s handoff.HalfStats) bool { return s.IdleClosed == n })
		a.do("exit")
		v.untouched()
	})
}

func atoiField(t *testing.T, f map[string]string, k string) int {
	t.Helper()
	var n int
	if _, err := fmt.Sscan(f[k], &n); err != nil {
		t.Fatalf("%s in %v: %v", k, f, err)
	}
	return n
}

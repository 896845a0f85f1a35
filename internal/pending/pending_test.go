package pending

import (
	"net"
	"testing"
)

// closer counts its closes.
type closer struct{ closed int }

func (c *closer) Close() error { c.closed++; return nil }

func ip(s string) net.Addr { return &net.TCPAddr{IP: net.ParseIP(s), Port: 4000} }

// TestRule walks the admission rule: the per-address cap refuses, the
// total cap makes the busiest address's oldest give way, and an address
// that is (one of) the busiest is refused at the total cap.
func TestRule(t *testing.T) {
	s := New(4, 2)
	var cs [8]closer
	a1, _ := s.Admit(ip("10.0.0.1"), &cs[0])
	a2, _ := s.Admit(ip("10.0.0.1"), &cs[1])
	if a1 == nil || a2 == nil {
		t.Fatal("first two refused")
	}
	if a3, _ := s.Admit(ip("10.0.0.1"), &cs[2]); a3 != nil {
		t.Fatal("a third from one address admitted past its cap")
	}
	b1, _ := s.Admit(ip("10.0.0.2"), &cs[3])
	c1, _ := s.Admit(ip("10.0.0.3"), &cs[4])
	if b1 == nil || c1 == nil || s.Len() != 4 {
		t.Fatalf("others refused below the total: %d pending", s.Len())
	}
	// Full. 10.0.0.2 holds 1, the busiest (10.0.0.1) 2: its oldest gives way.
	b2, gave := s.Admit(ip("10.0.0.2"), &cs[5])
	if b2 == nil || !gave || cs[0].closed != 1 || a1.Release() || s.Len() != 4 {
		t.Fatalf("b2 %v gave %v closed %d len %d", b2, gave, cs[0].closed, s.Len())
	}
	// 10.0.0.2 holds 2 now, the busiest: one from 10.0.0.3 (1 < 2)
	// makes 10.0.0.2's oldest give way.
	c2, gave := s.Admit(ip("10.0.0.3"), &cs[6])
	if c2 == nil || !gave || cs[3].closed != 1 || b1.Release() {
		t.Fatalf("c2 %v gave %v closed %d", c2, gave, cs[3].closed)
	}
	// 10.0.0.3 holds 2: a third from it is refused at its cap.
	if d, _ := s.Admit(ip("10.0.0.3"), &cs[7]); d != nil {
		t.Fatal("admitted past the per-address cap")
	}
	if !a2.Release() || !b2.Release() || !c1.Release() || !c2.Release() || s.Len() != 0 || len(s.addrs) != 0 {
		t.Fatalf("after every release: %d pending, %d addresses", s.Len(), len(s.addrs))
	}
	if !a2.Release() {
		t.Fatal("a second release changed its answer")
	}
}

// TestKey: IPv4 by address, IPv6 by /64, others by network and string.
func TestKey(t *testing.T) {
	for _, tt := range []struct {
		a    net.Addr
		want string
	}{
		{ip("127.0.0.2"), "127.0.0.2"},
		{ip("::ffff:10.1.2.3"), "10.1.2.3"},
		{ip("2001:db8:1:2:3:4:5:6"), "2001:db8:1:2::/64"},
		{&net.UnixAddr{Name: "@x", Net: "unix"}, "unix:@x"},
		{nil, ""},
	} {
		if got := Key(tt.a); got != tt.want {
			t.Errorf("Key(%v) = %q, want %q", tt.a, got, tt.want)
		}
	}
}

// FuzzSet: any sequence of admissions from a few addresses and releases
// keeps the bounds, admits an address that holds fewer pending
// connections than the busiest, and closes exactly the connections that
// gave way.
func FuzzSet(f *testing.F) {
	f.Add([]byte{0, 0, 0, 1, 1, 2, 2, 3, 0x80, 4, 0x81, 5})
	f.Add([]byte{7, 7, 7, 7, 7, 7, 0, 1, 2, 3, 4, 5, 6})
	f.Fuzz(func(t *testing.T, ops []byte) {
		const total, per = 5, 3
		s := New(total, per)
		type conn struct {
			c    closer
			t    *Ticket
			addr int
		}
		var live []*conn // admitted, not released, not given way
		count := map[int]int{}
		for _, op := range ops {
			if op&0x80 != 0 && len(live) > 0 {
				i := int(op&0x7f) % len(live)
				c := live[i]
				live = append(live[:i], live[i+1:]...)
				count[c.addr]--
				if !c.t.Release() || c.c.closed != 0 {
					t.Fatalf("a live connection released as given way")
				}
				continue
			}
			a := int(op % 8)
			busiest := 0
			for _, n := range count {
				busiest = max(busiest, n)
			}
			c := &conn{addr: a}
			tk, gave := s.Admit(ip("10.0.0."+string(rune('1'+a))), &c.c)
			n := len(live)
			switch {
			case count[a] >= per:
				if tk != nil {
					t.Fatalf("address %d admitted with %d pending", a, count[a])
				}
			case n < total:
				if tk == nil || gave {
					t.Fatalf("refused or evicted below the total (%d)", n)
				}
			case count[a] < busiest:
				if tk == nil || !gave {
					t.Fatalf("address %d (%d pending, busiest %d) refused", a, count[a], busiest)
				}
			default:
				if tk != nil {
					t.Fatalf("address %d, among the busiest, admitted at the total", a)
				}
			}
			if gave {
				k := -1
				for i, l := range live {
					if l.c.closed == 1 {
						if k >= 0 {
							t.Fatal("two gave way")
						}
						k = i
					}
				}
				if k < 0 || count[live[k].addr] != busiest || live[k].t.Release() {
					t.Fatalf("the one that gave way: %d", k)
				}
				count[live[k].addr]--
				live = append(live[:k], live[k+1:]...)
			}
			if tk != nil {
				c.t = tk
				live = append(live, c)
				count[a]++
			}
			if s.Len() != len(live) {
				t.Fatalf("%d pending, the model %d", s.Len(), len(live))
			}
		}
	})
}

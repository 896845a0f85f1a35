package rig

import (
	"fmt"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/kvlease/kvlease"
)

// TestMain makes the test binary the child when a test starts it again.
func TestMain(m *testing.M) {
	if IsChild() {
		os.Exit(ChildMain(os.Stdin, os.Stdout, os.Stderr, echo))
	}
	os.Exit(m.Run())
}

// echo is a child: it tells the parent the key it got, answers every
// line with "heard LINE", and reports when the control connection ends.
func echo(p *Parent) (Report, error) {
	conn, err := p.Dial()
	if err != nil {
		return Report{}, err
	}
	p.Say("key %x", p.Key)
	ended := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, conn)
		close(ended)
	}()
	for {
		select {
		case cmd := <-p.Commands():
			p.Say("heard %s", cmd)
		case <-ended:
			return Report{Errors: []string{"idle"}, Decode: kvlease.Stats{Capacity: int(p.Cfg.Seed)}}, nil // the run came through
		}
	}
}

// start starts the child and takes its control connection.
func start(t *testing.T, cfg Config) (*Child, net.Conn) {
	t.Helper()
	c, err := StartChild(cfg, os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Kill)
	conn, err := c.Control()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return c, conn
}

func line(t *testing.T, c *Child) string {
	t.Helper()
	select {
	case l, ok := <-c.Lines():
		if !ok {
			t.Fatal("the child's stdout ended")
		}
		return l
	case <-time.After(30 * time.Second):
		t.Fatal("the child said nothing")
		return ""
	}
}

// The child gets the key down its pipe (none when insecure), hears what
// the parent tells it and answers, reports when its control connection
// ends, and exits 0.
func TestChildTalksAndReports(t *testing.T) {
	for _, insecure := range []bool{false, true} {
		cfg := DefaultConfig()
		cfg.Insecure = insecure
		c, conn := start(t, cfg)
		if got, want := line(t, c), fmt.Sprintf("key %x", c.Key); got != want || (c.Key == nil) != insecure {
			t.Fatalf("insecure %v: the child says %q, want %q", insecure, got, want)
		}
		c.Tell("ping %d", 7)
		if got := line(t, c); got != "heard ping 7" {
			t.Fatalf("the child says %q", got)
		}
		_ = conn.Close()
		rep, err := c.Finish(30 * time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if len(rep.Errors) != 1 || rep.Errors[0] != "idle" || rep.Decode.Capacity != int(cfg.Seed) {
			t.Fatalf("report %+v", rep)
		}
		if c.Exit() != (ChildExit{Ran: true, Exited: true, Code: 0}) {
			t.Fatalf("child: %+v", c.Exit())
		}
	}
}

// The child exits when its stdin (a pipe from the parent, closed when the
// parent dies) closes; and the parent can kill it.
func TestChildDiesWithItsParent(t *testing.T) {
	t.Run("stdin", func(t *testing.T) {
		c, _ := start(t, DefaultConfig())
		_ = c.stdin.Close()
		if _, err := c.Finish(30 * time.Second); err == nil {
			t.Fatal("a report from a child whose parent went away")
		}
		if c.Exit() != (ChildExit{Ran: true, Exited: true, Code: 3}) {
			t.Fatalf("child: %+v", c.Exit())
		}
	})
	t.Run("kill", func(t *testing.T) {
		c, _ := start(t, DefaultConfig())
		c.Kill()
		if !c.done || c.Exit().Exited || c.cmd.ProcessState == nil {
			t.Fatalf("child after kill: %+v, %v", c.Exit(), c.cmd.ProcessState)
		}
	})
}

// A child that does not report in time is killed.
func TestChildFinishTimesOut(t *testing.T) {
	c, _ := start(t, DefaultConfig())
	if _, err := c.Finish(50 * time.Millisecond); err == nil {
		t.Fatal("a report from a child still serving")
	}
	if c.Exit().Exited {
		t.Fatalf("child: %+v", c.Exit())
	}
}

func TestStartChildBadConfig(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Deadline = 0
	if _, err := StartChild(cfg, os.Stderr); err == nil {
		t.Fatal("a child with no deadline")
	}
}

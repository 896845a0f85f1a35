package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvlease/kvlease/handoff"
	"github.com/kvlease/kvlease/handoff/inproc"
)

// TestMain makes the test binary the -net run's decode process when the
// prefill side (a test) starts it again with decodeEnv set.
func TestMain(m *testing.M) {
	if spec, ok := os.LookupEnv(decodeEnv); ok {
		os.Exit(decodeMain(spec, os.Stdin, os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// TestDefaultRun runs the README's command with its fixed seed and checks
// the ledger: every request accounted for, 0 marker mismatches, 0 late
// writes, every block free or quarantined, and the mix of outcomes the
// seed was chosen for.
func TestDefaultRun(t *testing.T) {
	var out bytes.Buffer
	l, err := Run(DefaultConfig(), &out)
	if err != nil {
		t.Fatal(err)
	}
	if p := l.Problems(); len(p) > 0 {
		t.Fatalf("problems: %v\n%s", p, out.String())
	}
	if l.MarkerMismatches != 0 || l.LateWrites != 0 {
		t.Fatalf("mismatches %d, late writes %d", l.MarkerMismatches, l.LateWrites)
	}
	for _, s := range []struct {
		name                 string
		free, quar, capacity int
	}{{"prefill", l.Prefill.Free, l.Prefill.Quarantined, l.Prefill.Capacity}, {"decode", l.Decode.Free, l.Decode.Quarantined, l.Decode.Capacity}} {
		if s.free+s.quar != s.capacity {
			t.Errorf("%s pool: %d free + %d quarantined of %d", s.name, s.free, s.quar, s.capacity)
		}
	}
	// The quarantined blocks are exactly those of the handoffs still
	// quarantined, on both sides.
	if (l.Quarantined == 0) != (l.Decode.Quarantined == 0) || l.Prefill.Quarantined != l.Decode.Quarantined {
		t.Errorf("%d handoffs quarantined, %d/%d blocks", l.Quarantined, l.Prefill.Quarantined, l.Decode.Quarantined)
	}
	want := Ledger{Requests: 24, Delivered: 5, RejectedEnvelope: 4, RejectedPrefill: 2, RejectedPolicy: 2, RejectedDecode: 1,
		Failed: 1, Aborted: 7, AbortedLifted: 1, Quarantined: 2}
	got := l
	got.Prefill, got.Decode = want.Prefill, want.Decode
	if got != want {
		t.Fatalf("ledger\n got %+v\nwant %+v", got, want)
	}
	text := out.String()
	for _, s := range []string{"rejected by envelope", "rejected by prefill pool", "running-request limit", "destination acquire",
		"aborting      by frontend", "quarantined   by supervisor", "late acknowledgement", "no acknowledgement ever came",
		"failed        by transport", "delivered     by transport", "aborted       by frontend", "kvlease: canceled", "marker mismatches     0", "late writes           0"} {
		if !strings.Contains(text, s) {
			t.Errorf("output lacks %q", s)
		}
	}
}

// TestDeterministic: the same seed prints the same timeline (transfer ids
// aside: they count up through the process).
func TestDeterministic(t *testing.T) {
	ids := regexp.MustCompile(`transfer \d+`)
	var texts []string
	for range 3 {
		var out bytes.Buffer
		if _, err := Run(DefaultConfig(), &out); err != nil {
			t.Fatal(err)
		}
		texts = append(texts, ids.ReplaceAllString(out.String(), "transfer N"))
	}
	if texts[0] != texts[1] || texts[1] != texts[2] {
		t.Fatalf("same seed, different output:\n%s\n---\n%s", texts[0], texts[1])
	}
}

// TestManySeeds runs bigger bursts with harsher faults: the ledger must
// stay clean whatever the interleaving.
func TestManySeeds(t *testing.T) {
	for seed := uint64(1); seed <= 12; seed++ {
		cfg := DefaultConfig()
		cfg.Seed, cfg.Requests, cfg.Quiet = seed, 40, true
		cfg.FailRate, cfg.LostAckRate, cfg.AbortRate, cfg.EarlyAbortRate = 0.2, 0.3, 0.4, 0.1
		var out bytes.Buffer
		l, err := Run(cfg, &out)
		if err != nil {
			t.Fatal(err)
		}
		if p := l.Problems(); len(p) > 0 {
			t.Fatalf("seed %d: %v\n%s", seed, p, out.String())
		}
	}
}

// TestAuditCatchesALyingTransport makes the transport lie (it resolves a
// transfer while still copying) and checks that the ledger reports the
// writes into reclaimed memory: a clean ledger means something.
func TestAuditCatchesALyingTransport(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Quiet = true
	cfg.AbortRate, cfg.IgnoreCancelRate, cfg.FailRate, cfg.LostAckRate = 1, 1, 0, 0
	cfg.sabotage = func(w inproc.Write, s handoff.State) {
		if s == handoff.Aborting {
			w.Transfer.Resolve(nil) // "quiescent", says the transport, mid-copy
		}
	}
	var out bytes.Buffer
	l, err := Run(cfg, &out)
	if err != nil {
		t.Fatal(err)
	}
	if l.LateWrites == 0 || len(l.Problems()) == 0 {
		t.Fatalf("a lying transport went unnoticed: %+v\n%s", l, out.String())
	}
}

func TestBadConfig(t *testing.T) {
	for _, cfg := range []Config{{Requests: -1}, {AbortRate: 2}, {LateAckRate: -1}, {FailRate: 3}} {
		if _, err := Run(cfg, &bytes.Buffer{}); err == nil {
			t.Errorf("Run(%+v) succeeded", cfg)
		}
	}
	l, err := Run(Config{Seed: 1}, &bytes.Buffer{})
	if err != nil || l.Requests != 0 || len(l.Problems()) != 0 {
		t.Fatalf("empty burst: %+v %v", l, err)
	}
}

// TestNetDefaultRun runs `go run ./examples/disagg -net` end to end: the
// decode side is this test binary started again as a child process, and
// every handoff crosses 127.0.0.1. The seed's burst meets every fault; the
// ledger must be clean, the same every run, and the child must have exited
// by itself with status 0.
func TestNetDefaultRun(t *testing.T) {
	var out bytes.Buffer
	l, err := RunNet(DefaultConfig(), &out)
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if p := l.Problems(); len(p) > 0 {
		t.Fatalf("problems: %v\n%s", p, out.String())
	}
	if l.MarkerMismatches != 0 || l.LateWrites != 0 || l.Disagreements != 0 || l.ProtocolErrors != 0 {
		t.Fatalf("mismatches %d, late writes %d, disagreements %d, protocol errors %d\n%s", l.MarkerMismatches, l.LateWrites, l.Disagreements, l.ProtocolErrors, out.String())
	}
	if l.Child != (ChildExit{Ran: true, Exited: true, Code: 0}) {
		t.Fatalf("decode process: %+v", l.Child)
	}
	// What never resumed stays quarantined on the prefill side, whose
	// sender is stuck; the decode side ended its own reader at its
	// deadline, and that evidence lifted its quarantine.
	if l.Prefill.Quarantined == 0 || l.Decode.Quarantined != 0 {
		t.Errorf("%d handoffs quarantined, %d/%d blocks", l.Quarantined, l.Prefill.Quarantined, l.Decode.Quarantined)
	}
	want := Ledger{Requests: 24, Delivered: 4, RejectedEnvelope: 4, RejectedPrefill: 2, RejectedPolicy: 2, RejectedDecode: 1,
		Failed: 3, Aborted: 5, AbortedLifted: 1, Quarantined: 3, Child: l.Child, Authenticated: "psk"}
	got := l
	got.Prefill, got.Decode = want.Prefill, want.Decode
	if got != want {
		t.Fatalf("ledger\n got %+v\nwant %+v\n%s", got, want, out.String())
	}
	text := out.String()
	for _, s := range []string{
		"rejected by envelope", "rejected by prefill pool", "running-request limit", "kvlease: exhausted",
		"    prefill process", "    decode process",
		"aborted       by frontend   abort: client went away", // before the start, on the prefill side
		"aborted       by prefill    abort [told over the control connection; nothing had moved]",
		"aborting      by frontend   abort: client went away while block", // mid-transfer, on the decode side
		"aborting      by decode     abort [told over the control connection; our own evidence still decides]",
		"failed        by transport  resolve-error [proof: our sender goroutine's last read of p returned]: tcp: block",
		"data connection cut (injected fault)",
		"failed        by transport  resolve-error [proof: our receiver goroutine writing d exited]: tcp: block",
		"quarantined   by deadline   expire [no proof by the deadline: quarantined, never reused]",
		"then resumed", "never resumed",
		"[proof: our sender goroutine's last read of p returned]", "[proof: our receiver goroutine writing d exited]",
		"delivered     by transport  resolve", "block markers: after delivery and before release; 0 mismatched",
		"decode process     exit 0", "marker mismatches     0", "late writes           0",
		"authenticated psk", "the decode side ended its own reader at its deadline",
	} {
		if !strings.Contains(text, s) {
			t.Errorf("output lacks %q", s)
		}
	}
}

// TestNetManySeeds runs other bursts with harsher faults across the two
// processes: whatever the interleaving, the ledger stays clean.
func TestNetManySeeds(t *testing.T) {
	for seed := uint64(1); seed <= 3; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			t.Parallel() // each run is two processes, idle while its deadlines pass
			cfg := DefaultConfig()
			cfg.Seed, cfg.Requests, cfg.Quiet = seed, 40, true
			cfg.FailRate, cfg.LostAckRate, cfg.AbortRate, cfg.EarlyAbortRate = 0.2, 0.2, 0.4, 0.1
			var out bytes.Buffer
			l, err := RunNet(cfg, &out)
			if err != nil {
				t.Fatalf("%v\n%s", err, out.String())
			}
			if p := l.Problems(); len(p) > 0 || l.Requests != 40 {
				t.Fatalf("%v\n%s", p, out.String())
			}
		})
	}
}

// TestNetAuditCatchesALyingTransport makes the decode process's transport
// lie (it resolves an aborting transfer while still receiving) and checks
// that the ledger reports the writes into reclaimed memory.
func TestNetAuditCatchesALyingTransport(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Quiet, cfg.lie = true, true
	cfg.AbortRate, cfg.EarlyAbortRate, cfg.FailRate, cfg.LostAckRate = 1, 0, 0, 0
	var out bytes.Buffer
	l, err := RunNet(cfg, &out)
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if l.LateWrites == 0 || len(l.Problems()) == 0 {
		t.Fatalf("a lying transport went unnoticed: %+v\n%s", l, out.String())
	}
}

func TestNetBadConfig(t *testing.T) {
	for _, cfg := range []Config{{Requests: -1, Deadline: time.Second}, {FailRate: 3, Deadline: time.Second}, {}} {
		if _, err := RunNet(cfg, &bytes.Buffer{}); err == nil {
			t.Errorf("RunNet(%+v) succeeded", cfg)
		}
	}
}

// startChild starts the decode process the way RunNet does and takes its
// control connection.
func startChild(t *testing.T) (*decodeProc, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	spec := decodeSpec{Ctl: ln.Addr().String(), Token: []byte("0123456789abcdef"), Cfg: DefaultConfig()}
	key, err := handoff.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	child, err := startDecode(spec, key, os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(child.kill)
	conn, err := acceptChild(ln.(*net.TCPListener), spec.Token)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return child, conn
}

// reap waits (bounded) for the child to exit by itself and returns its
// stdout.
func reap(t *testing.T, child *decodeProc) []byte {
	t.Helper()
	done := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(child.stdout)
		done <- b
	}()
	select {
	case b := <-done:
		_ = child.reap()
		return b
	case <-time.After(60 * time.Second):
		t.Fatal("the decode process did not exit")
		return nil
	}
}

// TestNetChildDiesWithItsParent: the decode process exits when its stdin
// (a pipe from the prefill process, closed when that one dies) closes,
// and when its control connection ends; and the prefill side can kill it.
func TestNetChildDiesWithItsParent(t *testing.T) {
	t.Run("stdin", func(t *testing.T) {
		child, _ := startChild(t)
		_ = child.stdin.Close()
		reap(t, child)
		if child.exit != (ChildExit{Ran: true, Exited: true, Code: 3}) {
			t.Fatalf("decode process: %+v", child.exit)
		}
	})
	t.Run("control", func(t *testing.T) {
		child, conn := startChild(t)
		_ = conn.Close()
		b := reap(t, child)
		if child.exit != (ChildExit{Ran: true, Exited: true, Code: 0}) {
			t.Fatalf("decode process: %+v", child.exit)
		}
		var rep decodeReport
		if err := json.Unmarshal(b, &rep); err != nil {
			t.Fatalf("report %q: %v", b, err)
		}
		if len(rep.Handoffs) != 0 || rep.Decode.Free != decodeBlocks || len(rep.Errors) != 0 {
			t.Fatalf("report of an idle decode process: %+v", rep)
		}
	})
	t.Run("kill", func(t *testing.T) {
		child, _ := startChild(t)
		child.kill()
		if !child.done || child.exit.Exited || child.cmd.ProcessState == nil {
			t.Fatalf("decode process after kill: %+v, %v", child.exit, child.cmd.ProcessState)
		}
	})
}

// TestNetInsecure: -insecure runs the halves unauthenticated, and the
// ledger says so; the default run is authenticated (TestNetDefaultRun).
func TestNetInsecure(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Insecure, cfg.Quiet = true, true
	var out bytes.Buffer
	l, err := RunNet(cfg, &out)
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if p := l.Problems(); len(p) > 0 || l.Authenticated != "none" || !strings.Contains(out.String(), "\n  authenticated none") {
		t.Fatalf("problems %v, authenticated %q\n%s", p, l.Authenticated, out.String())
	}
}

// TestStreamRun runs -net -stream: every admitted request is delivered
// both ways, every layer of every block arrives with its marker, no late
// writes, nothing leaked, and the timelines are printed; a layer never
// arrives before it was written, and a streaming handoff's first layer
// arrives while the prefill still computes (before its last layer is
// written: 70 ms of compute later), where the other's arrives after.
func TestStreamRun(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Requests, cfg.LayerDelay = 5, 10*time.Millisecond
	var out bytes.Buffer
	admitted := 0
	l, err := runStream(cfg, &out, os.Stderr, func(r *request, st, aft *streamRun) {
		admitted++
		for _, run := range []*streamRun{st, aft} {
			if run.out.State() != handoff.Delivered || run.view == nil || len(run.view.Arrived) != streamLayers {
				t.Errorf("%s handoff %d: %v, decode view %+v", r.name, run.id, run.out.State(), run.view)
				continue
			}
			for layer, at := range run.view.Arrived {
				if arr := time.Unix(0, at); arr.Before(run.written[layer]) {
					t.Errorf("%s handoff %d: layer %d arrived at %v, before it was written at %v", r.name, run.id, layer, arr, run.written[layer])
				}
			}
		}
		if st.view != nil && len(st.view.Arrived) == streamLayers {
			if first := time.Unix(0, st.view.Arrived[0]); !first.Before(st.written[streamLayers-1]) {
				t.Errorf("%s: streaming, layer 0 arrived at %v, not before the last layer was written at %v", r.name, first, st.written[streamLayers-1])
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	if p := l.Problems(); len(p) > 0 || admitted == 0 || l.Delivered != admitted {
		t.Fatalf("problems %v, %d admitted, %d delivered\n%s", p, admitted, l.Delivered, out.String())
	}
	for _, want := range []string{"streaming: written", "from the last write to delivered: streaming", "authenticated psk", "marker mismatches     0"} {
		if !strings.Contains(out.String(), want) {
			t.Fatalf("output lacks %q:\n%s", want, out.String())
		}
	}
}

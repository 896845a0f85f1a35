// Command disagg is the teaching example of kvlease: a prefill pool and a
// decode pool in one process, a burst of synthetic requests handed from
// one to the other over a deliberately faulty in-process transport, and a
// ledger that shows nothing leaked and nothing was overwritten.
//
// Every request is admitted (or refused) against one agreed Envelope,
// prefilled into its own prefill lease, where it writes its own marker,
// then handed off in two phases: the decode side accepts (holding a lease)
// or rejects (by policy or because its pool is exhausted); only then does
// one transfer copy the blocks. The transport injects failures, lost
// acknowledgements and cancels it ignores; the front end aborts some
// requests mid-transfer. The program prints each request's ownership
// timeline (which blocks it held on each side, and the evidence for every
// transition), then the ledger. Marker mismatches and late writes (a
// transfer touching memory after it was reclaimed) must be 0.
//
// With -net the decode side is a second process, a child of this one
// (this program started again; it dies with its parent), and every handoff
// crosses 127.0.0.1: the two halves of package handoff speak the control
// protocol over one connection and blocks move over handoff/tcp data
// connections. The same burst meets the network's faults: a stream cut
// mid-transfer (-fail), a prefill sender that stalls past both sides'
// deadlines (-lost-ack) and may resume (-late-ack), clients that go away
// before the start (told to the prefill side) or mid-transfer (told to the
// decode side). Each side's history shows what proved each of its steps.
// The two processes authenticate each other with a pre-shared key the
// parent draws and hands to its child through an inherited pipe (never
// its command line or environment); the ledger says "authenticated psk".
// -insecure runs them unauthenticated ("authenticated none").
//
//	go run ./examples/disagg
//	go run ./examples/disagg -requests 200 -seed 7 -lost-ack 0.2 -quiet
//	go run ./examples/disagg -net
//	go run ./examples/disagg -net -seed 7 -requests 60 -quiet
//	go run ./examples/disagg -net -insecure
//	go run ./examples/disagg -net -stream
//
// With -net -stream every request is handed off twice, streaming (the
// handoff starts before the prefill, and each layer is sent as the
// prefill writes it) and after its prefill; its timeline prints when each
// layer was written and arrived, both ways.
//
// This directory is the in-process example: disagg.go, read top to
// bottom. The two-process runs live in internal/overtcp, on the rig
// (internal/rig) that the ucx module's example shares.
package main

import (
	"flag"
	"os"

	"github.com/kvlease/kvlease/examples/disagg/internal/overtcp"
	"github.com/kvlease/kvlease/internal/rig"
)

func main() {
	if rig.IsChild() { // the decode process of a -net run
		os.Exit(rig.ChildMain(os.Stdin, os.Stdout, os.Stderr, overtcp.ServeDecode))
	}
	cfg := DefaultConfig()
	cfg.Flags(flag.CommandLine)
	netMode := flag.Bool("net", false, "run the decode side as a child process and hand off over TCP on 127.0.0.1 (-fail cuts streams, -lost-ack stalls them)")
	flag.BoolVar(&cfg.Stream, "stream", false, "with -net: hand every request off streaming (each layer sent as the prefill writes it) and after its prefill, and print both timelines")
	flag.DurationVar(&cfg.LayerDelay, "layer-delay", cfg.LayerDelay, "-stream: the simulated compute time of one layer")
	flag.Parse()

	run := Run
	switch {
	case cfg.Stream:
		run = overtcp.RunStream // implies -net
	case *netMode:
		run = overtcp.RunNet
	}
	ledger, err := run(cfg, os.Stdout)
	os.Exit(rig.Fail("disagg", ledger, err))
}

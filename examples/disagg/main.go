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
// layer was written and arrived, both ways (stream.go).
package main

import (
	"flag"
	"fmt"
	"os"
)

func main() {
	if spec, ok := os.LookupEnv(decodeEnv); ok {
		os.Exit(decodeMain(spec, os.Stdin, os.Stdout, os.Stderr)) // the -net run's decode process
	}
	cfg := DefaultConfig()
	netMode := false
	flag.IntVar(&cfg.Requests, "requests", cfg.Requests, "requests in the burst")
	flag.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed for the requests and the transport's faults")
	flag.Float64Var(&cfg.FailRate, "fail", cfg.FailRate, "probability a transfer fails (resolves with an error; -net: its data connection is cut)")
	flag.Float64Var(&cfg.LostAckRate, "lost-ack", cfg.LostAckRate, "probability a transfer's acknowledgement is lost (-net: its sender stalls past both sides' deadlines)")
	flag.Float64Var(&cfg.LateAckRate, "late-ack", cfg.LateAckRate, "probability a lost acknowledgement arrives late, lifting the quarantine (-net: the stalled sender resumes)")
	flag.Float64Var(&cfg.IgnoreCancelRate, "ignore-cancel", cfg.IgnoreCancelRate, "probability the transport ignores a cancel (in-process only: the tcp planes honour one at the next block)")
	flag.Float64Var(&cfg.AbortRate, "abort", cfg.AbortRate, "probability the client goes away mid-transfer")
	flag.Float64Var(&cfg.EarlyAbortRate, "early-abort", cfg.EarlyAbortRate, "probability the client goes away before the transfer starts")
	flag.BoolVar(&cfg.Quiet, "quiet", cfg.Quiet, "print only the ledger")
	flag.BoolVar(&cfg.Insecure, "insecure", false, "-net: run the two halves without authentication (the ledger says \"authenticated none\")")
	flag.BoolVar(&netMode, "net", false, "run the decode side as a child process and hand off over TCP on 127.0.0.1 (-fail cuts streams, -lost-ack stalls them)")
	flag.BoolVar(&cfg.Stream, "stream", false, "with -net: hand every request off streaming (each layer sent as the prefill writes it) and after its prefill, and print both timelines")
	flag.DurationVar(&cfg.LayerDelay, "layer-delay", cfg.LayerDelay, "-stream: the simulated compute time of one layer")
	flag.DurationVar(&cfg.Deadline, "deadline", cfg.Deadline, "-net: how long the prefill side waits for a started transfer's evidence before quarantining it (decode waits half)")
	flag.Parse()

	run := Run
	switch {
	case cfg.Stream:
		run = RunStream // implies -net
	case netMode:
		run = RunNet
	}
	ledger, err := run(cfg, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "disagg:", err)
		os.Exit(1)
	}
	if problems := ledger.Problems(); len(problems) > 0 {
		for _, p := range problems {
			fmt.Fprintln(os.Stderr, "disagg: ISOLATION FAILURE:", p)
		}
		os.Exit(2)
	}
}

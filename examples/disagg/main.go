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
//	go run ./examples/disagg
//	go run ./examples/disagg -requests 200 -seed 7 -lost-ack 0.2 -quiet
package main

import (
	"flag"
	"fmt"
	"os"
)

func main() {
	cfg := DefaultConfig()
	flag.IntVar(&cfg.Requests, "requests", cfg.Requests, "requests in the burst")
	flag.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed for the requests and the transport's faults")
	flag.Float64Var(&cfg.FailRate, "fail", cfg.FailRate, "probability a transfer fails (resolves with an error)")
	flag.Float64Var(&cfg.LostAckRate, "lost-ack", cfg.LostAckRate, "probability a transfer's acknowledgement is lost")
	flag.Float64Var(&cfg.LateAckRate, "late-ack", cfg.LateAckRate, "probability a lost acknowledgement arrives late (lifting the quarantine)")
	flag.Float64Var(&cfg.IgnoreCancelRate, "ignore-cancel", cfg.IgnoreCancelRate, "probability the transport ignores a cancel")
	flag.Float64Var(&cfg.AbortRate, "abort", cfg.AbortRate, "probability the client goes away mid-transfer")
	flag.Float64Var(&cfg.EarlyAbortRate, "early-abort", cfg.EarlyAbortRate, "probability the client goes away before the transfer starts")
	flag.BoolVar(&cfg.Quiet, "quiet", cfg.Quiet, "print only the ledger")
	flag.Parse()

	ledger, err := Run(cfg, os.Stdout)
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

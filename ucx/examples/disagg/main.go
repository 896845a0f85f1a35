// Command disagg is the teaching example of kvlease over UCX: a prefill
// process and a decode process (this program re-executes itself as the
// decode side), a burst of synthetic requests handed from one to the
// other by the handoff package over the UCX data plane (package ucx,
// UCX_TLS=tcp on loopback unless UCX_TLS is set), and a ledger that shows
// nothing leaked and nothing was overwritten.
//
// Every request is admitted (or refused) against one agreed Envelope,
// prefilled into its own prefill lease, where it writes its own marker,
// then proposed to the decode process, which accepts (holding a lease)
// or rejects (by policy or because its pool is exhausted) and then
// receives the blocks, which the prefill side sends as tagged messages,
// each checked against a MAC under the session. The two processes
// authenticate each other with a pre-shared key the prefill process draws
// and hands down a pipe (-insecure: none; the ledger's "authenticated"
// line says which). Faults are real ones, injected at the decode side:
// Start bytes corrupted in transit (-fail), a reader that stalls in the
// middle of a transfer past both deadlines (-lost-ack) and may resume
// later (-late-ack), a client that goes away while its blocks are being
// read (-abort) or before (-early-abort). The program prints each
// request's ownership timeline on both sides (which blocks it held, and
// the evidence for every transition), then the ledger. Marker mismatches
// and late writes (a receive posted into a handoff whose transfer had
// already resolved, so whose blocks could be back in the pool) must be 0.
//
//	cd ucx && go run ./examples/disagg -seed 1
//	cd ucx && go run ./examples/disagg -requests 60 -seed 7 -lost-ack 0.2 -quiet
//	cd ucx && go run ./examples/disagg -seed 1 -insecure
package main

import (
	"flag"
	"os"

	"github.com/kvlease/kvlease/internal/rig"
)

func main() {
	if rig.IsChild() { // the decode process (decode.go)
		os.Exit(rig.ChildMain(os.Stdin, os.Stdout, os.Stderr, serveDecode))
	}
	cfg := DefaultConfig()
	cfg.Flags(flag.CommandLine)
	flag.Bool("net", true, "accepted for the root example's command lines: this example always runs two processes")
	flag.Parse()
	ledger, err := Run(cfg, os.Stdout)
	os.Exit(rig.Fail("disagg", ledger, err))
}

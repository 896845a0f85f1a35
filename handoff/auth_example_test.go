package handoff_test

import (
	"errors"
	"fmt"
	"net"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// nopPlane accepts proposals and never moves a block (the example stops
// at the decision).
type nopPlane struct{}

func (nopPlane) Prepare(handoff.PlaneID, int) ([]byte, error) { return []byte("-"), nil }
func (nopPlane) Receive(handoff.PlaneID, [][]byte, []byte, func(*kvlease.Transfer) error) error {
	return errors.New("example: no data plane")
}
func (nopPlane) Forget(handoff.PlaneID) {}

// The two halves authenticate each other with a pre-shared key before
// any message is acted on; the destination allowlists its prefill fleet
// by the identity the handshake proved, and refuses anyone without the
// key. A half with no authenticator at all is refused by its constructor.
func ExamplePSK() {
	env := handoff.Envelope{BlockTokens: 16, BlockBytes: 64, PoolBlocks: 16,
		MaxContextTokens: 256, MaxPrefillTokens: 256, MaxRunningRequests: 4}
	mem, _ := kvlease.NewHostMemory(16, 64)
	pool, _ := kvlease.NewPool[[]byte](mem)
	key, _ := handoff.GenerateKey() // shared out of band, never on a command line

	dst, _ := handoff.NewDestination(pool, nopPlane{}, handoff.DestinationConfig[[]byte]{
		HalfConfig: handoff.HalfConfig{Envelope: env, Auth: &handoff.PSK{
			Keys: map[string][]byte{"prefill-fleet": key}, // the ids this destination accepts
		}},
		Authorize: func(p *handoff.Peer, _ *handoff.ProposeMsg) error {
			if p.Identity != "psk:prefill-fleet" {
				return errors.New("not in the fleet")
			}
			return nil
		},
	})
	serve := func() (net.Conn, chan error) {
		a, b := net.Pipe()
		served := make(chan error, 1)
		go func() { served <- dst.Serve(b) }()
		return a, served
	}

	// A prefill worker with the key.
	conn, served := serve()
	_, err := handoff.NewSource(conn, nopSender{}, handoff.HalfConfig{Envelope: env,
		Auth: &handoff.PSK{ID: "prefill-fleet", Key: key}})
	fmt.Println("with the key:", err)
	_ = conn.Close()
	<-served

	// Anyone else.
	conn, served = serve()
	wrong, _ := handoff.GenerateKey()
	_, err = handoff.NewSource(conn, nopSender{}, handoff.HalfConfig{Envelope: env,
		Auth: &handoff.PSK{ID: "prefill-fleet", Key: wrong}})
	fmt.Println("with another key:", errors.Is(err, handoff.ErrAuth), errors.Is(<-served, handoff.ErrAuth))

	// No authenticator, and not explicitly Insecure.
	_, err = handoff.NewSource(conn, nopSender{}, handoff.HalfConfig{Envelope: env})
	fmt.Println("no authenticator:", errors.Is(err, kvlease.ErrInvalidArgument))
	fmt.Printf("%+v\n", dst.Stats())
	// Output:
	// with the key: <nil>
	// with another key: true true
	// no authenticator: true
	// {Sessions:1 AuthRefused:1 Downgrades:0 FramesRefused:0 LimitRefused:0 StartTimeouts:0 Duplicates:0 Quarantined:0 Unauthorized:0 AcceptErrors:0 Busy:0 IdentityRefused:0 SessionsRefused:0 IdleClosed:0 Crossed:0}
}

type nopSender struct{}

func (nopSender) Send(handoff.PlaneID, [][]byte, []byte, func(*kvlease.Transfer) error) ([]byte, error) {
	return nil, errors.New("example: no data plane")
}
func (nopSender) Finish(handoff.PlaneID, error) {}

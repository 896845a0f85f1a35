package events_test

import (
	"context"
	"fmt"
	"net"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/events"
)

// A pool's KV events published on a PUB socket and read back by a
// subscriber, as a router would.
func Example() {
	mem, err := kvlease.NewHostMemory(8, 1024)
	if err != nil {
		panic(err)
	}
	pool, err := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(4), kvlease.WithKVEvents(1024))
	if err != nil {
		panic(err)
	}
	// Linger is long here so that only Flush drains and the output is
	// fixed; an engine keeps the default (1ms).
	pub, err := events.NewPublisher(events.Config{Endpoint: "tcp://127.0.0.1:0", Bind: true,
		Pod: "engine-0", Model: "llama", Linger: time.Minute}, events.Source{Pool: pool})
	if err != nil {
		panic(err)
	}
	defer pub.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	if err := sub.Dial("tcp://" + pub.Addr().String()); err != nil {
		panic(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, "kv@"); err != nil {
		panic(err)
	}
	for len(pub.Subscriptions()) == 0 && ctx.Err() == nil { // PUB drops what it sends before a subscriber joins
		time.Sleep(time.Millisecond)
	}

	// Two blocks of one prompt, sealed with their tokens.
	lease, err := pool.Acquire("request-1", 2)
	if err != nil {
		panic(err)
	}
	tokens := []int32{101, 102, 103, 104, 105, 106, 107, 108}
	parent := kvlease.BlockHash(0)
	for i := range 2 {
		if parent, err = lease.SealTokens(i, parent, tokens[4*i:4*i+4]); err != nil {
			panic(err)
		}
	}
	lease.Release()
	if err := pub.Flush(ctx); err != nil {
		panic(err)
	}

	msg, err := sub.Recv()
	if err != nil {
		panic(err)
	}
	batch, err := events.DecodeBatch(msg.Frames[2])
	if err != nil {
		panic(err)
	}
	ev := batch.Events[0]
	fmt.Println(string(msg.Frames[0]), msg.Frames[1])
	fmt.Println(ev.Type, len(ev.BlockHashes), "blocks", ev.TokenIDs, "parent", ev.ParentBlockHash)
	// Output:
	// kv@engine-0@llama [0 0 0 0 0 0 0 0]
	// BlockStored 2 blocks [101 102 103 104 105 106 107 108] parent <nil>
}

// A publisher tied to a context: it binds loopback (no endpoint given:
// DefaultEndpoint, or here a free port) and stops with the context, as
// an engine's serve loop would.
func ExampleStart() {
	mem, err := kvlease.NewHostMemory(8, 1024)
	if err != nil {
		panic(err)
	}
	pool, err := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(4), kvlease.WithKVEvents(1024))
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	pub, err := events.Start(ctx, events.Config{Endpoint: "tcp://127.0.0.1:0", Bind: true, Pod: "engine-0", Model: "llama"},
		events.Source{Pool: pool})
	if err != nil {
		panic(err)
	}
	fmt.Println("loopback only:", pub.Addr().(*net.TCPAddr).IP.IsLoopback())

	cancel() // the engine shuts down
	<-pub.Done()
	fmt.Println("flush after stop:", pub.Flush(context.Background()))
	// Output:
	// loopback only: true
	// flush after stop: events: publisher closed
}

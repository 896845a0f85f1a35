package events

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvlease/kvlease"
)

func tokens(seed, n int) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = int32(seed*1000 + i)
	}
	return t
}

func newPool(t *testing.T, blocks, ring int) *kvlease.Pool[[]byte] {
	t.Helper()
	mem, err := kvlease.NewHostMemory(blocks, 16)
	require.NoError(t, err)
	p, err := kvlease.NewPool[[]byte](mem, kvlease.WithBlockTokens(4), kvlease.WithKVEvents(ring))
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

// sealChain acquires n blocks and seals them as one chain of 4-token blocks.
func sealChain(t *testing.T, p *kvlease.Pool[[]byte], seed, n int) (*kvlease.Lease[[]byte], []kvlease.BlockHash) {
	t.Helper()
	l, err := p.Acquire(fmt.Sprint("r", seed), n)
	require.NoError(t, err)
	toks := tokens(seed, 4*n)
	var hs []kvlease.BlockHash
	parent := kvlease.BlockHash(seed)
	for i := range n {
		h, err := l.SealTokens(i, parent, toks[4*i:4*i+4])
		require.NoError(t, err)
		hs = append(hs, h)
		parent = h
	}
	return l, hs
}

// recorder captures what the publisher hands to its socket.
type recorder struct {
	mu    sync.Mutex
	msgs  []zmq4.Msg
	block chan struct{} // when non-nil, Send waits for it to close
}

func (r *recorder) send(seq uint64, payload []byte) {
	if r.block != nil {
		<-r.block
	}
	var sb [8]byte
	binary.BigEndian.PutUint64(sb[:], seq)
	r.mu.Lock()
	r.msgs = append(r.msgs, zmq4.NewMsgFrom([]byte("topic"), sb[:], payload))
	r.mu.Unlock()
}

func (r *recorder) batches(t *testing.T) []Batch {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Batch
	for i, m := range r.msgs {
		require.Len(t, m.Frames, 3)
		require.Equal(t, uint64(i), binary.BigEndian.Uint64(m.Frames[1]), "batches numbered from 0")
		b, err := DecodeBatch(m.Frames[2])
		require.NoError(t, err)
		out = append(out, b)
	}
	return out
}

func flatten(bs []Batch) []Event {
	var out []Event
	for _, b := range bs {
		out = append(out, b.Events...)
	}
	return out
}

func flush(t *testing.T, p *Publisher) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, p.Flush(ctx))
}

func newRecorded(t *testing.T, cfg Config, r *recorder, srcs ...Source) *Publisher {
	t.Helper()
	cfg.Endpoint = "tcp://127.0.0.1:0"
	cfg.Bind = true
	cfg.sendHook = r.send
	p, err := NewPublisher(cfg, srcs...)
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

func TestShouldBind(t *testing.T) {
	for ep, want := range map[string]bool{
		"tcp://*:5557": true, "tcp://[::]:5557": true, "ipc:///tmp/kv": true, "inproc://kv": true,
		"tcp://127.0.0.1:5557": false, "tcp://router:5557": false,
	} {
		require.Equal(t, want, ShouldBind(ep), ep)
	}
}

func TestNewPublisherRefuses(t *testing.T) {
	p := newPool(t, 2, 4)
	mem, _ := kvlease.NewHostMemory(2, 8)
	quiet, _ := kvlease.NewPool[[]byte](mem)
	for name, c := range map[string]struct {
		cfg  Config
		srcs []Source
	}{
		"bad endpoint": {Config{Endpoint: "udp://x:1"}, []Source{{Pool: p}}},
		"no port":      {Config{Endpoint: "tcp://127.0.0.1"}, []Source{{Pool: p}}},
		"inproc":       {Config{Endpoint: "inproc://kv"}, []Source{{Pool: p}}},
		"no source":    {Config{Endpoint: "tcp://127.0.0.1:0", Bind: true}, nil},
		"no events":    {Config{Endpoint: "tcp://127.0.0.1:0", Bind: true}, []Source{{Pool: quiet}}},
		"negative":     {Config{Endpoint: "tcp://127.0.0.1:0", Bind: true, Queue: -1}, []Source{{Pool: p}}},
		"encoding":     {Config{Endpoint: "tcp://127.0.0.1:0", Bind: true, Encoding: 7}, []Source{{Pool: p}}},
	} {
		_, err := NewPublisher(c.cfg, c.srcs...)
		require.ErrorIs(t, err, ErrInvalidConfig, name)
	}
}

// A chain sealed block by block goes out as one BlockStored with every
// hash, no parent, all tokens; eviction as one BlockRemoved; Seal without
// tokens is counted, not sent.
func TestPublisherStoredRemovedMerged(t *testing.T) {
	for _, enc := range []Encoding{MapEncoding, ArrayEncoding} {
		t.Run(enc.String(), func(t *testing.T) {
			pool := newPool(t, 4, 64)
			var r recorder
			l, hs := sealChain(t, pool, 1, 3) // before the publisher drains: one drain sees all three
			pub := newRecorded(t, Config{Pod: "pod-a", Model: "m", Encoding: enc, DataParallelRank: 2}, &r,
				Source{Pool: pool, Medium: "GPU"})
			require.Equal(t, "kv@pod-a@m", pub.Topic())
			flush(t, pub)
			l2, err := pool.Acquire("plain", 1)
			require.NoError(t, err)
			require.NoError(t, l2.Seal(0, 99))
			l.Release()
			l2.Release()
			x, err := pool.Acquire("x", 4) // evicts all four
			require.NoError(t, err)
			flush(t, pub)
			x.Release()

			bs := r.batches(t)
			require.Equal(t, 2, *bs[0].DataParallelRank)
			evs := flatten(bs)
			require.Len(t, evs, 2)
			require.Equal(t, Event{Type: "BlockStored", BlockHashes: []uint64{uint64(hs[0]), uint64(hs[1]), uint64(hs[2])},
				TokenIDs: tokens(1, 12), BlockSize: 4, Medium: "GPU"}, evs[0])
			require.Equal(t, "BlockRemoved", evs[1].Type)
			require.ElementsMatch(t, []uint64{uint64(hs[0]), uint64(hs[1]), uint64(hs[2]), 99}, evs[1].BlockHashes)
			require.Equal(t, "GPU", evs[1].Medium)
			st := pub.Stats()
			require.EqualValues(t, 1, st.Unpublishable)
			require.EqualValues(t, 2, st.Events)
			require.EqualValues(t, 7, st.Blocks)
			require.Zero(t, st.DroppedBatches)
		})
	}
}

// Hashes travel as full 8-byte unsigned integers (0xcf), even small ones.
func TestWireHashesFullWidth(t *testing.T) {
	for _, enc := range []Encoding{MapEncoding, ArrayEncoding} {
		b := newBatchEncoder(enc, 0)
		payload := b.encode(1.5, []wireEvent{
			{tag: tagBlockStored, hashes: []uint64{7}, parent: 3, hasParent: true, tokens: []int32{1, 2}, blockSize: 2, medium: "CPU", loraName: "ad", loraID: 4},
			{tag: tagBlockRemoved, hashes: []uint64{7}},
			{tag: tagAllBlocksCleared},
		})
		require.Contains(t, string(payload), string([]byte{0xcf, 0, 0, 0, 0, 0, 0, 0, 7}))
		got, err := DecodeBatch(payload)
		require.NoError(t, err)
		parent, four := uint64(3), 4
		require.Equal(t, Batch{TS: 1.5, DataParallelRank: new(int), Events: []Event{
			{Type: "BlockStored", BlockHashes: []uint64{7}, ParentBlockHash: &parent, TokenIDs: []int32{1, 2},
				BlockSize: 2, LoraID: &four, Medium: "CPU", LoraName: "ad"},
			{Type: "BlockRemoved", BlockHashes: []uint64{7}},
			{Type: "AllBlocksCleared"},
		}}, got, enc.String())
	}
}

// ResetCache that empties the index goes out as AllBlocksCleared.
func TestPublisherResetCache(t *testing.T) {
	pool := newPool(t, 4, 64)
	var r recorder
	pub := newRecorded(t, Config{Pod: "p", Model: "m"}, &r, Source{Pool: pool})
	l, _ := sealChain(t, pool, 1, 2)
	l.Release()
	require.Equal(t, 2, pool.ResetCache(false))
	flush(t, pub)
	evs := flatten(r.batches(t))
	require.Equal(t, "AllBlocksCleared", evs[len(evs)-1].Type)
	n := 0
	for _, e := range evs[:len(evs)-1] {
		require.Equal(t, "BlockStored", e.Type)
		n += len(e.BlockHashes)
	}
	require.Equal(t, 2, n)
}

// When the pool's ring drops events, the publisher clears and re-announces
// the whole cache from the snapshot, tokens and parents included.
func TestPublisherResyncAfterRingLoss(t *testing.T) {
	pool := newPool(t, 8, 2)
	other := newPool(t, 4, 16)
	var r recorder
	pub := newRecorded(t, Config{Pod: "p", Model: "m"}, &r, Source{Pool: pool}, Source{Pool: other, Medium: "CPU"})
	lo, ho := sealChain(t, other, 9, 1)
	defer lo.Release()
	flush(t, pub)
	require.NoError(t, pub.Close()) // stop draining so the ring overflows
	r.mu.Lock()
	r.msgs = nil
	r.mu.Unlock()

	l, hs := sealChain(t, pool, 1, 5) // 5 events into a ring of 2
	var r2 recorder
	pub2 := newRecorded(t, Config{Pod: "p", Model: "m"}, &r2, Source{Pool: pool}, Source{Pool: other, Medium: "CPU"})
	defer l.Release()
	flush(t, pub2)
	evs := flatten(r2.batches(t))
	require.Equal(t, "AllBlocksCleared", evs[0].Type)
	require.Len(t, evs, 3)
	require.Equal(t, Event{Type: "BlockStored", BlockHashes: []uint64{uint64(hs[0]), uint64(hs[1]), uint64(hs[2]), uint64(hs[3]), uint64(hs[4])},
		TokenIDs: tokens(1, 20), BlockSize: 4, Medium: "GPU"}, evs[1])
	require.Equal(t, []uint64{uint64(ho[0])}, evs[2].BlockHashes, "every source is re-announced")
	require.Equal(t, "CPU", evs[2].Medium)
	st := pub2.Stats()
	require.EqualValues(t, 3, st.DroppedEvents)
	require.EqualValues(t, 1, st.Resyncs)
}

// A stalled socket never stalls the allocator: batches are dropped and
// counted, and once the socket moves again the cache is re-announced.
func TestPublisherSlowSubscriberNeverBlocks(t *testing.T) {
	pool := newPool(t, 16, 4096)
	r := recorder{block: make(chan struct{})}
	pub := newRecorded(t, Config{Pod: "p", Model: "m", Queue: 2, BatchEvents: 1}, &r, Source{Pool: pool})
	done := make(chan struct{})
	var held *kvlease.Lease[[]byte]
	var heldHashes []kvlease.BlockHash
	go func() {
		defer close(done)
		for i := range 200 {
			l, _ := sealChain(t, pool, i+1, 2)
			if i == 199 {
				held, heldHashes = l, nil
				heldHashes = append(heldHashes, 0)
				continue
			}
			l.Release()
			time.Sleep(50 * time.Microsecond) // let the drainer interleave
		}
	}()
	select {
	case <-done:
		t.Logf("done %+v", pub.Stats())
	case <-time.After(30 * time.Second):
		t.Fatal("allocator blocked behind a stalled subscriber")
	}
	require.Eventually(t, func() bool { return pub.Stats().DroppedBatches > 0 }, 10*time.Second, time.Millisecond)
	t.Logf("%+v", pub.Stats())
	close(r.block)
	flush(t, pub)
	require.Eventually(t, func() bool { return pub.Stats().Resyncs > 0 }, 10*time.Second, time.Millisecond)
	flush(t, pub)
	bs := r.batches(t)
	// The last AllBlocksCleared is followed by the current cache.
	evs := flatten(bs)
	last := -1
	for i, e := range evs {
		if e.Type == "AllBlocksCleared" {
			last = i
		}
	}
	require.GreaterOrEqual(t, last, 0)
	_, snap := pool.SnapshotKVBlocks(nil)
	announced := map[uint64]bool{}
	for _, e := range evs[last+1:] {
		for _, h := range e.BlockHashes {
			announced[h] = e.Type == "BlockStored"
		}
	}
	for _, s := range snap {
		require.True(t, announced[uint64(s.BlockHash)], "block %x announced after the clear", s.BlockHash)
	}
	held.Release()
}

func recvTimeout(t *testing.T, s zmq4.Socket) zmq4.Msg {
	t.Helper()
	type res struct {
		m   zmq4.Msg
		err error
	}
	ch := make(chan res, 1)
	go func() { m, err := s.Recv(); ch <- res{m, err} }()
	select {
	case r := <-ch:
		require.NoError(t, r.err)
		return r.m
	case <-time.After(10 * time.Second):
		t.Fatal("no message")
	}
	return zmq4.Msg{}
}

func waitSubscribed(t *testing.T, p *Publisher) {
	t.Helper()
	require.Eventually(t, func() bool { return len(p.Subscriptions()) > 0 }, 10*time.Second, time.Millisecond)
}

// Over real sockets, both directions: the publisher binds and the
// subscriber dials, or the subscriber binds and the publisher dials.
func TestPublisherOverZMQ(t *testing.T) {
	for _, bind := range []bool{true, false} {
		t.Run(fmt.Sprint("bind=", bind), func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			pool := newPool(t, 4, 64)
			sub := zmq4.NewSub(ctx)
			defer sub.Close()
			cfg := Config{Pod: "pod", Model: "llama", ReplayEndpoint: "tcp://127.0.0.1:0"}
			if bind {
				cfg.Endpoint = "tcp://*:0"
			} else {
				require.NoError(t, sub.Listen("tcp://127.0.0.1:0"))
				cfg.Endpoint = "tcp://" + sub.Addr().String()
			}
			pub, err := NewPublisher(cfg, Source{Pool: pool})
			require.NoError(t, err)
			defer pub.Close()
			if bind {
				port := pub.Addr().(*net.TCPAddr).Port
				require.NoError(t, sub.Dial(fmt.Sprintf("tcp://127.0.0.1:%d", port)))
			} else {
				require.Nil(t, pub.Addr())
			}
			require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, "kv@"))
			waitSubscribed(t, pub)

			var hs []kvlease.BlockHash
			for i := range 3 {
				l, h := sealChain(t, pool, i+1, 1)
				hs = append(hs, h...)
				l.Release()
				flush(t, pub)
			}
			for i := range 3 {
				m := recvTimeout(t, sub)
				require.Equal(t, "kv@pod@llama", string(m.Frames[0]))
				require.Equal(t, uint64(i), binary.BigEndian.Uint64(m.Frames[1]))
				b, err := DecodeBatch(m.Frames[2])
				require.NoError(t, err)
				require.Equal(t, []uint64{uint64(hs[i])}, b.Events[0].BlockHashes)
			}

			// Replay from seq 1: batches 1 and 2, then the end marker.
			dealer := zmq4.NewDealer(ctx, zmq4.WithID(zmq4.SocketIdentity("replayer")))
			defer dealer.Close()
			require.NoError(t, dealer.Dial("tcp://"+pub.ReplayAddr().String()))
			start := make([]byte, 8)
			binary.BigEndian.PutUint64(start, 1)
			require.NoError(t, dealer.Send(zmq4.NewMsgFrom(nil, start)))
			for i := uint64(1); i <= 2; i++ {
				m := recvTimeout(t, dealer)
				require.Len(t, m.Frames, 4)
				require.Empty(t, m.Frames[0])
				require.Equal(t, "kv@pod@llama", string(m.Frames[1]))
				require.Equal(t, i, binary.BigEndian.Uint64(m.Frames[2]))
				b, err := DecodeBatch(m.Frames[3])
				require.NoError(t, err)
				require.Equal(t, []uint64{uint64(hs[i])}, b.Events[0].BlockHashes)
			}
			m := recvTimeout(t, dealer)
			require.Equal(t, [][]byte{{}, {}, replayEnd, {}}, normalize(m.Frames))
		})
	}
}

func normalize(fs [][]byte) [][]byte {
	out := make([][]byte, len(fs))
	for i, f := range fs {
		out[i] = append([]byte{}, f...)
	}
	return out
}

func TestReplayRingKeepsLast(t *testing.T) {
	r := replayRing{max: 3}
	for i := range uint64(5) {
		r.add(i, []byte{byte(i)})
	}
	seqs, msgs := r.from(0, 10, nil, nil)
	require.Equal(t, []uint64{2, 3, 4}, seqs)
	require.Equal(t, [][]byte{{2}, {3}, {4}}, msgs)
	seqs, _ = r.from(4, 10, nil, nil)
	require.Equal(t, []uint64{4}, seqs)
	seqs, _ = r.from(0, 2, nil, nil)
	require.Equal(t, []uint64{2, 3}, seqs, "at most limit, oldest first")
}

// TestReplayRingFromEveryState checks the ring's binary search against a
// plain scan in every fill and wrap state, for every start (before, in
// and past the kept seqs) and limit.
func TestReplayRingFromEveryState(t *testing.T) {
	const max = 5
	r := replayRing{max: max}
	var kept []uint64 // the reference: the last max seqs added
	for added := uint64(0); added <= 3*max; added++ {
		for start := uint64(0); start <= added+1; start++ {
			for limit := 0; limit <= max+1; limit++ {
				var want []uint64
				for _, s := range kept {
					if s >= start && len(want) < limit {
						want = append(want, s)
					}
				}
				seqs, msgs := r.from(start, limit, nil, nil)
				require.Equal(t, want, seqs, "added %d start %d limit %d", added, start, limit)
				require.Len(t, msgs, len(seqs))
				for i, m := range msgs {
					require.Equal(t, []byte{byte(seqs[i])}, m)
				}
			}
		}
		r.add(added, []byte{byte(added)})
		kept = append(kept, added)
		if len(kept) > max {
			kept = kept[1:]
		}
	}
}

func FuzzDecodeBatch(f *testing.F) {
	for _, enc := range []Encoding{MapEncoding, ArrayEncoding} {
		b := newBatchEncoder(enc, 0)
		f.Add(b.encode(1, []wireEvent{{tag: tagBlockStored, hashes: []uint64{1, 2}, tokens: []int32{1}, blockSize: 1},
			{tag: tagBlockRemoved, hashes: []uint64{3}}, {tag: tagAllBlocksCleared}}))
	}
	f.Add([]byte{0x93, 0xcb})
	f.Fuzz(func(t *testing.T, data []byte) {
		b, err := DecodeBatch(data)
		if err != nil {
			require.ErrorIs(t, err, ErrMalformed)
			return
		}
		for _, e := range b.Events {
			require.Contains(t, []string{"BlockStored", "BlockRemoved", "AllBlocksCleared"}, e.Type)
		}
	})
}

// An ipc:// endpoint binds a Unix socket that a zmq4 subscriber reads.
func TestPublisherIPC(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pool := newPool(t, 4, 64)
	ep := "ipc://" + t.TempDir() + "/kv.sock"
	pub, err := Start(ctx, Config{Endpoint: ep, Pod: "p", Model: "m"}, Source{Pool: pool})
	require.NoError(t, err)
	defer pub.Close()
	require.Equal(t, "unix", pub.Addr().Network())
	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	require.NoError(t, sub.Dial(ep))
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, ""))
	waitSubscribed(t, pub)
	l, hs := sealChain(t, pool, 1, 2)
	defer l.Release()
	flush(t, pub)
	m := recvTimeout(t, sub)
	b, err := DecodeBatch(m.Frames[2])
	require.NoError(t, err)
	require.Equal(t, []uint64{uint64(hs[0]), uint64(hs[1])}, b.Events[0].BlockHashes)
}

// In connect mode the publisher dials the router's bound subscriber, and
// dials again when that subscriber goes away and comes back.
func TestPublisherRedials(t *testing.T) {
	pool := newPool(t, 8, 64)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	pub, err := NewPublisher(Config{Endpoint: "tcp://" + addr, Pod: "p", Model: "m"}, Source{Pool: pool})
	require.NoError(t, err)
	defer pub.Close()
	require.Nil(t, pub.Addr(), "connect mode binds nothing")
	for round := range 2 {
		ctx, cancel := context.WithCancel(context.Background())
		sub := zmq4.NewSub(ctx)
		require.NoError(t, sub.Listen("tcp://"+addr))
		require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, "kv@"))
		waitSubscribed(t, pub)
		ls, hs := sealChain(t, pool, round+1, 1)
		flush(t, pub)
		got := false
		for i := 0; i < 100 && !got; i++ {
			m := recvTimeout(t, sub)
			b, err := DecodeBatch(m.Frames[2])
			require.NoError(t, err)
			last := b.Events[len(b.Events)-1]
			got = last.Type == "BlockStored" && last.BlockHashes[0] == uint64(hs[0])
		}
		require.True(t, got, "round %d: the chain arrived", round)
		ls.Release()
		require.NoError(t, sub.Close())
		cancel()
		require.Eventually(t, func() bool { return len(pub.Subscriptions()) == 0 }, 10*time.Second, time.Millisecond)
	}
}

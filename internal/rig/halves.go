package rig

// The two halves of package handoff as a two-process run connects them:
// the prefill process's Source on the child's control connection, the
// decode child's Destination on the parent's, both authenticated with
// the run's key, each recording the control messages it refused.

import (
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/kvlease/kvlease"
	"github.com/kvlease/kvlease/handoff"
)

// Prefill is the prefill process's half of a two-process run: its decode
// child and the handoff source on the child's control connection.
type Prefill[R any] struct {
	Src   *handoff.Source[R]
	Child *Child

	mu   sync.Mutex
	errs []string
}

// StartPrefill starts the decode child of run cfg (StartChild) and, on
// its control connection, the source over plane: named "prefill", its
// peer "decode", with envelope env and cfg.Deadline, authenticated with
// the child's key. Close it when done.
func StartPrefill[R any](cfg Config, env handoff.Envelope, plane handoff.SendPlane[R], stderr io.Writer) (*Prefill[R], error) {
	child, err := StartChild(cfg, stderr)
	if err != nil {
		return nil, err
	}
	conn, err := child.Control()
	if err != nil {
		child.Kill()
		return nil, err
	}
	p := &Prefill[R]{Child: child}
	p.Src, err = handoff.NewSource(conn, plane, Auth(handoff.HalfConfig{
		Envelope: env, Name: "prefill", Peer: "decode", Deadline: cfg.Deadline,
		OnError: func(err error) {
			p.mu.Lock()
			p.errs = append(p.errs, err.Error())
			p.mu.Unlock()
		},
	}, child.Key))
	if err != nil {
		_ = conn.Close()
		child.Kill()
		return nil, err
	}
	return p, nil
}

// Errors are the control messages the source refused.
func (p *Prefill[R]) Errors() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.errs)
}

// Close closes the source and kills the child unless it was reaped.
func (p *Prefill[R]) Close() {
	_ = p.Src.Close()
	p.Child.Kill()
}

// Settle closes the books of a two-process run once the child reported:
// the child's exit, the authentication, the decode pool, the marker
// mismatches and late writes the decode side saw (added to l's), and the
// control messages either side refused, each printed to out and counted.
// (A message that merely crossed a side's end of its handoff is not
// refused: the halves count it in HalfStats.Crossed.)
func (p *Prefill[R]) Settle(l *Ledger, rep Report, out io.Writer) {
	l.Child = p.Child.Exit()
	l.Authenticated = p.Src.Peer().Mode.String()
	l.Decode = rep.Decode
	l.MarkerMismatches += rep.MarkerMismatches
	l.LateWrites += rep.LateWrites
	for _, e := range append(p.Errors(), rep.Errors...) {
		l.ProtocolErrors++
		fmt.Fprintln(out, "protocol error:", e)
	}
}

// Destination is the decode child's half: dc's HalfConfig named
// "decode", its peer "prefill", with envelope env and deadline,
// authenticated with the parent's key, its refusals in the report
// (Parent.Fail); on the parent's control connection, which it returns to
// Serve.
func Destination[R any](p *Parent, pool *kvlease.Pool[R], plane handoff.RecvPlane[R], env handoff.Envelope, deadline time.Duration, dc handoff.DestinationConfig[R]) (*handoff.Destination[R], net.Conn, error) {
	dc.HalfConfig = Auth(handoff.HalfConfig{Envelope: env, Name: "decode", Peer: "prefill", Deadline: deadline, OnError: p.Fail}, p.Key)
	dst, err := handoff.NewDestination(pool, plane, dc)
	if err != nil {
		return nil, nil, err
	}
	conn, err := p.Dial()
	if err != nil {
		return nil, nil, err
	}
	return dst, conn, nil
}

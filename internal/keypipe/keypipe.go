// Package keypipe hands a pre-shared key from a process to a child it
// starts, through a pipe the child inherits as a file descriptor: never
// on a command line, never in the environment (where ps, /proc/PID/cmdline
// and /proc/PID/environ show it, and crash reports copy it). The
// environment names only the descriptor's number.
package keypipe

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"

	"go.uber.org/atomic"
)

// Env is the variable that tells the child which descriptor holds its
// key (a number, not a secret).
const Env = "KVLEASE_KEY_FD"

// KeyBytes is the length of a key that travels (handoff.GenerateKey's).
const KeyBytes = 32

// Attach arranges for cmd's child to inherit a pipe holding key: it
// adds the pipe's read end to cmd.ExtraFiles and names its descriptor in
// cmd.Env (which it sets from os.Environ when nil). Call the returned
// function once cmd has started: it writes the key and closes both ends
// on this side. If cmd never starts, call it anyway to close the pipe.
func Attach(cmd *exec.Cmd, key []byte) (send func() error, err error) {
	if len(key) != KeyBytes {
		return nil, fmt.Errorf("keypipe: a key of %d bytes, want %d", len(key), KeyBytes)
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	fd := 3 + len(cmd.ExtraFiles)
	cmd.ExtraFiles = append(cmd.ExtraFiles, r)
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Env = append(cmd.Env, Env+"="+strconv.Itoa(fd))
	return func() error {
		_ = r.Close() // the child has its own copy
		_, err := w.Write(key)
		if cerr := w.Close(); err == nil {
			err = cerr
		}
		return err
	}, nil
}

// read is set once Read has taken the inherited descriptor.
var read atomic.Bool

// Read reads the key this process inherited, once: the descriptor named
// by Env is read to its end and closed, and Env is removed from the
// environment (children started later inherit neither). A second Read
// fails rather than read whatever the descriptor's number names by then.
// ok is false when the parent handed down no key.
func Read() (key []byte, ok bool, err error) {
	if read.Load() {
		return nil, false, errors.New("keypipe: the inherited key was read already")
	}
	v := os.Getenv(Env)
	if v == "" {
		return nil, false, nil
	}
	fd, err := strconv.Atoi(v)
	if err != nil || fd < 3 {
		return nil, false, fmt.Errorf("keypipe: %s=%q is not an inherited descriptor", Env, v)
	}
	if !read.CompareAndSwap(false, true) {
		return nil, false, fmt.Errorf("keypipe: descriptor %d was read already", fd)
	}
	_ = os.Unsetenv(Env)
	f := os.NewFile(uintptr(fd), "kvlease-key")
	if f == nil {
		return nil, false, fmt.Errorf("keypipe: descriptor %d is not open", fd)
	}
	defer f.Close()
	key = make([]byte, KeyBytes)
	if _, err := io.ReadFull(f, key); err != nil {
		return nil, false, fmt.Errorf("keypipe: read the key from descriptor %d: %w", fd, err)
	}
	var extra [1]byte
	if n, _ := f.Read(extra[:]); n != 0 {
		return nil, false, errors.New("keypipe: more than a key on the descriptor")
	}
	return key, true, nil
}

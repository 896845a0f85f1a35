package inproc

import "errors"

// The errors of the plane. A cancelled copy ends with kvlease.ErrCanceled.

var (
	// ErrInjected is the outcome of a copy that failed by injection
	// (Config.FailRate or a Plan with FateFail).
	ErrInjected = errors.New("inproc: injected copy failure")
)

package kvlease

import "runtime"

func runtimeGosched() { runtime.Gosched() }

module github.com/kvlease/kvlease/ucx

go 1.26.8

require github.com/kvlease/kvlease v0.9.0

require (
	github.com/cespare/xxhash/v2 v2.3.0 // indirect
	github.com/vmihailenco/msgpack/v5 v5.4.1 // indirect
	github.com/vmihailenco/tagparser/v2 v2.0.0 // indirect
	go.uber.org/atomic v1.12.0
)

replace github.com/kvlease/kvlease => ../

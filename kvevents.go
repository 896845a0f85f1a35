package kvlease

type kvEventLog struct{}

func newKVEventLog(n int) *kvEventLog { return &kvEventLog{} }

func (c *core) kvStored(id BlockID, st *sealTokens) {}
func (c *core) kvRemoved(id BlockID)                {}

package kvlease

// sealMeta is what verified mode keeps per slot: the parent hash and where
// the block's tokens live in the pool's token arena.
type sealMeta struct {
	parent BlockHash
	ok     bool // tokens recorded at seal
}

// verifier carries the tokens a verified lookup checks hits against.
type verifier struct {
	seed        BlockHash
	tokens      []int32
	blockTokens int
}

func (c *core) verify(id BlockID, k int, v *verifier) bool { return false }

func (c *core) recordSeal(id BlockID, st *sealTokens) {}

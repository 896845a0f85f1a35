package kvlease

import "fmt"

// Adapter names the LoRA adapter a lease's KV was computed with, as vLLM
// names it in KV events: ID is lora_id, Name lora_name. The zero Adapter
// is the base model.
type Adapter struct {
	ID   int
	Name string
}

// SetAdapter tags the blocks this lease seals from now on with adapter a:
// their BlockStored events (and snapshots' re-announcements) carry a's
// lora_id and lora_name, so a router indexes them under the adapter, not
// the base model, while one pool serves many adapters. The tag is for
// events only: keep the adapters' prefixes apart with the seed (or an
// ExtraKey), as KV computed under two adapters differs. A tag with an ID
// but no Name is refused (ErrInvalidArgument; vLLM sends neither or
// both), as is a closed lease (ErrLeaseClosed).
func (l *Lease[R]) SetAdapter(a Adapter) error {
	ls := &l.ls
	if a.Name == "" && a.ID != 0 {
		return fmt.Errorf("kvlease: lease %d (%s): adapter id %d without a name: %w", ls.id, ls.owner, a.ID, ErrInvalidArgument)
	}
	c := ls.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if ls.closed {
		return fmt.Errorf("kvlease: set adapter of lease %d (%s): %w", ls.id, ls.owner, ErrLeaseClosed)
	}
	if a != (Adapter{}) || ls.extra != nil {
		ls.ext().tag = a
	}
	return nil
}

// adapter is the lease's tag. Called with c.mu held.
func (l *lease) adapter() Adapter {
	if l.extra == nil {
		return Adapter{}
	}
	return l.extra.tag
}

// internAdapter returns a's index in the pool's adapters, adding it. Called
// with c.mu held, for a tagged lease's seal.
func (c *core) internAdapter(a Adapter) int32 {
	if i, ok := c.adapterIx[a]; ok {
		return i
	}
	if c.adapterIx == nil {
		c.adapterIx = map[Adapter]int32{}
		c.adapters = []Adapter{{}}
	}
	i := int32(len(c.adapters))
	c.adapters = append(c.adapters, a)
	c.adapterIx[a] = i
	return i
}

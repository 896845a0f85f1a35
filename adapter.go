package kvlease

import "fmt"

// Adapter names the LoRA adapter a lease's KV was computed with, as vLLM
// names it in KV events: ID is lora_id, Name lora_name. The zero Adapter
// is the base model.
//
// An adapter is its Name: the ID is what the engine declares with it
// (vLLM's lora_int_id, often a slot index), sent on the wire as lora_id
// but not what retention follows. So an engine may reuse an id: unload
// adapter A from slot 1, load B into it, and A's blocks and B's keep
// their own retention (Pool.SetAdapterRetention takes the name). A name
// without an ID (Adapter{Name: "x"}) is an adapter of its own as well:
// its own retention, and events with lora_name "x" and lora_id 0. An ID
// without a Name is refused.
type Adapter struct {
	ID   int
	Name string
}

// SetAdapter tags the blocks this lease seals from now on with adapter a.
// The tag is recorded with each seal and used twice: their BlockStored
// events (and snapshots' re-announcements) carry a's lora_id and
// lora_name, so a router indexes them under the adapter, not the base
// model, while one pool serves many adapters; and their retention class
// is at most the adapter's (Pool.SetAdapterRetention), so an unloaded
// adapter's blocks go first. The tag does not keep prefixes apart: do
// that with the seed (or an ExtraKey), as KV computed under two adapters
// differs. A tag with an ID but no Name is refused (ErrInvalidArgument;
// the name is the adapter's identity), as is a closed lease
// (ErrLeaseClosed).
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
		ls.ext().tagIx = c.internAdapter(a)
	}
	return nil
}

// internAdapter returns a's index in the pool's adapters (0 for the base
// model), adding it: seal records and retention name an adapter by it.
// Called with c.mu held, when a lease is tagged.
func (c *core) internAdapter(a Adapter) int32 {
	if a == (Adapter{}) {
		return 0
	}
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
	if c.ret != nil {
		c.ret.interned(i, a.Name)
	}
	return i
}

"""KV residency events: what the store holds changes (stored, removed,
cleared, moved between tiers); the bus numbers them and hands them to the
publishers (ZMQ in vLLM's wire format, Server-Sent Events over HTTP)."""

"""KV tiers below the block pool: a tier interface, a local-disk and a Redis backend, and the stack
that loads from them at admission and stores to them off the engine loop (see ``stack.py``)."""

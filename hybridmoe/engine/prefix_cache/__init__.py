"""The prefix cache beyond the device pool: host RAM, then a directory, then a store shared by
several servers (Mooncake Store or Redis/Valkey).

- identity.py: the key of a block (model, dtypes, layout, previous key, tokens), used by the pool
  and every tier;
- codec.py: a block as checksummed bytes;
- tier.py: the Tier protocol and its counters; ram_tier.py, disk_tier.py, remote_tier.py (with
  redis_store.py and mooncake_store.py behind its KVStore protocol);
- tiered_cache.py: lookups through the tiers and the hooks the block manager calls;
- write_back.py: the thread that writes blocks;
- build.py: the tiers EngineConfig asks for.
"""

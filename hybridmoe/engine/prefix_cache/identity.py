"""Block identity: the one name a full KV block has, in the device pool and in every tier.

A block's key is a chained hash: blake2b(previous block's key, the block's token ids), and the
first block's "previous key" is the namespace, a hash of everything else the entries depend on: the
model (its config and a fingerprint of its weights), the dtypes it computes in, the block size and
the KV format. So equal keys mean the same tokens after the same prefix through the same model and
layout, and a block is never served to a model, dtype or layout that did not make it.
Plain Python (the block manager uses it); the model's fingerprint is in fingerprint.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

KEY_BYTES = 16

# Bumped whenever what a block holds, or how it is encoded (codec.py), changes.
KV_FORMAT = 2


def chain_key(prev: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block of `tokens` after the block whose key is `prev`."""
    h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
    h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens))
    return h.digest()


def chain_keys(
    seed: bytes,
    token_ids: Sequence[int],
    block_size: int,
    start: int,
    stop: int,
    prev: bytes | None = None,
) -> list[bytes]:
    """Keys of blocks start..stop-1 of `token_ids`, given the key before block `start` (`prev`;
    the seed for block 0)."""
    prev = seed if start == 0 else prev
    keys = []
    for i in range(start, stop):
        prev = chain_key(prev, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(prev)
    return keys


def adapter_seed(seed: bytes, adapter: str) -> bytes:
    """The seed of the chains of sequences that run with LoRA adapter `adapter`."""
    return hashlib.blake2b(seed + b"lora/" + adapter.encode(), digest_size=KEY_BYTES).digest()


def namespace(fingerprint: bytes, block_size: int, layout: str) -> bytes:
    """The seed of every chain: model fingerprint, block size, KV format and `layout` (the dtypes
    and entry shapes the model caches, as text)."""
    text = f"hybridmoe-kv/{KV_FORMAT}/{block_size}/{layout}".encode()
    return hashlib.blake2b(fingerprint + text, digest_size=KEY_BYTES).digest()

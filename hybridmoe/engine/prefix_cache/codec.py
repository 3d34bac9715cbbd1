"""A KV block as bytes: what every tier stores, verified whole on every read.

    MAGIC | key [16] | count u32 | per tensor: layer u32, dtype u8, ndim u8, dims u32 x ndim
          | the tensors' raw bytes, one after another | check

`check` is the CRC-32 of everything before it (4 bytes; zlib's runs at about 4 GB/s here, blake2b
at 0.4). A block decodes only if its length is the one its header implies, its checksum matches and
it names the key it was asked for, so a truncated write, a flipped byte or a file copied under
another name is refused (CorruptBlock), never served. (The checksum guards against accidents; the
key, a 128-bit hash, is what keeps one model's blocks from another.)
"""

from __future__ import annotations

import struct
import zlib

import torch

from hybridmoe.engine.prefix_cache.identity import KEY_BYTES

MAGIC = b"HMKVBLK2"
_CHECK = 4
_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
]
_CODE = {d: i for i, d in enumerate(_DTYPES)}


class CorruptBlock(ValueError):
    """Bytes that are not a whole, intact block of the key asked for."""


Block = dict[int, tuple[torch.Tensor, ...]]  # layer -> its cached entries, [block_size, ...] each


def encode(key: bytes, block: Block) -> bytes:
    """The bytes of the block `key`."""
    tensors = [(layer, t) for layer in sorted(block) for t in block[layer]]
    head = [MAGIC, key, struct.pack("<I", len(tensors))]
    body = []
    for layer, t in tensors:
        head.append(struct.pack(f"<IBB{t.dim()}I", layer, _CODE[t.dtype], t.dim(), *t.shape))
        body.append(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    data = b"".join(head + body)
    return data + struct.pack("<I", zlib.crc32(data))


def decode(data: bytes | bytearray, key: bytes) -> Block:
    """The block `key` in `data`; CorruptBlock (saying why) if `data` is not it."""
    if len(data) < len(MAGIC) + KEY_BYTES + 4 + _CHECK or data[: len(MAGIC)] != MAGIC:
        raise CorruptBlock("not a KV block (no header)")
    view = memoryview(data)
    if zlib.crc32(view[:-_CHECK]) != struct.unpack_from("<I", view, len(data) - _CHECK)[0]:
        raise CorruptBlock("checksum mismatch (truncated or corrupt)")
    at = len(MAGIC)
    if bytes(view[at : at + KEY_BYTES]) != key:
        raise CorruptBlock("it holds another block")
    at += KEY_BYTES
    specs = []
    try:
        (count,) = struct.unpack_from("<I", view, at)
        at += 4
        for _ in range(count):
            layer, code, ndim = struct.unpack_from("<IBB", view, at)
            shape = struct.unpack_from(f"<{ndim}I", view, at + 6)
            specs.append((layer, _DTYPES[code], shape))
            at += 6 + 4 * ndim
    except (struct.error, IndexError):
        raise CorruptBlock("bad header") from None
    buf = data if isinstance(data, bytearray) else bytearray(data)  # torch wants a writable one
    block: dict[int, list[torch.Tensor]] = {}
    for layer, dtype, shape in specs:
        n = dtype.itemsize * _numel(shape)
        if at + n > len(data) - _CHECK:
            raise CorruptBlock("shorter than its header says")
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=at) if n else torch.empty(0)
        block.setdefault(layer, []).append(raw.view(dtype).reshape(shape))
        at += n
    if at != len(data) - _CHECK:
        raise CorruptBlock("longer than its header says")
    return {layer: tuple(ts) for layer, ts in block.items()}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

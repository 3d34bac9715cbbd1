"""GGUF files (llama.cpp's format), read through the `gguf` package: config, and tensors one at a
time.

GGUF lists a tensor's dims innermost first, so a torch [rows, cols] weight is stored as
(cols, rows); the reader's arrays are already in row-major order. Matrices in a block format the
engine computes on (hybridmoe.quant.formats) come out as QTensors, their blocks as stored, one
tensor (one expert, for stacked experts) at a time: copied into memory in 2 MB pages
(native/huge_pages.py), where the kernels read them faster, while they fit in a share of the free
memory (free_memory.py), the map's pages let go as each is copied; beyond that, views of the
file's memory map (resident memory is then the page cache of what the kernels touch). The model
decides where they stay blocks.
Other 3-D tensors in blocks (MLA's halves) are dequantized, and formats the engine does not read
are refused.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from hybridmoe.config import HFConfig
from hybridmoe.errors import ModelFileError
from hybridmoe.loader import gguf_names as names
from hybridmoe.loader.free_memory import CopyBudget, available_bytes, let_go
from hybridmoe.loader.gguf_config import hf_config
from hybridmoe.native.huge_pages import arena
from hybridmoe.quant.formats import BY_GGML, FORMATS
from hybridmoe.quant.tensor import QTensor

GGUF_MAGIC = b"GGUF"


def read_config(path: str | Path) -> HFConfig:
    reader = _reader(path)
    return HFConfig(hf_config(_metadata(reader), _shapes(reader), str(path)))


def metadata(path: str | Path) -> dict:
    """The file's scalar and string metadata (general.*, {arch}.*, tokenizer.ggml.pre, ...)."""
    return _metadata(_reader(path))


def check(path: str | Path) -> None:
    """Raise ModelFileError unless `path` parses as a GGUF file with all its tensor data present."""
    _reader(path)


def count_tensors(path: str | Path) -> int:
    """How many (name, tensor) pairs iter_tensors yields: one per expert of a stack,
    one per MLA pair."""
    total = 0
    for t in _reader(path).tensors:
        if names.legacy_expert(t.name):
            total += 1
            continue
        _, base, _ = names.split(t.name, str(path))
        total += int(t.shape[-1]) if base in names.EXPERT_STACKS else 0 if base == "attn_v_b" else 1
    return total


def expert_types(path: str | Path) -> dict[str, int]:
    """Bytes of the routed experts' tensors per GGML type name (Q4_K: ..., Q6_K: ...)."""
    held: dict[str, int] = {}
    for t in _reader(path).tensors:
        base = names.split(t.name, str(path))[1] if not names.legacy_expert(t.name) else ""
        if base in names.EXPERT_STACKS or names.legacy_expert(t.name):
            kind = gguf.GGMLQuantizationType(t.tensor_type).name
            held[kind] = held.get(kind, 0) + int(t.n_bytes)
    return held


def iter_tensors(
    path: str | Path, cfg: HFConfig, copy_blocks: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, tensor) one at a time, experts split out of their stacks; blocks
    copied while they fit in a share of free memory, or (copy_blocks False) none."""
    reader, where = _reader(path), str(path)
    naming = names.NAMING.get(cfg.model_type, names.Naming())
    # llama.cpp's llama converter interleaves q/k rows per head (GPT-J rope);
    # HF keeps the halves apart
    heads = {"attn_q": cfg.get("num_attention_heads"), "attn_k": cfg.get("num_key_value_heads")}
    if _metadata(reader).get("general.architecture") != "llama":
        heads = {}
    mla: dict[tuple[int, str], torch.Tensor] = {}
    budget = CopyBudget(available_bytes() if copy_blocks else 0)
    # values that are copied into the model (floats, dequantised blocks) are read plainly: pages
    # of the memory map would stay in our RSS after their use; blocks are copied (_blocks)
    f = open(where, "rb")
    try:
        for t in reader.tensors:
            if legacy := names.legacy_expert(t.name):
                yield names.expert_name(*legacy, naming), _tensor(t, f, where, budget=budget)
                continue
            layer, base, suffix = names.split(t.name, where)
            if base in names.EXPERT_STACKS:
                for e in range(int(t.shape[-1])):
                    yield (
                        names.expert_name(layer, e, names.EXPERT_STACKS[base], naming),
                        _tensor(t, f, where, e, budget),
                    )
            elif base in names.MLA_HALVES:
                mla[(layer, base)] = _tensor(t, f, where, budget=budget)
                if all((layer, half) in mla for half in names.MLA_HALVES):
                    kv_b = _join_kv_b(mla.pop((layer, "attn_k_b")), mla.pop((layer, "attn_v_b")))
                    yield f"model.layers.{layer}.self_attn.kv_b_proj.weight", kv_b
            else:
                # rows that _fix_layout reorders are copied there: read in place until then
                now = None if base in heads else budget
                yield (
                    names.hf_name(layer, base, suffix, naming, where),
                    _fix_layout(base, _tensor(t, f, where, budget=now), heads),
                )
    finally:
        f.close()
        _open.cache_clear()  # the parsed header goes; the map stays while blocks view it
    if mla:
        (layer, half), _ = next(iter(mla.items()))
        raise ModelFileError(
            f"{where}: layer {layer} has {half} but not its other half; the file is incomplete"
        )


def _fix_layout(base: str, tensor, heads: dict[str, int]):
    """Where llama.cpp's layout of a tensor differs from Hugging Face's, convert it back."""
    if base in heads:
        if isinstance(tensor, QTensor):  # whole rows move: blocks never straddle rows
            return tensor.rows(_unpermute_rows(torch.arange(tensor.shape[0]), heads[base]))
        return _unpermute_rows(tensor, heads[base])
    if (
        base == "ffn_gate_inp_shexp" and tensor.dim() == 1
    ):  # llama.cpp accepts it as [H]; HF has [1, H]
        return tensor[None]
    return tensor


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's permute: per head,
    rows (pair, 2) -> (2, pair). w: [n_head*D, ...]."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def _join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """k_b [heads, kv_rank, nope] and v_b [heads, v_dim, kv_rank] -> kv_b_proj
    [heads*(nope+v_dim), kv_rank]."""
    kv = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [heads, nope+v_dim, kv_rank]
    return kv.reshape(-1, kv.shape[-1]).contiguous()


# llama.cpp's Q4_K_M falls back to Q5_0 (and Q5_K to Q5_1) for rows that do not fill 256-blocks;
# no kernel computes on them, so they are read as values
DEQUANTISED = ("Q5_0", "Q5_1")
READABLE = ("F32", "F16", "BF16", *(f.upper() for f in FORMATS), *DEQUANTISED)


def _tensor(t, f, where: str, index: int | None = None, budget: CopyBudget | None = None):
    """One GGUF tensor (or one expert `index` of a stack): a QTensor for a matrix in blocks (a copy
    where `budget` takes it, else a view of the memory map, its layout kept as it lies), else a
    torch tensor read from the open file `f`."""
    qtype = gguf.GGMLQuantizationType(t.tensor_type)
    fmt = BY_GGML.get(int(qtype))
    if fmt is None and qtype.name not in READABLE:
        raise ModelFileError(
            f"{where}: tensor {t.name} is {qtype.name}; hybridmoe reads {', '.join(READABLE)}: "
            "convert or requantize the model to one of them"
        )
    if fmt is not None and t.data.ndim - (index is not None) == 2:
        return _blocks(t, fmt, index, budget)
    data = _read(t, f, index)
    if qtype.name in DEQUANTISED:  # [..., row bytes] -> float32 [..., cols]
        return torch.from_numpy(gguf.quants.dequantize(data, qtype))
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return torch.from_numpy(data)
    if qtype == gguf.GGMLQuantizationType.BF16:  # stored as raw bytes [..., 2*cols]
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    cols = data.shape[-1] // fmt.nbytes * fmt.block  # data: [..., bytes per row]
    blocks = QTensor(torch.from_numpy(data.reshape(-1, data.shape[-1])), fmt, cols)
    return blocks.dequantize().reshape(*data.shape[:-1], cols)  # 3-D: values


def _blocks(t, fmt, index: int | None, budget: CopyBudget | None) -> QTensor:
    """A matrix in blocks (or expert `index` of a stack, contiguous in GGUF's layout): copied into
    2 MB pages where `budget` takes its bytes, and the map's pages it lay in let go of (they were
    never written: the file's bytes come back if they are read again); else a view of the file's
    memory map, its layout kept: nothing is read until a kernel touches it, and what it touches is
    page cache the kernel may drop and read again, not the process's own memory (llama.cpp maps its
    files alike). The map is copy-on-write, so torch takes it as writable; nothing writes it."""
    data = torch.from_numpy(t.data if index is None else t.data[index])  # uint8 [rows, row bytes]
    cols = data.shape[-1] // fmt.nbytes * fmt.block
    if budget is None or not budget.take(data.numel()):
        return QTensor(data, fmt, cols, keep_layout=True)
    copy = arena().copy(data)
    let_go(data)
    return QTensor(copy, fmt, cols)


def _read(t, f, index: int | None) -> np.ndarray:
    """The bytes of tensor `t` (or of its slice `index` along the outermost dim) in the reader's
    array layout: elements for float types, [..., bytes per row] for quantized blocks."""
    shape, nbytes, offset = (
        t.data.shape,
        t.n_bytes,
        t.data_offset,
    )  # t.data is a view: no pages touched
    if index is not None:
        nbytes //= shape[0]
        offset += index * nbytes
        shape = shape[1:]
    buf = bytearray(nbytes)  # writable, so torch can take it without a copy
    f.seek(offset)
    if f.readinto(buf) != nbytes:
        raise ModelFileError(
            f"{f.name}: tensor {t.name} runs past the end of the file (it is truncated); "
            "download the file again"
        )
    return np.frombuffer(buf, dtype=t.data.dtype).reshape(shape)


def _metadata(reader) -> dict:
    """Scalar and string metadata as Python values;
    arrays (the vocabulary) are left to the tokenizer."""
    kinds = gguf.GGUFValueType
    meta = {}
    for key, f in reader.fields.items():
        if not f.types or f.types[0] == kinds.ARRAY or not f.data:
            continue
        part = f.parts[f.data[0]]
        if f.types[0] == kinds.STRING:
            meta[key] = bytes(part).decode("utf-8", errors="replace")
        elif (
            f.types[0] == kinds.FLOAT32
        ):  # shortest decimal that round-trips: 1e-05, not 9.99999974e-06
            meta[key] = float(str(np.float32(part[0])))
        else:
            meta[key] = part[0].item()
    return meta


def _shapes(reader) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}


def _reader(path: str | Path):
    """The parsed file; kept while loading (config, count, tensors) because parsing a vocabulary
    takes seconds."""
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as e:
        raise ModelFileError(f"{p}: cannot be read ({e.strerror}); check the path") from None
    return _open(str(p), st.st_mtime_ns, st.st_size)


class Reader(gguf.GGUFReader):
    """GGUFReader, parsing over a plain ndarray view of its memory map: slicing an np.memmap builds
    a memmap object per slice, and a 49k-token vocabulary is ~500k slices (3.6x faster:
    docs/notes/)."""

    def _get(self, offset, dtype, count=1, override_order=None):
        if isinstance(self.data, np.memmap):
            self.data = self.data.view(np.ndarray)  # same buffer; the map stays open through .base
        return super()._get(offset, dtype, count, override_order)


@functools.lru_cache(maxsize=1)
def _open(path: str, mtime_ns: int, size: int):
    try:
        reader = Reader(path, "c")  # copy-on-write: views are writable arrays, the file unchanged
    except (
        Exception
    ) as e:  # the reader fails in many ways (ValueError, IndexError, ...) on a damaged header
        raise ModelFileError(
            f"{path}: {_problem(path, size, e)}; download the file again"
        ) from None
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelFileError(
                f"{path}: tensor {t.name} runs past the end of the file (it is truncated); "
                "download the file again"
            )
    return reader


def _problem(path: str, size: int, error: Exception) -> str:
    """One phrase saying what is wrong with a file the gguf reader rejected."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        return f"not a GGUF file (it starts with {magic!r}, not b'GGUF')"
    if "reshape" in str(error):  # the reader's view of a tensor came up short: data cut off
        return "tensor data runs past the end of the file (it is truncated)"
    detail = str(error).splitlines()[0] if str(error) else type(error).__name__
    return f"the GGUF header is cut short or corrupt ({detail}; {size} bytes)"

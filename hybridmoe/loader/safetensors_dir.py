"""Hugging Face directories: config.json plus one or many *.safetensors (with their index).

The safetensors format is an 8-byte header length, a JSON header (name -> dtype, shape, byte
offsets) and the raw data. We read each tensor with plain file reads into its own buffer rather
than mapping the file, so that the file's pages never count in our resident memory: peak RSS stays
near the size of the loaded weights.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from hybridmoe.errors import ModelFileError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def safetensors_files(directory: Path) -> list[Path]:
    """The shard files of a checkpoint, from model.safetensors.index.json when there is one."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelFileError(
                f"{index}: not a valid safetensors index ({e}); restore the file"
            ) from None
        files = [directory / f for f in names]
        for f in files:
            if not f.exists():
                raise ModelFileError(
                    f"{f}: missing, but {index.name} lists it; download that shard again"
                )
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFileError(
            f"{directory}: no *.safetensors weights; hybridmoe reads safetensors checkpoints "
            "(or a .gguf file)"
        )
    return files


def read_header(path: Path) -> tuple[dict, int]:
    """(tensor entries, byte offset where the data starts), validated against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise _corrupt(path, "shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100_000_000:
            raise _corrupt(path, f"header length {n} exceeds the file size {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _corrupt(path, f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    header.pop("__metadata__", None)
    start = 8 + n
    for name, entry in header.items():
        _check_entry(path, name, entry, size - start)
    return header, start


def _check_entry(path: Path, name: str, entry, data_size: int) -> None:
    try:
        dtype = DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        numel = 1
        for d in entry["shape"]:
            numel *= int(d)
    except (KeyError, TypeError, ValueError):
        raise _corrupt(path, f"tensor {name!r} has a malformed header entry") from None
    if end > data_size:
        raise _corrupt(
            path,
            f"tensor {name!r} ends at byte {end} but the data holds {data_size} bytes (truncated)",
        )
    if end - begin != numel * dtype.itemsize or begin < 0:
        raise _corrupt(path, f"tensor {name!r} has {end - begin} bytes for shape {entry['shape']}")


def count_tensors(files: list[Path]) -> int:
    return sum(len(read_header(f)[0]) for f in files)


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time, in file order."""
    for path in files:
        header, start = read_header(path)
        with open(path, "rb", buffering=0) as f:
            for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                yield name, read_tensor(f, path, name, entry, start)


def read_tensor(f, path: Path, name: str, entry: dict, start: int) -> torch.Tensor:
    """One tensor of the open file `f` (`path`), from its header entry, into a buffer of its own."""
    begin, end = entry["data_offsets"]
    out = torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]])
    f.seek(start + begin)
    view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    if f.readinto(view) != end - begin:
        raise _corrupt(path, f"tensor {name!r} is cut short (truncated)")
    return out


def _corrupt(path: Path, what: str) -> ModelFileError:
    return ModelFileError(f"{path}: not a valid safetensors file: {what}; download it again")

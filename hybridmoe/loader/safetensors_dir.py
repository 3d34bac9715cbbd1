"""Hugging Face directories: config.json plus one or many *.safetensors (with their index)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from hybridmoe.errors import ModelFileError


def safetensors_files(directory: Path) -> list[Path]:
    """The shard files of a checkpoint, from model.safetensors.index.json when there is one."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelFileError(f"{index}: not a valid safetensors index ({e}); restore the file") from None
        files = [directory / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise ModelFileError(f"{f}: missing, but {index.name} lists it; download that shard again")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{directory}: no *.safetensors weights; hybridmoe reads safetensors checkpoints "
                             "(or a .gguf file)")
    return files


def count_tensors(files: list[Path]) -> int:
    total = 0
    for f in files:
        with _open(f) as handle:
            total += len(handle.keys())
    return total


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time, so that peak memory stays near the model's size."""
    for f in files:
        with _open(f) as handle:
            for name in handle.keys():
                try:
                    tensor = handle.get_tensor(name)
                except Exception as e:  # safetensors raises its own error types for damaged data
                    raise ModelFileError(f"{f}: tensor {name!r} cannot be read ({e}); the file is truncated "
                                         "or corrupt, download it again") from None
                yield name, tensor


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:
        raise ModelFileError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]}); "
                             "it is truncated or corrupt, download it again") from None

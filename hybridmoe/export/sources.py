"""What an export reads from: a config.json dict, every tensor's Hugging Face name and shape, a
way to read one tensor, and the tokenizer's directory (or None). `Checkpoint` is a Hugging Face
directory; bench/random_model.py makes random tensors of a shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from hybridmoe.config import HFConfig
from hybridmoe.errors import ModelFileError
from hybridmoe.loader import safetensors_dir


class Source(Protocol):
    config: dict
    shapes: dict[str, tuple[int, ...]]
    tokenizer_dir: Path | None
    name: str

    def read(self, name: str) -> torch.Tensor: ...


@dataclass
class Checkpoint:
    """A Hugging Face model directory: tensors read one at a time from its safetensors files."""

    directory: Path
    config: dict = field(init=False)
    shapes: dict[str, tuple[int, ...]] = field(init=False)
    tokenizer_dir: Path | None = field(init=False)
    name: str = field(init=False)

    def __post_init__(self):
        d = self.directory
        if not (d / "config.json").is_file():
            raise ModelFileError(f"{d}: no config.json; pass a Hugging Face model directory")
        self.config = dict(HFConfig.from_file(d / "config.json").data)
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for path in safetensors_dir.safetensors_files(d):
            header, start = safetensors_dir.read_header(path)
            self._where.update({n: (path, entry, start) for n, entry in header.items()})
        self.shapes = {n: tuple(e["shape"]) for n, (_, e, _) in self._where.items()}
        self.tokenizer_dir = d if (d / "tokenizer.json").is_file() else None
        self.name = d.name

    def read(self, name: str) -> torch.Tensor:
        path, entry, start = self._where[name]
        with open(path, "rb", buffering=0) as f:
            return safetensors_dir.read_tensor(f, path, name, entry, start)

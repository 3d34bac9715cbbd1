"""Model settings as Hugging Face writes them in config.json, read through one accessor."""

from __future__ import annotations

import json
from pathlib import Path

from hybridmoe.errors import ModelFileError

_MISSING = object()


class HFConfig:
    """A config.json dict; `get` accepts several names for one setting (they vary by
    architecture)."""

    def __init__(self, data: dict):
        self.data = dict(data)

    @classmethod
    def from_file(cls, path: str | Path) -> HFConfig:
        path = Path(path)
        try:
            return cls(json.loads(path.read_text()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelFileError(
                f"{path}: cannot read it as JSON ({e}); restore the model's config.json"
            ) from None

    def get(self, *names: str, default=_MISSING):
        for name in names:
            value = self.data.get(name)
            if value is not None:
                return value
        if default is _MISSING:
            raise ModelFileError(
                f"config.json has no {' / '.join(names)}; the model directory is incomplete"
            )
        return default

    @property
    def architecture(self) -> str:
        archs = self.data.get("architectures") or []
        return archs[0] if archs else self.data.get("model_type", "")

    @property
    def model_type(self) -> str:
        return self.data.get("model_type", "")

    def head_dim(self) -> int:
        return self.get("head_dim", default=None) or self.get("hidden_size") // self.get(
            "num_attention_heads"
        )

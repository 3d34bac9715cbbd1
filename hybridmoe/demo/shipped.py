"""The small fitted results that ship inside the package (hybridmoe/demo/data), so that a build
only applies them to the dense weights instead of fitting from scratch:

- corpus.safetensors — token ids of the calibration and evaluation text the dense model wrote;
- plan-<tag>.safetensors — per layer, the neuron split and the router of a configuration;
- downs-<tag>.safetensors — per layer, its fitted down projection (downs.py), with which a build
  does no fitting at all.

`python -m hybridmoe.demo.fit` regenerates them (see docs/notes/2026-11-21-demo-model-recipe.md;
`--downs` the last only, docs/notes/2026-11-24-first-run.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hybridmoe.demo.calibration import Corpus

DATA = Path(__file__).parent / "data"
CORPUS = DATA / "corpus.safetensors"


def plan_path(tag: str) -> Path:
    return DATA / f"plan-{tag}.safetensors"


def save_corpus(calibration: Corpus, evaluation: Corpus, path: Path = CORPUS) -> None:
    tensors = {}
    for name, c in (("calibration", calibration), ("evaluation", evaluation)):
        tensors[f"{name}.ids"] = c.ids.to(torch.int32)  # vocab 49152 fits int32
        tensors[f"{name}.mask"] = c.mask.to(torch.uint8)
        tensors[f"{name}.scored"] = c.scored.to(torch.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


def load_corpus(name: str, path: Path = CORPUS) -> Corpus | None:
    """The shipped "calibration" or "evaluation" corpus, or None when it is not there."""
    if not path.is_file():
        return None
    t = load_file(str(path))
    return Corpus(t[f"{name}.ids"].long(), t[f"{name}.mask"].bool(), t[f"{name}.scored"].bool())


def save_plan(path: Path, layers: list, spec_dict: dict, version: int) -> None:
    tensors = {}
    for i, layer in enumerate(layers):
        tensors[f"layers.{i}.shared"] = layer.shared.to(torch.int16)  # ids < 1536
        tensors[f"layers.{i}.experts"] = layer.experts.to(torch.int16)
        tensors[f"layers.{i}.router"] = layer.router.float().contiguous()
    meta = {"spec": json.dumps(spec_dict), "recipe_version": str(version)}
    save_file(tensors, str(path), metadata=meta)


def load_plan(path: Path, spec_dict: dict, version: int) -> list[dict] | None:
    """Per layer {shared, experts, router} if `path` holds a plan for this spec and recipe."""
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        if json.loads(meta.get("spec", "{}")) != spec_dict or meta.get("recipe_version") != str(
            version
        ):
            return None
        t = {k: f.get_tensor(k) for k in f.keys()}
    count = len({k.split(".")[1] for k in t})
    return [
        {
            "shared": t[f"layers.{i}.shared"].long(),
            "experts": t[f"layers.{i}.experts"].long(),
            "router": t[f"layers.{i}.router"],
        }
        for i in range(count)
    ]

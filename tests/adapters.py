"""Adapters for tests: a LoRA with random factors on a loaded model (both A and B non-zero, so that
every gradient and every output change is visible), and the same adapter in a transformers + peft
model."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridmoe.loader.adapter import save_adapter
from hybridmoe.models import lora as model_lora

ALL_TARGETS = "attention,experts,shared,mlp,router"


def random_adapter(model, name: str, targets: str | None = None, rank: int = 4, seed: int = 0):
    """Attach adapter `name` with factors ~ N(0, 0.1^2) to `model`'s `targets` (default: every
    group the model has); returns (targets, modules)."""
    chosen = model_lora.select(model, targets)
    modules = model_lora.attach(chosen, name, rank, alpha=2.0 * rank)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model_lora.parameters(modules):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return chosen, modules


def every_group(model) -> str:
    """The target groups `model` has, all of them."""
    return ",".join(sorted({t.group for t in model_lora.all_targets(model)}))


def peft_model(hf_model, adapter_dir: Path, trainable: bool = False):
    """transformers model + the adapter saved in `adapter_dir`, loaded by peft itself."""
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model, str(adapter_dir), is_trainable=trainable)


def save_random_adapter(model, out: Path, name: str = "a", targets: str | None = None, seed=0):
    chosen, modules = random_adapter(model, name, targets, seed=seed)
    save_adapter(model, chosen, modules, out, rank=4, alpha=8.0, base_model="tiny")
    return chosen, modules

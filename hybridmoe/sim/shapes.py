"""Model shapes for the simulator: the routed-expert geometry plus the weights that stay dense.

Named shapes are from each model's published config.json; `dense_params` (attention, embeddings,
shared experts: what lives on the GPU besides the expert cache) is total minus routed parameters,
from the model cards' totals.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.config import HFConfig
from hybridmoe.errors import ModelFileError, UserError
from hybridmoe.experts.plan.shape import ExpertShape, expert_shape


@dataclass(frozen=True)
class ModelShape:
    name: str
    experts: ExpertShape
    dense_params: float  # parameters outside the routed experts

    @property
    def num_moe_layers(self) -> int:
        return len(self.experts.moe_layers)

    def routed_params(self) -> float:
        e = self.experts
        return e.params_per_expert() * e.num_experts * self.num_moe_layers


def _named(name, hidden, inter, experts, k, layers, first_moe, total_params) -> ModelShape:
    shape = ExpertShape(hidden, inter, experts, k, tuple(range(first_moe, layers)))
    routed = shape.params_per_expert() * experts * (layers - first_moe)
    return ModelShape(name, shape, max(0.0, total_params - routed))


SHAPES = {
    # Qwen3-30B-A3B: 48 layers, 128 experts top-8, moe_intermediate 768, 30.5 B total
    "qwen3-30b-a3b": _named("qwen3-30b-a3b", 2048, 768, 128, 8, 48, 0, 30.5e9),
    # DeepSeek-V3: 61 layers of which the first 3 dense, 256 routed top-8, 2048 wide, 671 B total
    "deepseek-v3": _named("deepseek-v3", 7168, 2048, 256, 8, 61, 3, 671e9),
    # Mixtral-8x7B: 32 layers, 8 experts top-2, intermediate 14336, 46.7 B total
    "mixtral-8x7b": _named("mixtral-8x7b", 4096, 14336, 8, 2, 32, 0, 46.7e9),
    # OLMoE-1B-7B: 16 layers, 64 experts top-8, intermediate 1024, 6.9 B total
    "olmoe-1b-7b": _named("olmoe-1b-7b", 2048, 1024, 64, 8, 16, 0, 6.9e9),
    # gpt-oss-120b: 36 layers, 128 experts top-4, intermediate 2880, 116.8 B total
    "gpt-oss-120b": _named("gpt-oss-120b", 2880, 2880, 128, 4, 36, 0, 116.8e9),
}


def get_shape(name_or_path: str) -> ModelShape:
    if name_or_path in SHAPES:
        return SHAPES[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UserError(
            f"unknown model shape {name_or_path!r}; use one of {', '.join(SHAPES)} or a "
            "config.json path"
        )
    try:
        return shape_from_config(json.loads(path.read_text()), path.parent.name or str(path))
    except json.JSONDecodeError:
        raise UserError(f"{path} is not valid JSON; pass a Hugging Face config.json") from None


def shape_from_config(cfg: dict, name: str) -> ModelShape:
    """A model's shape from its config.json: the engine's own reading of it (experts/plan/shape.py),
    dense layers between MoE layers included, and an estimate of the dense part."""
    hf = HFConfig(cfg)
    try:
        experts = expert_shape(hf)
    except ModelFileError as e:
        raise UserError(f"config.json of {name}: {e}") from None
    if experts is None:
        raise UserError(
            f"config.json of {name} has no num_experts (nor n_routed_experts, num_local_experts); "
            "is it an MoE model?"
        )
    hidden, layers = experts.hidden, hf.get("num_hidden_layers")
    # Dense part estimated: embeddings and head, plus ~4 hidden^2 of attention per layer.
    dense = 2 * int(hf.get("vocab_size", default=0)) * hidden + layers * 4 * hidden * hidden
    return ModelShape(name, experts, float(dense))

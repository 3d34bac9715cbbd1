"""The geometry of a model's routed experts, and the one function that reads it from config.json."""

from __future__ import annotations

from dataclasses import dataclass

Key = tuple[int, int]  # (layer, expert); layer is the decoder-layer index the engine uses


@dataclass(frozen=True)
class ExpertShape:
    """The geometry of the routed experts of one model."""

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]  # indices of the decoder layers that have routed experts

    def params_per_expert(self) -> int:
        return expert_params(self.hidden, self.intermediate)


def expert_params(hidden: int, intermediate: int) -> int:
    """Weights of one SwiGLU expert: gate and up [I, H], down [H, I]."""
    return 3 * hidden * intermediate


def is_moe_layer(cfg, i: int) -> bool:
    """Whether decoder layer i has routed experts. Each architecture spaces its dense layers with
    its own keys, absent (neutral) elsewhere: DeepSeek `first_k_dense_replace` and
    `moe_layer_freq` (i % freq == 0), Qwen-MoE `decoder_sparse_step` ((i + 1) % step == 0) and
    `mlp_only_layers`."""
    if i < cfg.get("first_k_dense_replace", default=0):
        return False
    if i % cfg.get("moe_layer_freq", default=1) or (i + 1) % cfg.get(
        "decoder_sparse_step", default=1
    ):
        return False
    return i not in set(cfg.get("mlp_only_layers", default=[]))


def expert_shape(cfg) -> ExpertShape | None:
    """The routed experts of the model `cfg` describes (an HFConfig), or None for a dense model.

    An expert's width is `moe_intermediate_size` where the model also has dense MLPs (Qwen-MoE,
    DeepSeek), else `intermediate_size` (Mixtral, OLMoE: the experts are the only MLPs)."""
    experts = cfg.get("n_routed_experts", "num_experts", "num_local_experts", default=0)
    if not experts or experts <= 0:
        return None
    layers = cfg.get("num_hidden_layers")
    return ExpertShape(
        hidden=cfg.get("hidden_size"),
        intermediate=cfg.get("moe_intermediate_size", "intermediate_size"),
        num_experts=experts,
        top_k=cfg.get("num_experts_per_tok"),
        moe_layers=tuple(i for i in range(layers) if is_moe_layer(cfg, i)),
    )

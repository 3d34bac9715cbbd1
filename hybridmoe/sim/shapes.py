"""Model shapes for the simulator: the routed-expert geometry plus the parts that stay dense.

Named shapes are from each model's published config.json. Besides the routed experts a shape
says what every token reads outside them: per decoder layer its attention weights (`attn_params`),
its dense MLP or shared experts (`mlp_params`, summed over all layers) and the KV cache entries per
token (`kv_dim` values per layer); per token the output head (`vocab` x `hidden`).
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
    layers: int = 0  # decoder layers (MoE and dense)
    attn_params: float = 0.0  # attention weights of one decoder layer (with its router)
    mlp_params: float = 0.0  # dense MLPs and shared experts, all layers together
    kv_dim: int = 0  # KV-cache values one token adds to one layer (K and V, or MLA's latent)
    vocab: int = 0

    @property
    def num_moe_layers(self) -> int:
        return len(self.experts.moe_layers)

    def routed_params(self) -> float:
        e = self.experts
        return e.params_per_expert() * e.num_experts * self.num_moe_layers

    def head_params(self) -> float:
        return float(self.vocab * self.experts.hidden)


def _gqa(hidden: int, heads: int, kv_heads: int, head_dim: int, experts: int) -> float:
    """q, k, v, o projections and the router of one layer."""
    return hidden * head_dim * (2 * heads + 2 * kv_heads) + hidden * experts


def _mla(hidden, heads, q_lora, kv_lora, nope, rope, v_dim, experts) -> float:
    """DeepSeek's multi-head latent attention (q through a rank-q_lora bottleneck when q_lora)."""
    q = (
        hidden * q_lora + q_lora * heads * (nope + rope)
        if q_lora
        else hidden * heads * (nope + rope)
    )
    kv = hidden * (kv_lora + rope) + kv_lora * heads * (nope + v_dim)
    return q + kv + heads * v_dim * hidden + hidden * experts


def _named(name, hidden, inter, experts, k, layers, first_moe, total, attn, kv_dim, vocab, mlp):
    shape = ExpertShape(hidden, inter, experts, k, tuple(range(first_moe, layers)))
    routed = shape.params_per_expert() * experts * (layers - first_moe)
    return ModelShape(
        name, shape, max(0.0, total - routed), layers, float(attn), float(mlp), kv_dim, vocab
    )


SHAPES = {
    # Qwen3-30B-A3B: 48 layers, 128 experts top-8, moe_intermediate 768, 30.5 B total; 32 query /
    # 4 KV heads of 128; vocab 151936
    "qwen3-30b-a3b": _named(
        "qwen3-30b-a3b", 2048, 768, 128, 8, 48, 0, 30.5e9, _gqa(2048, 32, 4, 128, 128),
        2 * 4 * 128, 151936, 0,
    ),
    # Qwen3.5-35B-A3B (model card: 40 layers, 256 experts top-8, hidden 2048): est.
    # moe_intermediate 512 and one shared expert of 512, which give its published 34.66 B total;
    # attention taken as 16 / 2 heads of 256 for every layer (30 of its 40 are linear attention)
    "qwen3.5-35b-a3b": _named(
        "qwen3.5-35b-a3b", 2048, 512, 256, 8, 40, 0, 34.66e9, _gqa(2048, 16, 2, 256, 256),
        2 * 2 * 256, 248320, 40 * 3 * 2048 * 512,
    ),
    # DeepSeek-V3: 61 layers of which the first 3 dense (MLP 18432), 256 routed top-8 and one
    # shared expert of 2048, hidden 7168, MLA (128 heads, q_lora 1536, kv_lora 512, 128 + 64 / 128),
    # 671 B total, vocab 129280
    "deepseek-v3": _named(
        "deepseek-v3", 7168, 2048, 256, 8, 61, 3, 671e9,
        _mla(7168, 128, 1536, 512, 128, 64, 128, 256), 512 + 64, 129280,
        3 * 3 * 7168 * 18432 + 58 * 3 * 7168 * 2048,
    ),
    # DeepSeek-V2-Lite (and Coder-V2-Lite): 27 layers, the first dense (MLP 10944), 64 routed top-6
    # and two shared experts of 1408, hidden 2048, MLA without q_lora (16 heads, kv_lora 512),
    # 15.7 B total, vocab 102400
    "deepseek-v2-lite": _named(
        "deepseek-v2-lite", 2048, 1408, 64, 6, 27, 1, 15.7e9,
        _mla(2048, 16, 0, 512, 128, 64, 128, 64), 512 + 64, 102400,
        3 * 2048 * 10944 + 26 * 2 * 3 * 2048 * 1408,
    ),
    # Mixtral-8x7B: 32 layers, 8 experts top-2, intermediate 14336, 46.7 B total; 32 / 8 heads of
    # 128; vocab 32000
    "mixtral-8x7b": _named(
        "mixtral-8x7b", 4096, 14336, 8, 2, 32, 0, 46.7e9, _gqa(4096, 32, 8, 128, 8),
        2 * 8 * 128, 32000, 0,
    ),
    # OLMoE-1B-7B: 16 layers, 64 experts top-8, intermediate 1024, 6.9 B total; 16 heads of 128
    # (no GQA); vocab 50304
    "olmoe-1b-7b": _named(
        "olmoe-1b-7b", 2048, 1024, 64, 8, 16, 0, 6.9e9, _gqa(2048, 16, 16, 128, 64),
        2 * 16 * 128, 50304, 0,
    ),
    # gpt-oss-120b: 36 layers, 128 experts top-4, intermediate 2880, 116.8 B total; 64 / 8 heads
    # of 64; vocab 201088
    "gpt-oss-120b": _named(
        "gpt-oss-120b", 2880, 2880, 128, 4, 36, 0, 116.8e9, _gqa(2880, 64, 8, 64, 128),
        2 * 8 * 64, 201088, 0,
    ),
}  # fmt: skip


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
    dense layers between MoE layers included, and its dense part (attention, shared experts,
    dense MLPs, head)."""
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
    heads = hf.get("num_attention_heads", default=max(1, hidden // 128))
    head_dim = hf.get("head_dim", default=hidden // heads)
    kv_heads = hf.get("num_key_value_heads", default=heads)
    kv_lora = hf.get("kv_lora_rank", default=0)
    if kv_lora:
        nope, rope = hf.get("qk_nope_head_dim", default=128), hf.get("qk_rope_head_dim", default=64)
        attn = _mla(
            hidden, heads, hf.get("q_lora_rank", default=0) or 0, kv_lora, nope, rope,
            hf.get("v_head_dim", default=128), experts.num_experts,
        )  # fmt: skip
        kv_dim = kv_lora + rope
    else:
        attn = _gqa(hidden, heads, kv_heads, head_dim, experts.num_experts)
        kv_dim = 2 * kv_heads * head_dim
    shared = hf.get("n_shared_experts", default=0) * experts.intermediate + hf.get(
        "shared_expert_intermediate_size", default=0
    )
    dense_layers = layers - len(experts.moe_layers)
    mlp = 3 * hidden * (shared * len(experts.moe_layers)) + dense_layers * 3 * hidden * int(
        hf.get("intermediate_size", default=0)
    )
    vocab = int(hf.get("vocab_size", default=0))
    heads_out = 1 if hf.get("tie_word_embeddings", default=False) else 2
    dense = heads_out * vocab * hidden + layers * attn + mlp
    return ModelShape(name, experts, float(dense), layers, float(attn), float(mlp), kv_dim, vocab)

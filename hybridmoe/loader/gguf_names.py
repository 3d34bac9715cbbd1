"""llama.cpp tensor names (blk.3.ffn_up_exps.weight) -> the Hugging Face names our models load.

The table is the reverse of gguf's TensorNameMap for the checkpoints we support. Routed experts,
which llama.cpp stacks into one [E, ...] tensor per layer and role, come out one per expert, named
as a saved Hugging Face checkpoint names them (Mixtral: block_sparse_moe.experts.E.w1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hybridmoe.errors import ModelFileError

_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP_LEVEL = re.compile(r"^(\w+)\.(weight|bias)$")
# Mixtral files from before llama.cpp stacked experts (early 2024) keep one tensor per expert
_LEGACY_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")

TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "{moe}.gate",
    "ffn_gate_shexp": "{shared}.gate_proj",
    "ffn_up_shexp": "{shared}.up_proj",
    "ffn_down_shexp": "{shared}.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}

# all experts of a layer in one tensor [E, rows, cols]; the value is the role
EXPERT_STACKS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}

# DeepSeek MLA: newer converters split kv_b_proj into these two halves (k_b transposed);
# we rejoin them
MLA_HALVES = ("attn_k_b", "attn_v_b")


@dataclass(frozen=True)
class Naming:
    """How one architecture's Hugging Face checkpoint names its MoE block."""

    moe: str = "mlp"
    roles: dict = field(
        default_factory=lambda: {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    )
    shared: str = "mlp.shared_expert"


NAMING = {
    "mixtral": Naming(moe="block_sparse_moe", roles={"gate": "w1", "up": "w3", "down": "w2"}),
    "deepseek_v2": Naming(shared="mlp.shared_experts"),
    "deepseek_v3": Naming(shared="mlp.shared_experts"),
}


def split(name: str, where: str) -> tuple[int | None, str, str]:
    """blk.3.attn_q.weight -> (3, 'attn_q', 'weight');
    output.weight -> (None, 'output', 'weight')."""
    m = _BLOCK.match(name)
    if m:
        return int(m[1]), m[2], m[3]
    m = _TOP_LEVEL.match(name)
    if m:
        return None, m[1], m[2]
    raise ModelFileError(f"{where}: tensor {name!r} is not a llama.cpp tensor name hybridmoe knows")


def hf_name(layer: int | None, base: str, suffix: str, naming: Naming, where: str) -> str:
    """The Hugging Face name of a non-expert tensor."""
    if layer is None and base in TOP:
        return f"{TOP[base]}.{suffix}"
    if layer is not None and base == "exp_probs_b":
        return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    if layer is not None and base in LAYER:
        name = LAYER[base].format(moe=naming.moe, shared=naming.shared)
        return f"model.layers.{layer}.{name}.{suffix}"
    if (
        base == "rope_freqs"
    ):  # Llama 3.1 frequency factors: our rotary takes them only from a config
        raise ModelFileError(
            f"{where}: llama3-style rope_freqs factors in GGUF are not supported yet; "
            "load the Hugging Face checkpoint instead"
        )
    raise ModelFileError(
        f"{where}: tensor {base!r} is not one hybridmoe knows for this architecture"
    )


def legacy_expert(name: str) -> tuple[int, int, str] | None:
    """blk.3.ffn_up.7.weight -> (3, 7, 'up'); None for any other name."""
    m = _LEGACY_EXPERT.match(name)
    return (int(m[1]), int(m[3]), m[2]) if m else None


def expert_name(layer: int, expert: int, role: str, naming: Naming) -> str:
    return f"model.layers.{layer}.{naming.moe}.experts.{expert}.{naming.roles[role]}.weight"

"""What a model's weights take in RAM in each GGUF file format, in real block sizes: every tensor
in the type llama.cpp's converter and llama-quantize give it (export/gguf_types.py: Q4_K_M's Q6_K
for some layers' ffn_down and the output head, fallbacks where rows do not fill 256-blocks), at its
blocks' bytes, scales included. The engine keeps a GGUF file's blocks as they are, so this is what
it holds (the dense part, known to the shape only as parameter counts, is costed as attention's
type).
"""

from __future__ import annotations

import gguf

from hybridmoe.export.gguf_types import Mix
from hybridmoe.sim.shapes import ModelShape

# The file formats `hybridmoe plan` weighs, as `hybridmoe export --format gguf-...` writes them.
FILE_FORMATS = ("bf16", "q8_0", "q4_k_m")
# The name of the format most of the routed experts' bytes are in (the cost model's).
EXPERT_FORMAT = {"bf16": "bf16", "q8_0": "q8_0", "q4_k_m": "q4_k"}


def tensor_bytes(qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> float:
    """Bytes of a tensor of `shape` (torch order, rows of shape[-1]) stored as `qtype`."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return float(rows * (shape[-1] // block) * size)


def _mix(shape: ModelShape, fmt: str) -> Mix:
    return Mix(f"gguf-{fmt}", shape.layers, shape.experts.num_experts, shape.layers, False)


def routed_bytes(shape: ModelShape, fmt: str) -> float:
    """All routed experts' bytes in file format `fmt`, layer by layer as llama-quantize types
    them."""
    e, mix, total = shape.experts, _mix(shape, fmt), 0.0
    stacks = (("gate", e.intermediate, e.hidden), ("up", e.intermediate, e.hidden))
    stacks += (("down", e.hidden, e.intermediate),)
    for layer in e.moe_layers:
        for name, rows, cols in stacks:
            dims = (e.num_experts, rows, cols)
            total += tensor_bytes(
                mix.choose(f"blk.{layer}.ffn_{name}_exps.weight", dims, layer), dims
            )
    return total


def dense_bytes(shape: ModelShape, fmt: str) -> float:
    """Bytes of everything but the routed experts: the output head and the token embeddings in
    their own types, the rest of the dense parameters at attention's (attn_q's) bytes per weight."""
    mix, hidden = _mix(shape, fmt), shape.experts.hidden
    table = (shape.vocab, hidden)
    head = tensor_bytes(mix.choose("output.weight", table, None), table) if shape.vocab else 0.0
    embed = (
        tensor_bytes(mix.choose("token_embd.weight", table, None), table) if shape.vocab else 0.0
    )
    row = (1, hidden)
    per_weight = tensor_bytes(mix.choose("blk.0.attn_q.weight", row, 0), row) / hidden
    rest = max(0.0, shape.dense_params - 2 * shape.head_params())
    return head + embed + rest * per_weight

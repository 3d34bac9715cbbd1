"""The part of each step that is not routed experts: attention over the context, shared experts and
dense MLPs, norms, the router, and the output head.

It runs where the design puts it, on the GPU when there is one (its bandwidth), else on the CPU.
A decoder layer reads its dense weights once per step and, per sequence in the batch, the KV cache
of its context; every small kernel costs at least `c_kernel` (launch and execution floor), and a
layer runs `tuning.DENSE_KERNELS_PER_LAYER` of them. The head reads vocab x hidden weights once
per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmoe import tuning
from hybridmoe.experts.plan.cost_model import CostModel, quant_bytes
from hybridmoe.sim.shapes import ModelShape

KV_BYTES = 2.0  # the KV cache kept in fp16 / bf16, as llama.cpp and KTransformers do by default


@dataclass(frozen=True)
class DenseCost:
    per_layer_s: float  # one MoE layer's dense work for one step
    per_step_s: float  # the output head and the dense-only decoder layers, once a step


def dense_cost(
    shape: ModelShape, cost: CostModel, quant: str, sequences: int, context: int
) -> DenseCost:
    """Seconds of dense work, for a step of `sequences` decode tokens each with `context` tokens
    before it; zero for a shape that says nothing of its dense part."""
    if not shape.layers:
        return DenseCost(0.0, 0.0)
    gpu = cost.has_gpu
    bw, flops = (cost.bw_gpu, cost.f_gpu) if gpu else (cost.bw_cpu, cost.f_cpu)
    qb = quant_bytes(quant)
    floor = tuning.DENSE_KERNELS_PER_LAYER * (cost.c_kernel if gpu else cost.c_cpu)
    kv = sequences * context * shape.kv_dim * KV_BYTES

    def layer(params: float) -> float:
        stream = (params * qb + kv) / bw
        return max(stream, 2.0 * params * sequences / flops) + floor

    mlp = shape.mlp_params / max(1, shape.layers)  # dense MLPs and shared experts, spread evenly
    moe = layer(shape.attn_params + mlp)
    dense_layers = shape.layers - shape.num_moe_layers
    head = shape.head_params() * qb / bw + (cost.c_kernel if gpu else cost.c_cpu)
    return DenseCost(moe, head + dense_layers * layer(shape.attn_params + mlp))

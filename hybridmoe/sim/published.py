"""Published decode figures of MoE models on CPU+GPU machines, and the simulator's prediction for
each setting: the check that the simulator's physics match real machines.

Each row names the model shape, weight format, hardware profile (profiles.py: one per machine,
from spec sheets and published measurements, never tuned to the row) and the published setting,
simulated as it ran: llama.cpp's `--cpu-moe` as the `cpu` policy (every routed expert on the CPU,
the rest on the GPU), `--n-cpu-moe N` as `static` with whole layers on the GPU (front-loading
placement, a budget of the GPU's layers), KTransformers with no GPU experts as `cpu`, a model held
whole on the GPU as `static` at budget 1. Routing comes from a synthetic trace of the shape: these
settings place whole layers, so which experts a token picks does not change their time.

What the published engines do differently from hybridmoe's, the same for every row of an engine:
neither runs a Python planner (no planning time), and llama.cpp runs all of a layer's GPU experts
in one fused kernel per matrix (MUL_MAT_ID for gate, up and down, and the activation:
`LLAMA_CPP_MOE_KERNELS` small kernels a layer) instead of a kernel call per expert.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.sim.advisor import synthetic_for
from hybridmoe.sim.shapes import get_shape
from hybridmoe.sim.simulator import SimConfig, simulate


@dataclass(frozen=True)
class Published:
    model: str  # as published
    shape: str  # sim/shapes.py
    quant: str  # the experts' format, simulated
    hardware: str  # profiles.py
    machine: str  # as published
    engine: str  # engine and setting, as published
    policy: str
    budget: str
    placement: str | None
    context: int  # tokens of context while decoding (prompt plus half the output)
    tok_s: float  # published decode tok/s
    source: str


ROWS = (
    Published(
        "Qwen3-30B-A3B Q4_K_M", "qwen3-30b-a3b", "q4", "rtx4090-ddr5",
        "RTX 4090 24 GB", "llama.cpp (Ollama), whole model on the GPU", "static", "1.0", None,
        256, 196.0,
        "https://runaihome.com/blog/qwen3-30b-a3b-local-ai-guide-2026/",
    ),
    Published(
        "Qwen3.5-35B-A3B Q4_K_M", "qwen3.5-35b-a3b", "q4", "rtx4070-ddr5",
        "RTX 4070 12 GB, DDR5 desktop (CPU not named), 31 GB", "llama.cpp -ngl 99 --cpu-moe",
        "cpu", "0", None, 256, 34.6,
        "https://kenimoto.dev/blog/rtx-4070-cpu-moe-flag-2-8x-tokens/",
    ),
    Published(
        "Qwen3-30B-A3B-Instruct-2507 Q4_K_M", "qwen3-30b-a3b", "q4", "rtx2080-i9-10900x",
        "RTX 2080 8 GB, i9-10900X, quad-channel DDR4 (~102 GB/s)",
        "llama.cpp -ngl 99 --n-cpu-moe 36", "static", str(12 / 48), "front-loading", 160, 36.7,
        "https://github.com/AlexsJones/llmfit/pull/755",
    ),
    Published(
        "DeepSeek-Coder-V2-Lite-Instruct Q4_K_M", "deepseek-v2-lite", "q4", "rtx2080-i9-10900x",
        "RTX 2080 8 GB, i9-10900X, quad-channel DDR4 (~102 GB/s)",
        "llama.cpp --n-cpu-moe 16", "static", str(10 / 26), "front-loading", 160, 49.6,
        "https://github.com/AlexsJones/llmfit/pull/778",
    ),
    Published(
        "DeepSeek-V3 Q4_K_M", "deepseek-v3", "q4", "xeon6454s-4090d",
        "RTX 4090D 24 GB, one Xeon Gold 6454S (32 cores), 8 x DDR5-4800",
        "KTransformers v0.2, 8 experts, single socket", "cpu", "0", None, 650, 8.73,
        "https://github.com/kvcache-ai/ktransformers/blob/main/doc/en/DeepseekR1_V3_tutorial.md",
    ),
)  # fmt: skip


@dataclass(frozen=True)
class Check:
    row: Published
    predicted: float

    @property
    def error(self) -> float:
        return self.predicted / self.row.tok_s - 1.0


LLAMA_CPP_MOE_KERNELS = 4  # gate, up and down MUL_MAT_ID, and the activation


def check(row: Published, tokens: int = 64) -> Check:
    shape = get_shape(row.shape)
    cost = get_profile(row.hardware).for_expert(shape.experts, row.quant)
    extra = 0.0
    if row.engine.startswith("llama.cpp") and cost.has_gpu:
        cost = replace(cost, c_gpu=0.0)
        extra = LLAMA_CPP_MOE_KERNELS * cost.c_kernel
    cfg = SimConfig(
        policy=row.policy,
        budget=row.budget,
        placement=row.placement,
        context=row.context,
        plan_us=0.0,
        dense_s=extra,
    )
    r = simulate(synthetic_for(shape, tokens), shape, cost, cfg)
    return Check(row, r.tokens_per_s)

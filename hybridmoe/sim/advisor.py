"""`hybridmoe plan`: which quantisation, GPU expert budget and policy are fastest on a machine.

For each GGUF file format (bf16, q8_0, q4_k_m): does the model fit in RAM; what VRAM is left for
experts once the dense weights, the KV-cache reserve and the runtime overhead are on the GPU; then
the simulator runs the candidate policies at that budget (on the given trace, or a synthetic one of
the model's shape) and the fastest wins; the simulator charges the dense part (sim/dense.py).
Sizes are the formats' real block sizes, tensor by tensor as llama.cpp types them
(sim/file_bytes.py): the bytes the engine keeps a file's weights in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hybridmoe.experts.plan.host_memory import runtime_pinned_bytes
from hybridmoe.experts.plan.profiles import MEMORY_GB, get_profile
from hybridmoe.sim.file_bytes import EXPERT_FORMAT, FILE_FORMATS, dense_bytes, routed_bytes
from hybridmoe.sim.shapes import ModelShape
from hybridmoe.sim.simulator import SimConfig, simulate
from hybridmoe.sim.synthetic import SynthConfig, generate

GB = 1e9
RUNTIME_OVERHEAD_GB = 1.0  # CUDA context, activations, staging buffers (est.)
RAM_OVERHEAD_GB = 4.0  # OS and the Python process (est.)
STEP_TOKENS = 512  # the largest step the pinned activation buffers are sized for (a prefill chunk)


@dataclass
class Option:
    quant: str
    fits_ram: bool
    ram_needed_gb: float  # experts (and the dense model without a GPU), pinned buffers, overhead
    pinned_gb: float  # of it, page-locked: the staging ring and the activation buffers
    expert_budget: float  # fraction of routed-expert bytes on the GPU
    expert_gb_on_gpu: float
    kv_gb: float  # VRAM left for the KV cache (at least the reserve, more when all experts fit)
    policy: str = ""
    tokens_per_s: float = 0.0
    hit_rate: float = 0.0


def budget_for(shape: ModelShape, quant: str, vram_gb: float, kv_gb: float) -> tuple[float, float]:
    """(fraction of expert bytes that fits, GB it takes) after dense weights and the KV reserve,
    for the model in file format `quant`."""
    dense_gb = dense_bytes(shape, quant) / GB
    experts_gb = routed_bytes(shape, quant) / GB
    left = max(0.0, vram_gb - dense_gb - kv_gb - RUNTIME_OVERHEAD_GB)
    frac = min(1.0, left / experts_gb) if experts_gb else 0.0
    return frac, frac * experts_gb


def advise(
    shape: ModelShape,
    hardware: str,
    vram_gb: float | None,
    ram_gb: float | None,
    lines=None,
    quants=FILE_FORMATS,
    policies=("static", "hybrimoe", "value"),
    kv_gb: float | None = None,
    progress: bool = False,
) -> list[Option]:
    """Each quantisation's option, its policy the fastest of `policies` in simulation (a bar on
    stderr with `progress`: a large shape takes minutes)."""
    from tqdm import tqdm

    base = get_profile(hardware)
    default_vram, default_ram = MEMORY_GB.get(hardware, (0.0, 64.0))
    vram = default_vram if vram_gb is None else vram_gb
    ram = default_ram if ram_gb is None else ram_gb
    kv = max(1.0, 0.1 * vram) if kv_gb is None else kv_gb
    lines = lines or synthetic_for(shape)
    options = []
    bar = tqdm(
        total=len(quants) * len(policies), desc="simulating", unit="run", disable=not progress
    )
    for quant in quants:
        routed, dense_gb = routed_bytes(shape, quant), dense_bytes(shape, quant) / GB
        per_expert = routed / max(1, shape.experts.num_experts * shape.num_moe_layers)
        pinned = pinned_gb(shape, per_expert) if base.has_gpu and vram else 0.0
        need = routed / GB + (0 if vram else dense_gb) + pinned + RAM_OVERHEAD_GB
        frac, on_gpu = budget_for(shape, quant, vram, kv) if base.has_gpu and vram else (0.0, 0.0)
        kv_left = max(0.0, vram - dense_gb - on_gpu - RUNTIME_OVERHEAD_GB) if vram else 0.0
        opt = Option(quant, need <= ram, need, pinned, round(frac, 4), on_gpu, kv_left)
        cost = base.for_expert(shape.experts, EXPERT_FORMAT[quant], per_expert)
        for policy in policies if frac > 0 else ("cpu",):
            r = simulate(lines, shape, cost, SimConfig(policy=policy, budget=str(frac)))
            if r.tokens_per_s > opt.tokens_per_s:
                opt.policy, opt.tokens_per_s, opt.hit_rate = policy, r.tokens_per_s, r.hit_rate
        bar.update(len(policies))
        options.append(opt)
    bar.close()
    return options


def pinned_gb(shape: ModelShape, expert_bytes: float) -> float:
    """GB of page-locked host memory the hybrid runtime takes for this shape, experts of
    `expert_bytes` each (host_memory.py)."""
    e = shape.experts
    return runtime_pinned_bytes(expert_bytes, e.hidden, STEP_TOKENS, e.top_k) / GB


def synthetic_for(shape: ModelShape, tokens: int = 120):
    e = shape.experts
    return generate(
        SynthConfig(
            layers=shape.num_moe_layers,
            experts=e.num_experts,
            top_k=e.top_k,
            tokens=tokens,
            skew=1.0,
            locality=0.4,
            drift=60,
            seed=0,
        )
    )


def best(options: list[Option]) -> Option | None:
    fitting = [o for o in options if o.fits_ram]
    return max(fitting, key=lambda o: o.tokens_per_s) if fitting else None


def to_json(options: list[Option]) -> list[dict]:
    return [asdict(o) for o in options]

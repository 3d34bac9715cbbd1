"""Whether an accelerator path gives the CPU's tokens on this machine, checked once and cached:
`--device auto` takes CUDA only where this check passed, so a GPU whose path has never run here
(a driver, a torch build, a kernel that differs) is never the silent default.

The check builds a tiny Qwen3-MoE of seeded random weights (no download), decodes a prompt
greedily on the CPU runtime and on the hybrid runtime on the device at GPU expert budgets 0, 0.5
and 1 (every expert on the CPU, mixed, every expert on the GPU), and passes when every run gives
the CPU's tokens. The result is kept per device, GPU name and torch version in the user cache.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import torch

from hybridmoe.files import write_atomic
from hybridmoe.paths import user_cache_dir

log = logging.getLogger("hybridmoe")

CHECK_CONFIG = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
PROMPT = [3, 17, 5, 42, 8, 11, 2, 29, 64, 7]
TOKENS = 16
BUDGETS = ("0", "0.5", "1.0")


def check_path(device: str) -> Path:
    """The cached result's file: per device kind, GPU name and torch version."""
    name = torch.cuda.get_device_name() if device == "cuda" else device
    slug = "".join(c if c.isalnum() else "-" for c in f"{name}-torch{torch.__version__}")
    return user_cache_dir() / f"device-check-{device}-{slug}.json"


def verified(device: str) -> bool:
    """Whether `device`'s path gives the CPU's greedy tokens here: measured once, then cached."""
    path = check_path(device)
    if path.exists():
        try:
            return bool(json.loads(path.read_text())["passed"])
        except (ValueError, KeyError):
            pass  # a broken file is checked again
    log.warning(
        "checking once that the %s path gives the CPU's tokens (cached in %s)", device, path
    )
    passed, detail = run_check(device)
    if not passed:
        log.warning("the %s path failed its check (%s); experts run on the CPU", device, detail)
    write_atomic(path, json.dumps({"device": device, "passed": passed, "detail": detail}) + "\n")
    return passed


def run_check(device: str) -> tuple[bool, str]:
    """(passed, what was seen): the CPU's greedy tokens against the device's at each budget."""
    from hybridmoe.engine.generate import generate_ids
    from hybridmoe.engine.sampler import SamplingParams
    from hybridmoe.loader import load_model

    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    try:
        with tempfile.TemporaryDirectory() as d:
            write_check_model(Path(d))
            reference = list(generate_ids(load_model(d, progress=False), PROMPT, greedy))
            for budget in BUDGETS:
                model = load_model(d, runtime_factory=_factory(device, budget), progress=False)
                got = list(generate_ids(model, PROMPT, greedy))
                model.runtime.close()
                if got != reference:
                    return False, f"budget {budget}: {got} instead of the CPU's {reference}"
    except Exception as e:  # any failure of the path is a failed check, not a crash
        return False, f"{type(e).__name__}: {e}"
    return True, f"{len(BUDGETS)} budgets, {TOKENS} tokens each, equal to the CPU's"


def _factory(device: str, budget: str):
    from hybridmoe import tuning
    from hybridmoe.experts.plan.profiles import get_profile
    from hybridmoe.experts.run.hybrid_runtime import HybridConfig, make_runtime

    config = HybridConfig(device=device, policy="value", budget=budget, cpu_clock="model")
    cost = get_profile(tuning.EMULATED_GPU)
    return lambda shape, dtype: make_runtime(shape, dtype, config, cost)


def write_check_model(out: Path) -> None:
    """The check's model: CHECK_CONFIG with seeded N(0, 0.05) weights (norms 1), as safetensors."""
    from safetensors.torch import save_file

    from hybridmoe.config import HFConfig
    from hybridmoe.experts.plan.shape import expert_shape
    from hybridmoe.models import model_class

    cfg = HFConfig(CHECK_CONFIG)
    shape = expert_shape(cfg)
    with torch.device("meta"):
        dense = model_class(cfg)(cfg, None)  # no runtime: its parameters are the dense ones
    g = torch.Generator().manual_seed(0)

    def draw(*size):
        return torch.randn(*size, generator=g) * 0.05

    tensors = {}
    for name, p in dense.named_parameters():
        key = name if name.startswith("lm_head") else f"model.{name}"
        tensors[key] = torch.ones(p.shape) if name.endswith("norm.weight") else draw(*p.shape)
    h, i = shape.hidden, shape.intermediate
    for layer in shape.moe_layers:
        for e in range(shape.num_experts):
            pre = f"model.layers.{layer}.mlp.experts.{e}"
            tensors[f"{pre}.gate_proj.weight"] = draw(i, h)
            tensors[f"{pre}.up_proj.weight"] = draw(i, h)
            tensors[f"{pre}.down_proj.weight"] = draw(h, i)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(CHECK_CONFIG))

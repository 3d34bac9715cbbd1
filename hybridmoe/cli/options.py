"""Options shared by the commands that load a model, and the one place that turns them into objects."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from hybridmoe.errors import UserError

# Below this hidden size one torch thread decodes faster than two on the 2-core machine, at batch 1
# and batch 8 (demo model, hidden 576: 23.7 vs 20.2 tok/s, batch-8 step 77 vs 213 ms); at hidden
# 2048 two threads win (36.1 vs 28.2 tok/s). docs/benchmarks.md, 2026-11-21.
WIDE_MODEL = 1024

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="PATH",
                   help="Hugging Face directory or .gguf file (default: the built-in demo model, built on first use)")
    g.add_argument("--tokenizer", metavar="DIR", help="take the tokenizer and chat template from this directory")
    g.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="weights and compute dtype (auto: bfloat16 where the CPU multiplies bf16 natively, "
                        "AVX512-BF16 or AMX, else float32)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: 1 for models narrower than "
                   f"{WIDE_MODEL} hidden units, else all cores)")
    add_runtime_options(p)


POLICIES = ("cpu", "static", "fiddler", "hybrimoe", "lru", "lfu", "value")
PLACEMENTS = ("uniform", "frequency", "front-loading")


def add_runtime_options(p: argparse.ArgumentParser) -> None:
    """Options of the expert runtime (where experts run): experts/hybrid_runtime.py."""
    g = p.add_argument_group("expert placement (CPU/GPU)")
    g.add_argument("--gpu-expert-budget", metavar="SIZE", default=None,
                   help="GPU memory for routed experts: bytes (6GB) or a fraction of all expert bytes (0.1)")
    g.add_argument("--policy", choices=POLICIES, default=None,
                   help="where experts run and what the GPU keeps (default: value with a budget, else cpu)")
    g.add_argument("--placement", choices=PLACEMENTS, default=None,
                   help="experts placed on the GPU at start (default: the policy's own)")
    g.add_argument("--device", choices=("auto", "cuda", "emulated"), default="auto",
                   help="the accelerator: CUDA, or an emulated GPU over CPU memory (auto: CUDA when present)")
    g.add_argument("--calibration", metavar="FILE",
                   help="cost profile from `hybridmoe calibrate` (default: measured once and cached)")
    g.add_argument("--expert-stats", metavar="FILE", help="activation statistics for placement and warm start")
    g.add_argument("--expert-stats-out", metavar="FILE", help="write this run's activation statistics here")
    g.add_argument("--routing-trace", metavar="FILE",
                   help="take expert choices from this routing trace (JSONL) instead of the router")
    g.add_argument("--record-trace", metavar="FILE",
                   help="record this run's routing as a JSONL trace: a line per decode token, with its request id")


def _device(args: argparse.Namespace) -> str:
    if args.device == "emulated":
        return "emulated"
    if torch.cuda.is_available():
        return "cuda"
    if args.device == "cuda":
        raise UserError("--device cuda: no CUDA GPU is visible to torch; use --device emulated or leave it out")
    if args.gpu_expert_budget:
        print("hybridmoe: no CUDA GPU, every expert runs on the CPU (--device emulated emulates one)", file=sys.stderr)
    return "cpu"


def runtime_factory(args: argparse.Namespace):
    """The expert runtime the options ask for; None means the plain CPU runtime."""
    wanted = [args.gpu_expert_budget, args.policy, args.placement, args.expert_stats, args.expert_stats_out,
              args.routing_trace, args.record_trace, args.calibration, args.device != "auto",
              getattr(args, "stats", False)]
    if not any(wanted):
        return None
    from hybridmoe.experts.cache import parse_budget
    from hybridmoe.experts.calibrate import load_or_calibrate
    from hybridmoe.experts.hybrid_runtime import HybridConfig, HybridRuntime

    budget = args.gpu_expert_budget or "0"
    parse_budget(budget, 1.0, 1.0)  # a malformed budget fails now, not after loading
    config = HybridConfig(
        policy=args.policy or ("value" if args.gpu_expert_budget else "cpu"), budget=budget,
        placement=args.placement, device=_device(args), expert_stats=args.expert_stats,
        expert_stats_out=args.expert_stats_out, routing_trace=args.routing_trace, record_trace=args.record_trace)

    def make(shape, dtype):
        # The cached profile is per expert shape: measured on this model's experts among others.
        cost = load_or_calibrate(args.calibration, dtype, model=(shape.hidden, shape.intermediate))
        return HybridRuntime(shape, dtype, config, cost)

    return make


def finish_runtime(model, args: argparse.Namespace) -> None:
    """After a command's run: print the runtime's stats if --stats, write its trace and statistics."""
    runtime = getattr(model, "runtime", None)
    if getattr(args, "stats", False) and hasattr(runtime, "refresh_stats"):
        print(runtime.refresh_stats().summary(), file=sys.stderr)
    if hasattr(runtime, "close"):
        runtime.close()


def model_path(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from hybridmoe.demo.cache import ensure_demo_model

    return str(ensure_demo_model())


def load_from_args(args: argparse.Namespace):
    """(model, tokenizer) for the model options in `args`."""
    from hybridmoe.loader import load_model, load_tokenizer

    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads {args.threads}: give a positive number of threads")
    path = model_path(args)
    torch.set_num_threads(args.threads or default_threads(path))
    tokenizer = load_tokenizer(path, args.tokenizer)
    model = load_model(path, dtype=compute_dtype(args.dtype), runtime_factory=runtime_factory(args),
                       progress=True)
    return model, tokenizer


def compute_dtype(name: str) -> torch.dtype:
    """--dtype's value as a torch dtype. auto is bf16 on CPUs with bf16 dot products: there a bf16
    matrix product runs ~4x faster than fp32 on one core (oneDNN, [512, 576] x [576, 1536]: 2.2 vs
    9.7 ms) and decode reads half the bytes; the demo model's held-out perplexity moves from 8.161 to
    8.200 (docs/benchmarks.md). Elsewhere bf16 would be emulated, slower than fp32."""
    if name != "auto":
        return DTYPES[name]
    from hybridmoe.native import cpu_has_native_bf16

    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def default_threads(path: str) -> int:
    """All cores, except for narrow models whose per-op work is too small to split."""
    from hybridmoe.loader import model_config

    hidden = model_config(path).get("hidden_size", default=WIDE_MODEL)
    return 1 if hidden < WIDE_MODEL else available_cores()


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def add_sampling_options(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="stop after this many new tokens")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 means no limit")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible output)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")


def sampling_from_args(args: argparse.Namespace):
    from hybridmoe.engine.sampler import SamplingParams

    if args.max_tokens < 1:
        raise UserError(f"--max-tokens {args.max_tokens}: give at least 1")
    if args.temperature < 0:
        raise UserError(f"--temperature {args.temperature}: give 0 (greedy) or more")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p {args.top_p}: give a value in (0, 1]")
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=list(args.stop))

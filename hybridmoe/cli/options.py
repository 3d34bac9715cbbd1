"""Options shared by the commands that load a model,
and the one place that turns them into objects."""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from dataclasses import fields
from typing import get_args, get_type_hints

from hybridmoe.errors import UserError
from hybridmoe.quant.formats import QUANTIZE_TO

# --dtype names -> torch dtype names (torch is imported only when a model is loaded)
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def config_flags(cls) -> list:
    """The fields of dataclass `cls` that are flags: those with a help text in their metadata."""
    return [f for f in fields(cls) if "help" in f.metadata]


def add_config_flags(group, cls) -> None:
    """A flag for each such field, named (--max-batch-size from max_batch_size, or metadata "flag"),
    typed, defaulted and explained by the field, with its "choices" and "metavar" if it has them."""
    hints = get_type_hints(cls)
    for f in config_flags(cls):
        kind = next(
            t for t in get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)
        )  # int | None: int
        default = (
            "" if f.default is None else f" (default {f.default})"
        )  # None: the help says what it means
        group.add_argument(
            f.metadata.get("flag", f"--{f.name.replace('_', '-')}"),
            dest=f.name,
            type=kind,
            default=f.default,
            choices=f.metadata.get("choices"),
            metavar=f.metadata.get("metavar"),
            help=f.metadata["help"] + default,
        )


def config_values(args: argparse.Namespace, cls) -> dict:
    """The values of `cls`'s flags in `args`, by field name."""
    return {f.name: getattr(args, f.name) for f in config_flags(cls)}


def add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        metavar="PATH",
        help="Hugging Face directory or .gguf file (default: the built-in demo model, built on "
        "first use)",
    )
    g.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="take the tokenizer and chat template from this directory",
    )
    g.add_argument(
        "--quant",
        choices=QUANTIZE_TO,
        default=None,
        help="quantise a Hugging Face checkpoint's linears and experts to these blocks as it loads "
        "(a GGUF file's blocks are always kept as stored)",
    )
    g.add_argument(
        "--dtype",
        choices=["auto", *sorted(DTYPES)],
        default="auto",
        help="weights and compute dtype (auto: bfloat16 where the CPU multiplies bf16 natively, "
        "AVX512-BF16 or AMX, or where hybridmoe's bf16 kernels run (AVX-512), else float32)",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch and the native kernels (default: all cores)",
    )
    add_runtime_options(p)


def add_runtime_options(p: argparse.ArgumentParser) -> None:
    """Options of the expert runtime (where experts run, what watches it): experts/run/."""
    from hybridmoe.experts.run.hybrid_runtime import (
        HybridConfig,
    )  # imports torch: only for model commands

    g = p.add_argument_group("expert placement (CPU/GPU)")
    add_config_flags(g, HybridConfig)
    g.add_argument(
        "--device",
        choices=("auto", "cuda", "emulated"),
        default="auto",
        help="the accelerator: CUDA, or an emulated GPU over CPU memory (auto: CUDA when present "
        "and checked once to give the CPU's tokens)",
    )
    g.add_argument(
        "--calibration",
        metavar="FILE",
        help="cost profile from `hybridmoe calibrate` (default: measured once and cached)",
    )
    g.add_argument(
        "--expert-stats-out", metavar="FILE", help="write this run's activation statistics here"
    )
    g.add_argument(
        "--routing-trace",
        metavar="FILE",
        help="take expert choices from this routing trace (JSONL) instead of the router",
    )
    g.add_argument(
        "--record-trace",
        metavar="FILE",
        help="record this run's routing as a JSONL trace: a line per decode token, with its "
        "request id",
    )


def _device(args: argparse.Namespace) -> str:
    """Where GPU experts run: an explicit --device, else CUDA when it is there, a budget or a
    policy asks for GPU experts and the CUDA path has been checked to give the CPU's tokens on
    this machine (once, cached: cli/device_check.py), else nowhere ("cpu": every expert on the
    CPU)."""
    if args.device == "emulated":
        return "emulated"
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError(
            "--device cuda: no CUDA GPU is visible to torch; use --device emulated or leave it out"
        )
    if args.device == "cuda":
        return "cuda"
    if torch.cuda.is_available() and (args.budget or args.policy):
        from hybridmoe.cli.device_check import check_path, verified

        if verified("cuda"):
            return "cuda"
        print(
            f"hybridmoe: the CUDA path did not give the CPU's tokens here ({check_path('cuda')}); "
            "every expert runs on the CPU (--device cuda uses it anyway)",
            file=sys.stderr,
        )
    elif args.budget:
        print(
            "hybridmoe: no CUDA GPU, every expert runs on the CPU (--device emulated emulates one)",
            file=sys.stderr,
        )
    return "cpu"


def runtime_factory(args: argparse.Namespace):
    """The expert runtime the options ask for: make_runtime decides from where experts may run,
    never from what is observed (--stats, --record-trace, ... attach observers to whichever
    runs)."""
    from hybridmoe.experts.plan.cache import parse_budget
    from hybridmoe.experts.run.calibrate import load_or_calibrate
    from hybridmoe.experts.run.hybrid_runtime import HybridConfig, make_runtime

    config = HybridConfig(**config_values(args, HybridConfig), device=_device(args))
    parse_budget(config.budget, 1.0, 1.0)  # a malformed budget fails now, not after loading

    def make(shape, dtype):
        cost = None
        if config.device != "cpu" or args.calibration:
            from hybridmoe.loader.load import expert_format

            # The cached profile is per expert shape: measured on this model's experts among
            # others, in the format the experts will be kept in.
            cost = load_or_calibrate(
                args.calibration,
                dtype,
                model=(shape.hidden, shape.intermediate),
                fmt=expert_format(model_path(args), dtype, args.quant),
            )
        return make_runtime(shape, dtype, config, cost)

    return make


def attach_observers(model, routing_trace=None, record_trace=None, expert_stats_out=None) -> None:
    """What the options ask to watch: routing replayed from a trace, recorded to one,
    activation counts."""
    from hybridmoe.experts.run.observers import ActivationCounter, RoutingReplay, TraceRecorder

    runtime = model.runtime
    if runtime is None:  # a dense model: no routing to watch
        return
    layers, shape = list(runtime.shape.moe_layers), runtime.shape
    if routing_trace:
        model.replay_routing(
            RoutingReplay.from_file(routing_trace, layers, shape.num_experts, shape.top_k)
        )
    if record_trace:
        runtime.add_observer(TraceRecorder(record_trace, len(layers)))
    if expert_stats_out:
        runtime.add_observer(ActivationCounter(expert_stats_out, layers, shape.num_experts))


def add_lora_option(p: argparse.ArgumentParser, named: bool) -> None:
    """--lora: one adapter (generate, chat) or several, each by the name requests use (serve)."""
    if named:
        p.add_argument(
            "--lora",
            action="append",
            default=[],
            metavar="NAME=DIR",
            help="serve a LoRA adapter (PEFT format) as model NAME beside the base model "
            "(repeatable)",
        )
    else:
        p.add_argument("--lora", metavar="DIR", help="run with this LoRA adapter (PEFT format)")


LORA = "lora"  # the adapter's name when a command runs with one (generate, chat)


def lora_specs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, directory) of each adapter the options ask for."""
    given = getattr(args, "lora", None)
    if not given:
        return []
    if isinstance(given, str):
        return [(LORA, given)]
    specs = []
    for value in given:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--lora {value}: give NAME=DIR, the name requests use and the adapter")
        if name in (n for n, _ in specs):
            raise UserError(f"--lora {value}: the name {name!r} is given twice; give each its own")
        specs.append((name, path))
    return specs


def attach_adapters(model, specs: list[tuple[str, str]]) -> None:
    """Load each adapter onto `model` under its name; expert adapters need the CPU runtime."""
    from hybridmoe.experts.run.runtime import CPURuntime
    from hybridmoe.loader.adapter import load_adapter

    for name, path in specs:
        targets, _ = load_adapter(model, path, name)
        if any(t.is_experts for t in targets) and not isinstance(model.runtime, CPURuntime):
            raise UserError(
                f"--lora {path}: its routed-expert LoRA runs on the CPU expert runtime only; "
                "leave out --gpu-expert-budget, --policy and --device"
            )


def finish_runtime(model, args: argparse.Namespace) -> None:
    """After a command's run: print the runtime's stats if --stats;
    write its trace and statistics."""
    runtime = model.runtime
    if runtime is None:
        return
    if getattr(args, "stats", False):
        print(runtime.stats.summary(), file=sys.stderr)
    runtime.close()


@contextmanager
def loaded_model(args: argparse.Namespace):
    """(model, tokenizer) for the run of a command; what its observers were asked to write is
    written when the run ends, however it ends."""
    model, tokenizer = load_from_args(args)
    try:
        yield model, tokenizer
    finally:
        finish_runtime(model, args)


def model_path(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from hybridmoe.demo.cache import ensure_demo_model

    return str(ensure_demo_model())


def load_from_args(args: argparse.Namespace):
    """(model, tokenizer) for the model options in `args`, its observers attached."""
    import torch

    from hybridmoe.loader import load_model, load_tokenizer

    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads {args.threads}: give a positive number of threads")
    path = model_path(args)
    torch.set_num_threads(args.threads or available_cores())
    tokenizer = load_tokenizer(path, args.tokenizer)
    model = load_model(
        path,
        dtype=compute_dtype(args.dtype),
        runtime_factory=runtime_factory(args),
        progress=True,
        quant=args.quant,
    )
    check_vocabulary(tokenizer, model, args.tokenizer)
    attach_observers(model, args.routing_trace, args.record_trace, args.expert_stats_out)
    attach_adapters(model, lora_specs(args))
    return model, tokenizer


def check_vocabulary(tokenizer, model, given: str | None) -> None:
    """A tokenizer that makes ids the model has no embedding for would fail at the first such
    token (an IndexError deep in the forward): refuse it now."""
    size = len(tokenizer.hf)
    if size > model.vocab_size:
        where = f"--tokenizer {given}" if given else "the model's tokenizer"
        raise UserError(
            f"{where} has {size} tokens but the model's vocabulary has {model.vocab_size}; "
            "pass the tokenizer the model was trained with"
        )


def compute_dtype(name: str):
    """--dtype's value as a torch dtype. auto is bf16 on CPUs with bf16 dot products: there a bf16
    matrix product runs ~4x faster than fp32 on one core and decode reads half the bytes, for a
    small loss in quality (docs/benchmarks.md#demo-model-quality). It is bf16 too where the bf16
    kernels run with their instructions emulated (AVX-512 without AVX512-BF16, or AVX2 alone:
    native/bf16.py): on the demo model, on a stand-in for such a CPU, decode ran ~4x and prefill
    ~2x fp32's speed (docs/benchmarks.md#bf16-kernels-without-avx512-bf16), capped to AVX2 decode
    ~3x and prefill ~0.9x (docs/benchmarks.md#on-a-cpu-without-avx-512-avx2-only). Elsewhere torch
    would emulate bf16, slower than fp32."""
    import torch

    if name != "auto":
        return getattr(torch, DTYPES[name])
    from hybridmoe import native

    return torch.bfloat16 if native.cpu_has_native_bf16() or native.available() else torch.float32


def available_cores() -> int:
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )


def add_sampling_options(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens", type=int, default=max_tokens, help="stop after this many new tokens"
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 means no limit")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible output)")
    g.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)"
    )


def sampling_from_args(args: argparse.Namespace):
    from hybridmoe.engine.sampler import SamplingParams

    if args.max_tokens < 1:
        raise UserError(f"--max-tokens {args.max_tokens}: give at least 1")
    if args.temperature < 0:
        raise UserError(f"--temperature {args.temperature}: give 0 (greedy) or more")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p {args.top_p}: give a value in (0, 1]")
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=list(args.stop),
    )

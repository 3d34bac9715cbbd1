"""`hybridmoe bench generate`: prefill and decode tok/s of one model, optionally beside
transformers.

Both engines are loaded into one process, see the same random prompt, and decode greedily for the
same number of steps with the same torch threads. Each measurement is repeated after a warm-up run
(which pays for first-touch page faults, allocator growth and oneDNN kernel selection), the engines
take turns, and the median is reported, since the machine may be shared.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from datetime import date

import torch

from hybridmoe import env
from hybridmoe.bench.engine_worker import memory
from hybridmoe.cli.options import DTYPES, compute_dtype


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="prefill and decode tok/s of a model (optionally vs transformers)",
        description="Measure prefill and decode tokens per second of one model: a random prompt, "
        "greedy decoding, warm-up runs excluded, the median of repeats.",
    )
    p.add_argument(
        "--model", metavar="PATH", required=True, help="Hugging Face directory or .gguf file"
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="weights and compute dtype (default bf16)",
    )
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument(
        "--max-tokens", type=int, default=64, help="generated tokens per run (default 64)"
    )
    p.add_argument("--repeats", type=int, default=3, help="measured runs per engine (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured runs before them (default 1)")
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads for torch (default: all cores)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    p.add_argument(
        "--compare-transformers",
        action="store_true",
        help="also load the weights into transformers' own model class and measure it in this run",
    )
    p.add_argument(
        "--compare-llama-cpp",
        action="store_true",
        help="also run llama.cpp (llama-cpp-python, the peers extra) on the same GGUF file, each "
        "engine in its own process, and report both against this machine's decode roofline",
    )
    p.add_argument(
        "--in-place",
        action="store_true",
        help="read every block of the GGUF file where it lies in the file's map, as on a machine "
        "whose free memory is too short to copy them (default: copied while they fit)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


def _check(args) -> None:
    from hybridmoe.errors import UserError

    for name in ("prompt_len", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)}: give at least 1")
    if args.warmup < 0:
        raise UserError(f"--warmup {args.warmup}: give 0 or more")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads {args.threads}: give a positive number of threads")
    if args.in_place and not str(args.model).endswith(".gguf"):
        raise UserError(
            f"--in-place: {args.model} is not a .gguf file (only a GGUF file's blocks are read "
            "in place); drop --in-place or give a .gguf file"
        )


def measure(engines: dict, prompt: list[int], max_tokens: int, repeats: int, warmup: int) -> dict:
    """Run each `engine(prompt, max_tokens) -> (prefill_s, decode_s, decode_steps)` warmup + repeats
    times.

    The engines take turns within each repeat (in alternating order), so that a burst of load from
    other processes on a shared machine falls on both rather than on one engine's whole series.
    """
    for _ in range(warmup):
        for engine in engines.values():
            engine(prompt, max_tokens)
    runs = {name: {"prefill_runs": [], "decode_runs": []} for name in engines}
    for i in range(repeats):
        for name in list(engines) if i % 2 == 0 else list(reversed(engines)):
            prefill_s, decode_s, steps = engines[name](prompt, max_tokens)
            runs[name]["prefill_runs"].append(len(prompt) / prefill_s)
            runs[name]["decode_runs"].append(steps / decode_s if steps else 0.0)
    return {
        name: {
            "prefill_tps": statistics.median(r["prefill_runs"]),
            "decode_tps": statistics.median(r["decode_runs"]),
            **r,
        }
        for name, r in runs.items()
    }


def hybridmoe_engine(model):
    """Our engine's own generation loop (greedy, EOS ignored), timed by its own stats."""
    from hybridmoe.engine.generate import GenerationStats, generate_ids
    from hybridmoe.engine.sampler import SamplingParams

    def run(prompt, max_tokens):
        stats = GenerationStats()
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        for _ in generate_ids(model, prompt, params, stats=stats):
            pass
        return stats.prefill_s, stats.decode_s, max(stats.completion_tokens - 1, 0)

    return run


def transformers_engine(model):
    """transformers' forward with its DynamicCache, greedy,
    in a plain loop (no generate() overhead)."""
    from transformers import DynamicCache

    @torch.inference_mode()
    def run(prompt, max_tokens):
        cache = DynamicCache()
        t0 = time.perf_counter()
        out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        token = out.logits[0, -1].float().argmax()
        t1 = time.perf_counter()
        for _ in range(max_tokens - 1):
            out = model(token.view(1, 1), past_key_values=cache, use_cache=True)
            token = out.logits[0, -1].float().argmax()
        return t1 - t0, time.perf_counter() - t1, max_tokens - 1

    return run


def load_transformers(path: str, dtype: torch.dtype):
    """transformers' own class for the checkpoint (both models stay in RAM: twice the weights)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def run_benchmark(args) -> dict:
    from hybridmoe.loader import load_model, model_config

    _check(args)
    if args.compare_llama_cpp:
        from hybridmoe.bench.compare_llama_cpp import check

        check(args.model)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = compute_dtype(args.dtype)
    vocab = model_config(args.model).get("vocab_size")
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
    result = {
        "model": str(args.model),
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "in_place": args.in_place,
        "date": date.today().isoformat(),
        "machine": machine(),
    }
    if args.compare_llama_cpp:
        from hybridmoe.bench.compare_llama_cpp import compare

        result.update(compare(args, prompt), load_avg_1min_after=round(os.getloadavg()[0], 2))
        return result
    t0 = time.perf_counter()
    model = load_model(
        args.model, dtype=dtype, progress=not args.json, copy_blocks=not args.in_place
    )
    result["load_s"] = time.perf_counter() - t0
    engines = {"hybridmoe": hybridmoe_engine(model)}
    if args.compare_transformers:
        engines["transformers"] = transformers_engine(load_transformers(args.model, dtype))
    result.update(measure(engines, prompt, args.max_tokens, args.repeats, args.warmup))
    result["load_avg_1min_after"] = round(os.getloadavg()[0], 2)
    result["memory"] = memory()  # peak over loading and every run (transformers' too, if any)
    result["model_bytes"] = model_bytes(args.model)
    result.setdefault("transformers", None)
    if args.compare_transformers:
        for key in ("prefill", "decode"):
            ours, theirs = result["hybridmoe"][f"{key}_tps"], result["transformers"][f"{key}_tps"]
            result[f"{key}_ratio"] = ours / theirs if theirs else None
    return result


def model_bytes(path: str) -> int:
    """Bytes of the model's weight files: the GGUF file, or a directory's *.safetensors."""
    from pathlib import Path

    p = Path(path).expanduser()
    return (
        sum(f.stat().st_size for f in p.glob("*.safetensors")) if p.is_dir() else p.stat().st_size
    )


def machine() -> dict:
    """What the figures depend on (the kernels' paths among it: HYBRIDMOE_QUANT_ISA and
    HYBRIDMOE_BF16_ISA name them); the load average shows whether other processes shared the
    cores."""
    from hybridmoe.native import bf16, quant

    def name(names: dict, value: int) -> str:
        return next(k for k, v in names.items() if v == value)

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "quant_path": name(quant.PATH_NAMES, quant.isa()),
        "bf16_build": name(bf16.BUILD_NAMES, bf16.isa()),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "omp_wait_policy": env.omp_wait_policy(),
    }


def run(args) -> int:
    result = run_benchmark(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if args.compare_llama_cpp:
        print_comparison(result)
        return 0
    print(
        f"{result['model']}  {result['dtype']}  prompt {result['prompt_len']}  decode "
        f"{result['max_tokens']} tokens  threads {result['threads']}  median of {result['repeats']}"
        f"  load average {result['machine']['load_avg_1min']} -> {result['load_avg_1min_after']}"
    )
    print(f"{'engine':<14}{'prefill tok/s':>15}{'decode tok/s':>15}")
    for engine in ("hybridmoe", "transformers"):
        r = result[engine]
        if r is not None:
            print(f"{engine:<14}{r['prefill_tps']:>15.1f}{r['decode_tps']:>15.2f}")
    if result["transformers"] is not None:
        print(f"{'ratio':<14}{result['prefill_ratio']:>14.2f}x{result['decode_ratio']:>14.2f}x")
    m = result["memory"]
    print(
        f"load {result['load_s']:.1f} s; peak RSS {m['peak_rss'] / 1e9:.2f} GB (model files "
        f"{result['model_bytes'] / 1e9:.2f} GB); at the end {m['rss_anon'] / 1e9:.2f} GB "
        f"anonymous + {m['rss_file'] / 1e9:.2f} GB file-backed"
    )
    return 0


def print_comparison(r: dict) -> None:
    print(
        f"{r['model']}  prompt {r['prompt_len']}  decode {r['max_tokens']} tokens  threads "
        f"{r['threads']}  median of {r['repeats']}  load average "
        f"{r['machine']['load_avg_1min']} -> {r['load_avg_1min_after']}"
    )
    print(
        f"roofline: {r['weight_bytes_per_token'] / 1e6:.1f} MB of weights per token / "
        f"{r['read_bandwidth_gbs']:.1f} GB/s read = {r['roofline_tps']:.1f} tok/s"
    )
    print(
        f"{'engine':<11}{'prefill tok/s':>15}{'decode tok/s':>14}{'% roofline':>12}{'peak RSS':>10}"
    )
    for name in ("hybridmoe", "llama.cpp"):
        e = r[name]
        print(
            f"{name:<11}{e['prefill_tps']:>15.1f}{e['decode_tps']:>14.2f}"
            f"{e['roofline_pct']:>11.0f}%{e['peak_rss'] / 1e9:>8.2f} GB"
        )
    print(f"{'ratio':<11}{r['prefill_ratio']:>14.2f}x{r['decode_ratio']:>13.2f}x")
    print(f"greedy tokens equal for the first {r['same_tokens']} of {r['max_tokens']}")

"""`hybridmoe bench finetune`: LoRA training tokens/s and peak memory of hybridmoe against
transformers + peft, on the same model, data, adapter targets and settings, in one run.

Each measurement is a process of its own (`--engine`), so that its peak resident memory (VmHWM) is
its own: load the model, put the LoRA adapter on it, run `--warmup` optimizer steps unmeasured, then
`--steps` measured ones. The two engines' processes take turns, `--repeats` times each, and the
median is reported, since the machine may be shared. The data: random token sequences of
`--seq-len`, `--batch-size` per step, the last `--learn` fraction of each learned (as an assistant's
answer after its prompt); hybridmoe packs them into one pass, transformers gets them as one batch
(all the same length: no padding) with labels, as its Trainer does. Tokens/s counts every token
of the sequences, learned or not.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date

ENGINES = ("hybridmoe", "transformers")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "finetune",
        help="LoRA training tokens/s and peak RSS, hybridmoe vs transformers + peft",
        description="Train the same LoRA adapter with hybridmoe and with transformers + peft on "
        "the same model and data; report tokens/s (median of alternating runs) and peak RSS.",
    )
    p.add_argument("--model", metavar="PATH", help="Hugging Face directory (default: demo)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="frozen weights")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument(
        "--learn", type=float, default=0.5, help="learned fraction of each sequence (default 0.5)"
    )
    p.add_argument("--steps", type=int, default=3, help="measured steps per run (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="runs per engine (default 3)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--targets", default=None, help="as finetune's --targets (default its own)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--engine", choices=ENGINES, help="measure this engine once (one process)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from hybridmoe.cli.options import available_cores, model_path

    args.model = model_path(args)
    args.threads = args.threads or available_cores()
    if args.engine:
        print(json.dumps(measure_once(args)))
        return 0
    result = compare(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(table(result))
    return 0


def compare(args) -> dict:
    """Alternate one-process runs of both engines; medians of tokens/s and peak RSS."""
    runs = {e: [] for e in ENGINES}
    load_before = os.getloadavg()[0]
    for i in range(args.repeats):
        for engine in ENGINES if i % 2 == 0 else reversed(ENGINES):
            runs[engine].append(_child(args, engine))
    out = {
        "model": args.model,
        "dtype": args.dtype,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "learn": args.learn,
        "steps": args.steps,
        "repeats": args.repeats,
        "lora_rank": args.lora_rank,
        "threads": args.threads,
        "date": date.today().isoformat(),
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    for engine, rs in runs.items():
        out[engine] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "peak_rss_mb": statistics.median(r["peak_rss"] for r in rs) / 2**20,
            "runs": rs,
        }
    out["speedup"] = out["hybridmoe"]["tokens_per_s"] / out["transformers"]["tokens_per_s"]
    out["memory_ratio"] = out["hybridmoe"]["peak_rss_mb"] / out["transformers"]["peak_rss_mb"]
    return out


def _child(args, engine: str) -> dict:
    cmd = [sys.executable, "-m", "hybridmoe", "bench", "finetune", "--engine", engine]
    for flag in (
        "model",
        "dtype",
        "seq_len",
        "batch_size",
        "learn",
        "steps",
        "warmup",
        "lora_rank",
    ):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    cmd += ["--threads", str(args.threads)] + (["--targets", args.targets] if args.targets else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(r: dict) -> str:
    lines = [
        f"{r['model']}  {r['dtype']}  {r['batch_size']} x {r['seq_len']} tokens per step "
        f"({r['learn']:.0%} learned)  "
        f"rank {r['lora_rank']}  threads {r['threads']}  median of {r['repeats']}  load average "
        f"{r['load_avg_1min'][0]} -> {r['load_avg_1min'][1]}",
        f"{'engine':<14}{'tokens/s':>10}{'peak RSS MB':>13}",
    ]
    for engine in ENGINES:
        lines.append(
            f"{engine:<14}{r[engine]['tokens_per_s']:>10.1f}{r[engine]['peak_rss_mb']:>13.0f}"
        )
    lines.append(f"{'ratio':<14}{r['speedup']:>9.2f}x{r['memory_ratio']:>12.2f}x")
    return "\n".join(lines)


# ---- one engine, one process ----


def peak_rss() -> int:
    """This process's peak resident memory (VmHWM), bytes."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmHWM")


def measure_once(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    step = (_hybridmoe if args.engine == "hybridmoe" else _transformers)(args, dtype)
    prompt = args.seq_len - max(1, round(args.learn * args.seq_len))  # tokens not learned
    vocab = _vocab(args.model)
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=gen)
        for _ in range(args.warmup + args.steps)
    ]
    for ids in batches[: args.warmup]:
        step(ids, prompt)
    t0 = time.perf_counter()
    losses = [step(ids, prompt) for ids in batches[args.warmup :]]
    seconds = time.perf_counter() - t0
    return {
        "tokens_per_s": args.steps * args.batch_size * args.seq_len / seconds,
        "peak_rss": peak_rss(),
        "losses": losses,
    }


def _vocab(path: str) -> int:
    from hybridmoe.loader import model_config

    return model_config(path).get("vocab_size")


def _hybridmoe(args, dtype):
    """A step of our trainer on the batch [B, L]: packed, every token learned."""
    import torch

    from hybridmoe.loader import load_model
    from hybridmoe.models import lora as model_lora
    from hybridmoe.train.forward import Batch, loss_sum
    from hybridmoe.train.heap import keep_freed_memory

    keep_freed_memory()  # as the trainer does
    model = load_model(args.model, dtype=dtype, progress=False)
    model.requires_grad_(False)
    model.train()
    targets = model_lora.select(model, args.targets)
    modules = model_lora.attach(targets, "bench", args.lora_rank, 2.0 * args.lora_rank)
    for m in modules.values():
        m.reset()
    params = model_lora.parameters(modules)
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step(ids, prompt: int) -> float:
        learn = [False] * prompt + [True] * (ids.shape[1] - prompt)
        batch = Batch.of([(row.tolist(), learn) for row in ids])
        loss = loss_sum(model, batch, "bench") / batch.num_targets
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _transformers(args, dtype):
    """The same step with transformers + peft: the same targets (by their peft names)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    modules, parameters = _peft_targets(args)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    config = LoraConfig(
        r=args.lora_rank,
        lora_alpha=2 * args.lora_rank,
        target_modules=modules or None,
        target_parameters=parameters or None,
    )
    model = get_peft_model(model, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step(ids, prompt: int) -> float:
        labels = ids.clone()
        labels[:, :prompt] = -100  # not learned; transformers shifts the labels itself
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _peft_targets(args) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) of our adapter on this model, as peft names them."""
    import torch

    from hybridmoe.config import HFConfig
    from hybridmoe.experts.plan.shape import expert_shape
    from hybridmoe.experts.run.runtime import CPURuntime
    from hybridmoe.models import lora as model_lora
    from hybridmoe.models import model_class

    cfg = HFConfig.from_file(os.path.join(args.model, "config.json"))
    shape = expert_shape(cfg)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, CPURuntime(shape) if shape else None)
    return model_lora.peft_config_targets(model, model_lora.select(model, args.targets))

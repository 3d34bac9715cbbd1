"""`hybridmoe finetune`: train a LoRA adapter on JSONL data with the routed experts left in the
expert store; `hybridmoe finetune merge`: write a model with an adapter merged into its weights."""

from __future__ import annotations

import sys
from pathlib import Path

from hybridmoe.cli.options import DTYPES, add_config_flags, available_cores, config_values
from hybridmoe.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "finetune",
        help="train a LoRA adapter on your data (PEFT format); `finetune merge` merges one",
        description='Fine-tune a LoRA adapter on JSONL data: chats ({"messages": [...]}, '
        'learning the assistant\'s turns through the chat template) or text ({"text": ...}). '
        "The adapter is written to --out in PEFT's format; serve it with "
        "`hybridmoe serve --lora NAME=DIR` or `hybridmoe generate --lora DIR`.",
    )
    _model_flags(p)
    g = p.add_argument_group("data and output")
    g.add_argument("--data", metavar="FILE", help="training data, JSONL")
    g.add_argument("--out", metavar="DIR", help="where the adapter and checkpoints go")
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue the run whose checkpoint is in --out (same data and settings)",
    )
    from hybridmoe.train.config import FinetuneConfig

    add_config_flags(p.add_argument_group("training"), FinetuneConfig)
    p.set_defaults(func=run)
    subs = p.add_subparsers(dest="finetune_command", metavar="merge")
    m = subs.add_parser(
        "merge",
        help="write a copy of the model with the adapter merged into its weights",
        description="Merge a LoRA adapter into a Hugging Face model's weights (dense "
        "projections and routed experts alike) and write the result as a new Hugging Face "
        "directory, in the checkpoint's own dtype.",
    )
    m.add_argument("--model", metavar="PATH", help="the base model (default: the demo model)")
    m.add_argument("--adapter", metavar="DIR", required=True, help="the LoRA adapter directory")
    m.add_argument("--out", metavar="DIR", required=True, help="the merged model's directory")
    m.set_defaults(func=run_merge)


def _model_flags(p) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model", metavar="PATH", help="Hugging Face directory or .gguf file (default: demo)"
    )
    g.add_argument("--tokenizer", metavar="DIR", help="take the tokenizer and template from here")
    g.add_argument(
        "--dtype",
        choices=["auto", *sorted(DTYPES)],
        default="auto",
        help="the frozen weights' dtype (auto: bfloat16 where the CPU multiplies bf16 natively, "
        "else float32); adapters always train in float32",
    )
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def finetune_config(args):
    from hybridmoe.train.config import FinetuneConfig

    cfg = FinetuneConfig(**config_values(args, FinetuneConfig))
    positive = ("epochs", "batch_size", "grad_accum", "save_every", "lora_rank")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: give at least 1")
    if cfg.max_seq_len < 2:
        raise UserError(f"--max-seq-len {cfg.max_seq_len}: give at least 2 tokens")
    if cfg.lr <= 0 or cfg.lora_alpha <= 0:
        raise UserError("--lr and --lora-alpha must be positive")
    for name in ("lora_dropout", "eval_fraction", "warmup"):
        if not 0 <= getattr(cfg, name) < 1:
            raise UserError(
                f"--{name.replace('_', '-')} {getattr(cfg, name)}: give a value in [0, 1)"
            )
    return cfg


def _out_dir(args) -> Path:
    if not args.data or not args.out:
        raise UserError("finetune needs --data FILE (JSONL) and --out DIR")
    from hybridmoe.train.checkpoint import has_checkpoint

    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: a file is there; give a directory")
    if args.resume and not has_checkpoint(out):
        raise UserError(
            f"--resume: {out} holds no checkpoint.pt to resume from; leave --resume out"
        )
    if has_checkpoint(out) and not args.resume:
        raise UserError(
            f"--out {out} holds the checkpoint of an unfinished run; pass --resume to continue "
            "it, or choose another --out"
        )
    return out


def run(args) -> int:
    import torch

    from hybridmoe.cli.options import compute_dtype, model_path
    from hybridmoe.loader import load_model, load_tokenizer
    from hybridmoe.train.data import prepare
    from hybridmoe.train.trainer import Trainer

    cfg = finetune_config(args)
    out = _out_dir(args)
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads {args.threads}: give a positive number of threads")
    path = model_path(args)
    torch.set_num_threads(args.threads or available_cores())
    tokenizer = load_tokenizer(path, args.tokenizer)
    data = prepare(args.data, tokenizer, cfg.max_seq_len, cfg.long, cfg.eval_fraction, cfg.seed)
    _say_long(data, cfg)
    model = load_model(path, dtype=compute_dtype(args.dtype))
    trainer = Trainer(model, data, cfg, out, base_model=Path(path).name)
    if args.resume:
        trainer.resume()
    _say_plan(trainer, data)
    result = trainer.train()
    print(
        f"hybridmoe: adapter written to {out} ({result.tokens_per_s:.0f} tokens/s); use it with "
        f"`hybridmoe generate --lora {out}` or `hybridmoe serve --lora NAME={out}`",
        file=sys.stderr,
    )
    return 0


def _say_long(data, cfg) -> None:
    if data.long:
        what = "skipped" if cfg.long == "skip" else f"truncated to {cfg.max_seq_len} tokens"
        print(
            f"hybridmoe: {data.long} example(s) longer than --max-seq-len {cfg.max_seq_len}: {what}"
            + (f"; {data.dropped} left with nothing to learn were dropped" if data.dropped else ""),
            file=sys.stderr,
        )


def _say_plan(trainer, data) -> None:
    params = sum(p.numel() for p in trainer.params)
    print(
        f"hybridmoe: {len(data.train)} training and {len(data.held_out)} held-out examples; "
        f"{trainer.total} steps ({trainer.cfg.epochs} epochs of {trainer.steps_per_epoch}); "
        f"LoRA r={trainer.cfg.lora_rank} on {len(trainer.targets)} targets, "
        f"{params / 1e6:.2f}M parameters",
        file=sys.stderr,
    )


def run_merge(args) -> int:
    from hybridmoe.cli.options import model_path
    from hybridmoe.train.merge import merge

    out = merge(model_path(args), args.adapter, args.out)
    print(out)
    return 0

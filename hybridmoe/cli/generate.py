"""`hybridmoe generate`: stream one completion to the terminal, then prefill and decode speed."""

from __future__ import annotations

import sys

from hybridmoe.cli.options import (
    LORA,
    add_lora_option,
    add_model_options,
    add_sampling_options,
    loaded_model,
    sampling_from_args,
)
from hybridmoe.engine.generate import GenerationStats, generate_text


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Generate text from a prompt and stream it to the terminal.",
    )
    add_model_options(p)
    add_lora_option(p, named=False)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    p.add_argument("--system", default=None, help="system message (with --chat)")
    add_sampling_options(p)
    p.add_argument(
        "--stats", action="store_true", help="print the expert runtime's statistics at the end"
    )
    p.set_defaults(func=run)


def run(args) -> int:
    params = sampling_from_args(args)
    with loaded_model(args) as (model, tok):
        generate(model, tok, params, args)
    return 0


def generate(model, tok, params, args) -> None:
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt_ids = tok.encode_chat(messages + [{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tok.encode(args.prompt)
    stats = GenerationStats()
    adapter = LORA if args.lora else None
    for text in generate_text(model, tok, prompt_ids, params, stats, adapter):
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(
        f"prefill: {stats.prompt_tokens} tokens, {stats.prefill_tps:.1f} tok/s | "
        f"decode: {stats.completion_tokens} tokens, {stats.decode_tps:.1f} tok/s | "
        f"finish: {stats.finish_reason}",
        file=sys.stderr,
    )

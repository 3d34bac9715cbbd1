"""`hybridmoe chat`: an interactive loop with the model's chat template."""

from __future__ import annotations

import signal
import sys
import threading

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
        "chat",
        help="chat interactively with a model",
        description="Chat with a model in the terminal. Empty line or Ctrl-D quits; Ctrl-C stops "
        "a reply (at the prompt, quits); /reset forgets.",
    )
    add_model_options(p)
    add_lora_option(p, named=False)
    p.add_argument("--system", default=None, help="system message")
    add_sampling_options(p, max_tokens=512)
    p.set_defaults(func=run)


def run(args) -> int:
    params = sampling_from_args(args)
    with loaded_model(args) as (model, tok):
        return chat(model, tok, params, args)


def chat(model, tok, params, args) -> int:
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C stops a reply even where the chat was started with SIGINT ignored (a background
        # job of a non-interactive shell), in which case Python would not turn it into an exception
        signal.signal(signal.SIGINT, signal.default_int_handler)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line.strip():
            return 0
        if line.strip() == "/reset":
            messages = list(start)
            continue
        messages.append({"role": "user", "content": line})
        messages.append({"role": "assistant", "content": reply(model, tok, messages, params, args)})


def reply(model, tok, messages, params, args) -> str:
    """Stream the model's answer to stdout, ended by a newline there (piped output keeps replies
    apart); Ctrl-C stops it and keeps what came so far. Returns the answer's text."""
    stats, text = GenerationStats(), []
    adapter = LORA if args.lora else None
    stopped = False
    try:
        for piece in generate_text(model, tok, tok.encode_chat(messages), params, stats, adapter):
            text.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        stopped = True
    sys.stdout.write("\n")
    sys.stdout.flush()
    note = "stopped, " if stopped else ""
    print(
        f"[{note}{stats.completion_tokens} tokens, {stats.decode_tps:.1f} tok/s]", file=sys.stderr
    )
    return "".join(text)

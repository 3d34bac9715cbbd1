"""`hybridmoe serve`: an OpenAI-compatible HTTP server with continuous batching."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from hybridmoe.cli.options import (
    add_config_flags,
    add_lora_option,
    add_model_options,
    available_cores,
    config_values,
    loaded_model,
    lora_specs,
    model_path,
)
from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.prefix_cache.build import check_settings
from hybridmoe.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and "
        "/metrics, batching concurrent requests (default model: the built-in demo model).",
    )
    add_model_options(p)
    add_lora_option(p, named=True)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=10002, help="port (default 10002, as KTransformers)")
    g.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients send (default: the model's directory or file name)",
    )
    g.add_argument(
        "--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1 routes"
    )
    g = p.add_argument_group("engine")
    add_config_flags(g, EngineConfig)
    g.add_argument(
        "--overlap-prefill",
        choices=("auto", "on", "off"),
        default="auto",
        help="prefill prompts on a second core while the first decodes (auto: on with the CPU "
        "expert runtime, one torch thread and at least two cores)",
    )
    p.set_defaults(func=run)


def engine_config(args) -> EngineConfig:
    values = config_values(args, EngineConfig)
    for name, value in values.items():
        if isinstance(value, (int, float)) and value <= 0:
            raise UserError(f"--{name.replace('_', '-')} {value}: give a positive number")
    if args.kv_cache_tokens < args.block_size:
        raise UserError(
            f"--kv-cache-tokens {args.kv_cache_tokens} is less than one block ({args.block_size}); "
            "raise it"
        )
    config = EngineConfig(**values)
    check_settings(config)
    return config


def overlap_prefill(args, model) -> bool:
    """Whether to run prefill passes beside decode passes (EngineConfig.overlap_prefill)."""
    if args.overlap_prefill == "off":
        return False
    from hybridmoe.engine.model_runner import overlap_unsupported

    fits = overlap_unsupported(model) is None and available_cores() >= 2
    if args.overlap_prefill == "on" and not fits:
        raise UserError(
            "--overlap-prefill on needs the CPU expert runtime (no GPU options), --threads 1 and "
            "at least two cores; leave it at auto"
        )
    return fits


def listen(host: str, port: int) -> socket.socket:
    """Bind now, so that a busy port is a one-line error before the model loads."""
    try:
        sock = socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET
        )
    except OSError as e:
        raise UserError(
            f"cannot listen on {host}:{port} ({e.strerror}); pass another --port or --host"
        ) from None
    return sock


def run(args) -> int:
    import uvicorn

    from hybridmoe.engine.llm_engine import LLMEngine
    from hybridmoe.server.app import create_app
    from hybridmoe.server.async_engine import AsyncEngine

    config = engine_config(args)
    sock = listen(args.host, args.port)
    with loaded_model(args) as (model, tokenizer):
        config.overlap_prefill = overlap_prefill(args, model)
        name = args.served_model_name or Path(model_path(args)).name
        if name in {n for n, _ in lora_specs(args)}:
            raise UserError(f"--lora {name}=...: {name!r} is the base model's name; rename it")
        engine = LLMEngine(model, tokenizer, config)
        app = create_app(AsyncEngine(engine), tokenizer, name, args.api_key)
        print(
            f"hybridmoe: serving '{name}'{_listed(engine.adapters)} at "
            f"http://{args.host}:{args.port}/v1 (context {engine.max_model_len} tokens, "
            f"batch {config.max_batch_size}"
            f"{', prefill beside decode' if config.overlap_prefill else ''})",
            file=sys.stderr,
        )
        try:
            uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
        finally:
            engine.close()  # the blocks still queued for the prefix cache's tiers
    return 0


def _listed(adapters) -> str:
    return f" and LoRA adapters {', '.join(map(repr, sorted(adapters)))}" if adapters else ""

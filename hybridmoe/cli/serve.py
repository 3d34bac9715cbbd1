"""`hybridmoe serve`: an OpenAI-compatible HTTP server with continuous batching."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from hybridmoe import env
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
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health (visible in the "
        "process list: prefer --api-key-file or the HYBRIDMOE_API_KEY variable)",
    )
    g.add_argument(
        "--api-key-file", metavar="PATH", type=Path, help="read the API key from this file"
    )
    g.add_argument(
        "--metrics-key-file",
        metavar="PATH",
        type=Path,
        help="a key of its own for /metrics (a scraper's), read from this file; default: the "
        "API key",
    )
    g.add_argument(
        "--allowed-origins",
        metavar="ORIGIN",
        nargs="+",
        default=(),
        help="web origins whose pages may call the server (CORS), e.g. http://localhost:3000; "
        "default: none",
    )
    g = p.add_argument_group("engine")
    add_config_flags(g, EngineConfig)
    g.add_argument(
        "--overlap-prefill",
        choices=("auto", "on", "off"),
        default="auto",
        help="prefill prompts on a second core while the first decodes, every core to a pass "
        "that runs alone (auto: on with the CPU expert runtime and at least two cores)",
    )
    g.add_argument(
        "--deterministic",
        choices=("on", "off"),
        default="on",
        help="on (default): greedy output does not depend on the batch, prefill chunks or "
        "prefix-cache hits (each token computed as if alone); off: the fastest kernel for each "
        "pass, a little faster prefill (docs/serving.md)",
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
    config = EngineConfig(**values, deterministic=args.deterministic == "on")
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
            "--overlap-prefill on needs the CPU expert runtime (no GPU options) and at least two "
            "cores; leave it at auto"
        )
    return fits


def server_access(args):
    """The server's Access: the keys (from a file, HYBRIDMOE_API_KEY or --api-key) and the CORS
    origins."""
    from hybridmoe.server.access import Access

    given = [x for x in (args.api_key_file, env.api_key(), args.api_key) if x]
    if len(given) > 1:
        raise UserError(
            "the API key was given more than once (--api-key-file, HYBRIDMOE_API_KEY, --api-key); "
            "give it one way"
        )
    api_key = _read_key(args.api_key_file, "--api-key-file") if args.api_key_file else None
    metrics_key = _read_key(args.metrics_key_file, "--metrics-key-file")
    if metrics_key and not (api_key or env.api_key() or args.api_key):
        raise UserError("--metrics-key-file without an API key: set one, or drop it")
    for origin in args.allowed_origins:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            raise UserError(f"--allowed-origins {origin}: give origins as http(s)://HOST[:PORT]")
    return Access(
        api_key or env.api_key() or args.api_key, metrics_key, tuple(args.allowed_origins)
    )


def _read_key(path: Path | None, flag: str) -> str | None:
    if path is None:
        return None
    try:
        key = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag} {path}: cannot read it ({e}); give a readable text file") from None
    if not key:
        raise UserError(f"{flag} {path}: the file is empty; put the key in it")
    return key


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
    access = server_access(args)
    sock = listen(args.host, args.port)
    with loaded_model(args) as (model, tokenizer):
        config.overlap_prefill = overlap_prefill(args, model)
        name = args.served_model_name or Path(model_path(args)).name
        if name in {n for n, _ in lora_specs(args)}:
            raise UserError(f"--lora {name}=...: {name!r} is the base model's name; rename it")
        engine = LLMEngine(model, tokenizer, config)
        app = create_app(AsyncEngine(engine), tokenizer, name, access=access)
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

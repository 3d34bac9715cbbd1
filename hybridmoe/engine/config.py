"""Every knob of the engine, in one dataclass.

A field with a help text in its metadata is also a flag of `hybridmoe serve` (--max-batch-size from
max_batch_size), which takes its type, default and help from here; the others are set by code.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineConfig:
    max_batch_size: int = field(
        default=8, metadata={"help": "requests decoded together", "metavar": "N"}
    )
    max_tokens_per_step: int = field(
        default=512,
        metadata={
            "help": "tokens per forward pass; longer prompts are prefilled in chunks",
            "metavar": "T",
        },
    )
    kv_cache_tokens: int = field(
        default=16384,
        metadata={"help": "KV cache capacity in tokens, shared by all requests", "metavar": "K"},
    )
    block_size: int = field(
        default=16, metadata={"help": "tokens per KV block, and the granularity of prefix sharing"}
    )
    max_model_len: int | None = field(
        default=None,
        metadata={
            "help": "longest prompt + output (default: the model's context, at most the KV cache)"
        },
    )
    # Compute every token as if it were alone (fixed kernels and reduction orders: see
    # hybridmoe/invariance.py), so greedy output does not depend on the batch, prefill chunks or
    # prefix-cache hits. Off: the fastest kernel for each pass's size. `serve --deterministic`.
    deterministic: bool = True
    max_tokens_default: int | None = field(
        default=None,
        metadata={
            "help": "tokens a request without max_tokens may generate (default: the rest of the "
            "context, as OpenAI does)",
            "metavar": "N",
        },
    )
    request_timeout: float | None = field(
        default=None,
        metadata={
            "help": "seconds a request may take from its arrival; then it ends with "
            "finish_reason 'length' (default: no limit)",
            "metavar": "S",
        },
    )
    # Torch threads for passes of at least `threads_from_tokens` new tokens (prefill chunks), which
    # are compute-bound and split well; smaller passes (decode) keep the thread count torch has.
    # None: one count for every pass.
    prefill_threads: int | None = None
    threads_from_tokens: int = 64
    # Prefill chunks on a second thread while this one decodes, one torch thread each; a pass that
    # runs alone (a decode pass with no prefill in flight, a prefill pass with nothing to decode)
    # takes this thread's count. Needs a model whose forward may run twice at once (the plain CPU
    # expert runtime).
    overlap_prefill: bool = False
    # The prefix cache beyond the pool (engine/prefix_cache/): any of these turns it on.
    prefix_cache_ram: str | None = field(
        default=None,
        metadata={
            "help": "keep KV blocks evicted from the pool in host RAM, up to SIZE (LRU)",
            "metavar": "SIZE",
        },
    )
    prefix_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "keep computed KV blocks in this directory, across restarts (one checksummed "
            "file per block)",
            "metavar": "DIR",
        },
    )
    prefix_cache_disk: str | None = field(
        default=None,
        metadata={
            "help": "bytes of --prefix-cache-dir to use, least recently used blocks deleted past "
            "it (default 10GB)",
            "metavar": "SIZE",
        },
    )
    prefix_cache_remote: str | None = field(
        default=None,
        metadata={
            "help": "share KV blocks with other servers through Mooncake Store "
            "(mooncake://MASTER:PORT[?metadata=URL]) or Redis/Valkey (redis://HOST:PORT/DB)",
            "metavar": "URL",
        },
    )
    prefix_cache_timeout: float = field(
        default=1.0,
        metadata={
            "help": "seconds a remote lookup or write may take before the request is computed "
            "without it",
            "metavar": "S",
        },
    )

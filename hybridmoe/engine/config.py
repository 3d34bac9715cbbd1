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
    # Torch threads for passes of at least `threads_from_tokens` new tokens (prefill chunks), which
    # are compute-bound and split well; smaller passes (decode) keep the thread count torch has.
    # None: one count for every pass.
    prefill_threads: int | None = None
    threads_from_tokens: int = 64
    # Prefill chunks on a second thread (one torch thread each) while this one decodes. Needs a
    # model whose forward may run twice at once (the plain CPU expert runtime) and one torch thread.
    overlap_prefill: bool = False

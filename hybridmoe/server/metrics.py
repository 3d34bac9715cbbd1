"""`GET /metrics`: the engine's counters (and the expert runtime's, when it has any) as Prometheus
text."""

from __future__ import annotations

import numbers

from hybridmoe.engine.llm_engine import LLMEngine


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def engine_metrics(engine: LLMEngine) -> list[tuple[str, str, str, float]]:
    """(name, type, help, value) for everything the engine counts."""
    m, blocks = engine.metrics, engine.blocks
    return [
        ("requests_total", "counter", "requests received", m.requests_added),
        ("requests_finished_total", "counter", "requests completed", m.requests_finished),
        (
            "requests_aborted_total",
            "counter",
            "requests cancelled (client disconnect)",
            m.requests_aborted,
        ),
        (
            "requests_failed_total",
            "counter",
            "requests ended by an engine error (a bug)",
            m.requests_failed,
        ),
        (
            "requests_timed_out_total",
            "counter",
            "requests ended by --request-timeout (finish_reason length)",
            m.requests_timed_out,
        ),
        (
            "requests_waiting",
            "gauge",
            "requests queued or preempted (queue length)",
            engine.num_waiting,
        ),
        ("requests_running", "gauge", "requests in the running batch", engine.num_running),
        ("prompt_tokens_total", "counter", "prompt tokens received", m.prompt_tokens),
        (
            "prefill_tokens_total",
            "counter",
            "prompt tokens computed (prefix-cache hits excluded)",
            m.prefill_tokens,
        ),
        ("generation_tokens_total", "counter", "tokens generated", m.generation_tokens),
        (
            "prefill_tokens_per_second",
            "gauge",
            "prefill tokens per second of prefill time",
            _rate(m.prefill_tokens, m.prefill_s),
        ),
        (
            "decode_tokens_per_second",
            "gauge",
            "decode tokens per second of decode time",
            _rate(m.decode_tokens, m.decode_s),
        ),
        ("steps_total", "counter", "engine steps (forward passes)", m.steps),
        (
            "preemptions_total",
            "counter",
            "sequences preempted for lack of KV blocks",
            engine.scheduler.num_preemptions,
        ),
        ("kv_blocks_used", "gauge", "KV cache blocks in use", blocks.num_used),
        ("kv_blocks_total", "gauge", "KV cache blocks", blocks.num_blocks),
        (
            "prefix_cache_query_tokens_total",
            "counter",
            "prompt tokens looked up in the prefix cache",
            blocks.query_tokens,
        ),
        (
            "prefix_cache_hit_tokens_total",
            "counter",
            "prompt tokens found in the prefix cache",
            blocks.hit_tokens,
        ),
        ("prefix_cache_hit_rate", "gauge", "hit tokens / query tokens", blocks.hit_rate),
    ] + tier_metrics(engine)


def tier_metrics(engine: LLMEngine) -> list[tuple[str, str, str, float]]:
    """The prefix cache's tiers below the pool (--prefix-cache-*), none without them."""
    cache = engine.prefix_cache
    if cache is None:
        return []
    out = [
        (
            "prefix_cache_loaded_tokens_total",
            "counter",
            "prompt tokens loaded from the tiers below the KV pool",
            engine.blocks.loaded_tokens,
        ),
        (
            "prefix_cache_write_queue_blocks",
            "gauge",
            "blocks waiting to be written to the tiers",
            cache.writer.pending,
        ),
        (
            "prefix_cache_writes_dropped_total",
            "counter",
            "blocks not written because the write queue was full",
            cache.writer.dropped,
        ),
    ]
    for tier in cache.tiers:
        s, t = tier.stats, tier.name
        out += [
            (f"prefix_cache_{t}_hits_total", "counter", f"blocks loaded from {t}", s.hits),
            (
                f"prefix_cache_{t}_misses_total",
                "counter",
                f"lookups that did not find their next block in {t}",
                s.misses,
            ),
            (f"prefix_cache_{t}_read_bytes_total", "counter", f"bytes read from {t}", s.bytes_read),
            (
                f"prefix_cache_{t}_load_seconds_total",
                "counter",
                f"seconds spent loading and verifying blocks from {t}",
                s.load_s,
            ),
            (
                f"prefix_cache_{t}_blocks_written_total",
                "counter",
                f"blocks written to {t}",
                s.writes,
            ),
            (
                f"prefix_cache_{t}_written_bytes_total",
                "counter",
                f"bytes written to {t}",
                s.bytes_written,
            ),
            (
                f"prefix_cache_{t}_errors_total",
                "counter",
                f"failed reads or writes and corrupt blocks in {t}",
                s.errors,
            ),
            (
                f"prefix_cache_{t}_timeouts_total",
                "counter",
                f"calls to {t} given up after --prefix-cache-timeout",
                s.timeouts,
            ),
        ]
    return out


def runtime_metrics(stats: dict) -> list[tuple[str, str, str, float]]:
    """The numbers of the expert runtime's stats (hits, misses, copies...; LLMEngine.expert_stats),
    none for a dense model."""
    return [
        (f"expert_{name.removeprefix('expert_')}", "gauge", f"expert runtime: {name}", value)
        for name, value in sorted(stats.items())
        if isinstance(value, numbers.Real) and not isinstance(value, bool)
    ]


def render(engine: LLMEngine, model_name: str) -> str:
    label = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    lines = []
    for name, kind, help_text, value in engine_metrics(engine) + runtime_metrics(
        engine.expert_stats
    ):
        value = int(value) if isinstance(value, numbers.Integral) else float(value)
        lines += [
            f"# HELP hybridmoe_{name} {help_text}",
            f"# TYPE hybridmoe_{name} {kind}",
            f'hybridmoe_{name}{{model="{label}"}} {value}',
        ]
    return "\n".join(lines) + "\n"

"""Generation for one prompt (the `generate` and `chat` commands): the batching engine with a batch
of one."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine, RequestOutput
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.loader.tokenizer import Tokenizer


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = ""

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        # The first completion token comes from the prefill step; decode steps make the rest.
        steps = max(self.completion_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0


def single_engine(
    model, tokenizer, prompt_ids: list[int], params: SamplingParams, eos_ids=None
) -> LLMEngine:
    """An engine for one request: the whole prompt in one step, a KV cache just large enough."""
    need = len(prompt_ids) + params.max_tokens
    need = min(need, model.cfg.get("max_position_embeddings", default=need))
    config = EngineConfig(
        max_batch_size=1, max_tokens_per_step=max(len(prompt_ids), 1), kv_cache_tokens=need + 16
    )
    return LLMEngine(model, tokenizer, config, eos_ids=eos_ids)


def _run(
    engine: LLMEngine,
    prompt_ids: list[int],
    params: SamplingParams,
    stats: GenerationStats,
    adapter: str | None = None,
) -> Iterator[RequestOutput]:
    stats.prompt_tokens = len(prompt_ids)
    engine.add_request(prompt_ids, params, "generate", adapter)
    while engine.has_unfinished():
        for out in engine.step():
            stats.completion_tokens, stats.prefill_s, stats.decode_s = (
                out.completion_tokens,
                out.prefill_s,
                out.decode_s,
            )
            stats.finish_reason = out.finish_reason or ""
            yield out


def generate_ids(
    model,
    prompt_ids: list[int],
    params: SamplingParams,
    eos_ids=frozenset(),
    stats: GenerationStats | None = None,
    adapter: str | None = None,
) -> Iterator[int]:
    """Yield generated token ids until EOS (not yielded, but counted) or max_tokens; the engine,
    batch of one, with LoRA adapter `adapter` if given. Stop strings are the caller's, on text."""
    stats = stats if stats is not None else GenerationStats()
    params = replace(params, stop=[])
    engine = single_engine(model, None, prompt_ids, params, eos_ids)
    for out in _run(engine, prompt_ids, params, stats, adapter):
        if not (out.finish_reason == "stop" and not params.ignore_eos):
            yield from out.token_ids


def generate_text(
    model,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    params: SamplingParams,
    stats: GenerationStats | None = None,
    adapter: str | None = None,
) -> Iterator[str]:
    """Yield text increments, honouring EOS, stop strings and max_tokens; with LoRA adapter
    `adapter` if given."""
    stats = stats if stats is not None else GenerationStats()
    engine = single_engine(model, tokenizer, prompt_ids, params)
    for out in _run(engine, prompt_ids, params, stats, adapter):
        if out.text:
            yield out.text

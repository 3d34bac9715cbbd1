"""Generation for one prompt: prefill, then decode token by token with a contiguous KV cache."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from hybridmoe.engine.kv_cache import BatchKVContext, SequenceKV
from hybridmoe.engine.sampler import SamplingParams, make_generator, sample
from hybridmoe.engine.stop import StopStrings
from hybridmoe.loader.tokenizer import Detokenizer, Tokenizer


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


@torch.inference_mode()
def forward_step(model, cache: SequenceKV, ids: list[int], start: int) -> torch.Tensor:
    """Run `ids` at positions start.. through the model; fp32 logits of the last position [V]."""
    input_ids = torch.tensor(ids, dtype=torch.long)
    positions = torch.arange(start, start + len(ids))
    hidden = model(input_ids, positions, BatchKVContext([cache], [len(ids)]))  # [n, H]
    return model.logits(hidden[-1:])[0]


def generate_ids(model, prompt_ids: list[int], params: SamplingParams, eos_ids=frozenset(),
                 stats: GenerationStats | None = None) -> Iterator[int]:
    """Yield generated token ids until EOS or max_tokens (stop strings are the caller's, on text)."""
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    gen = None if params.greedy else make_generator(params.seed)
    cache, output = SequenceKV(), []
    t0 = time.perf_counter()
    logits = forward_step(model, cache, prompt_ids, 0)
    stats.prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    while len(output) < params.max_tokens:
        token = sample(logits, params, gen, prompt_ids, output)
        output.append(token)
        stats.completion_tokens = len(output)
        if token in eos_ids and not params.ignore_eos:
            stats.finish_reason = "stop"
            break
        yield token
        if len(output) >= params.max_tokens:
            break
        logits = forward_step(model, cache, [token], len(prompt_ids) + len(output) - 1)
        stats.decode_s = time.perf_counter() - t1
    stats.finish_reason = stats.finish_reason or "length"


def generate_text(model, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
                  stats: GenerationStats | None = None) -> Iterator[str]:
    """Yield text increments, honouring EOS, stop strings and max_tokens."""
    stats = stats if stats is not None else GenerationStats()
    detok, stops = Detokenizer(tokenizer, prompt_ids), StopStrings(params.stop)
    ids = generate_ids(model, prompt_ids, params, tokenizer.eos_ids, stats)
    for token in ids:
        text, hit = stops.feed(detok.add(token))
        if text:
            yield text
        if hit:
            stats.finish_reason = "stop"
            ids.close()
            return
    tail = stops.flush()
    if tail:
        yield tail

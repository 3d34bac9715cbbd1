"""Choosing the next token from logits: greedy, or sampled with the usual OpenAI/vLLM knobs."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no limit
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = (
        None  # None: none; n >= 0: the chosen token's log-probability and the n most likely
    )

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """logits: [V]. Repetition penalty (CTRL paper) over prompt and output; OpenAI's presence and
    frequency penalties over the output only."""
    if params.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.tensor(sorted(set(prompt) | set(output)))
        vals = logits[seen]
        logits[seen] = torch.where(
            vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty
        )
    if (params.presence_penalty or params.frequency_penalty) and output:
        counts = Counter(output)
        ids = torch.tensor(list(counts))
        freq = torch.tensor([float(c) for c in counts.values()])
        logits[ids] -= params.frequency_penalty * freq + params.presence_penalty
    return logits


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    prompt: list[int] = (),
    output: list[int] = (),
) -> int:
    """logits: [V] fp32 -> the next token id."""
    logits = apply_penalties(logits.float().clone(), params, list(prompt), list(output))
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, 0) - sorted_probs  # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def token_logprobs(
    logits: torch.Tensor, token: int, top_n: int
) -> tuple[float, list[tuple[int, float]]]:
    """logits: [V], the model's own (before penalties and temperature, as OpenAI reports them) ->
    (log-probability of `token`, the `top_n` most likely (id, log-probability) pairs)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [V]
    top = torch.topk(logp, top_n) if top_n > 0 else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return float(logp[token]), pairs


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else torch.seed())
    return g

"""Choosing the next token from logits: greedy, or sampled with the usual OpenAI/vLLM knobs.

`LIMITS` is the one statement of what each knob may be: the HTTP schema is built from it and
`check` enforces it wherever parameters enter the engine. `sample` is safe for every value that
passes: whatever the logits and the knobs, it returns a token and never raises.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, fields

import torch

# Temperatures below this sample as greedy (as vLLM does): dividing fp32 logits by less overflows.
SAMPLING_EPS = 1e-5

# The range of each knob, as pydantic Field keywords (ge, gt, le); an int bound means the knob
# takes whole numbers only. The sampler computes any finite
# value inside: a top_p as small as 5e-324 keeps the most likely token; a repetition penalty of
# 0.01 multiplies logits by 100 at most.
LIMITS = {
    "temperature": {"ge": 0.0, "le": 2.0},
    "top_p": {"gt": 0.0, "le": 1.0},
    "top_k": {"ge": -1, "le": 2**31 - 1},  # -1 or 0: no limit (vLLM uses -1)
    "min_p": {"ge": 0.0, "le": 1.0},
    "presence_penalty": {"ge": -2.0, "le": 2.0},
    "frequency_penalty": {"ge": -2.0, "le": 2.0},
    "repetition_penalty": {"ge": 0.01, "le": 100.0},
    "max_tokens": {"ge": 1},
    "logprobs": {"ge": 0, "le": 20},
}


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 1.0  # 0 (or below SAMPLING_EPS) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 means no limit
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
    grammar: str | None = None  # llguidance's grammar the output must follow (engine/grammar.py)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


class OutOfRange(ValueError):
    """A sampling value outside `LIMITS`; `name` is its field."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def check(params: SamplingParams) -> None:
    """Raise OutOfRange naming the first value outside `LIMITS` (or not finite) and its range."""
    for f in fields(params):
        value, bounds = getattr(params, f.name), LIMITS.get(f.name)
        if bounds is None or value is None:
            continue
        kinds = int if isinstance(bounds["ge" if "ge" in bounds else "gt"], int) else (int, float)
        ok = isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and value >= bounds.get("ge", value) and value > bounds.get("gt", value - 1)
        ok = ok and value <= bounds.get("le", value)
        if not ok:
            what = describe(bounds, "a whole number" if kinds is int else "a number")
            raise OutOfRange(f.name, f"'{f.name}' must be {what} (got {value!r}).")


def describe(bounds: dict, kind: str = "a number") -> str:
    """LIMITS' keywords in words: 'a number from 0.0 to 2.0', 'a number above 0.0 to 1.0'."""
    low = f"above {bounds['gt']}" if "gt" in bounds else f"from {bounds['ge']}"
    return f"{kind} {low}" + (f" to {bounds['le']}" if "le" in bounds else " or more")


def _penalised(params: SamplingParams) -> bool:
    return bool(
        params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
    )


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
    """logits: [V] -> the next token id. NaN logits count as impossible, +inf as the largest
    finite value; the most likely token always stays a candidate, so the draw never fails."""
    if params.greedy and not _penalised(params):
        # the first largest, NaN counting as the largest (then the long way); max over a dim, not
        # argmax: 37 against 160 us over the demo's 49152 bf16 logits, 1% of a decode step
        best = int(torch.max(logits, 0).indices)
        if math.isfinite(float(logits[best])):  # no NaN and no +inf: nan_to_num changes nothing
            return best
    logits = apply_penalties(logits.float().clone(), params, list(prompt), list(output))
    logits = torch.nan_to_num(logits, nan=-math.inf, posinf=torch.finfo(torch.float32).max)
    top = logits.max()
    if params.greedy or top == -math.inf:
        return int(torch.argmax(logits))
    logits = (logits - top) / params.temperature  # [V], <= 0, the best token at 0: finite or -inf
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)  # [V], the best token's at least 1/V
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, 0) - sorted_probs  # mass strictly above each token
        cut = before >= params.top_p
        cut[0] = False  # a top_p below fp32's smallest number still keeps the best token
        sorted_probs = sorted_probs.masked_fill(cut, 0.0)
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

"""A sequence: one request's tokens, how many of them are in the KV cache, and its block table."""

from __future__ import annotations

import itertools
from enum import Enum, auto

from hybridmoe.engine.sampler import SamplingParams

_arrival = itertools.count()


class Status(Enum):
    WAITING = auto()  # queued, or preempted and waiting to be recomputed
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        max_len: int,
        adapter: str | None = None,
    ):
        self.request_id = request_id
        self.adapter = adapter  # the LoRA adapter it runs with (None: the base model)
        self.arrival = next(
            _arrival
        )  # FCFS order; preemption keeps it, so a preempted one stays in front
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.max_len = (
            max_len  # prompt + output may not exceed this (the model's context, the KV capacity)
        )
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_computed = 0  # leading tokens whose KV entries are in the cache
        self.num_cached = 0  # of those, how many came from the prefix cache at the last admission
        self.block_keys: list[bytes] = []  # keys of its leading full blocks, as far as computed
        self.finish_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next token can be sampled (1 when
        decoding)."""
        return len(self) - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed > 1

    @property
    def is_decoding(self) -> bool:
        """Whether its one uncomputed token is one it sampled (a decode step's), not the last of a
        prompt whose other tokens came from the prefix cache (prefill, as the metrics count it)."""
        return self.num_uncomputed == 1 and bool(self.output_ids)

    @property
    def max_tokens(self) -> int:
        return min(self.params.max_tokens, self.max_len - len(self.prompt_ids))

    def append(self, token: int) -> None:
        self.output_ids.append(token)

    def reset_for_recompute(self) -> None:
        """After preemption: the cache is gone,
        every token (prompt and output so far) is prefilled again."""
        self.block_table = []
        self.num_computed = 0
        self.num_cached = 0
        self.status = Status.WAITING

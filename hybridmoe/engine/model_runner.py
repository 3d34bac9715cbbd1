"""Running the model on a scheduled batch: the pass's inputs, the forward pass, and the torch thread
count it runs with; the KV cache it writes; and, with `overlap_prefill`, the thread of prefill
passes.

    runner = ModelRunner(model, config, num_blocks)
    logits = runner.run(batch)       # [n, V] on this thread
    future = runner.start(batch)     # the same on the prefill thread: (logits [n, V], seconds)

Every pass, on either thread, is one call `model(ids, positions, ctx, decode_rows)` on the thread
that runs it: the model tells its expert runtime there that a step begins.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hybridmoe import invariance, native
from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.paged_kv import PagedKVCache, PagedKVContext
from hybridmoe.engine.scheduler import Batch
from hybridmoe.layers import lora
from hybridmoe.layers.lora import RowAdapters
from hybridmoe.native.threads import kernels_only


def overlap_unsupported(model) -> str | None:
    """Why `model` cannot run a prefill pass beside a decode pass (EngineConfig.overlap_prefill),
    or None when it can: its expert runtime must allow two forward passes at once."""
    if not model.reentrant:
        return (
            "the model's expert runtime cannot run two forward passes at once (the plain CPU "
            "runtime can)"
        )
    return None


def decode_rows(batch: Batch, starts: list[int]) -> list[tuple[int, str]]:
    """(row of the forward pass, request id) of each decode token in `batch`: a sequence's one new
    token past its prompt. Prompt chunks, even one token long, are not decode tokens."""
    rows, row = [], 0
    for seq, n, start in zip(batch.seqs, batch.num_tokens, starts):
        if n == 1 and start >= len(seq.prompt_ids):
            rows.append((row, seq.request_id))
        row += n
    return rows


@dataclass(frozen=True)
class PassInputs:
    """What one forward pass reads, built on the engine's thread before the pass starts."""

    ids: torch.Tensor  # [T] token ids: each sequence's new tokens, one sequence after another
    positions: torch.Tensor  # [T]
    ctx: PagedKVContext
    rows: list[
        int
    ]  # rows whose logits are needed: the last of each sequence then wholly in the cache
    adapters: RowAdapters | None  # each sequence's LoRA adapter; None when no sequence has one


class ModelRunner:
    def __init__(self, model, config: EngineConfig, num_blocks: int):
        self.model, self.config = model, config
        self.kv = PagedKVCache(num_blocks, config.block_size, getattr(model, "place_tensor", None))
        self._prefill_pool: ThreadPoolExecutor | None = None
        if config.overlap_prefill:
            why_not = overlap_unsupported(model)
            if why_not:
                raise ValueError(f"overlap_prefill: {why_not}")
            self._prefill_pool = ThreadPoolExecutor(
                1, "hybridmoe-prefill", initializer=torch.set_num_threads, initargs=(1,)
            )

    def run(self, batch: Batch, beside: bool = False) -> torch.Tensor:
        """One forward pass over `batch` on this thread: logits [n, V], one row per sequence whose
        every token is then in the cache, in batch order. `beside`: a prefill pass is in flight on
        the prefill thread (overlap_prefill), which has a core of its own: this pass takes one
        torch thread, where alone it takes this thread's count (every core, as the CLI sets it)."""
        inputs = self._inputs(batch)
        decode = decode_rows(batch, inputs.ctx.starts)
        threads = self._threads(len(inputs.ids), beside)
        with threads, self._decode_threads(len(inputs.ids), len(decode)):
            return self._run(inputs, decode)

    def start(self, batch: Batch) -> Future:
        """The same pass on the prefill thread (overlap_prefill): a future of (logits [n, V],
        seconds the pass itself took, as the engine may take the result later)."""
        inputs = self._inputs(batch)  # here: the engine's thread goes on to change other sequences
        return self._prefill_pool.submit(
            self._timed_run, inputs, []
        )  # prefill chunks only: no decode rows

    def _timed_run(
        self, inputs: PassInputs, decode: list[tuple[int, str]]
    ) -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        return self._run(inputs, decode), time.perf_counter() - t0

    def _inputs(self, batch: Batch) -> PassInputs:
        ids, positions, starts, rows, end = [], [], [], [], 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed
            ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            starts.append(start)
            end += n
            if seq.num_uncomputed == n:
                rows.append(end - 1)
        tables = [s.block_table for s in batch.seqs]
        ctx = PagedKVContext(self.kv, tables, starts, batch.num_tokens, self.config.deterministic)
        names = [s.adapter for s in batch.seqs]
        adapters = RowAdapters(batch.num_tokens, names) if any(names) else None
        return PassInputs(torch.tensor(ids), torch.tensor(positions), ctx, rows, adapters)

    @torch.inference_mode()
    def _run(self, inputs: PassInputs, decode: list[tuple[int, str]]) -> torch.Tensor:
        """The forward pass itself, on the thread that runs it: logits [len(rows), V]."""
        with lora.using(inputs.adapters), invariance.rows_alone(self.config.deterministic):
            hidden = self.model(inputs.ids, inputs.positions, inputs.ctx, decode)  # [T, H]
            return self.model.logits(hidden[inputs.rows]).cpu()  # [n, V], sampled on the host

    @contextmanager
    def _decode_threads(self, num_tokens: int, num_decode: int):
        """A pass of decode tokens only, few enough for the native kernels (native.MAX_ROWS):
        torch's small ops on one thread, the kernels on all (native/threads.py)."""
        if num_decode == num_tokens <= native.MAX_ROWS:
            with kernels_only():
                yield
        else:
            yield

    @contextmanager
    def _threads(self, num_tokens: int, beside: bool = False):
        """Run a pass of `num_tokens` new tokens with the thread count configured for its size, or
        on one thread `beside` a prefill pass in flight."""
        before, want = torch.get_num_threads(), self.config.prefill_threads
        if beside:
            want = 1
        elif want is None or num_tokens < self.config.threads_from_tokens:
            want = before
        if want == before:
            yield
            return
        torch.set_num_threads(want)  # per-thread OpenMP setting, ~1 us: cheap to change every pass
        try:
            yield
        finally:
            torch.set_num_threads(before)

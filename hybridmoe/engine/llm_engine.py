"""The engine: a plain Python object that takes requests and, step by step, produces their tokens.

    engine = LLMEngine(model, tokenizer, EngineConfig(...))
    engine.add_request(prompt_ids, SamplingParams(...), "req-1")
    while engine.has_unfinished():
        for out in engine.step():      # schedule, one forward pass over the batch, sample, detokenize
            print(out.request_id, out.text, out.finished)

Single-threaded by design; the server drives it from one background thread.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from hybridmoe.engine.block_manager import BlockManager
from hybridmoe.engine.paged_kv import PagedKVCache, PagedKVContext
from hybridmoe.engine.sampler import SamplingParams, make_generator, sample, token_logprobs
from hybridmoe.engine.scheduler import Batch, Scheduler
from hybridmoe.engine.sequence import Sequence
from hybridmoe.engine.stop import StopStrings
from hybridmoe.loader.tokenizer import Detokenizer


@dataclass
class EngineConfig:
    max_batch_size: int = 8  # sequences running at once
    max_tokens_per_step: int = 512  # tokens in one forward pass (decode tokens + prefill chunks)
    kv_cache_tokens: int = 16384  # KV cache capacity, in tokens, shared by all sequences
    block_size: int = 16  # tokens per KV block, and the granularity of prefix sharing
    max_model_len: int | None = None  # default: the model's max_position_embeddings


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass
class RequestOutput:
    """What a step produced for one request: new tokens and text, and, when finished, why."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length"
    logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    prefill_s: float = 0.0  # from first scheduled to first token
    decode_s: float = 0.0  # from first token to the last one so far


@dataclass
class EngineMetrics:
    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0  # of the requests added
    prefill_tokens: int = 0  # computed in prefill: prefix-cache hits excluded, recomputation included
    generation_tokens: int = 0
    prefill_s: float = 0.0  # step time, shared between prefill and decode by their token counts
    decode_s: float = 0.0
    steps: int = 0


@dataclass
class _Request:
    seq: Sequence
    detok: Detokenizer | None
    stops: StopStrings
    generator: torch.Generator | None
    arrived: float = field(default_factory=time.perf_counter)
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None


class LLMEngine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, eos_ids=None):
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        self.eos_ids = frozenset(eos_ids if eos_ids is not None else (tokenizer.eos_ids if tokenizer else ()))
        num_blocks = max(1, config.kv_cache_tokens // config.block_size)
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.kv = PagedKVCache(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.blocks, config.max_batch_size, config.max_tokens_per_step)
        model_len = config.max_model_len or model.cfg.get("max_position_embeddings", default=None) or 2**31
        self.max_model_len = min(model_len, num_blocks * config.block_size)  # one sequence always fits
        self.requests: dict[str, _Request] = {}
        self.metrics = EngineMetrics()
        self._ids = itertools.count()

    # ---- requests ----
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_ids:
            raise ValueError("the prompt is empty; give at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; this engine's context holds "
                             f"{self.max_model_len} (prompt and output together)")
        seq = Sequence(request_id, prompt_ids, params, self.max_model_len)
        self.scheduler.add(seq)
        detok = Detokenizer(self.tokenizer, prompt_ids) if self.tokenizer is not None else None
        gen = None if params.greedy else make_generator(params.seed)
        self.requests[request_id] = _Request(seq, detok, StopStrings(params.stop), gen)
        self.metrics.requests_added += 1
        self.metrics.prompt_tokens += len(prompt_ids)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its blocks; False if it is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.finish(req.seq)
        self.metrics.requests_aborted += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        t0 = time.perf_counter()
        for seq in batch.seqs:
            req = self.requests[seq.request_id]
            req.scheduled = req.scheduled or t0
        decode_tokens = sum(n for s, n in zip(batch.seqs, batch.num_tokens) if s.num_uncomputed == 1)
        logits, done = self._forward(batch)
        outputs = [self._postprocess(seq, row) for seq, row in zip(done, logits)]
        self._account(time.perf_counter() - t0, sum(batch.num_tokens) - decode_tokens, decode_tokens)
        return outputs

    @torch.inference_mode()
    def _forward(self, batch: Batch) -> tuple[torch.Tensor, list[Sequence]]:
        """Run every scheduled token through the model; logits [n, V] of the sequences that may sample."""
        ids, positions, starts = [], [], []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed
            ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            starts.append(start)
        ctx = PagedKVContext(self.kv, [s.block_table for s in batch.seqs], starts, batch.num_tokens)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), ctx)  # [T, H]
        rows, done, end = [], [], 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            end += n
            seq.num_computed += n
            self.blocks.commit(seq)
            if seq.num_uncomputed == 0:  # the whole sequence is in the cache: its last row gives the next token
                rows.append(end - 1)
                done.append(seq)
        return self.model.logits(hidden[rows]), done  # [n, V]

    def _postprocess(self, seq: Sequence, logits: torch.Tensor) -> RequestOutput:
        req, params = self.requests[seq.request_id], seq.params
        token = sample(logits, params, req.generator, seq.prompt_ids, seq.output_ids)
        seq.append(token)
        now = time.perf_counter()
        req.first_token = req.first_token or now
        req.last_token = now
        out = RequestOutput(seq.request_id, [token], "", prompt_tokens=len(seq.prompt_ids),
                            completion_tokens=len(seq.output_ids), cached_tokens=seq.num_cached,
                            prefill_s=req.first_token - req.scheduled, decode_s=now - req.first_token)
        if params.logprobs is not None:
            lp, top = token_logprobs(logits, token, params.logprobs)
            out.logprobs = [TokenLogprob(token, lp, top)]
        self.metrics.generation_tokens += 1
        if token in self.eos_ids and not params.ignore_eos:
            out.finish_reason = "stop"
        else:
            text, hit = req.stops.feed(req.detok.add(token)) if req.detok else ("", False)
            out.text = text
            if hit:
                out.finish_reason = "stop"
            elif len(seq.output_ids) >= seq.max_tokens:
                out.finish_reason = "length"
        if out.finish_reason:
            out.text += req.stops.flush()  # text held back for a stop string that did not come
            self._finish(seq)
            out.finished = True
        return out

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        del self.requests[seq.request_id]
        self.metrics.requests_finished += 1

    def _account(self, seconds: float, prefill: int, decode: int) -> None:
        m = self.metrics
        m.steps += 1
        m.prefill_tokens += prefill
        m.prefill_s += seconds * prefill / (prefill + decode)
        m.decode_s += seconds * decode / (prefill + decode)

    # ---- convenience ----
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 max_steps: int | None = None) -> list[list[int]]:
        """Run `prompts` together to completion; the generated ids of each (EOS included when hit)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        result: dict[str, list[int]] = {i: [] for i in ids}
        for _ in itertools.count() if max_steps is None else range(max_steps):
            if not self.has_unfinished():
                break
            for out in self.step():
                result[out.request_id] += out.token_ids
        return [result[i] for i in ids]

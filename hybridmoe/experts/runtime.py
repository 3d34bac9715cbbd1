"""The seam between the models and the experts: an MoE block hands its routed tokens to a runtime.

A runtime owns an ExpertStore and, for one layer, turns (hidden states, top-k ids, top-k weights)
into the weighted sum of the chosen experts' outputs. `CPURuntime` runs everything on the CPU and
is the reference every other runtime must agree with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe import native
from hybridmoe.experts.store import ExpertShape, ExpertStore, ExpertWeights
from hybridmoe.experts.expert_workers import ExpertWorkers


def expert_ffn(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """SwiGLU expert: down(silu(gate x) * up x). x: [n, H] -> [n, H].

    F.linear, not layers/linear.py's oneDNN path: on worker threads oneDNN gave results 7e-6 apart
    from the calling thread's (test_expert_workers), and an expert must not depend on where it runs.
    Up to native.MAX_ROWS bf16 tokens (decode) go to the native kernel wherever it runs (CPU runtime,
    pool, calibration), so that holds there too: gate and up stay fp32 and silu(gate) * up is rounded
    to bf16 once; a token's result does not depend on how many came with it."""
    if native.applies(x, w.gate_up, w.down):
        return native.expert(x, w.gate_up, w.down).to(torch.bfloat16)  # [n, H]
    gate, up = F.linear(x.to(w.gate_up.dtype), w.gate_up).chunk(2, dim=-1)  # [n, I] each, views of [n, 2I]
    return F.linear(F.silu(gate) * up, w.down)  # [n, H]


def group_by_expert(topk_ids: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """For each expert used, (expert id, token rows, k columns) of its assignments.

    topk_ids: [T, K]. Returned in increasing expert id.
    """
    flat = topk_ids.reshape(-1)  # [T*K]
    order = torch.argsort(flat, stable=True)  # [T*K]
    k = topk_ids.shape[1]
    # Rows and columns for all assignments at once, then sliced per expert: a `//` and a `%` per expert
    # cost 128 small ops per layer at prefill (integer remainder alone measured 33 us a call here).
    rows, cols = order // k, order % k  # [T*K] each
    counts = torch.bincount(flat).tolist()  # one sync per layer
    groups, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            groups.append((expert, rows[start : start + count], cols[start : start + count]))
            start += count
    return groups


# Tokens up to which combine_grouped adds all experts' terms in one call (decode batches).
FEW_TOKENS = 32


def combine_grouped(x: torch.Tensor, groups, ys: list[torch.Tensor], topk_weights: torch.Tensor) -> torch.Tensor:
    """The weighted sum [T, H] of the experts' outputs ys ([n, H] each, in the order of `groups`), in
    fp32, each token's terms added in increasing expert id.

    index_add_ adds its source rows in order, so one call for all experts is bit for bit the
    per-expert loop. One call is faster for a decode batch (a batch-8 decode of the demo model uses
    ~15 experts in each of 30 layers: 0.60 -> 0.50 ms per layer; 32 tokens: 1.02 -> 0.95 ms) and slower
    for a prefill chunk, whose [T*K, H] terms outgrow the cache (64 tokens: 1.7 -> 2.7 ms, 128: 2.7 ->
    4.6 ms), which keeps the loop."""
    out = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
    if x.shape[0] > FEW_TOKENS:
        for (_, rows, cols), y in zip(groups, ys):
            out.index_add_(0, rows, y.float() * topk_weights[rows, cols, None].float())  # [n, H]
        return out.to(x.dtype)
    rows = torch.cat([g[1] for g in groups])  # [T*K], grouped by expert
    cols = torch.cat([g[2] for g in groups])  # [T*K]
    terms = torch.cat(ys).float() * topk_weights[rows, cols, None].float()  # [T*K, H]
    return out.index_add_(0, rows, terms).to(x.dtype)


def combine_token(x: torch.Tensor, ys: list[torch.Tensor], topk_weights: torch.Tensor) -> torch.Tensor:
    """One token's weighted sum [1, H] of its K experts' outputs ys ([1, H] each, in top-k order), as
    one [1, K] @ [K, H] product accumulated in fp32."""
    return (topk_weights.float() @ torch.cat(ys).float()).to(x.dtype)


class ExpertRuntime:
    """Base class: holds the store; subclasses decide where each expert runs."""

    reentrant = False  # whether two forward passes may run at once (the engine's overlap_prefill)

    def __init__(self, shape: ExpertShape, dtype: torch.dtype = torch.float32):
        self.shape = shape
        self.store = ExpertStore(shape, dtype)

    def finish_loading(self) -> None:
        """Called once every expert is in the store."""
        missing = self.store.missing()
        if missing:
            layer, expert = missing[0]
            raise ValueError(f"no weights were loaded for expert {expert} of layer {layer} ({len(missing)} missing)")

    def forward(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x: [T, H], topk_ids: [T, K], topk_weights: [T, K] -> [T, H] weighted sum of expert outputs."""
        raise NotImplementedError

    def begin_step(self, num_tokens: int, decode_rows: list[tuple[int, str]]) -> None:
        """A forward pass of `num_tokens` rows begins on this thread; `decode_rows` are (row, request id)."""


# Hand-offs to the workers measured about 0.5 ms per layer on a loaded 2-core machine (tiny-width
# Qwen3-30B-A3B structure: 3.2 ms per decode step inline, 5.2 ms with workers); below ~2 ms of one
# core's work (32 MB at 16 GB/s) the experts run inline.
WORKERS_MIN_BYTES = 32 << 20


class CPURuntime(ExpertRuntime):
    """Every routed expert runs on the CPU: in the calling thread with one torch thread, else split
    over single-threaded workers, whole experts each (expert_workers.py says why)."""

    reentrant = True  # with one torch thread it keeps no state between calls (the workers are not used)

    def __init__(self, shape: ExpertShape, dtype: torch.dtype = torch.float32):
        super().__init__(shape, dtype)
        self._workers: ExpertWorkers | None = None

    def forward(self, layer, x, topk_ids, topk_weights):
        if x.shape[0] == 1:
            return self._forward_token(layer, x, topk_ids, topk_weights)
        groups = group_by_expert(topk_ids)
        ys = self._map(lambda g: expert_ffn(x[g[1]], self.store.get(layer, g[0])), groups)  # [n, H] each
        return combine_grouped(x, groups, ys, topk_weights)

    def _forward_token(self, layer, x, topk_ids, topk_weights):
        """Decode: one token, so no grouping, gathering or scattering; the K outputs are summed by one
        [1, K] @ [K, H] product. This halves the ops per expert (16 -> 8), which measured about
        3 ms of a 37 ms decode step (Qwen3-30B-A3B shapes, 4 layers, 1 thread)."""
        weights = [self.store.get(layer, e) for e in topk_ids[0].tolist()]
        return combine_token(x, self._map(lambda w: expert_ffn(x, w), weights), topk_weights)

    def _map(self, fn, items: list) -> list:
        """[fn(item) for item in items] over experts, on the workers when torch has more than one
        thread and the experts are big enough to pay for the hand-off."""
        threads = torch.get_num_threads()
        if min(threads, len(items)) <= 1 or len(items) * self.store.expert_nbytes() < WORKERS_MIN_BYTES:
            return [fn(item) for item in items]
        if self._workers is None or self._workers.workers != threads:  # map() uses at most len(items)
            if self._workers is not None:
                self._workers.close()
            self._workers = ExpertWorkers(threads)
        return self._workers.map(fn, items)
